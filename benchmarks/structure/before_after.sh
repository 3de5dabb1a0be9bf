#!/usr/bin/env bash
# Issue 11's check: W1, W2, W3 before and after the structure change in one run, alternating A B A B.
# A = the tree before it (git worktree add /tmp/before 1a1d364), B = this checkout; both on this .venv.
# Results: /tmp/bench/*.json (summarised in benchmarks/structure/before_after.json).
set -u
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PY=$ROOT/.venv/bin/python
mkdir -p /tmp/bench
A() { (cd /tmp/before && PYTHONPATH=/tmp/before $PY -m pagedserve.cli "$@"); }
B() { (cd "$ROOT" && $PY -m pagedserve.entrypoints.cli.main "$@"); }
W1="bench throughput --num-prompts 128 --input-len 128 --output-len 128 --quiet"
W2="bench latency --input-len 32 --output-len 256 --num-iters 3 --quiet"
W3="bench throughput --num-prompts 16 --input-len 1024 --output-len 1 --quiet"
for round in 1 2; do
  for w in W1 W2 W3; do
    for side in A B; do
      $side ${!w} --json /tmp/bench/${w}_${side}_${round}.json > /dev/null 2>/tmp/bench/${w}_${side}_${round}.err
      echo "$w $side $round rc=$?"
    done
  done
done
echo DONE
