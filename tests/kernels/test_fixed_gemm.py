"""The batch-invariant matmul (csrc/fixed_gemm.cpp) and the routes that use it (model/matmul.py).

fixed_linear computes x @ w.T with one float32 FMA chain over k per output: it must agree with a
float64 reference to float32 accuracy, and a row's result must be the same bits whatever rows come with
it, wherever it sits in the batch and however many threads run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import CpuKernels
from pagedserve.model.matmul import GGUF_TYPE_IDS, MatmulRoutes, Route

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("wdt", DTYPES, ids=["w32", "wbf16"])
@pytest.mark.parametrize("xdt", DTYPES, ids=["x32", "xbf16"])
@pytest.mark.parametrize("odt", DTYPES, ids=["o32", "obf16"])
def test_matches_a_float64_reference(kernels, wdt, xdt, odt):
    g = torch.Generator().manual_seed(1)
    n, k = 37, 70  # neither a multiple of the 16-column panel nor of the vector width
    w = torch.randn(n, k, generator=g).to(wdt)
    x = torch.randn(23, k, generator=g).to(xdt)
    bias = torch.randn(n, generator=g)
    y = kernels.fixed_linear(x, kernels.fixed_pack(w), n, bias, odt)
    assert y.dtype == odt and y.shape == (23, n)
    exact = F.linear(x.double(), w.double(), bias.double())
    if odt == torch.float32:
        assert torch.allclose(y.double(), exact, atol=1e-4, rtol=1e-5)
    else:  # one rounding of the float32 result: within half a bf16 ulp of it
        assert torch.equal(y, kernels.fixed_linear(x, kernels.fixed_pack(w), n, bias, torch.float32).bfloat16())
    assert torch.allclose(kernels.fixed_linear(x, kernels.fixed_pack(w), n, None, torch.float32).double(),
                          F.linear(x.double(), w.double()), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_a_rows_result_does_not_depend_on_the_batch(kernels, dtype):
    g = torch.Generator().manual_seed(2)
    n, k = 200, 96
    w = torch.randn(n, k, generator=g).to(dtype)
    packed = kernels.fixed_pack(w)
    x = torch.randn(300, k, generator=g).to(dtype)
    full = kernels.fixed_linear(x, packed, n, None, torch.float32)
    for start, rows in ((0, 1), (5, 1), (0, 2), (3, 4), (7, 5), (11, 6), (0, 7), (13, 48), (2, 49), (100, 200)):
        part = kernels.fixed_linear(x[start : start + rows], packed, n, None, torch.float32)
        assert torch.equal(part, full[start : start + rows]), (start, rows)
    # A strided view of the rows (as q/k/v slices are) and one thread instead of several: same bits.
    wide = torch.cat([x, torch.randn(300, 5, generator=g).to(dtype)], dim=1)[:, :k]
    assert wide.stride(0) != k and torch.equal(kernels.fixed_linear(wide, packed, n, None, torch.float32), full)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.fixed_linear(x, packed, n, None, torch.float32), full)
    finally:
        torch.set_num_threads(threads)


def test_the_library_gemm_is_not_batch_invariant_but_fixed_linear_is(kernels):
    """Why the kernel exists: on this machine's torch, at least one row count gives a row different
    bits than the full batch does (for float32 GEMMs on x86 it is so at 1-3 rows); fixed_linear never."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1536, 576, generator=g)
    x = torch.randn(64, 576, generator=g)
    full = F.linear(x, w)
    lib_differs = any(not torch.equal(F.linear(x[:m], w), full[:m]) for m in (1, 2, 3, 5, 17))
    packed = kernels.fixed_pack(w)
    ours = kernels.fixed_linear(x, packed, 1536, None, torch.float32)
    assert all(torch.equal(kernels.fixed_linear(x[:m], packed, 1536, None, torch.float32), ours[:m])
               for m in (1, 2, 3, 5, 17))
    if not lib_differs:
        pytest.skip("this torch build's float32 GEMM happened to be invariant for these shapes")


def test_bad_inputs_raise(kernels):
    w = torch.randn(20, 8)
    packed = kernels.fixed_pack(w)
    assert packed.shape == (2, 8, 16)
    with pytest.raises(RuntimeError, match="fixed_linear"):
        kernels.fixed_linear(torch.randn(3, 9), packed, 20, None, torch.float32)  # K does not match
    with pytest.raises(RuntimeError, match="fixed_linear"):
        kernels.fixed_linear(torch.randn(3, 8), packed, 40, None, torch.float32)  # N beyond the panels
    with pytest.raises(RuntimeError, match="fixed_pack"):
        kernels.fixed_pack(torch.randn(4, 4).half())


