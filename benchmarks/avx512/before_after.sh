#!/usr/bin/env bash
# Issue 17 on an AVX-512 CPU: W1, W2, W3 before and after this round of kernel work, alternating A B per
# workload in one run. A = the tree at 5eaaf0b (the AVX-512 build fixed, nothing else):
#   git worktree add /tmp/before 5eaaf0b
# B = this checkout; both on this .venv. Results: benchmarks/avx512/<W>_<A|B>.json.
set -u
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PY=$ROOT/.venv/bin/python
OUT=${OUT:-$ROOT/benchmarks/avx512}  # benchmarks/amx/before_after.sh runs this loop with its own OUT
A() { (cd /tmp/before && PYTHONPATH=/tmp/before $PY -m pagedserve.entrypoints.cli.main "$@"); }
B() { (cd "$ROOT" && $PY -m pagedserve.entrypoints.cli.main "$@"); }
W1="bench throughput --num-prompts 128 --input-len 128 --output-len 128 --quiet"
W2="bench latency --input-len 32 --output-len 256 --num-iters 3 --quiet"
W3="bench throughput --num-prompts 16 --input-len 1024 --output-len 1 --quiet"
for w in W1 W2 W3; do
  for side in A B; do
    $side ${!w} --json "$OUT/${w}_${side}.json" > /dev/null 2> "/tmp/${w}_${side}.err"
    echo "$w $side rc=$?"
  done
done
