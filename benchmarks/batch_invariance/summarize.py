"""Summarise benchmarks/batch_invariance/*.json (written by run.sh) into summary.json and a table."""

import json
import platform
from pathlib import Path

HERE = Path(__file__).resolve().parent
METRIC = {"W1": "output_tokens_per_s", "W2": "decode_tokens_per_s", "W3": "prompt_tokens_per_s"}


def value(w: str, d: dict) -> float:
    return d[METRIC[w]]


def main() -> None:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    rows: dict = {}
    by_round: dict = {}
    for f in sorted(HERE.glob("W*_*_*.json")):
        w, mode, rnd = f.stem.split("_")
        v = round(value(w, json.loads(f.read_text())), 1)
        rows.setdefault(w, {}).setdefault(mode, []).append(v)
        by_round.setdefault((w, rnd), {})[mode] = v
    summary = {"cpu": cpu, "metric": METRIC, "results": rows}
    # Ratios only within one round (one run, modes alternating): the last round that has all three.
    for (w, rnd), modes in sorted(by_round.items()):
        if {"library", "default", "strict"} <= set(modes):
            summary.setdefault("round_of_ratios", {})[w] = rnd
            summary.setdefault("strict_vs_default", {})[w] = round(modes["strict"] / modes["default"], 3)
            summary.setdefault("default_vs_library", {})[w] = round(modes["default"] / modes["library"], 3)
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
