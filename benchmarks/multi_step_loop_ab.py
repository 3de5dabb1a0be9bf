"""W2 in runs of 8 on the bundled model (bf16): the whole run in one C++ call (DecodeStack.greedy_steps) against a
Python loop over the same calls, alternating on one engine; checks that both give the same tokens.

    python benchmarks/multi_step_loop_ab.py 10     # 10 runs of each
"""

from __future__ import annotations

import statistics
import sys
import time

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.cli.bench import random_prompts

llm = LLM()
m = llm.engine.runner.model
loops = {"cpp": m._steps_in_cpp, "py": m._steps_in_python}  # the model's own two loops

prompts = [{"prompt_token_ids": p} for p in random_prompts(1, 32, 0)]
sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
llm.generate(prompts, sp, use_tqdm=False)
res = {"cpp": [], "py": []}
toks = {}
for r in range(int(sys.argv[1])):
    for name in (("cpp", "py") if r % 2 == 0 else ("py", "cpp")):
        m._steps_in_cpp = loops[name]  # (greedy_steps takes it for this model: GGUF embedding and bf16 head)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        toks[name] = outs[0].outputs[0].token_ids
        res[name].append(256 / dt)
print("same tokens:", toks["cpp"] == toks["py"])
for k, v in res.items():
    print(k, "median", round(statistics.median(v), 1), [round(x, 1) for x in v])
print("cpp/py per pair:", [round(a / b, 3) for a, b in zip(res["cpp"], res["py"], strict=True)])
