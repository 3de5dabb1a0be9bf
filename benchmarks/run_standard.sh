#!/usr/bin/env bash
# The standard workloads of benchmarks/README.md, each side by side with HF transformers (float32, the
# issue's reference) in one run. Run on a quiet machine: nothing else should load the cores meanwhile.
set -euo pipefail
cd "$(dirname "$0")/.."
B=.venv/bin/pagedserve
DTYPE=${DTYPE:-auto}
HF="--compare-hf --hf-dtype float32"
# W1: throughput, 128 requests x (128 prompt + 128 output tokens), all at once.
$B bench throughput --num-prompts 128 --input-len 128 --output-len 128 --dtype "$DTYPE" $HF \
    --quiet --json benchmarks/w1_throughput.json
# W2: single stream, 32 prompt tokens, 256 output tokens.
$B bench latency --input-len 32 --output-len 256 --num-iters 3 --dtype "$DTYPE" $HF \
    --quiet --json benchmarks/w2_latency.json
# W3: prefill, 16 requests x 1024 prompt tokens, 1 output token.
$B bench throughput --num-prompts 16 --input-len 1024 --output-len 1 --dtype "$DTYPE" $HF \
    --quiet --json benchmarks/w3_prefill.json
# W2 ablations: float32 (the exact mode), and bf16 with dense bf16 weights instead of the GGUF blocks.
$B bench latency --input-len 32 --output-len 256 --num-iters 3 --dtype float32 \
    --quiet --json benchmarks/w2_latency_fp32.json
$B bench latency --input-len 32 --output-len 256 --num-iters 3 --dtype bfloat16 --no-gguf-gemv \
    --quiet --json benchmarks/w2_latency_bf16_dense.json
# Prefix caching: 64 requests sharing a 512-token prefix (+ 64 own tokens), TTFT with caching on and off.
$B bench throughput --num-prompts 64 --input-len 576 --output-len 16 --shared-prefix-len 512 \
    --dtype "$DTYPE" --quiet --json benchmarks/prefix_on.json
$B bench throughput --num-prompts 64 --input-len 576 --output-len 16 --shared-prefix-len 512 \
    --dtype "$DTYPE" --no-enable-prefix-caching --quiet --json benchmarks/prefix_off.json
# Peer: llama.cpp on W2 (BF16 weights, and the bundled Q4_1), if llama-cpp-python is installed (see
# benchmarks/peers/llama_cpp_w2.py for how).
LCP=${LLAMA_CPP_PYTHON:-/tmp/lcpvenv/bin/python}
if [ -x "$LCP" ]; then
    GGUF=$(.venv/bin/python -c "from pagedserve.model.loader import bundled_model_path; print(bundled_model_path())")
    .venv/bin/python -c "import json; from pagedserve.entrypoints.cli.bench import random_prompts; \
print(json.dumps(random_prompts(1, 32, 0)[0]))" > /tmp/w2_prompt.json
    "$LCP" benchmarks/peers/llama_cpp_w2.py --src "$GGUF" --prompt /tmp/w2_prompt.json \
        --json benchmarks/peers/llama_cpp_w2_bf16.json
    # The bundled Q4_1 file itself: llama.cpp 0.3.36 built with GGML_NATIVE dies with SIGILL on it on
    # this machine (its BF16 path runs), so this one may fail without stopping the script.
    "$LCP" benchmarks/peers/llama_cpp_w2.py --src "$GGUF" --out-gguf "$GGUF" --prompt /tmp/w2_prompt.json \
        --json benchmarks/peers/llama_cpp_w2_q4_1.json || echo "llama.cpp on Q4_1 failed"
fi
