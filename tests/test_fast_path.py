"""The fast path (batched backend + C++ decode kernel) generates exactly what the reference path does."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.attention import cpu_kernels

pytestmark = pytest.mark.slow

PROMPTS = [
    "Explain what a paged KV cache is.",
    "List three rivers in Africa:",
    "def fibonacci(n):",
    "The quick brown fox",
]


def test_fast_path_greedy_equals_reference_backend(llm_fp32):
    assert llm_fp32.engine.runner.backend.name == "batched"
    # The C++ kernel must really be in use here (it builds wherever a compiler is, as in CI).
    assert cpu_kernels.load() is not None and llm_fp32.engine.runner.backend.kernel is not None
    ref = LLM(dtype="float32", attention_backend="torch_ref")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fast = llm_fp32.generate(PROMPTS, params, use_tqdm=False)
    slow = ref.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in slow]
