"""quant_linear_i8 (csrc/quant_gemm.cpp): Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks against
activations quantized to int8 per 32-k block -- llama.cpp's numerics, the opt-in `int8_activations` decode route.

Its definition is exact: y = W . Q(x) (+ bias), W the float32 matrix gguf-py dequantizes, Q(x) each 32-k block of
a row as dx * q with dx = max|x| / 127 and q = x * (127 / max|x|) rounded to nearest-even (both divisions rounded
once). The integer dot products are exact, so the kernel may differ from that product only by float32 summation
order; one activation quantum off anywhere is ~1e3 times the tolerance below. The reference here is float64.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_quant_gemm import DTYPES, dequantize, random_blocks

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
IDS = [t.name for t in TYPES]


# "native": built for this CPU (the AVX512-VNNI + VBMI kernels where it has them); "x86-64-v3": the AVX2 kernels,
# which must give the same bits.
ARCHS = ["native", "x86-64-v3"]
# Byte offsets of each block's fp16 fields (d, m / dmin): set to a finite value in the extreme blocks below.
HALVES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
          Q.Q6_K: (208,)}


@pytest.fixture(scope="module", params=ARCHS)
def kernels(request):
    from pagedserve.kernels import CpuKernels

    k = CpuKernels.build(request.param, int8_activations=True)
    assert k is not None
    if not k.quant_i8:
        pytest.skip("quant_linear_i8 needs AVX2")
    assert k.quant_i8_types == frozenset(int(t) for t in TYPES)
    if request.param == "x86-64-v3":
        assert not k.has_avx512
    return k


def quantize_x(x: torch.Tensor) -> torch.Tensor:
    """Q(x) in float64: per 32-k block dx * round_half_even(x * (127 / amax)), in float32 arithmetic as defined, with
    an unbounded exponent range: a block below 2^-100 is scaled by 2^64 before 127 / amax (exact: powers of two), so
    that one below 127 / FLT_MAX still gets its quants (dx = amax / 127 as it is, perhaps denormal)."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    dx = amax / torch.full_like(amax, 127.0)
    up = torch.where(amax < 2.0**-100, torch.full_like(amax, 2.0**64), torch.ones_like(amax))
    xb, amax = xb * up, amax * up
    # torch's `127.0 / t` is 127 * (1 / t), two roundings: divide a tensor by a tensor for one.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv)
    assert q.abs().max() <= 127
    return (q.double() * dx.double()).reshape(x.shape)


def check(kernels, x, raw, qtype, bias=None, out_dtype=torch.float32):
    n = raw.shape[0]
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    y = kernels.quant_linear_i8(x, packed, int(qtype), n, bias, out_dtype)
    w = dequantize(raw, qtype).double()
    qx = quantize_x(x)
    ref = qx @ w.T + (0 if bias is None else bias.double())
    # float32 summation of exact block products: a few ulp of the sum of magnitudes.
    scale = qx.abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    assert y.dtype == out_dtype and y.shape == (x.shape[0], n)
    err = (y.double() - ref).abs()
    assert (err <= 1e-6 * scale + 1e-30).all(), (err / scale.clamp_min(1e-30)).max().item()
    return y, packed


@pytest.mark.parametrize("x_dtype", DTYPES, ids=["x32", "xbf16"])
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_i8_linear_is_the_weights_times_the_quantized_activations(kernels, qtype, x_dtype):
    g = torch.Generator().manual_seed(1)
    n, k = 45, 512  # a partial panel; 16 blocks of 32 (two Q4_K blocks)
    raw = random_blocks(qtype, n, k, seed=3)
    bias = torch.randn(n, generator=g)
    for m in (1, 2, 3, 4, 7):  # 7: past the few-rows limit, taken 4 rows at a time
        x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m).unsqueeze(1)).to(x_dtype)
        x[0, 32:64] = 0  # an all-zero block: dx = 0, contributes nothing (no NaN)
        x[-1, 64:96] = torch.arange(32) - 16.0  # integers: x / dx lands on many exact ties
        check(kernels, x, raw, qtype, bias if m % 2 else None)


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_i8_linear_rounds_ties_to_even(kernels, qtype):
    """Block max 127 * 2^-3: x * (127 / max) = 8 x exactly, so x = k/16 lands on the tie k/2 + 0.5 ... for odd k."""
    k = 256
    row = torch.zeros(k)
    row[0] = 127 / 8
    row[1:32] = (torch.arange(31) * 2 + 1) / 16 - 2.0  # odd sixteenths: 8 x = (2 i + 1) / 2 - 16, all ties
    row[32:64] = -row[:32]
    row[64:] = row[:64].repeat(3)
    raw = random_blocks(qtype, 16, k, seed=5)
    check(kernels, row.unsqueeze(0), raw, qtype)
    # The ties really are ties, and half-to-even differs from half-away-from-zero on them.
    scaled = row[1:32] * 8
    assert torch.equal(scaled - scaled.floor(), torch.full_like(scaled, 0.5))
    assert not torch.equal(torch.round(scaled), torch.sign(scaled) * torch.floor(scaled.abs() + 0.5))