# ---- routes ------------------------------------------------------------------------------------------
def test_batch_invariant_routes_everything_through_fixed_linear(kernels):
    w = torch.randn(48, 64).bfloat16()
    routes = MatmulRoutes()
    routes.setup(w, kernels, pack=True, batch_hint=8, batch_invariant=True)
    assert (routes.few_rows, routes.many_rows) == (Route.FIXED, Route.FIXED) and routes.packed is None
    x = torch.randn(40, 64).bfloat16()
    full = routes(x, w, None)
    assert full.dtype == torch.bfloat16
    assert all(torch.equal(routes(x[:m], w, None), full[:m]) for m in (1, 3, 4, 5, 17))
    with pytest.raises(ValueError, match="batch_invariant"):
        routes.setup(w, None, pack=False, batch_hint=8, batch_invariant=True)


@pytest.mark.parametrize("with_kernels", [True, False])
def test_a_bf16_head_returns_float32_sums(kernels, with_kernels):
    """Float32 logits in every dtype: the bf16 head's every route sums in float32 and returns float32 (no
    bf16 rounding of the logits), so few-row and many-row results agree to float32 accuracy."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, 64, generator=g).bfloat16()
    routes = MatmulRoutes()
    routes.setup(w, kernels if with_kernels else None, pack=True, batch_hint=8, float32_out=True)
    assert routes.few_rows in (Route.FIXED, Route.LINEAR_F32) and routes.many_rows in (Route.FIXED, Route.LINEAR_F32)
    x = torch.randn(40, 64, generator=g).bfloat16()
    exact = F.linear(x.double(), w.double())
    for rows in (1, 4, 40):
        y = routes(x[:rows], w, None)
        assert y.dtype == torch.float32
        assert torch.allclose(y.double(), exact[:rows], atol=1e-4, rtol=1e-5)
        assert not torch.equal(y, y.bfloat16().float())  # not bf16-quantized


def test_bf16_weights_never_take_the_exact_gguf_route(kernels):
    """One effective weight per matrix: a bf16 model multiplies by the bf16 rounding of the dequantized
    weights on every route, so the GGUF GEMVs (exact float32 weights) serve float32 models only."""
    import gguf
    import numpy as np

    dense = torch.randn(32, 64).numpy().astype(np.float32)
    kind = gguf.GGMLQuantizationType.Q4_1
    raw = gguf.quants.quantize(dense, kind)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(32, 64).astype(np.float32))
    qweight = (GGUF_TYPE_IDS["Q4_1"], torch.from_numpy(np.ascontiguousarray(raw)))
    on = kernels.replace(gguf_gemv=True, gguf_block_types=frozenset({GGUF_TYPE_IDS["Q4_1"]}), fixed_matmuls=False)
    routes = MatmulRoutes()
    routes.setup(weight, on, pack=False, batch_hint=8, qweight=qweight)
    assert routes.few_rows == Route.GGUF_R16
    routes.setup(weight.bfloat16(), on, pack=False, batch_hint=8, qweight=qweight)
    assert routes.qgemv is None and routes.few_rows != Route.GGUF_R16


def test_fixed_matmuls_default_and_switch(kernels):
    """By default the fixed-order matmul runs every matmul on CPUs without AVX-512 (where it is the
    fastest); EngineConfig.fixed_matmuls forces it either way."""
    from pagedserve.config import EngineConfig

    assert kernels.fixed_matmuls == (not kernels.has_avx512)
    w = torch.randn(48, 64)
    routes = MatmulRoutes()
    routes.setup(w, kernels.replace(fixed_matmuls=True), pack=True, batch_hint=8)
    assert (routes.few_rows, routes.many_rows) == (Route.FIXED, Route.FIXED)
    routes.setup(w, kernels.replace(fixed_matmuls=False), pack=True, batch_hint=8)
    assert Route.FIXED not in (routes.few_rows, routes.many_rows)
    for value in (True, False):
        built = CpuKernels.from_config(EngineConfig(fixed_matmuls=value))
        assert built is not None and built.fixed_matmuls is value
