"""W1 or W2 with num_scheduler_steps 1 and 8 alternating on one engine (the same weights, the same minute): each
setting's output tok/s per run (end to end, as `pagedserve bench throughput` counts them), the medians and the ratio
of each pair.

    python benchmarks/multi_step_ab.py W2 8      # 8 runs of each setting
    python benchmarks/multi_step_ab.py W1 4
"""

from __future__ import annotations

import statistics
import sys
import time

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.cli.bench import random_prompts

wl = sys.argv[1]
reps = int(sys.argv[2])
llm = LLM()
res: dict[int, list[float]] = {1: [], 8: []}
if wl == "W2":
    prompts = [{"prompt_token_ids": p} for p in random_prompts(1, 32, 0)]
    sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
else:
    prompts = [{"prompt_token_ids": p} for p in random_prompts(128, 128, 0)]
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
for r in range(reps):
    for s in ((1, 8) if r % 2 == 0 else (8, 1)):
        llm._num_scheduler_steps = s  # what LLM.generate runs (LLM(num_scheduler_steps=s) sets it)
        llm.engine.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        res[s].append(n / dt)
        print(wl, s, f"{n / dt:.1f} tok/s", flush=True)
for s, v in res.items():
    print(wl, "steps", s, "median", f"{statistics.median(v):.1f}", "all", [round(x, 1) for x in v])
print("ratio 8/1 per pair:", [round(b / a, 3) for a, b in zip(res[1], res[8], strict=True)])
