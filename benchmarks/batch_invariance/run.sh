#!/usr/bin/env bash
# Issue 13's cost check: W1, W2, W3 in one run, the modes alternating, two rounds:
#   library = the library GEMMs (MKL / oneDNN; --no-fixed-matmuls), i.e. the routes before issue 13
#   default = this machine's default (on CPUs without AVX-512: every matmul on the fixed-order kernel)
#   strict  = --batch-invariant (fixed-order matmuls, every attention row on the decode kernel,
#             row-by-row sampler reductions)
# Results: benchmarks/batch_invariance/<workload>_<mode>_<round>.json; summary.json by summarize.py.
set -u
cd "$(dirname "$0")/../.."
OUT=benchmarks/batch_invariance
PS=".venv/bin/pagedserve"
W1="bench throughput --num-prompts 128 --input-len 128 --output-len 128 --quiet"
W2="bench latency --input-len 32 --output-len 256 --num-iters 3 --quiet"
W3="bench throughput --num-prompts 16 --input-len 1024 --output-len 1 --quiet"
declare -A FLAGS=([library]="--no-fixed-matmuls" [default]="" [strict]="--batch-invariant")
for round in ${ROUNDS:-1 2}; do
  for w in W1 W2 W3; do
    for mode in library default strict; do
      $PS ${!w} ${FLAGS[$mode]} --json $OUT/${w}_${mode}_${round}.json > /dev/null 2>/tmp/bi_${w}_${mode}_${round}.err
      echo "$w $mode $round rc=$?"
    done
  done
done
.venv/bin/python $OUT/summarize.py
