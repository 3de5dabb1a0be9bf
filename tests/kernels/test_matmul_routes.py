"""model/matmul.py decides every matmul's routes in one place, from what the kernels object offers and
the config's switches; the routes compute what F.linear computes on the weights they stand for."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import CpuKernels
from pagedserve.model.matmul import GGUF_TYPE_IDS, MatmulRoutes, Route, onednn_packing_available


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    k = CpuKernels.build()
    assert k is not None, "the C++ kernels must build wherever a compiler is (as in CI)"
    return k.replace(fixed_matmuls=False)  # the library routes (tests/kernels/test_fixed_gemm.py: the other)


def q4_1_weight(n: int = 32, k: int = 64):
    g = torch.Generator().manual_seed(n * k)
    dense = torch.randn(n, k, generator=g).numpy().astype(np.float32)
    kind = gguf.GGMLQuantizationType.Q4_1
    raw = gguf.quants.quantize(dense, kind)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(n, k).astype(np.float32))
    return weight, (GGUF_TYPE_IDS["Q4_1"], torch.from_numpy(np.ascontiguousarray(raw)))


def test_without_kernels_everything_is_linear():
    weight, qweight = q4_1_weight()
    routes = MatmulRoutes()
    routes.setup(weight, None, pack=False, batch_hint=8, qweight=qweight)
    assert (routes.few_rows, routes.many_rows) == (Route.LINEAR, Route.LINEAR)
    x = torch.randn(3, 64)
    assert torch.equal(routes(x, weight, None), F.linear(x, weight))


def test_gguf_route_follows_the_kernels_capabilities(kernels):
    weight, qweight = q4_1_weight()
    on = kernels.replace(gguf_gemv=True, gguf_block_types=frozenset({GGUF_TYPE_IDS["Q4_1"]}))
    off = kernels.replace(gguf_gemv=False, gguf_block_types=frozenset())
    routes = MatmulRoutes()
    routes.setup(weight, on, pack=False, batch_hint=8, qweight=qweight)
    assert routes.few_rows == Route.GGUF_R16 and routes.many_rows == Route.LINEAR  # 32 rows: regrouped
    routes.setup(weight, off, pack=False, batch_hint=8, qweight=qweight)
    assert routes.few_rows == Route.LINEAR and routes.qgemv is None
    routes.setup(weight, on, pack=False, batch_hint=8, qweight=None)  # no blocks kept for this weight
    assert routes.few_rows == Route.LINEAR
    if kernels.gguf_gemv:  # AVX-512 builds: the route really runs, on exactly the dequantized weights
        routes.setup(weight, kernels, pack=False, batch_hint=8, qweight=qweight)
        x = torch.randn(2, 64)
        assert torch.allclose(routes(x, weight, None), F.linear(x, weight), atol=1e-4, rtol=1e-4)


def test_packing_and_gemv_routes(kernels):
    weight = torch.randn(48, 64).bfloat16()
    routes = MatmulRoutes()
    routes.setup(weight, kernels, pack=True, batch_hint=8)
    if not onednn_packing_available():
        assert (routes.few_rows, routes.many_rows) == (Route.LINEAR, Route.LINEAR)
        return
    assert routes.many_rows == Route.PACKED
    assert routes.few_rows == (Route.BF16_GEMV if kernels.bf16_gemv else Route.PACKED)
    routes.setup(weight, kernels.replace(bf16_gemv=False), pack=True, batch_hint=8)
    assert routes.few_rows == Route.PACKED
    routes.setup(weight, kernels, pack=False, batch_hint=8)  # pack_weights=False: only the packing goes
    assert routes.many_rows == Route.LINEAR
    assert routes.few_rows == (Route.BF16_GEMV if kernels.bf16_gemv else Route.LINEAR)
    for rows in (1, 4, 40):
        x = torch.randn(rows, 64).bfloat16()
        routes.setup(weight, kernels, pack=True, batch_hint=8)
        exact = F.linear(x.float(), weight.float())
        assert torch.allclose(routes(x, weight, None).float(), exact, atol=2e-2, rtol=1e-2)


def test_engine_config_switches_reach_the_kernels_object():
    from pagedserve.config import EngineConfig

    k = CpuKernels.from_config(EngineConfig(decode_stack=False, bf16_gemv=False, gguf_gemv=False))
    assert k is not None and not k.decode_stack and not k.bf16_gemv and not k.gguf_gemv
    assert not k.gguf_block_types
    assert CpuKernels.from_config(EngineConfig(use_cpp_kernels=False)) is None
    assert CpuKernels.from_config(EngineConfig(attention_backend="torch_ref")) is None


def test_int8_activations_is_opt_in_and_not_with_the_strict_mode():
    from pagedserve.config import EngineConfig

    assert not CpuKernels.from_config(EngineConfig()).quant_i8  # default: the reference's activations
    k = CpuKernels.from_config(EngineConfig(int8_activations=True))
    assert k.quant_i8 == k.ext.has_quant_i8()  # where the CPU cannot, ignored (with a warning)
    with pytest.raises(ValueError, match="int8_activations"):
        EngineConfig(int8_activations=True, batch_invariant=True)


def test_int8_route_is_for_few_rows_of_its_block_types(kernels):
    """QUANT_I8 takes the few-rows route of weights read in place in the block types it has kernels for, when the
    kernels offer it, never in the strict mode; many rows keep the model's route."""
    from pagedserve.model.loader import IN_PLACE_TYPES
    from pagedserve.model.matmul import QuantPart, Route

    _, (_, raw) = q4_1_weight()
    k8 = kernels.replace(quant_i8=True)
    for km, strict, want in ((k8, False, Route.QUANT_I8), (k8, True, Route.QUANT), (kernels, False, Route.QUANT)):
        routes = MatmulRoutes()
        routes.quant = [QuantPart(3, kernels.quant_pack(raw, 3), raw.shape[0])]
        routes.setup(torch.empty(32, 64), km, pack=False, batch_hint=8, batch_invariant=strict)
        assert (routes.few_rows, routes.many_rows) == (want, Route.QUANT)
        assert routes.one_route == (want != Route.QUANT_I8)
    # Every block type read in place has an int8 kernel: Q5_K too, alone or beside another type. A part of a type
    # without one (none today: the set is narrowed here) keeps the whole matmul on its route.
    k5 = torch.randint(0, 256, (16, 176), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    k5[:, :4] = torch.tensor([0, 20, 0, 20], dtype=torch.uint8)  # d, dmin: small finite fp16
    raw256 = torch.randint(0, 256, (16, 8 * 20), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    raw256.view(16, 8, 20)[:, :, :4] = torch.tensor([0, 20, 0, 20], dtype=torch.uint8)
    assert kernels.quant_i8_types == IN_PLACE_TYPES  # every build with AVX2: the VNNI or the AVX2 kernels
    q4_1, q5_k = QuantPart(3, kernels.quant_pack(raw256, 3), 16), QuantPart(13, kernels.quant_pack(k5, 13), 16)
    for narrowed in (False, True):
        km = k8.replace(quant_i8_types=IN_PLACE_TYPES - {13}) if narrowed else k8
        for parts, want in (([q5_k], Route.QUANT if narrowed else Route.QUANT_I8), ([q4_1], Route.QUANT_I8),
                            ([q4_1, q5_k], Route.QUANT if narrowed else Route.QUANT_I8)):
            routes = MatmulRoutes()
            routes.quant = parts
            routes.setup(torch.empty(16 * len(parts), 256), km, pack=False, batch_hint=8, batch_invariant=False)
            assert routes.few_rows == want


def test_swiglu_is_one_call_on_the_float32_quant_route_and_none_elsewhere(kernels):
    """MatmulRoutes.silu_and_mul: on the QUANT route with float32 x (one block type, 2 I % 32 == 0), quant_linear_silu
    — the bits of the matmul then kernels.silu_and_mul — at few and many rows; None where no fused form applies (a
    plain weight with no blocks, e.g. a draft model's; bf16 x on the float32 route; two block types; I = 8)."""
    from pagedserve.model.matmul import QuantPart

    _, (_, raw) = q4_1_weight(n=64)  # [gate; up], I = 32
    routes = MatmulRoutes()
    routes.quant = [QuantPart(3, kernels.quant_pack(raw, 3), 64)]
    routes.setup(torch.empty(64, 64), kernels, pack=False, batch_hint=8)
    assert (routes.few_rows, routes.many_rows) == (Route.QUANT, Route.QUANT)
    for m in (1, 3, 40):
        x = torch.randn(m, 64)
        got = routes.silu_and_mul(x)
        assert got is not None and torch.equal(got, kernels.silu_and_mul(routes(x, None, None)))
    assert routes.silu_and_mul(torch.randn(2, 64).bfloat16()) is None
    plain = MatmulRoutes()
    plain.setup(torch.randn(64, 64), kernels, pack=False, batch_hint=8)
    assert plain.quant is None and plain.silu_and_mul(torch.randn(2, 64)) is None
    _, (_, raw16) = q4_1_weight(n=16)
    small = MatmulRoutes()
    small.quant = [QuantPart(3, kernels.quant_pack(raw16, 3), 16)]
    small.setup(torch.empty(16, 64), kernels, pack=False, batch_hint=8)
    assert small.silu_and_mul(torch.randn(2, 64)) is None
    two = MatmulRoutes()
    two.quant = [QuantPart(3, kernels.quant_pack(raw16, 3), 16), QuantPart(3, kernels.quant_pack(raw16, 3), 16)]
    two.setup(torch.empty(32, 64), kernels, pack=False, batch_hint=8)
    assert two.silu_and_mul(torch.randn(2, 64)) is None


def test_an_engine_counts_the_onednn_packed_weights_it_holds():
    """oneDNN's packed weights (the many-rows route of bf16 matmuls where the CPU has native bf16: every matmul under
    the torch_ref backend) have no storage to take a pointer of: the engine counts their bytes instead of failing
    at construction."""
    if not onednn_packing_available():
        pytest.skip("no oneDNN bf16 packing on this CPU")
    from pagedserve import LLM, SamplingParams

    llm = LLM(attention_backend="torch_ref", dtype="bfloat16", num_kv_blocks=16)
    model = llm.engine.runner.model
    packed = [r.packed for r in model.matmul_routes() if r.packed is not None]
    assert packed and all(t.is_mkldnn for t in packed)
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    assert llm.engine.weight_bytes >= dense + sum(t.numel() * t.element_size() for t in packed)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
