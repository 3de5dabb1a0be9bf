"""Profile one decode step of W1 (128 running sequences, 128-token prompts) and of W2 (one sequence,
32-token prompt), a W3 prefill step and one of W1's prefill steps (prompt chunks and decode rows together), by op.
Usage: python benchmarks/profile_step.py OUT.txt [DTYPE]

pagedserve's C++ kernels are pybind functions the profiler cannot see, so for the profiled step each is
wrapped in a `record_function` named `pagedserve::<kernel>`. W2 normally runs every layer in one C++ call
(DecodeStack); its by-op table is taken with the layer-by-layer path, and both step times are given.
DTYPE (default auto) may be float32 or bfloat16; PAGEDSERVE_NO_EXTENSION=1 profiles the pure-PyTorch paths.
"""

from __future__ import annotations

import functools
import sys
import time

from torch.profiler import ProfilerActivity, profile, record_function

from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine
from pagedserve.entrypoints.cli.bench import random_prompts
from pagedserve.sampling_params import SamplingParams

KERNELS = ("paged_decode_attention", "paged_attention_rows", "paged_attention_rows_into",
           "rms_norm", "fused_add_rms_norm", "rotary_write_kv",
           "silu_and_mul", "argmax_rows", "gemv_bf16", "gemv_gguf", "gemv_gguf_r16", "quant_linear",
           "quant_linear_bf16", "quant_linear_bf16_silu", "quant_linear_bf16_argmax", "quant_linear_argmax",
           "quant_linear_silu",
           "quant_linear_i8", "fixed_linear",
           "quant_embedding")


def _named(fn, name):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with record_function(f"pagedserve::{name}"):
            return fn(*args, **kwargs)

    return call


class _Traced:
    """The extension module with every kernel wrapped in a record_function."""

    def __init__(self, mod) -> None:
        self._mod = mod
        for k in KERNELS:
            if hasattr(mod, k):  # (an older build may lack a newer kernel)
                setattr(self, k, _named(getattr(mod, k), k))

    def __getattr__(self, name):
        return getattr(self._mod, name)


def trace_kernels(engine: LLMEngine) -> None:
    runner = engine.runner
    if runner.kernels is None:
        return
    traced = _Traced(runner.kernels.ext)
    runner.set_kernels(runner.kernels.replace(ext=traced))
    kernels = runner.kernels
    for routes in runner.model.matmul_routes():
        if routes.kernels is not None:  # the quantized and fixed-order routes call through their CpuKernels
            routes.kernels = kernels
        routes.gemv = routes.gemv and traced.gemv_bf16
        if routes.qgemv is not None:
            routes.qgemv.fn = traced.gemv_gguf_r16 if routes.qgemv.regrouped else traced.gemv_gguf


def time_steps(engine: LLMEngine, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        engine.step()
    return (time.perf_counter() - start) / n


def profile_decode(engine: LLMEngine, batch: int, input_len: int, out) -> None:
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=200)
    for i, p in enumerate(random_prompts(batch, input_len, 0)):
        engine.add_request(f"w{batch}-{i}", {"prompt_token_ids": p}, params)
    while engine.stats().num_waiting or any(r.num_output_tokens == 0 for r in engine.live_requests()):
        engine.step()
    time_steps(engine, 3)
    runner = engine.runner
    kernels = runner.kernels
    step_s = time_steps(engine, 10)
    note = ""
    if kernels is not None and kernels.decode_stack:  # the step ran in DecodeStack: profile it layer by layer
        runner.set_kernels(kernels.replace(decode_stack=False))
        time_steps(engine, 2)
        layered_s = time_steps(engine, 10)
        note = f" (every layer in one C++ call; layer by layer, as profiled below: {layered_s * 1000:.1f} ms)"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    runner.set_kernels(kernels)
    out.write(f"\n== decode step, {batch} sequences (prompt {input_len}): {step_s * 1000:.1f} ms/step, "
              f"{batch / step_s:.1f} tok/s{note} ==\n")
    out.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=16))
    engine.abort_all()


def profile_one_step(engine: LLMEngine, out, title: str) -> None:
    """Profile the engine's next step, write its table under `title`, then abort every request."""
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    step_s = time.perf_counter() - start
    tokens = engine.step_records[-1].num_scheduled_tokens
    out.write(f"\n== {title} ({tokens} tokens scheduled): {step_s * 1000:.1f} ms/step (profiled) ==\n")
    out.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=16))
    engine.abort_all()


def profile_prefill(engine: LLMEngine, num: int, input_len: int, out) -> None:
    """One full prefill step of W3 (16 prompts of 1,024 tokens: the step takes max_num_batched_tokens)."""
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)
    for i, p in enumerate(random_prompts(num, input_len, 1)):
        engine.add_request(f"warm-{i}", {"prompt_token_ids": p}, params)
    engine.step()  # warm-up: one step of the same shape
    engine.abort_all()
    for i, p in enumerate(random_prompts(num, input_len, 0)):
        engine.add_request(f"w3-{i}", {"prompt_token_ids": p}, params)
    profile_one_step(engine, out, f"prefill step, {num} prompts of {input_len}")


def profile_mixed(engine: LLMEngine, out) -> None:
    """W1's second step: 16 decode rows (the first step's prompts) + 2,032 prompt tokens of the next 16 prompts."""
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=128)
    for i, p in enumerate(random_prompts(128, 128, 2)):
        engine.add_request(f"warm1-{i}", {"prompt_token_ids": p}, params)
    engine.step()
    engine.step()  # warm-up: the same two shapes
    engine.abort_all()
    for i, p in enumerate(random_prompts(128, 128, 3)):  # prompts no earlier profile left in the prefix cache
        engine.add_request(f"w1-{i}", {"prompt_token_ids": p}, params)
    engine.step()
    profile_one_step(engine, out, "W1 prefill step with decodes in it, 128 prompts of 128")


def main() -> None:
    engine = LLMEngine(EngineConfig(dtype=sys.argv[2] if len(sys.argv) > 2 else "auto"))
    trace_kernels(engine)
    with open(sys.argv[1], "w") as out:
        path = "C++ kernel" if engine.runner.kernels else "gather + SDPA"
        out.write(f"dtype {engine.dtype}; attention decode path: {path}\n")
        profile_decode(engine, 128, 128, out)  # W1
        profile_decode(engine, 1, 32, out)  # W2
        profile_prefill(engine, 16, 1024, out)  # W3
        profile_mixed(engine, out)  # W1's prefill steps


if __name__ == "__main__":
    main()
