#!/bin/sh
# Tensor and data parallelism on this machine (benchmarks/README.md, "Parallelism"): the collectives' cost,
# TP=1 vs TP=3 on the bundled model (its 9/3 heads split over 3 ranks, not 2), and DP=1 vs DP=2 behind
# `pagedserve serve`. Run on a quiet machine: `sh benchmarks/parallel/run.sh`.
set -e
cd "$(dirname "$0")/../.."
P=.venv/bin/pagedserve
OUT=benchmarks/parallel
.venv/bin/python $OUT/allreduce.py --json $OUT/allreduce.json
# Dense float32 weights for both (TP widens GGUF blocks: shards cut along columns would split them).
# (PAGEDSERVE_NO_GGUF_GEMV too: the decode GEMV over the kept Q4 blocks is slow on AVX2-only builds.)
export PAGEDSERVE_DEQUANTIZE_GGUF=1 PAGEDSERVE_NO_GGUF_GEMV=1
for tp in 1 3; do
  $P bench throughput --num-prompts 32 --input-len 128 --output-len 64 --tensor-parallel-size $tp \
    --quiet --json $OUT/tp${tp}_throughput.json > /dev/null
  $P bench latency --input-len 32 --output-len 64 --num-iters 2 --tensor-parallel-size $tp \
    --quiet --json $OUT/tp${tp}_latency.json > /dev/null
done
unset PAGEDSERVE_DEQUANTIZE_GGUF PAGEDSERVE_NO_GGUF_GEMV
for dp in 1 2; do
  port=$((18400 + dp))
  $P serve --port $port --data-parallel-size $dp --num-kv-blocks 2048 > $OUT/serve_dp$dp.log 2>&1 &
  pid=$!
  for _ in $(seq 1 240); do
    curl -sf http://127.0.0.1:$port/health > /dev/null 2>&1 && break
    sleep 0.5
  done
  $P bench serve --base-url http://127.0.0.1:$port --num-prompts 64 --input-len 128 --output-len 64 \
    --max-concurrency 16 --quiet --json $OUT/dp${dp}_serve.json > /dev/null
  kill -INT $pid
  wait $pid || true
done
.venv/bin/python - <<'PY'
import json
d = "benchmarks/parallel/"
for n in ("tp1", "tp3"):
    t, l = json.load(open(d + n + "_throughput.json")), json.load(open(d + n + "_latency.json"))
    print(n, {k: round(v, 1) for k, v in t.items() if k.endswith("_per_s") and isinstance(v, float)},
          "latency", {k: round(v, 4) for k, v in l.items() if k.endswith("_mean") and isinstance(v, float)})
for n in ("dp1", "dp2"):
    s = json.load(open(d + n + "_serve.json"))
    print(n, "req/s %.2f out tok/s %.1f ttft p50 %.3f tpot p50 %.4f failed %d" % (
        s["requests_per_s"], s["output_tokens_per_s"], s["ttft_s_p50"], s["tpot_s_p50"], s["failed"]))
PY
