"""Profile one decode step of W1 (128 running sequences, 128-token prompts) and of W2 (one sequence,
32-token prompt), by op. Usage: python benchmarks/profile_step.py OUT.txt
(PAGEDSERVE_NO_EXTENSION=1 profiles the pure-PyTorch attention path instead of the C++ kernel)."""

from __future__ import annotations

import os
import sys
import time

from torch.profiler import ProfilerActivity, profile

from pagedserve.bench import random_prompts
from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine
from pagedserve.sampling_params import SamplingParams


def profile_decode(engine: LLMEngine, batch: int, input_len: int, out) -> None:
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=64)
    for i, p in enumerate(random_prompts(batch, input_len, 0)):
        engine.add_request(f"w{batch}-{i}", {"prompt_token_ids": p}, params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(5):
        engine.step()
    step_s = (time.perf_counter() - start) / 5
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    out.write(f"\n== decode step, {batch} sequences (prompt {input_len}): {step_s * 1000:.1f} ms/step, "
              f"{batch / step_s:.1f} tok/s ==\n")
    out.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    engine.abort_request(list(engine.parents))


def main() -> None:
    engine = LLMEngine(EngineConfig(dtype=os.environ.get("PAGEDSERVE_DTYPE", "auto")))
    with open(sys.argv[1], "w") as out:
        path = "C++ kernel" if engine.runner.backend.kernel else "gather + SDPA"
        out.write(f"dtype {engine.dtype}; attention decode path: {path}\n")
        profile_decode(engine, 128, 128, out)  # W1
        profile_decode(engine, 1, 32, out)  # W2


if __name__ == "__main__":
    main()
