#!/usr/bin/env bash
# Issue 17 on an AMX CPU (Sapphire Rapids): W1, W2, W3 before and after this round of kernel work, alternating A B per
# workload in one run. A = the tree before this round (c7e18f3):
#   git worktree add /tmp/before c7e18f3
# B = this checkout; both on this .venv. Results: benchmarks/amx/<W>_<A|B>.json.
set -u
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PY=$ROOT/.venv/bin/python
OUT=${OUT:-$ROOT/benchmarks/amx}
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