GGUF_PY_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]  # gguf-py has no K-quant quantizer


@pytest.mark.parametrize("qtype", GGUF_PY_TYPES, ids=[t.name for t in GGUF_PY_TYPES])
def test_i8_linear_on_blocks_gguf_py_quantized(kernels, qtype):
    """Real-looking weights (gguf-py's quantizer) and activations: the result is W . Q(x), and Q(x)'s error against
    the exact product is what quantizing x implies (at most half a quantum per element), no more."""
    g = torch.Generator().manual_seed(7)
    n, k = 64, 576
    w = torch.randn(n, k, generator=g) * 0.05
    raw = gguf.quants.quantize(w.numpy(), qtype).view(np.uint8).reshape(n, -1)
    x = torch.randn(2, k, generator=g).bfloat16()
    y, _ = check(kernels, x, raw, qtype)
    wd = dequantize(raw, qtype).double()
    exact = x.double() @ wd.T
    dx = x.float().reshape(2, -1, 32).abs().amax(-1).double() / 127  # [2, blocks]
    bound = (dx.repeat_interleave(32, dim=1) / 2) @ wd.abs().T  # sum over k of dx_b / 2 * |w|
    assert ((y.double() - exact).abs() <= bound * 1.0001 + 1e-6).all()
    assert (y.double() - exact).abs().max() > 0  # quantized: not the exact product


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_i8_linear_rows_and_threads_do_not_change_bits(kernels, qtype):
    """A row's output is one chain per output over the blocks: the same bits alone, in any batch of rows, with any
    thread count, in bf16 out as its float32 result rounded once."""
    g = torch.Generator().manual_seed(9)
    n, k = 200, 256
    raw = random_blocks(qtype, n, k, seed=11)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    x = torch.randn(6, k, generator=g).bfloat16()
    y = kernels.quant_linear_i8(x, packed, int(qtype), n, None, torch.float32)
    for i in range(6):
        one = kernels.quant_linear_i8(x[i : i + 1], packed, int(qtype), n, None, torch.float32)
        assert torch.equal(one[0], y[i]), i
    yb = kernels.quant_linear_i8(x, packed, int(qtype), n, None, torch.bfloat16)
    assert torch.equal(yb, y.bfloat16())
    strided = torch.randn(6, k + 64, generator=g).bfloat16()
    strided[:, :k] = x
    assert torch.equal(kernels.quant_linear_i8(strided[:, :k], packed, int(qtype), n, None, torch.float32), y)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.quant_linear_i8(x, packed, int(qtype), n, None, torch.float32), y)
    finally:
        torch.set_num_threads(threads)


