"""Choose the prompt set of the batch-invariance tests (tests/engine/test_batch_invariance.py).

A greedy request can only be expected to give the same text in every batch where its path is not a
near-tie: this keeps the candidates whose float32 greedy path (run alone, prefix cache off) has a
top-1/top-2 logprob gap of at least MARGIN nats at every one of its first TOKENS steps, and writes
them with that smallest gap to tests/data/invariance_prompts.json.

    .venv/bin/python scripts/select_invariance_prompts.py
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve import LLM, SamplingParams

MARGIN = 0.02
TOKENS = 16
OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "invariance_prompts.json"

# Every prompt starts with this (three full KV blocks), so the prefix cache serves it to all but the
# first request of a batch: the tests see cache hits in every scenario.
PREAMBLE = ("The following are short texts, each one completed by a careful writer who prefers plain "
            "words, exact facts and simple sentences to anything fancy or long-winded. They never use "
            "jargon and they always finish what they started.\n\n")
SUBJECTS = ["France", "Japan", "Brazil", "Kenya", "Canada", "Norway", "Egypt", "India", "Peru", "Italy",
            "Spain", "Mexico", "Chile", "Greece", "Poland", "Vietnam"]
TEMPLATES = [
    "The capital of {} is",
    "{} is a country in",
    "Here are three facts about {}:\n1.",
    "Q: What language is spoken in {}?\nA:",
    "A short poem about {}:\n",
]
EXTRA = [
    "def fibonacci(n):", "import numpy as np\n\n", "1, 2, 3, 4, 5,", "Monday, Tuesday, Wednesday,",
    "The quick brown fox", "Once upon a time, there was a", "To make a cup of tea, first",
    "The three primary colors are", "Water boils at", "The largest planet in our solar system is",
    "SELECT name FROM users WHERE", "<html>\n<head>\n", "Dear John,\n\nThank you for",
    "The theory of relativity was proposed by", "A haiku about autumn:\n", "for i in range(10):",
]


def candidates() -> list[str]:
    return [PREAMBLE + t.format(s) for t in TEMPLATES for s in SUBJECTS] + [PREAMBLE + e for e in EXTRA]


def margins(llm: LLM, prompts: list[str]) -> list[float]:
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, logprobs=2, ignore_eos=True)
    out = []
    for p in prompts:  # alone: no other request in the batch
        o = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
        gaps = []
        for step in o.logprobs:
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            gaps.append(top[0] - top[1])
        out.append(min(gaps))
    return out


def main() -> None:
    llm = LLM(dtype="float32", enable_prefix_caching=False)
    prompts = candidates()
    kept = [{"prompt": p, "min_margin": round(m, 4)} for p, m in zip(prompts, margins(llm, prompts), strict=True)
            if m >= MARGIN]
    OUT.write_text(json.dumps({"margin": MARGIN, "tokens": TOKENS, "candidates": len(prompts),
                               "prompts": kept}, indent=1) + "\n")
    print(f"{len(kept)} of {len(prompts)} candidates have a margin >= {MARGIN} over {TOKENS} tokens -> {OUT}")


if __name__ == "__main__":
    main()
