"""benchmarks/models/*.json -> summary.json and a markdown table on stdout."""

import json
from pathlib import Path

D = Path(__file__).resolve().parent


def load(name):
    p = D / name
    return json.loads(p.read_text()) if p.exists() and p.stat().st_size else None


def llamacpp(name):
    runs = load(name)
    if not runs:
        return None
    return {f"{r['n_prompt']}p/{r['n_gen']}g": round(r["avg_ts"], 1) for r in runs}


summary = {"cpu": (D / "cpu.txt").read_text().splitlines()[0].split(":", 1)[1].strip()}
rows = []
for model in ("smollm2", "gemma3"):
    entry = {}
    for mode in ("in_place", "dequantized"):
        w2, w3, rss = (load(f"{model}_{w}_{mode}.json") for w in ("w2", "w3", "rss"))
        entry[mode] = {
            "w2_decode_tok_s": w2 and round(w2["decode_tokens_per_s"], 1),
            "w3_prompt_tok_s": w3 and round(w3["prompt_tokens_per_s"], 1),
            "rss_mib": rss and round(rss["rss_bytes"] / 2**20, 1),
            "weights_mib": rss and round(rss["weight_bytes"] / 2**20, 1),
        }
    entry["llama.cpp"] = {"w2": llamacpp(f"{model}_llamacpp_w2.json"), "w3": llamacpp(f"{model}_llamacpp_w3.json")}
    summary[model] = entry
(D / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
