"""One small traced run shared by tests/test_trace.py and tests/test_trace_browser.py (built once).

Block size 4, 12 blocks and a 16-token budget: the 20-token prompt is prefilled in two chunks, the
cache runs out by step 3 so a request is preempted and recomputed, one request arrives late and one
is aborted. Prefix caching is off so every computed token is accounted for exactly.
"""

from __future__ import annotations

import functools

from pagedserve.config import EngineConfig
from pagedserve.engine.trace import engine_trace_data
from pagedserve.entrypoints.cli.trace import TraceRequest, run_workload
from pagedserve.sampling_params import SamplingParams

PROMPTS = [
    "The paged KV cache stores the keys and values of every token in fixed size blocks, so",
    "Continuous batching lets requests join",
    "A block table maps",
    "Preemption frees",
    "Chunked prefill splits long prompts",
]


def small_config() -> EngineConfig:
    return EngineConfig(dtype="float32", block_size=4, num_kv_blocks=12, max_num_batched_tokens=16,
                        max_num_seqs=8, enable_prefix_caching=False, keep_block_tables=True, seed=0)


def small_workload() -> list[TraceRequest]:
    out = []
    for i, text in enumerate(PROMPTS):
        stop = ["."] if i == 1 else None
        params = SamplingParams(temperature=0.0, max_tokens=6, stop=stop)
        arrival = 0 if i < 3 else 2 + i
        abort = 9 if i == 4 else None
        out.append(TraceRequest(text, params, arrival, abort, f"r{i}"))
    return out


@functools.cache
def small_trace():
    """(engine, recorder, data) of the small workload, run once per test session."""
    from pagedserve.engine.engine import LLMEngine

    engine = LLMEngine(small_config())
    recorder = run_workload(engine, small_workload())
    data = engine_trace_data(engine, recorder=recorder)
    return engine, recorder, data


# ---- speculative decoding: the same kind of run with n-gram drafts -------------------------------------
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
               "disable_by_batch_size": None}
PARAGRAPHS = [
    "The paged KV cache stores the keys and values of every token in fixed size blocks, so memory is not wasted.",
    "A block table maps the logical positions of a request to physical blocks, which are shared between requests.",
]
# Prompts that repeat text (the n-gram proposer finds the drafts in them) and one that does not.
SPEC_PROMPTS = [p + " Repeat the paragraph exactly: " + p.split(",")[0] for p in PARAGRAPHS] + [
    "Continuous batching lets requests join",
]


def spec_config() -> EngineConfig:
    return EngineConfig(dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=64,
                        max_num_seqs=4, enable_prefix_caching=False, keep_block_tables=True, seed=0,
                        speculative_config=SPEC_CONFIG)


def spec_workload(prefix: str = "s") -> list[TraceRequest]:
    max_tokens = [16, 12, 6]
    return [TraceRequest(text, SamplingParams(temperature=0.0, max_tokens=max_tokens[i]), 0 if i < 2 else 2, None,
                         f"{prefix}{i}") for i, text in enumerate(SPEC_PROMPTS)]


@functools.cache
def spec_trace():
    """(engine, recorder, data, stats, baseline) of the speculative workload, run once per test session.

    stats: the engine's SpecDecodeStats right after the run. baseline: (recorder, number of steps) of the
    same workload on the same engine with its speculator detached, i.e. plain decoding."""
    from pagedserve.engine.engine import LLMEngine

    engine = LLMEngine(spec_config())
    recorder = run_workload(engine, spec_workload())
    data = engine_trace_data(engine, recorder=recorder)
    stats = engine.stats().spec_decode
    speculator, engine.speculator = engine.speculator, None
    try:
        first = engine.step_count
        base = run_workload(engine, spec_workload("b"))
        baseline = (base, engine.step_count - first)
    finally:
        engine.speculator = speculator
    return engine, recorder, data, stats, baseline
