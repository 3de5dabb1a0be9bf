"""The fast path (batched backend + C++ decode kernel) generates exactly what the reference path does."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import CpuKernels
from pagedserve.kernels.cpu_info import cpu_info

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
    assert CpuKernels.build() is not None and llm_fp32.engine.runner.backend.kernels is not None
    ref = LLM(dtype="float32", attention_backend="torch_ref")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fast = llm_fp32.generate(PROMPTS, params, use_tqdm=False)
    slow = ref.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in slow]


def test_bf16_linear_routes_agree():
    """On CPUs without native bf16, many-row bf16 matmuls run in float32: both routes must agree."""
    import torch

    from pagedserve.model import matmul as layers

    torch.manual_seed(0)
    w = torch.randn(96, 64).bfloat16()
    b = torch.randn(96).bfloat16()
    x = torch.randn(40, 64).bfloat16()
    many = layers.linear(x, w, b)  # > BF16_EMULATED_MAX_ROWS rows
    few = torch.cat([layers.linear(x[i : i + 1], w, b) for i in range(len(x))])
    exact = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert many.dtype == few.dtype == torch.bfloat16
    # Both are the exact float32 product of the bf16 inputs, rounded once to bf16 (± summation order).
    assert torch.allclose(many.float(), exact, rtol=1e-2, atol=1e-2)
    assert torch.allclose(few.float(), exact, rtol=1e-2, atol=1e-2)


def test_bf16_engine_greedy_mostly_matches_float32(llm_fp32):
    """bf16 is not exact, but on the bundled model it must follow float32 closely at first."""
    bf16 = LLM(dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in llm_fp32.generate(PROMPTS, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in bf16.generate(PROMPTS, params, use_tqdm=False)]
    assert sum(x[0] == y[0] for x, y in zip(a, b, strict=True)) >= 3  # first tokens agree (almost) always


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_steps_take_the_heads_argmax_and_the_same_tokens(monkeypatch, dtype):
    """An all-greedy step with nothing to adjust or report asks the model for its rows' argmaxes only: on the bf16
    GGUF route the LM head hands those over without writing the logits (MatmulRoutes.argmax), and on the float32 GGUF
    route above 4 rows the screened head does (the bundled head is Q8_0). The same tokens as the sampler's argmax
    over the logits, at a step of a few rows (the GEMV) and of 20 (the many-rows kernels on either route); a step with
    a request asking for logprobs gets its logits."""
    llm = LLM(dtype=dtype, max_num_seqs=32)
    runner = llm.engine.runner
    fused: list[int] = []
    real = runner.sampler.from_argmax
    monkeypatch.setattr(runner.sampler, "from_argmax", lambda ids, vocab: fused.append(len(ids)) or real(ids, vocab))
    prompts = [f"{p} ({i})" for i in range(5) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    few = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    many = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    kernels = CpuKernels.build()
    if dtype == "bfloat16" and kernels.quant_bf16:  # the bf16 GGUF head (AVX512-BF16)
        assert 2 in fused and 20 in fused
        # The int8 screen of the Q8_0 head (20 rows) wherever the build has AVX512-VNNI, the same tokens below.
        assert (runner.model.tied_head_routes.screen_i8 is not None) == ("avx512_vnni" in cpu_info().flags)
    else:
        # The float32 route screens the Q8_0 head wherever the AVX2 + FMA + F16C kernels are built (has_quant_i8 is
        # built under the same condition); elsewhere the logits as before.
        screened = runner.model.tied_head_routes.screen_norms is not None
        assert screened == kernels.ext.has_quant_i8()
        if screened:
            assert 2 not in fused and 20 in fused
        else:
            assert fused == []
    fused.clear()
    monkeypatch.setattr(runner, "only_argmax", lambda out, sampling: False)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)] == few
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == many
    assert fused == []
    monkeypatch.undo()
    monkeypatch.setattr(runner.sampler, "from_argmax", lambda ids, vocab: fused.append(len(ids)) or real(ids, vocab))
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)[0]
    assert fused == [] and len(out.outputs[0].logprobs) == 3
    assert out.outputs[0].token_ids == few[0][:3]
