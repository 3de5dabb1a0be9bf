"""W2 in runs of 8 on the bundled model (bf16): the whole run in one C++ call (DecodeStack.greedy_steps) against a
Python loop over the same calls, alternating on one engine; checks that both give the same tokens.

    python benchmarks/multi_step_loop_ab.py 10     # 10 runs of each
"""

from __future__ import annotations

import statistics
import sys
import time
import types

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.cli.bench import random_prompts

llm = LLM()
m = llm.engine.runner.model
cpp = m.greedy_steps

def py_loop(self, input_ids, positions, kv_caches, backend, meta, num_steps):
    if not self._decode_stack_applies(backend, meta):
        return None
    stack = self._decode_stack(kv_caches, backend.row_invariant)
    head = self.tied_head_routes
    step = torch.arange(num_steps).unsqueeze(1)
    pos = positions.unsqueeze(0) + step
    seq_lens = meta.seq_lens.unsqueeze(0) + step
    bs = meta.block_size
    slots = (meta.block_tables.gather(1, (pos // bs).T).T * bs + pos % bs).contiguous()
    out = []
    ids = input_ids
    for s in range(num_steps):
        x = self._stack_forward(stack, self._input_embeddings(ids), pos[s], slots[s], meta.block_tables,
                                seq_lens[s], True)
        ids = head.argmax(x)
        out.append(ids)
    return torch.stack(out)

prompts = [{"prompt_token_ids": p} for p in random_prompts(1, 32, 0)]
sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
llm.generate(prompts, sp, use_tqdm=False)
res = {"cpp": [], "py": []}
toks = {}
for r in range(int(sys.argv[1])):
    for name in (("cpp", "py") if r % 2 == 0 else ("py", "cpp")):
        m.greedy_steps = cpp if name == "cpp" else types.MethodType(py_loop, m)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        toks[name] = outs[0].outputs[0].token_ids
        res[name].append(256 / dt)
print("same tokens:", toks["cpp"] == toks["py"])
for k, v in res.items():
    print(k, "median", round(statistics.median(v), 1), [round(x, 1) for x in v])
print("cpp/py per pair:", [round(a / b, 3) for a, b in zip(res["cpp"], res["py"], strict=True)])
