"""How far two engine configurations' greedy continuations agree: 8 prompts, each generated alone (a single stream,
as W2 runs: with more than 4 sequences in a step, decode matmuls take the many-rows route) for 64 tokens; prints how
many tokens each pair shares before the first difference.

    python benchmarks/greedy_agreement.py int8_activations=true            # against the default configuration
    python benchmarks/greedy_agreement.py dtype=float32 dtype=bfloat16     # two configurations
    python benchmarks/greedy_agreement.py model=GGUF,int8_activations=true model=GGUF   # several keys: commas

A value is parsed as true / false, an int, or kept as a string.
"""

from __future__ import annotations

import sys

from pagedserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):",
           "Explain photosynthesis in simple terms.", "List three uses of copper:",
           "Once upon a time, in a small village,", "The quick brown fox",
           "Translate to French: Good morning, how are you?"]


def parse(spec: str | None) -> dict:
    """key=value[,key=value...] -> LLM keyword arguments."""
    out: dict = {}
    for item in (spec or "").split(","):
        if not item:
            continue
        key, _, value = item.partition("=")
        low = value.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        else:
            out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def main() -> None:
    specs = sys.argv[1:3]
    configs = [parse(specs[0]), parse(specs[1] if len(specs) > 1 else None)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    runs = []
    for cfg in configs:
        llm = LLM(**cfg)
        runs.append([llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS])
        del llm
    shared = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
              for a, b in zip(*runs, strict=True)]
    print(f"{configs[0]} vs {configs[1] or 'default'}: tokens equal before the first difference {shared}; "
          f"identical for all 64: {sum(n == 64 for n in shared)} of {len(shared)}")


if __name__ == "__main__":
    main()
