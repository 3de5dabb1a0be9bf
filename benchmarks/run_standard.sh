#!/usr/bin/env bash
# The standard workloads of benchmarks/README.md, each side by side with HF transformers in one run.
# Run on a quiet machine: nothing else should load the cores while this runs.
set -euo pipefail
cd "$(dirname "$0")/.."
B=.venv/bin/pagedserve
DTYPE=${DTYPE:-auto}
# W1: throughput, 128 requests x (128 prompt + 128 output tokens), all at once.
$B bench throughput --num-prompts 128 --input-len 128 --output-len 128 --dtype "$DTYPE" --compare-hf \
    --quiet --json benchmarks/w1_throughput.json
# W2: single stream, 32 prompt tokens, 256 output tokens.
$B bench latency --input-len 32 --output-len 256 --num-iters 3 --dtype "$DTYPE" --compare-hf \
    --quiet --json benchmarks/w2_latency.json
# W3: prefill, 16 requests x 1024 prompt tokens, 1 output token.
$B bench throughput --num-prompts 16 --input-len 1024 --output-len 1 --dtype "$DTYPE" --compare-hf \
    --quiet --json benchmarks/w3_prefill.json
# Prefix caching: 64 requests sharing a 512-token prefix (+ 64 own tokens), TTFT with caching on and off.
$B bench throughput --num-prompts 64 --input-len 576 --output-len 16 --shared-prefix-len 512 \
    --dtype "$DTYPE" --quiet --json benchmarks/prefix_on.json
$B bench throughput --num-prompts 64 --input-len 576 --output-len 16 --shared-prefix-len 512 \
    --dtype "$DTYPE" --no-enable-prefix-caching --quiet --json benchmarks/prefix_off.json