def test_i8_linear_bad_arguments_raise(kernels):
    raw = torch.from_numpy(random_blocks(Q.Q8_0, 16, 64, seed=13))
    packed = kernels.quant_pack(raw, int(Q.Q8_0))
    with pytest.raises(RuntimeError, match="not Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K"):
        kernels.quant_linear_i8(torch.randn(1, 64), packed, int(Q.Q2_K), 16, None, torch.float32)
    with pytest.raises(RuntimeError, match="K the packed"):
        kernels.quant_linear_i8(torch.randn(1, 96), packed, int(Q.Q8_0), 16, None, torch.float32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.quant_linear_i8(torch.randn(1, 64).half(), packed, int(Q.Q8_0), 16, None, torch.float32)


def test_route_id(kernels):
    assert dict(kernels.ext.matmul_routes())["quant_i8"] == 9


def extreme_blocks(qtype, n: int, k: int) -> np.ndarray:
    """Every quant (and scale) bit set, the fp16 fields finite; Q8_0: -128 in half the rows (-1 in the rest)."""
    layout = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.full((n, k // layout[0] * layout[1]), 0xFF, dtype=np.uint8)
    blocks = raw.reshape(n, -1, layout[1])
    for off in HALVES[qtype]:
        blocks[:, :, off : off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == Q.Q8_0:
        blocks[: n // 2, :, 2:] = 0x80
    return raw


def extreme_x(m: int, k: int, g: torch.Generator, dtype) -> torch.Tensor:
    x = torch.randn(m, k, generator=g).to(dtype)
    x[0] = 1.0  # every activation quantizes to 127
    x[-1, :128] = -3.0  # -127
    return x


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_i8_linear_at_the_largest_integer_sums(kernels, qtype):
    """Every quant at its extreme against activations at +-127: the largest sums the AVX2 kernels' int16 runs can meet
    (a run one step too long saturates or wraps, and the result is off by far more than the tolerance) -- on every
    build, so that an AVX2-only CPU checks its own kernels against the definition."""
    g = torch.Generator().manual_seed(19)
    raw = extreme_blocks(qtype, 40, 512)
    for m in (1, 3, 4):
        check(kernels, extreme_x(m, 512, g, torch.float32), raw, qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_i8_linear_avx2_gives_the_vnni_bits(qtype):
    """The AVX2 kernels (int16 partial sums from vpmaddubsw / vpmaddwd) against the AVX512-VNNI ones, bit for bit, at
    the largest sums their int16 steps can meet (extreme_blocks) and on random blocks; 1-7 rows, both x dtypes."""
    from pagedserve.kernels import CpuKernels

    vnni = CpuKernels.build(int8_activations=True)
    if not (vnni.has_avx512 and vnni.ext.has_quant_i8_vnni()):
        pytest.skip("needs a CPU with AVX512-VNNI + VBMI to compare against")
    avx2 = CpuKernels.build("x86-64-v3", int8_activations=True)
    n, k = 40, 512
    g = torch.Generator().manual_seed(21)
    extreme = extreme_blocks(qtype, n, k)
    for raw in (extreme, random_blocks(qtype, n, k, seed=23)):
        packed = vnni.quant_pack(torch.from_numpy(raw), int(qtype))
        for m in (1, 2, 3, 4, 7):
            for x_dtype in (torch.float32, torch.bfloat16):
                x = extreme_x(m, k, g, x_dtype)
                a = avx2.quant_linear_i8(x, packed, int(qtype), n, None, torch.float32)
                b = vnni.quant_linear_i8(x, packed, int(qtype), n, None, torch.float32)
                assert torch.equal(a, b), (m, x_dtype, (a - b).abs().max().item())
        check(avx2, x, raw, qtype)  # and the definition


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_i8_linear_of_non_finite_and_tiny_activations(kernels, qtype):
    """A block of x holding a NaN or an infinity makes its row's outputs NaN (the engine then fails the request; the
    int8 route cannot give x @ W's inf), never a finite guess from its other values, and leaves the other rows'
    bits alone. A block below 127 / FLT_MAX (normal or denormal floats) is quantized as an unbounded exponent range
    would: 127 / amax no longer overflows into quants of the wrong sign. The same bits on every build (the AVX2 one
    too: this runs for both)."""
    n, k = 24, 512
    raw = random_blocks(qtype, n, k, seed=29)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    w = dequantize(raw, qtype).double()
    g = torch.Generator().manual_seed(31)
    x = torch.randn(7, k, generator=g)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, 500] = float("-inf")
    x[3, 64:96] = float("nan")
    for m in (1, 4, 7):
        y = kernels.quant_linear_i8(x[:m], packed, int(qtype), n, None, torch.float32)
        assert y[: min(m, 4)].isnan().all(), m
        for r in range(4, m):  # finite rows: their own bits, whatever the rows beside them
            alone = kernels.quant_linear_i8(x[r:r + 1], packed, int(qtype), n, None, torch.float32)
            assert torch.equal(y[r], alone[0])
    yb = kernels.quant_linear_i8(x, packed, int(qtype), n, None, torch.bfloat16)
    assert yb[:4].isnan().all() and not yb[4:].isnan().any()

    # Scales of about 1 (and mins): dx * d, denormal, then keeps ~17 bits.
    rng = np.random.default_rng(37)
    blocks = raw.reshape(n, -1, gguf.GGML_QUANT_SIZES[qtype][1])  # a view
    for off in HALVES[qtype]:
        f16 = rng.uniform(0.5, 2.0, blocks.shape[:2]) * rng.choice([-1.0, 1.0], blocks.shape[:2])
        blocks[:, :, off:off + 2] = f16.astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    w = dequantize(raw, qtype).double()
    tiny = torch.randn(4, k, generator=g).abs() + 0.5
    tiny[0] *= 1e-37  # normal floats: 127 / amax overflowed
    tiny[1] *= 3e-39  # denormals
    tiny[2, :256] *= 1e-30  # one half normal-sized (the old path), the other 1e-37
    tiny[2, 256:] *= 1e-37
    tiny[3] = -tiny[0]
    y = kernels.quant_linear_i8(tiny, packed, int(qtype), n, None, torch.float32)
    qx = quantize_x(tiny)
    ref, scale = qx @ w.T, qx.abs() @ w.abs().T
    # dx is denormal here, and so are its products with the weights' scales: 1e-3 of the sum of magnitudes (the
    # quants overflowed before came out 60 times the result, of the wrong sign).
    assert torch.isfinite(y).all()
    err = (y.double() - ref).abs()
    assert (err <= 1e-3 * scale).all(), (err / scale).max().item()
    assert (torch.sign(y) == torch.sign(ref.float())).float().mean() > 0.9  # (not garbage of one sign)

