#!/usr/bin/env bash
# Issue 17 on an AMX CPU (Sapphire Rapids): W1, W2, W3 before and after this round of kernel work, alternating A B per
# workload in one run (benchmarks/avx512/before_after.sh's loop). A = the tree before this round (c7e18f3):
#   git worktree add /tmp/before c7e18f3
# B = this checkout; both on this .venv. Results: benchmarks/amx/<W>_<A|B>.json.
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$HERE} exec bash "$HERE/../avx512/before_after.sh"
