"""GGUF quantized weights read in place (csrc/quant_gemm.cpp): quant_pack, quant_linear, quant_embedding
and DecodeStack's quantized route.

The reference is exact: W is the float32 matrix gguf-py dequantizes, and quant_linear must give the same
bits as fixed_linear over that W (one float32 FMA chain over k per output) at every row count, with and
without bias, for float32 and bf16 inputs and outputs and for any thread count. The blocks are random
bytes with sane fp16 scales (every byte pattern is a valid block), so every quant value, 6-bit K-quant
scale and high bit occurs; the legacy types are also checked on blocks gguf-py quantized.
"""

from __future__ import annotations

import os
import resource

import gguf
import numpy as np
import pytest
import torch

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
IDS = [t.name for t in TYPES]
# Byte offsets of each block's fp16 fields (d, m / dmin): random bytes there could be inf or NaN.
F16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
              Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def threads():
    """Restores the thread count a test changes."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def random_blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, row_bytes]: random blocks of qtype, fp16 fields drawn as small normals (some negative,
    some subnormal-sized)."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    nb = k // block_size
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, nb, block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = np.exp(rng.uniform(-12, -2, size=(n, nb))) * rng.choice([-1.0, 1.0], size=(n, nb))
        raw[:, :, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return raw.reshape(n, nb * block_bytes)


def dequantize(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))


def k_for(qtype: Q) -> int:
    # Several 256-k slices and a tail slice (320 = 256 + 64) for the 32-blocks; two super-blocks for K-quants.
    return 512 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 320


def test_quant_types(kernels):
    assert kernels.quant_types == frozenset(int(t) for t in TYPES)
    assert sorted(kernels.ext.quant_types()) == sorted(kernels.quant_types)


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_pack_moves_the_files_bytes_without_expanding_them(kernels, qtype):
    n, k = 37, k_for(qtype)
    raw = random_blocks(qtype, n, k, seed=1)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    assert len(packed) == 1 and packed[0].dtype == torch.uint8
    panels = (n + 15) // 16
    assert packed[0].shape == (panels, 16 * raw.shape[1])
    # The same bytes (a permutation) plus the zero rows padding n to a multiple of 16.
    pad = (panels * 16 - n) * raw.shape[1]
    counts = np.bincount(packed[0].numpy().ravel(), minlength=256)
    expect = np.bincount(raw.ravel(), minlength=256)
    expect[0] += pad
    assert np.array_equal(counts, expect)


@pytest.mark.parametrize("out_dtype", DTYPES, ids=["o32", "obf16"])
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_embedding_is_gguf_pys_dequantization(kernels, qtype, out_dtype):
    n, k = 45, k_for(qtype)
    raw = random_blocks(qtype, n, k, seed=2)
    w = dequantize(raw, qtype)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    every = kernels.quant_embedding(torch.arange(n), packed, int(qtype), k, out_dtype)
    assert every.dtype == out_dtype and every.shape == (n, k)
    assert torch.equal(every, w.to(out_dtype))
    ids = torch.tensor([[44, 0, 17], [17, 3, 31]])  # any shape, repeats
    assert torch.equal(kernels.quant_embedding(ids, packed, int(qtype), k, out_dtype), w[ids].to(out_dtype))


def test_a_nan_rounded_to_bf16_stays_a_nan(kernels):
    """A NaN whose top payload bits are ones -- an fp16 NaN scale (0x7FFF, 0xFFFF) times a quant is float32 0x7FFFE000
    -- rounded to a bf16 output is torch's NaN, not the rounding's carry into the exponent or sign (+-0.0, inf): so a
    damaged block or a NaN activation still shows as NaN downstream (the engine fails that request). Whole panels
    (the vector stores), a partial one (the scalar tail) and the embedding."""
    qtype = Q.Q8_0
    for bits in (0x7FFF, 0xFFFF, 0x7E01, 0xFD00):  # fp16 NaNs, quiet and signalling, both signs
        raw = np.zeros((17, 34), np.uint8)
        raw[:, 2:] = 1
        raw[:, 0:2] = np.array([bits], np.uint16).view(np.uint8)
        packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
        emb = kernels.quant_embedding(torch.tensor([0, 16]), packed, int(qtype), 32, torch.bfloat16)
        assert emb.isnan().all(), hex(bits)
        for m in (1, 5):  # the few-rows and many-rows drivers
            y = kernels.quant_linear(torch.ones(m, 32), packed, int(qtype), 17, None, torch.bfloat16)
            assert y.isnan().all(), (hex(bits), m)
    # NaN payloads of x through finite weights into bf16 outputs (float32 in: the payload survives the products).
    raw = random_blocks(qtype, 17, 64, seed=4)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    for payload in (0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0x7FC00000):
        x = torch.ones(2, 64)
        x.view(torch.int32)[0, 5] = torch.tensor(payload, dtype=torch.int64).to(torch.int32)
        y = kernels.quant_linear(x, packed, int(qtype), 17, None, torch.bfloat16)
        assert y[0].isnan().all() and not y[1].isnan().any(), hex(payload)
        assert torch.equal(y[1], kernels.quant_linear(x[1:], packed, int(qtype), 17, None, torch.bfloat16)[0])


def check_linear(kernels, qtype: Q, raw: np.ndarray, rows: tuple[int, ...], seed: int) -> None:
    """quant_linear == fixed_linear over the dequantized weight, bit for bit, for every row count in rows,
    with and without bias, float32/bf16 x and outputs; and a row's bits do not depend on the batch."""
    n, k = raw.shape[0], raw.shape[1] // gguf.GGML_QUANT_SIZES[qtype][1] * gguf.GGML_QUANT_SIZES[qtype][0]
    w = dequantize(raw, qtype)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    fixed = kernels.fixed_pack(w)
    g = torch.Generator().manual_seed(seed)
    x_all = torch.randn(max(rows), k, generator=g)
    bias = torch.randn(n, generator=g)
    for xdt in DTYPES:
        x_full = x_all.to(xdt)
        for b in (None, bias):
            full = kernels.quant_linear(x_full, packed, int(qtype), n, b, torch.float32)
            for m in rows:
                x = x_full[:m]
                for odt in DTYPES:
                    y = kernels.quant_linear(x, packed, int(qtype), n, b, odt)
                    ref = kernels.fixed_linear(x, fixed, n, b, odt)
                    assert y.dtype == odt and y.shape == (m, n)
                    assert torch.equal(y, ref), (qtype.name, m, xdt, odt, b is None)
                assert torch.equal(kernels.quant_linear(x, packed, int(qtype), n, b, torch.float32), full[:m])


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_linear_is_fixed_linear_over_the_dequantized_weight(kernels, qtype):
    raw = random_blocks(qtype, 37, k_for(qtype), seed=3)  # 37: a partial last panel
    check_linear(kernels, qtype, raw, (1, 2, 3, 4, 5, 6, 7, 16, 53, 64, 300), seed=4)


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_linear_of_many_row_blocks_widens_each_panel_once_with_the_same_bits(kernels, qtype):
    """Past 8 row blocks (48 rows each at K >= 1,366) the many-rows route widens each panel whole once per call (into
    a buffer of the calling thread) instead of once per row block: the same bits as fixed_linear and as fewer rows
    (which widen per block), on 1 and 2 threads, twice in a row (the buffer reused), with a tail k slice for the
    32-blocks (K = 1,600 = 6 x 256 + 64)."""
    k = 1792 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 1600
    n = 37
    raw = random_blocks(qtype, n, k, seed=9)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    fixed = kernels.fixed_pack(dequantize(raw, qtype))
    x = torch.randn(400, k, generator=torch.Generator().manual_seed(10))
    ref = kernels.fixed_linear(x, fixed, n, None, torch.float32)
    for t in (1, 2, 2):
        torch.set_num_threads(t)
        assert torch.equal(kernels.quant_linear(x, packed, int(qtype), n, None, torch.float32), ref), t
    assert torch.equal(kernels.quant_linear(x[390:], packed, int(qtype), n, None, torch.float32), ref[390:])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda t: t.name)
def test_linear_on_blocks_gguf_py_quantized(kernels, qtype):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(21, 96, generator=g).numpy() * 0.05
    raw = gguf.quants.quantize(w, qtype)
    assert raw.dtype == np.uint8 and raw.shape[0] == 21
    check_linear(kernels, qtype, raw, (1, 4, 9), seed=6)


def test_large_outputs_reuse_kept_buffers_only_once_nothing_holds_them(kernels):
    """Outputs of 32 MB or more (an LM head's logits over a large vocabulary) come from buffers kept per thread (at
    most two) instead of a fresh mmap whose pages fault in at every call: a buffer is handed out again only once the
    output made from it, and every view of it, is gone; a smaller output reuses a larger buffer, a larger one regrows
    it. Values: quant_linear = fixed_linear (both take their outputs this way) bit for bit, and outputs still held keep
    theirs while later calls write."""
    n, k = 98_304, 32  # [128, n] float32: 50 MB; [96, n]: 38 MB; [160, n]: 63 MB; [64, n]: 25 MB (a plain allocation)
    raw = random_blocks(Q.Q8_0, n, k, seed=11)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(Q.Q8_0))
    fixed = kernels.fixed_pack(dequantize(raw, Q.Q8_0))
    g = torch.Generator().manual_seed(12)
    xa, xb = torch.randn(160, k, generator=g), torch.randn(160, k, generator=g)

    def linear(x):
        return kernels.quant_linear(x, packed, int(Q.Q8_0), n, None, torch.float32)

    def ref(x):
        return kernels.fixed_linear(x, fixed, n, None, torch.float32)

    expect_a, expect_b = ref(xa[:128]).clone(), ref(xb[:128]).clone()
    y1 = linear(xa[:128])
    y2 = linear(xb[:128])  # y1 held: the other kept buffer
    y3 = linear(xa[:128])  # both held: a plain allocation
    ptrs = {y.data_ptr() for y in (y1, y2, y3)}
    assert len(ptrs) == 3
    assert torch.equal(y1, expect_a) and torch.equal(y2, expect_b) and torch.equal(y3, expect_a)
    p1, p2 = y1.data_ptr(), y2.data_ptr()
    view = y1[3:5]  # keeps y1's buffer
    del y1, y3
    y4 = linear(xb[:128])
    assert y4.data_ptr() not in (p1, p2) and torch.equal(y4, expect_b)
    assert torch.equal(view, expect_a[3:5])
    del y2, y4
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y5 = linear(xa[:96])  # y2's buffer is free again: reused, for fewer rows, its pages already in
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    assert faults < 1000, f"{faults} page faults for a 38 MB output (9,216 pages): its buffer was not reused"
    assert y5.data_ptr() == p2 and torch.equal(y5, expect_a[:96]) and torch.equal(view, expect_a[3:5])
    del view, y5
    y6 = linear(xb[:96])
    assert y6.data_ptr() in (p1, p2) and torch.equal(y6, expect_b[:96])
    del y6
    y7 = linear(xa)  # more than either buffer holds: one regrows (the first free one, p1's: its memory is freed)
    assert y7.shape == (160, n)
    r7 = ref(xa)  # y7 held: the other buffer (p2's) regrows too, so neither p1 nor p2 is kept any more
    assert torch.equal(y7, r7) and r7.data_ptr() != y7.data_ptr()
    kept = (y7.data_ptr(), r7.data_ptr())
    del r7
    y8 = linear(xb[:64])  # under 32 MB: a plain allocation (which may land where p1's or p2's freed memory was)
    assert y8.data_ptr() not in kept and torch.equal(y8, expect_b[:64])


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_thread_count_and_strided_rows_do_not_change_bits(kernels, threads, qtype):
    n, k = 77, k_for(qtype)  # 5 panels: an odd number of panel pairs, a partial last panel
    raw = random_blocks(qtype, n, k, seed=7)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    g = torch.Generator().manual_seed(8)
    wide = torch.randn(70, k + 9, generator=g)
    x = wide[:, :k]  # row stride k + 9
    for m in (1, 2, 3, 4, 70):
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(kernels.quant_linear(x[:m], packed, int(qtype), n, None, torch.float32))
        assert torch.equal(outs[0], outs[1]), m
        assert torch.equal(outs[0], kernels.quant_linear(x[:m].contiguous(), packed, int(qtype), n, None,
                                                         torch.float32))


# ---- bf16 weights: quant_linear_bf16 (AVX512-BF16 builds) -------------------------------------------------

needs_bf16 = pytest.mark.skipif("not __import__('pagedserve.kernels', fromlist=['x']).load_extension('native')"
                                ".has_quant_bf16()", reason="quant_linear_bf16 needs an AVX512-BF16 build")


def _amx_active() -> bool:
    return bool(__import__("pagedserve.kernels", fromlist=["x"]).load_extension("native").amx_active())


# quant_linear_bf16's two routes: vdpbf16ps chains (every AVX512-BF16 build) and AMX tiles (where the CPU has AMX).
BF16_ROUTES = [pytest.param(False, id="vdpbf16ps"),
               pytest.param(True, id="amx", marks=pytest.mark.skipif("not _amx_active()",
                                                                    reason="no AMX on this CPU (or not granted)"))]


@pytest.fixture
def bf16_route(kernels, request):
    """Runs the test on one quant_linear_bf16 route (process-wide switch), then restores the default."""
    before = kernels.ext.amx_active()
    assert kernels.ext.set_amx(request.param) == request.param
    yield request.param
    kernels.ext.set_amx(True)
    assert kernels.ext.amx_active() == before


def assert_unit_rows_read_the_bf16_weights(kernels, packed, qtype: Q, w: torch.Tensor) -> None:
    """Unit rows read quant_linear_bf16's widened weights out exactly (one non-zero product per sum): every k of
    every row of w (gguf-py's [n, k]) rounded to bf16, bit for bit, through the few-rows GEMV (1-4 rows) and the
    buffered tiles (all k rows at once)."""
    n, k = w.shape
    eye = torch.eye(k, dtype=torch.bfloat16)
    expect = w.to(torch.bfloat16).float().t()
    assert torch.equal(kernels.quant_linear_bf16(eye, packed, int(qtype), n, None, torch.float32), expect)
    for k0 in range(0, k, 4):
        got = kernels.quant_linear_bf16(eye[k0 : k0 + 4], packed, int(qtype), n, None, torch.float32)
        assert torch.equal(got, expect[k0 : k0 + 4]), k0


@needs_bf16
@pytest.mark.parametrize("bf16_route", BF16_ROUTES, indirect=True)
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_bf16_linear_uses_the_bf16_rounded_weights_and_is_batch_invariant(kernels, threads, bf16_route, qtype):
    """quant_linear_bf16 multiplies bf16 x by gguf-py's weights rounded to nearest-even bf16 (what a bf16
    model dequantized at load holds), float32 sums: within float32 summation error of that product in float64,
    and far from the product with the unrounded weights. A row's bits depend on nothing else: not on the row
    count (the register GEMV of 1-4 rows and the buffered tiles of more give the same chains; on AMX, tiles
    configured to 1-16 rows, streamed or buffered weights), the thread count, the row stride or the bias."""
    n, k = 77, k_for(qtype) * 2  # 5 panels: a partial group of 4, a partial last panel
    raw = random_blocks(qtype, n, k, seed=21)
    w = dequantize(raw, qtype)
    wb = w.to(torch.bfloat16).double()
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    g = torch.Generator().manual_seed(22)
    wide = torch.randn(300, k + 10, generator=g).to(torch.bfloat16)
    x = wide[:, :k]  # row stride k + 10
    bias = torch.randn(n, generator=g)
    full = kernels.quant_linear_bf16(x.contiguous(), packed, int(qtype), n, bias, torch.float32)
    ref = x.double() @ wb.t() + bias.double()
    scale = (x.double().abs() @ wb.abs().t()).max()
    assert (full.double() - ref).abs().max() <= 1e-5 * scale
    unrounded = x.double() @ w.double().t() + bias.double()
    assert (full.double() - unrounded).abs().max() > 1e-4 * scale  # the weights really are bf16
    for m in (1, 2, 3, 4, 5, 6, 7, 13, 16, 17, 31, 32, 33, 64, 300):
        for t in (1, 2):
            torch.set_num_threads(t)
            y = kernels.quant_linear_bf16(x[:m], packed, int(qtype), n, bias, torch.float32)
            assert torch.equal(y, full[:m]), (m, t)
        yb = kernels.quant_linear_bf16(x[:m], packed, int(qtype), n, bias, torch.bfloat16)
        assert yb.dtype == torch.bfloat16 and torch.equal(yb, full[:m].to(torch.bfloat16))
    nob = kernels.quant_linear_bf16(x[:5], packed, int(qtype), n, None, torch.float32)
    assert torch.allclose(nob + bias, full[:5], rtol=0, atol=1e-5 * float(scale))
    assert_unit_rows_read_the_bf16_weights(kernels, packed, qtype, w)


def _k_scales(raw: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """float32 [n, nb, 8] twice: each sub-block's d * scale and dmin * min of Q4_K / Q5_K blocks (as the kernels do),
    the 6-bit scales unpacked by gguf-py's own Q4_K.get_scale_min (Q5_K packs them the same way)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, gguf.GGML_QUANT_SIZES[qtype][1])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    scale, mn = gguf.quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12).copy())
    scale, mn = scale.reshape(*d.shape, 8), mn.reshape(*d.shape, 8)
    return d[..., None] * scale.astype(np.float32), dmin[..., None] * mn.astype(np.float32)


@needs_bf16
@pytest.mark.parametrize("bf16_route", BF16_ROUTES, indirect=True)
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K], ids=["Q4_1", "Q5_1", "Q4_K", "Q5_K"])
def test_bf16_widening_in_both_forms_gives_the_same_weights(kernels, threads, bf16_route, qtype):
    """With VBMI the bf16 routes widen a sub-block's 16 rows in the magic form (each quant written into a float's
    mantissa, no conversion, one fma with c = m - 128 d; K-quants: -dmin * min - 128 d * scale) where that c is
    exact in float32 for all 16 rows, else in the converting form. A model's scales (m about -7.5 d) give exact c;
    an m 2^14 below its d does not, m = 0 and d = 0 do. Such rows mixed into one matmul (so a few-rows GEMV also
    meets panels of both forms in one k step): every weight comes out as gguf-py's rounded to bf16, bit for bit
    (unit rows), and the product of random rows is right at 1-4 and more rows."""
    n, k = 80, 2 * k_for(qtype)
    raw = random_blocks(qtype, n, k, seed=91)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = raw.reshape(n, -1, block_bytes)
    rng = np.random.default_rng(92)
    d = (rng.uniform(0.5, 1.5, size=blocks.shape[:2]) * 2.0**-2).astype(np.float16)
    if qtype in (Q.Q4_1, Q.Q5_1):
        m = (-d.astype(np.float64) * rng.uniform(6.0, 9.0, size=d.shape)).astype(np.float16)
        m[20, 3] = d[20, 3] * np.float16(2.0**-14)  # panel 1: one row's c inexact in one block
        m[50, :] = 0.0  # panel 3: exact (c = -128 d)
        d[51, 5] = 0.0  # exact (c = m)
        m[70, 1:] = d[70, 1:] * np.float16(2.0**-14)  # panel 4: inexact in all blocks but the first
        blocks[..., 2:4] = m.view(np.uint8).reshape(*m.shape, 2)
        dd, mm = d.astype(np.float32)[..., None], m.astype(np.float32)[..., None]
        c = mm + np.float32(-128.0) * dd
        exact = c.astype(np.float64) == mm.astype(np.float64) - 128.0 * dd.astype(np.float64)
        exact = exact[..., 0]
    else:  # dmin beside d: with random 6-bit scales and mins some sub-blocks' c are exact, some are not
        dmin = (d.astype(np.float64) * rng.uniform(0.5, 2.0, size=d.shape)).astype(np.float16)
        blocks[..., 2:4] = dmin.view(np.uint8).reshape(*dmin.shape, 2)
    blocks[..., 0:2] = d.view(np.uint8).reshape(*d.shape, 2)
    raw = blocks.reshape(n, -1)
    if qtype in (Q.Q4_K, Q.Q5_K):
        ds, dm = _k_scales(raw, qtype)
        c = -dm + np.float32(-128.0) * ds
        exact = c.astype(np.float64) == -dm.astype(np.float64) - 128.0 * ds.astype(np.float64)
    panels = exact.reshape(n // 16, 16, -1).all(axis=1)  # [panel, sub-block]: the magic form
    assert panels.any() and not panels.all() and panels.any(axis=1).all()  # both forms, in every panel

    w = dequantize(raw, qtype)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    assert_unit_rows_read_the_bf16_weights(kernels, packed, qtype, w)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(93)).to(torch.bfloat16)
    wb = w.to(torch.bfloat16).double()
    ref = x.double() @ wb.t()
    scale = (x.double().abs() @ wb.abs().t()).max()
    full = kernels.quant_linear_bf16(x, packed, int(qtype), n, None, torch.float32)
    assert (full.double() - ref).abs().max() <= 1e-5 * scale
    for rows in (1, 2, 3, 4, 17):
        assert torch.equal(kernels.quant_linear_bf16(x[:rows], packed, int(qtype), n, None, torch.float32),
                           full[:rows]), rows


@needs_bf16
@pytest.mark.parametrize("bf16_route", BF16_ROUTES, indirect=True)
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_1, Q.Q6_K], ids=lambda t: t.name)
def test_bf16_non_finite_scale_leaves_the_other_rows_weights_exact(kernels, threads, bf16_route, qtype):
    """A block whose scale d is inf or NaN (a damaged file) makes its sub-blocks take the converting form, and the
    few-rows GEMV's neighbour panel with them (one form per k step): every other row's weights must still come out
    as gguf-py's rounded to bf16, also at k 16-31 of each sub-block (the signed types' converting form once took
    those from Q6_K's second scale, 0 there: a bad row zeroed half of 15-31 other rows' weights), and the damaged
    rows' outputs are NaN."""
    n, k = 48, 2 * k_for(qtype)  # 3 panels: a GEMV group of 2 and one of 1
    raw = random_blocks(qtype, n, k, seed=95)
    size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    d_at = 208 if qtype == Q.Q6_K else 0  # Q6_K's d is its last field
    blocks = raw.reshape(n, -1, block_bytes)
    blocks[5, 1, d_at : d_at + 2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    blocks[37, 0, d_at : d_at + 2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    raw = blocks.reshape(n, -1)
    with np.errstate(invalid="ignore"):
        w = dequantize(raw, qtype)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    expect = w.to(torch.bfloat16).float().t()
    good = torch.ones(n, dtype=torch.bool)
    good[[5, 37]] = False
    eye = torch.eye(k, dtype=torch.bfloat16)
    for rows in (1, 4, k):
        got = torch.cat([kernels.quant_linear_bf16(eye[i : i + rows], packed, int(qtype), n, None, torch.float32)
                         for i in range(0, k, rows)])
        assert torch.equal(got[:, good], expect[:, good]), rows
        assert got[:, ~good].isnan().all(), rows


def _lanes_type(kernels, qtype: Q) -> int:
    lanes = kernels.ext.quant_lanes_type(int(qtype))
    if lanes < 0:
        pytest.skip("no lane-local packing in this build (it needs AVX512-BF16 and VBMI)")
    return lanes


def _both_forms_blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """Q4_0 / Q4_1 blocks of model-like scales where some sub-blocks cannot take the magic form: Q4_1 rows whose m
    lies 2^14 below d (c = m - 128 d inexact), and in both types a row with an inf d and one with a NaN d."""
    raw = random_blocks(qtype, n, k, seed)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = raw.reshape(n, -1, block_bytes)
    rng = np.random.default_rng(seed + 1)
    d = (rng.uniform(0.5, 1.5, size=blocks.shape[:2]) * 2.0**-2).astype(np.float16)
    d[9, 1], d[40, 0] = np.inf, np.nan
    blocks[..., 0:2] = d.view(np.uint8).reshape(*d.shape, 2)
    if qtype == Q.Q4_1:
        m = (-d.astype(np.float64) * rng.uniform(6.0, 9.0, size=d.shape)).astype(np.float16)
        m[20, 3] = d[20, 3] * np.float16(2.0**-14)
        m[70, 1:] = d[70, 1:] * np.float16(2.0**-14)
        blocks[..., 2:4] = m.view(np.uint8).reshape(*m.shape, 2)
    return blocks.reshape(n, -1)


@needs_bf16
@pytest.mark.parametrize("bf16_route", BF16_ROUTES, indirect=True)
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_lane_local_packing_gives_the_bf16_routes_bits(kernels, threads, bf16_route, qtype):
    """quant_relayout regroups each block's quant bytes lane-local (the bf16 route widens them without a byte
    permute) and back: the same bytes, moved. On it quant_linear_bf16, its SwiGLU and its greedy argmax give the bits
    of quant_pack's packing at every row count and thread count, in the magic form and the converting one (blocks
    whose c is inexact, non-finite scales) -- every weight gguf-py's rounded to bf16 (unit rows) -- and
    quant_embedding dequantizes it as gguf-py does."""
    lanes = _lanes_type(kernels, qtype)
    n, k = 96, 640  # 6 panels: GEMV groups of 2; 20 blocks
    raw = _both_forms_blocks(qtype, n, k, seed=61)
    with np.errstate(invalid="ignore"):
        w = dequantize(raw, qtype)
    planes = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    regrouped = [t.clone() for t in planes]
    kernels.relayout(regrouped, int(qtype), lanes)
    assert not torch.equal(regrouped[0], planes[0])
    assert torch.equal(regrouped[0].sort(dim=1).values, planes[0].sort(dim=1).values)  # each panel's bytes, moved
    emb = kernels.ext.quant_embedding(torch.arange(n), regrouped, lanes, k, torch.float32)
    assert torch.equal(emb.nan_to_num(), w.nan_to_num())
    good = torch.ones(n, dtype=torch.bool)
    good[[9, 40]] = False
    eye = torch.eye(k, dtype=torch.bfloat16)
    expect = w.to(torch.bfloat16).float().t()
    for rows in (1, 3, 4, k):
        got = torch.cat([kernels.quant_linear_bf16(eye[i : i + rows], regrouped, lanes, n, None, torch.float32)
                         for i in range(0, k, rows)])
        assert torch.equal(got[:, good], expect[:, good]), rows
    g = torch.Generator().manual_seed(62)
    x = torch.randn(300, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    for m in (1, 2, 3, 4, 5, 17, 300):
        for t in (1, 2):
            torch.set_num_threads(t)
            ref = kernels.quant_linear_bf16(x[:m], planes, int(qtype), n, bias, torch.float32)
            got = kernels.quant_linear_bf16(x[:m], regrouped, lanes, n, bias, torch.float32)
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (m, t)  # NaNs too, bit for bit
            assert torch.equal(kernels.quant_linear_bf16_silu(x[:m], regrouped, lanes, n).view(torch.int16),
                               kernels.quant_linear_bf16_silu(x[:m], planes, int(qtype), n).view(torch.int16)), (m, t)
    finite = _both_forms_blocks(qtype, n, k, seed=63)
    finite[[9, 40]] = random_blocks(qtype, n, k, seed=64)[[9, 40]]  # finite logits: an argmax in every row
    head = kernels.quant_pack(torch.from_numpy(finite), int(qtype))
    kernels.relayout(head, int(qtype), lanes)
    for m in (1, 4, 17, 300):
        logits = kernels.quant_linear_bf16(x[:m], head, lanes, n, None, torch.float32)
        assert torch.equal(kernels.quant_linear_bf16_argmax(x[:m], head, lanes, n, None), logits.argmax(-1)), m
    kernels.relayout(regrouped, lanes, int(qtype))
    assert torch.equal(regrouped[0], planes[0])


@needs_bf16
def test_lane_local_packing_is_read_by_the_bf16_route_only(kernels):
    """The lane-local packing exists for Q4_0 / Q4_1 only; quant_pack packs ggml types; the float32 and int8 routes
    refuse a lane-local weight by name, as quant_relayout refuses another block format."""
    lanes = _lanes_type(kernels, Q.Q4_1)
    assert kernels.ext.quant_lanes_type(int(Q.Q8_0)) == -1 and kernels.ext.quant_lanes_type(int(Q.Q4_K)) == -1
    assert lanes not in kernels.ext.quant_types()
    raw = torch.from_numpy(random_blocks(Q.Q4_1, 32, 64, seed=64))
    packed = kernels.quant_pack(raw, int(Q.Q4_1))
    kernels.relayout(packed, int(Q.Q4_1), lanes)
    with pytest.raises(RuntimeError, match="bf16 route only"):
        kernels.quant_linear(torch.randn(2, 64), packed, lanes, 32, None, torch.float32)
    if kernels.ext.has_quant_i8():
        with pytest.raises(RuntimeError, match="is not Q4_0"):
            kernels.ext.quant_linear_i8(torch.randn(2, 64), packed, lanes, 32, 64, None, torch.float32)
    with pytest.raises(RuntimeError, match="quant_relayout makes"):
        kernels.quant_pack(raw, lanes)
    with pytest.raises(RuntimeError, match="cannot be repacked"):
        kernels.relayout(packed, lanes, int(Q.Q4_0))
    with pytest.raises(RuntimeError, match="not one of"):  # no lane-local Q8_0
        kernels.relayout(packed, int(Q.Q8_0), lanes & ~0xFF | int(Q.Q8_0))


@needs_bf16
def test_bf16_linear_cuts_rows_for_an_odd_number_of_groups(kernels, threads):
    """With few panel groups that two threads cannot share evenly (3 here: 9 panels, the decode step's o and down
    projections have 9) the vdpbf16ps route cuts the rows into more blocks; every row, in whichever block, gets the
    bits it gets alone (the few-rows GEMV) and on one thread, and none is left out or written twice."""
    assert kernels.ext.set_amx(False) is False
    try:
        qtype, n, k = Q.Q4_1, 144, 256
        raw = random_blocks(qtype, n, k, seed=61)
        packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
        x = torch.randn(131, k, generator=torch.Generator().manual_seed(62)).to(torch.bfloat16)
        alone = torch.cat([kernels.quant_linear_bf16(x[i : i + 1], packed, int(qtype), n, None, torch.float32)
                           for i in range(131)])
        for m in (5, 6, 11, 12, 13, 64, 127, 131):
            for t in (2, 1):
                torch.set_num_threads(t)
                y = kernels.quant_linear_bf16(x[:m], packed, int(qtype), n, None, torch.float32)
                assert torch.equal(y, alone[:m]), (m, t)
    finally:
        kernels.ext.set_amx(True)


@needs_bf16
@pytest.mark.parametrize("bf16_route", BF16_ROUTES, indirect=True)
def test_bf16_linear_of_many_rows_and_columns_gives_each_rows_own_bits(kernels, threads, bf16_route):
    """Past 1 MB of x the AMX route widens the weights into a buffer the threads share, a chunk of 4 MB of them
    at a time, and splits the rows instead of the columns: 1,100 rows x 512 k (1.1 MB) against 4,100 outputs
    (64 KB of bf16 weights per 64 columns: two chunks, the second a partial group with a partial panel). Every
    row still gets the bits it gets alone or in a few rows, at any thread count, and the product is right."""
    qtype = Q.Q4_1
    n, k, m = 4100, 512, 1100
    raw = random_blocks(qtype, n, k, seed=41)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    g = torch.Generator().manual_seed(42)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    torch.set_num_threads(2)
    full = kernels.quant_linear_bf16(x, packed, int(qtype), n, bias, torch.float32)
    torch.set_num_threads(1)
    assert torch.equal(kernels.quant_linear_bf16(x, packed, int(qtype), n, bias, torch.float32), full)
    for r0, r1 in ((0, 3), (517, 530), (1067, 1100)):
        assert torch.equal(kernels.quant_linear_bf16(x[r0:r1], packed, int(qtype), n, bias, torch.float32),
                           full[r0:r1]), (r0, r1)
    yb = kernels.quant_linear_bf16(x, packed, int(qtype), n, bias, torch.bfloat16)
    assert torch.equal(yb, full.to(torch.bfloat16))
    rows = torch.tensor([0, 31, 32, 400, 1099])
    wb = dequantize(raw, qtype).to(torch.bfloat16).double()
    ref = x[rows].double() @ wb.t() + bias.double()
    scale = (x[rows].double().abs() @ wb.abs().t()).max()
    assert (full[rows].double() - ref).abs().max() <= 1e-5 * scale


@needs_bf16
@pytest.mark.parametrize("bf16_route", BF16_ROUTES, indirect=True)
def test_bf16_linear_argmax_is_the_first_argmax_of_its_logits(kernels, threads, bf16_route):
    """quant_linear_bf16_argmax (greedy decoding's LM head): each row's index of the first maximum of the float32
    logits quant_linear_bf16 gives, as torch.argmax picks it, where the many-rows kernels never write those logits:
    on the few-rows GEMV, both many-rows routes (x in L2, split by columns; past 1 MB of x, split by rows) and 1 or
    2 threads; with a bias; a partial last panel. The weights' second half repeats the first, so every maximum is
    there twice, the later copy in another panel group (on 2 threads, another thread's): the first must win; and a
    weight of equal rows ties every column. A row with a NaN logit gives -1."""
    qtype = Q.Q8_0
    half, k = 1000, 256  # n = 2,000 columns (125 whole panels); 1,007 below, a partial last panel
    raw = random_blocks(qtype, half, k, seed=51)
    raw = np.concatenate([raw, raw])
    n = 2 * half
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    odd = random_blocks(qtype, 1000 + 7, k, seed=52)  # 1,007 columns: a partial last panel
    odd_packed = kernels.quant_pack(torch.from_numpy(odd), int(qtype))
    same = kernels.quant_pack(torch.from_numpy(np.repeat(odd[:1], 100, axis=0)), int(qtype))
    g = torch.Generator().manual_seed(53)
    x = torch.randn(4200, k, generator=g).to(torch.bfloat16)  # 4,200 x 256 bf16: 2.1 MB
    bias = torch.randn(n, generator=g)
    for m in (1, 3, 4, 5, 16, 17, 128, 4200):
        for t in (1, 2):
            torch.set_num_threads(t)
            for b in (None, bias):
                logits = kernels.quant_linear_bf16(x[:m], packed, int(qtype), n, b, torch.float32)
                got = kernels.quant_linear_bf16_argmax(x[:m], packed, int(qtype), n, b)
                assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1)), (m, t, b is None)
                if b is None:
                    assert bool((got < half).all())  # the first copy of each maximum
            logits = kernels.quant_linear_bf16(x[:m], odd_packed, int(qtype), 1007, None, torch.float32)
            assert torch.equal(kernels.quant_linear_bf16_argmax(x[:m], odd_packed, int(qtype), 1007, None),
                               logits.argmax(-1)), (m, t)
            assert not bool(kernels.quant_linear_bf16_argmax(x[:m], same, int(qtype), 100, None).any())  # all ties: 0
    nan = x[:130].clone()
    nan[2, 3] = nan[129, 0] = float("nan")
    for m in (4, 130):
        got = kernels.quant_linear_bf16_argmax(nan[:m], packed, int(qtype), n, None)
        logits = kernels.quant_linear_bf16(nan[:m], packed, int(qtype), n, None, torch.float32)
        bad = logits.isnan().any(-1)
        assert bool((got[bad] == -1).all()) and int(bad.sum()) == (1 if m == 4 else 2)
        assert torch.equal(got[~bad], logits[~bad].argmax(-1))


def _first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first maximum (argmax_rows' / torch.argmax's over finite logits), -1 with a NaN."""
    out = logits.nan_to_num(nan=0.0).argmax(-1)
    return torch.where(logits.isnan().any(-1), torch.full_like(out, -1), out)


def _near_ties(seed: int) -> np.ndarray:
    """1007 Q8_0 rows of k = 320: every row the first, one quant a step away (near ties the screens cannot tell
    apart where x is tiny, the exact chains can)."""
    odd = random_blocks(Q.Q8_0, 1007, 320, seed=seed)
    odd[1:, :] = odd[:1, :]
    for r in range(1, 1007):
        b, j = r % 10, 2 + (r * 7) % 32
        odd[r, b * 34 + j] = np.uint8((int(odd[r, b * 34 + j]) + (1 if r % 2 else 255)) % 256)
    return odd


def _screen_rows(seed: int, k: int = 320) -> torch.Tensor:
    """300 rows for the screened heads: normals with outlier channels (as hidden states have), tiny and huge rows,
    rows mostly near 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, k, generator=g)
    x[::3, 17] *= 300.0
    x[1::7, 200] *= -2000.0
    x[2::11] *= 1e-3
    x[4::13] *= 1e4
    x[5::17] *= torch.rand(k, generator=g) ** 8
    return x


def _rows_out_of_range(x: torch.Tensor) -> torch.Tensor:
    """x's first 40 rows with rows the screens cannot take: zeros (3), a NaN (7), an infinity (11), 1e30 (19), 1e-30
    (23, below their range)."""
    bad = x[:40].clone()
    bad[3] = 0.0
    bad[7, 5] = float("nan")
    bad[11, 9] = float("inf")
    bad[19, 0] = 1e30
    bad[23] = 1e-30
    return bad


def _needs_screen(kernels) -> None:
    if kernels.quant_screen_norms(
            kernels.quant_pack(torch.from_numpy(random_blocks(Q.Q8_0, 16, 32, seed=1)), int(Q.Q8_0)), int(Q.Q8_0),
            16, 32).numel() == 0:
        pytest.skip("no screened greedy head in this build (it needs AVX2 + FMA + F16C)")


def test_screen_norms_bound_each_columns_weights(kernels):
    """quant_screen_norms: column n's sum of |w| over the dequantized Q8_0 weight, rounded up (never below it), zeros
    past n; empty for another block type and for a weight with a non-finite scale (it cannot be screened)."""
    _needs_screen(kernels)
    raw = random_blocks(Q.Q8_0, 1007, 320, seed=61)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(Q.Q8_0))
    norms = kernels.quant_screen_norms(packed, int(Q.Q8_0), 1007, 320)
    exact = dequantize(raw, Q.Q8_0).double().abs().sum(-1)
    assert norms.shape == (1008,) and float(norms[1007]) == 0.0
    assert bool((norms[:1007].double() >= exact).all())
    assert torch.allclose(norms[:1007].double(), exact, rtol=1e-6, atol=0)
    q41 = kernels.quant_pack(torch.from_numpy(random_blocks(Q.Q4_1, 32, 320, seed=62)), int(Q.Q4_1))
    assert kernels.quant_screen_norms(q41, int(Q.Q4_1), 32, 320).numel() == 0
    bad = raw[:32].copy()
    bad[5, 34 * 3 : 34 * 3 + 2] = np.array([np.inf], dtype=np.float16).view(np.uint8)  # block 3's d of row 5
    bad_packed = kernels.quant_pack(torch.from_numpy(bad), int(Q.Q8_0))
    assert kernels.quant_screen_norms(bad_packed, int(Q.Q8_0), 32, 320).numel() == 0


@pytest.mark.usefixtures("threads")
def test_screened_argmax_is_the_first_argmax_of_quant_linears_logits(kernels):
    """quant_linear_argmax (the float32 route's greedy LM head over Q8_0): each row's index of the first maximum of the
    float32 logits quant_linear gives, though only the columns its int16 screen cannot rule out get their exact chain.
    Random quants (-128 included) with random scales; rows of plain normals, rows with outlier channels (as hidden
    states have), tiny and huge rows, 1 to 300 rows on 1 or 2 threads (the panels claimed in ranges). The weight's
    second half repeats the first, so every maximum is there twice, the later copy in another panel (and thread): the
    first must win; a partial last panel; a weight of equal rows ties every column (past the candidate cap: every
    exact logit); columns that differ from another by one quant step where x is tiny (the screen cannot tell them
    apart, the exact chains can). Rows the screen cannot take (zeros, a NaN, an infinity, 1e30) get every exact
    logit: -1 for a NaN logit."""
    _needs_screen(kernels)
    qt = int(Q.Q8_0)
    half, k = 1000, 320
    raw = random_blocks(Q.Q8_0, half, k, seed=63)
    raw = np.concatenate([raw, raw])
    n = 2 * half
    packed = kernels.quant_pack(torch.from_numpy(raw), qt)
    norms = kernels.quant_screen_norms(packed, qt, n, k)
    odd = _near_ties(64)
    odd_packed = kernels.quant_pack(torch.from_numpy(odd), qt)
    odd_norms = kernels.quant_screen_norms(odd_packed, qt, 1007, k)
    same = kernels.quant_pack(torch.from_numpy(np.repeat(odd[:1], 100, axis=0)), qt)
    same_norms = kernels.quant_screen_norms(same, qt, 100, k)
    x = _screen_rows(65)
    for m in (1, 5, 6, 7, 13, 128, 300):
        for t in (1, 2):
            torch.set_num_threads(t)
            logits = kernels.quant_linear(x[:m], packed, qt, n, None, torch.float32)
            got = kernels.quant_linear_argmax(x[:m], packed, qt, n, norms)
            assert got.dtype == torch.int64 and torch.equal(got, _first_argmax(logits)), (m, t)
            assert bool((got < half).all())  # the first copy of each maximum
            logits = kernels.quant_linear(x[:m], odd_packed, qt, 1007, None, torch.float32)
            assert torch.equal(kernels.quant_linear_argmax(x[:m], odd_packed, qt, 1007, odd_norms),
                               _first_argmax(logits)), (m, t)
            assert not bool(kernels.quant_linear_argmax(x[:m], same, qt, 100, same_norms).any())  # all ties: 0
    bad = _rows_out_of_range(x)  # every exact logit
    logits = kernels.quant_linear(bad, packed, qt, n, None, torch.float32)
    got = kernels.quant_linear_argmax(bad, packed, qt, n, norms)
    assert torch.equal(got, _first_argmax(logits))
    assert int(got[7]) == -1 and int(got[3]) == 0


def test_screened_argmax_bad_arguments_raise(kernels):
    _needs_screen(kernels)
    qt = int(Q.Q8_0)
    packed = kernels.quant_pack(torch.from_numpy(random_blocks(Q.Q8_0, 40, 64, seed=66)), qt)
    norms = kernels.quant_screen_norms(packed, qt, 40, 64)
    x = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="norms"):
        kernels.quant_linear_argmax(x, packed, qt, 40, norms[:40])
    with pytest.raises(RuntimeError, match="float32"):
        kernels.quant_linear_argmax(x.bfloat16(), packed, qt, 40, norms)
    with pytest.raises(RuntimeError, match="Q8_0"):
        kernels.quant_linear_argmax(x, packed, int(Q.Q4_0), 40, norms)
    with pytest.raises(RuntimeError, match="K"):
        kernels.quant_linear_argmax(torch.randn(8, 32), packed, qt, 40, norms)
    assert kernels.quant_linear_argmax(x[:0], packed, qt, 40, norms).shape == (0,)


def _needs_i8_screen(kernels) -> None:
    packed = kernels.quant_pack(torch.from_numpy(random_blocks(Q.Q8_0, 16, 32, seed=1)), int(Q.Q8_0))
    if kernels.quant_screen_i8_norms(packed, int(Q.Q8_0), 16, 32).numel() == 0:
        pytest.skip("no int8-screened bf16 head in this build (it needs AVX512-VNNI and AVX512-BF16)")


def test_screen_i8_norms_bound_each_columns_blocks(kernels):
    """quant_screen_i8_norms: per panel of 16 columns and 32-k block, each column's sum of |w| over the block of the
    dequantized Q8_0 weight, rounded up (never below it; zeros past n), then per 16 panels and block each panel's
    largest of those; empty for another block type and for a weight with a non-finite scale."""
    _needs_i8_screen(kernels)
    n, k = 1007, 320  # 63 panels (a partial last one), 10 blocks
    raw = random_blocks(Q.Q8_0, n, k, seed=81)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(Q.Q8_0))
    norms = kernels.quant_screen_i8_norms(packed, int(Q.Q8_0), n, k)
    panels, nb = 63, 10
    assert norms.shape == ((panels + 4) * nb * 16,)
    tight = norms[: panels * nb * 16].view(panels, nb, 16).permute(0, 2, 1).reshape(panels * 16, nb)
    exact = dequantize(raw, Q.Q8_0).double().abs().view(n, nb, 32).sum(-1)
    assert bool((tight[:n].double() >= exact).all()) and not bool(tight[n:].any())
    assert torch.allclose(tight[:n].double(), exact, rtol=1e-6, atol=0)
    loose = norms[panels * nb * 16 :].view(4, nb, 16).permute(0, 2, 1).reshape(64, nb)[:panels]
    assert torch.equal(loose, tight.view(panels, 16, nb).amax(1))
    q41 = kernels.quant_pack(torch.from_numpy(random_blocks(Q.Q4_1, 32, 320, seed=82)), int(Q.Q4_1))
    assert kernels.quant_screen_i8_norms(q41, int(Q.Q4_1), 32, 320).numel() == 0
    bad = raw[:32].copy()
    bad[5, 34 * 3 : 34 * 3 + 2] = np.array([np.nan], dtype=np.float16).view(np.uint8)  # block 3's d of row 5
    bad_packed = kernels.quant_pack(torch.from_numpy(bad), int(Q.Q8_0))
    assert kernels.quant_screen_i8_norms(bad_packed, int(Q.Q8_0), 32, 320).numel() == 0


@needs_bf16
@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("bf16_route", BF16_ROUTES, indirect=True)
def test_bf16_screened_argmax_is_the_first_argmax_of_its_logits(kernels, bf16_route):
    """quant_linear_bf16_argmax with quant_screen_i8_norms (the bf16 route's greedy LM head over Q8_0 above 4 rows,
    without AMX): each row's index of the first maximum of quant_linear_bf16's float32 logits, though only the panels
    its int8 screen cannot rule out get their exact chains. The float32 screen's cases (first copy of a repeated
    maximum in another panel and thread; near ties a quant step apart where x is tiny; all columns equal; outlier
    channels, tiny and huge rows, rows mostly near 0) with bf16 rows, plus a block of a row below the quantization's
    range (2^-100: no quants there), 5 to 300 rows on 1 and 2 threads, vocabularies of fewer and more panels than the
    screen's seed (64) with an odd number of panels and a partial last one. Rows the screen cannot take (zeros, a NaN,
    an infinity, 1e30, 1e-30) get every exact logit: -1 for a NaN logit."""
    _needs_i8_screen(kernels)
    qt = int(Q.Q8_0)
    half, k = 1000, 320
    raw = random_blocks(Q.Q8_0, half, k, seed=83)
    raw = np.concatenate([raw, raw])
    n = 2 * half  # 125 panels
    packed = kernels.quant_pack(torch.from_numpy(raw), qt)
    norms = kernels.quant_screen_i8_norms(packed, qt, n, k)
    odd = _near_ties(84)
    odd_packed = kernels.quant_pack(torch.from_numpy(odd), qt)
    odd_norms = kernels.quant_screen_i8_norms(odd_packed, qt, 1007, k)
    small = kernels.quant_pack(torch.from_numpy(raw[:100]), qt)  # 7 panels: all within the seed
    small_norms = kernels.quant_screen_i8_norms(small, qt, 100, k)
    same = kernels.quant_pack(torch.from_numpy(np.repeat(odd[:1], 100, axis=0)), qt)
    same_norms = kernels.quant_screen_i8_norms(same, qt, 100, k)
    x = _screen_rows(85)
    x[6::19, 64:96] = 1e-35  # a block below 2^-100
    x = x.to(torch.bfloat16)
    for m in (5, 6, 7, 13, 128, 300):
        for t in (1, 2):
            torch.set_num_threads(t)
            for w, nn, nm in ((packed, n, norms), (odd_packed, 1007, odd_norms), (small, 100, small_norms)):
                logits = kernels.quant_linear_bf16(x[:m], w, qt, nn, None, torch.float32)
                got = kernels.quant_linear_bf16_argmax(x[:m], w, qt, nn, None, nm)
                assert got.dtype == torch.int64 and torch.equal(got, _first_argmax(logits)), (m, t, nn)
            assert bool((kernels.quant_linear_bf16_argmax(x[:m], packed, qt, n, None, norms) < half).all())
            assert not bool(kernels.quant_linear_bf16_argmax(x[:m], same, qt, 100, None, same_norms).any())
    bad = _rows_out_of_range(x)  # every exact logit
    logits = kernels.quant_linear_bf16(bad, packed, qt, n, None, torch.float32)
    got = kernels.quant_linear_bf16_argmax(bad, packed, qt, n, None, norms)
    assert torch.equal(got, _first_argmax(logits))
    assert int(got[7]) == -1 and int(got[3]) == 0


@needs_bf16
def test_bf16_screened_argmax_bad_screens_raise(kernels):
    """A screen that is not quant_screen_i8_norms' tensor of this weight is refused, also at few rows (where the screen
    would not run); without a screen (None, or an empty one) the head runs every exact chain."""
    _needs_i8_screen(kernels)
    qt = int(Q.Q8_0)
    packed = kernels.quant_pack(torch.from_numpy(random_blocks(Q.Q8_0, 40, 64, seed=86)), qt)
    norms = kernels.quant_screen_i8_norms(packed, qt, 40, 64)
    x = torch.randn(8, 64).to(torch.bfloat16)
    for bad in (norms[:-16], norms.double(), norms.view(2, -1).t()):
        for rows in (x, x[:2]):
            with pytest.raises(RuntimeError, match="screen"):
                kernels.quant_linear_bf16_argmax(rows, packed, qt, 40, None, bad)
    q40 = kernels.quant_pack(torch.from_numpy(random_blocks(Q.Q4_0, 40, 64, seed=87)), int(Q.Q4_0))
    with pytest.raises(RuntimeError, match="screen"):
        kernels.quant_linear_bf16_argmax(x, q40, int(Q.Q4_0), 40, None, norms)
    expect = kernels.quant_linear_bf16_argmax(x, packed, qt, 40, None)
    assert torch.equal(kernels.quant_linear_bf16_argmax(x, packed, qt, 40, None, torch.empty(0)), expect)
    assert torch.equal(kernels.quant_linear_bf16_argmax(x, packed, qt, 40, None, norms), expect)


@needs_bf16
@pytest.mark.parametrize("bf16_route", BF16_ROUTES, indirect=True)
def test_bf16_linear_in_k_blocks_gives_each_rows_own_bits(kernels, threads, bf16_route):
    """Past K = 640 the AMX many-rows route runs K in blocks (here 5 of 256), C stored and reloaded between them, a
    panel pair's B tiles kept in L1 while the row pairs pass (up to 640 on the prefill-sized route and for the fused
    SwiGLU: A-major, no blocks, the other tests' K), on both of its routes: 64 and 77 rows (each thread widens its
    own groups), 450 rows (x past 1 MB: shared widened weights). Every row gets the bits it gets in 16-row calls (one
    row tile over all of K, no blocks) -- the chains are not cut or reordered -- on 1 or 2 threads, and the product
    is right."""
    qtype = Q.Q4_1
    n, k = 100, 1280  # 7 panels: a group of 4 and a partial one with a partial panel
    raw = random_blocks(qtype, n, k, seed=71)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    x = torch.randn(450, k, generator=torch.Generator().manual_seed(72)).to(torch.bfloat16)  # 1.15 MB
    tiles = torch.cat([kernels.quant_linear_bf16(x[i : i + 16], packed, int(qtype), n, None, torch.float32)
                       for i in range(0, 450, 16)])
    for m in (64, 77, 450):
        for t in (1, 2):
            torch.set_num_threads(t)
            y = kernels.quant_linear_bf16(x[:m], packed, int(qtype), n, None, torch.float32)
            assert torch.equal(y, tiles[:m]), (m, t)
    wb = dequantize(raw, qtype).to(torch.bfloat16).double()
    ref = x.double() @ wb.t()
    assert (tiles.double() - ref).abs().max() <= 1e-5 * (x.double().abs() @ wb.abs().t()).max()


@needs_bf16
@pytest.mark.parametrize("bf16_route", BF16_ROUTES, indirect=True)
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.Q6_K], ids=["Q4_1", "Q5_0", "Q6_K"])
def test_bf16_silu_is_silu_and_mul_over_the_bf16_linear(kernels, threads, bf16_route, qtype):
    """quant_linear_bf16_silu (the MLP's gate_up projection and SwiGLU in one call; fused into the many-rows
    matmuls' epilogue, and for few rows each gate panel with its up panel in one GEMV call) gives exactly silu_and_mul
    over quant_linear_bf16's bf16 output: few rows (1 and 3; 16 on AMX, whose few-rows route goes to 16), tiles of rows
    with a partial last one, x past 1 MB (the shared widened weights), I = 80 (a group of 4 panels and one of 1),
    I = 208 (several groups per thread: on AMX each item's outputs are written during the next item's products)."""
    k = 512 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 640
    g = torch.Generator().manual_seed(52)
    x = (torch.randn(900, k, generator=g) * 4).to(torch.bfloat16)
    for I, ms in ((208, (64, 77, 900)), (80, (1, 3, 16, 17, 45, 900))):
        raw = random_blocks(qtype, 2 * I, k, seed=51)
        packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
        for m in ms:
            for t in (1, 2):
                torch.set_num_threads(t)
                ref = kernels.silu_and_mul(kernels.quant_linear_bf16(x[:m], packed, int(qtype), 2 * I, None,
                                                                     torch.bfloat16))
                got = kernels.quant_linear_bf16_silu(x[:m], packed, int(qtype), 2 * I)
                assert got.dtype == torch.bfloat16 and got.shape == (m, I)
                assert torch.equal(got, ref), (I, m, t)
    gate, up = (x.double() @ dequantize(raw, qtype).to(torch.bfloat16).double().t()).chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert torch.allclose(got.double(), expected, rtol=2e-2, atol=2e-2 * float(up.abs().max()))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.quant_linear_bf16_silu(x[:4], packed, int(qtype), 2 * I - 16)


@pytest.mark.skipif("not _amx_active()", reason="no AMX on this CPU (or not granted)")
def test_amx_route_is_the_default_where_amx_is_and_can_be_switched(kernels):
    """Where the CPU has AMX, quant_linear_bf16 runs on tiles by default (its bits are TDPBF16PS's sums, not the
    vdpbf16ps chain's: the switch really changes the route), and set_amx(False) goes back to vdpbf16ps."""
    qtype = Q.Q4_1
    n, k = 64, 4096
    raw = random_blocks(qtype, n, k, seed=31)
    packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(32)).to(torch.bfloat16)
    assert kernels.ext.amx_active()
    amx = kernels.quant_linear_bf16(x, packed, int(qtype), n, None, torch.float32)
    try:
        assert not kernels.ext.set_amx(False)
        vdp = kernels.quant_linear_bf16(x, packed, int(qtype), n, None, torch.float32)
    finally:
        assert kernels.ext.set_amx(True)
    assert not torch.equal(amx, vdp)
    ref = x.double() @ dequantize(raw, qtype).to(torch.bfloat16).double().t()
    scale = (x.double().abs() @ dequantize(raw, qtype).abs().double().t()).max()
    for y in (amx, vdp):
        assert (y.double() - ref).abs().max() <= 1e-5 * scale


@needs_bf16
def test_bf16_linear_bad_arguments_raise(kernels):
    raw = torch.from_numpy(random_blocks(Q.Q8_0, 20, 64, seed=23))
    packed = kernels.quant_pack(raw, int(Q.Q8_0))
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.quant_linear_bf16(torch.randn(2, 64), packed, int(Q.Q8_0), 20, None, torch.float32)
    with pytest.raises(RuntimeError, match="K the packed"):
        kernels.quant_linear_bf16(torch.randn(2, 96).bfloat16(), packed, int(Q.Q8_0), 20, None, torch.float32)


def test_bad_arguments_raise(kernels):
    raw = torch.from_numpy(random_blocks(Q.Q8_0, 20, 64, seed=9))
    packed = kernels.quant_pack(raw, int(Q.Q8_0))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="not one of"):
        kernels.quant_pack(raw, int(Q.Q2_K))
    with pytest.raises(RuntimeError, match="K"):
        kernels.quant_linear(torch.randn(2, 96), packed, int(Q.Q8_0), 20, None, torch.float32)
    with pytest.raises(RuntimeError, match="N does not match"):
        kernels.quant_linear(x, packed, int(Q.Q8_0), 40, None, torch.float32)
    with pytest.raises(RuntimeError, match="packed"):
        kernels.quant_linear(x, packed, int(Q.Q4_0), 20, None, torch.float32)
    with pytest.raises(RuntimeError, match="outside"):
        kernels.quant_embedding(torch.tensor([32]), packed, int(Q.Q8_0), 64, torch.float32)


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_silu_is_silu_and_mul_over_the_linear(kernels, qtype):
    """quant_linear_silu (the MLP's gate_up projection and SwiGLU in one call on the float32 route: the many-rows
    matmul's epilogue, and for few rows each gate panel with its up panel in one GEMV task) gives exactly silu_and_mul
    over quant_linear's float32 output: 1-2 rows (a paired GEMV), 3-4 (one GEMV per half), tiles of rows with a partial
    last one, past 8 row blocks (the weights widened whole once), rows with a stride, I = 80 and 208, 1 and 2 threads;
    and it is SwiGLU over the dequantized weight (float64) to a few float32 ulp."""
    k = 512 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 640
    g = torch.Generator().manual_seed(62)
    x = torch.randn(1100, k + 32, generator=g)[:, :k] * 2  # row stride k + 32
    for I, ms in ((208, (1, 4, 64, 1100)), (80, (1, 2, 3, 4, 5, 17, 300))):
        raw = random_blocks(qtype, 2 * I, k, seed=61)
        packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
        for m in ms:
            for t in (1, 2):
                torch.set_num_threads(t)
                ref = kernels.silu_and_mul(kernels.quant_linear(x[:m], packed, int(qtype), 2 * I, None,
                                                                torch.float32))
                got = kernels.quant_linear_silu(x[:m], packed, int(qtype), 2 * I)
                assert got.dtype == torch.float32 and got.shape == (m, I)
                assert torch.equal(got, ref), (I, m, t)
    gate, up = (x[:300].double() @ dequantize(raw, qtype).double().t()).chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    scale = (x[:300].double().abs() @ dequantize(raw, qtype).double().abs().t()).max()
    assert (got.double() - expected).abs().max() <= 1e-5 * scale * float(up.abs().max() + 1)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.quant_linear_silu(x[:4], packed, int(qtype), 2 * I - 16)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.quant_linear_silu(x[:4].bfloat16(), packed, int(qtype), 2 * I)


# ---- DecodeStack's quantized route (7) --------------------------------------------------------------

H, KVH, D, HIDDEN, INTER, BS = 4, 2, 64, 256, 256, 16


def test_route_id(kernels):
    assert dict(kernels.ext.matmul_routes())["quant"] == 7
    assert dict(kernels.ext.matmul_routes())["quant_bf16"] == 8


@pytest.mark.parametrize("strict", [False, True], ids=["fused", "strict"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_decode_stack_quant_route_is_the_fixed_route_over_the_dequantized_weights(kernels, dtype, strict):
    """Every quantized matmul of a two-layer stack (all eight types among them) on route 7 gives the bits
    of the same stack on the fixed route (5) over the dequantized weights: same kernels, same order."""
    ext = kernels.ext
    g = torch.Generator().manual_seed(10)
    shapes = {"qkv": ((H + 2 * KVH) * D, HIDDEN), "o": (HIDDEN, H * D), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER)}
    types = iter(TYPES)
    layers = []
    for i in range(2):
        mats = {}
        for j, (name, (n, k)) in enumerate(shapes.items()):
            qtype = next(types)
            raw = random_blocks(qtype, n, k, seed=100 + 10 * i + j)
            bias = torch.randn(n, generator=g).to(dtype) if name == "qkv" else None
            mats[name] = (qtype, raw, bias)
        layers.append(({"ln1": (torch.rand(HIDDEN, generator=g) + 0.5).to(dtype),
                        "ln2": (torch.rand(HIDDEN, generator=g) + 0.5).to(dtype)}, mats))
    caches = [(torch.randn(8, BS, KVH, D, generator=g).to(dtype), torch.randn(8, BS, KVH, D, generator=g).to(dtype))
              for _ in layers]

    def spec(route: int, qtype: Q, raw: np.ndarray, bias, how: str):
        n = raw.shape[0]
        if route == 5:
            w = dequantize(raw, qtype)
            return ext.MatmulSpec(5, w.to(dtype), bias, [kernels.fixed_pack(w)], 0)
        packed = kernels.quant_pack(torch.from_numpy(raw), int(qtype))
        if how == "n":  # no dense weight at all
            return ext.MatmulSpec(7, None, bias, packed, int(qtype), n=n)
        k = raw.shape[1] // gguf.GGML_QUANT_SIZES[qtype][1] * gguf.GGML_QUANT_SIZES[qtype][0]
        return ext.MatmulSpec(7, torch.empty(n, k, device="meta"), bias, packed, int(qtype))  # n from its shape

    def stack(route: int, how: str = "n"):
        built = []
        for (norms, mats), (kc, vc) in zip(layers, caches, strict=True):
            specs = [spec(route, *mats[name], how) for name in shapes]
            built.append(ext.DecodeLayer(norms["ln1"], norms["ln2"], *specs, kc.clone(), vc.clone()))
        return ext.DecodeStack(built, H, KVH, 1e-6, D**-0.5, strict)

    seq_lens = torch.tensor([5, 17, 9])
    block_tables = torch.tensor([[0, 1], [2, 3], [4, 5]])
    pos = seq_lens - 1
    slots = block_tables[torch.arange(3), pos // BS] * BS + pos % BS
    angles = torch.rand(3, D // 2, generator=g) * 6
    x = torch.randn(3, HIDDEN, generator=g).to(dtype)
    for b in (1, 3):
        # forward adds into its input (the first residual): a fresh copy each call.
        args = (angles[:b].cos(), angles[:b].sin(), slots[:b], block_tables[:b], seq_lens[:b])
        ref = stack(5).forward(x[:b].clone(), *args)
        for how in ("n", "meta"):
            out = stack(7, how).forward(x[:b].clone(), *args)
            assert out.dtype == dtype and torch.equal(out, ref), (b, how)

    # Whole rotary tables and the positions: the stack takes the rows Python's table[positions] takes; final_norm:
    # the model's last norm over the result, the bits of rms_norm after the call (what llama.py did before).
    table = torch.rand(40, D // 2, generator=g) * 6
    cos_t, sin_t = table.cos(), table.sin()
    tail = (slots, block_tables, seq_lens)
    ref = stack(7).forward(x.clone(), cos_t[pos], sin_t[pos], *tail)
    assert not torch.equal(ref, stack(7).forward(x.clone(), cos_t[pos + 1], sin_t[pos + 1], *tail))  # rows matter
    assert torch.equal(stack(7).forward(x.clone(), cos_t, sin_t, *tail, positions=pos), ref)
    w = (torch.rand(HIDDEN, generator=g) + 0.5).to(dtype)
    normed = stack(7).forward(x.clone(), cos_t, sin_t, *tail, positions=pos, final_norm=w)
    assert normed.dtype == dtype and torch.equal(normed, kernels.rms_norm(ref, w, 1e-6, False))
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        stack(7).forward(x.clone(), cos_t, sin_t, *tail, positions=torch.tensor([4, 40, 8]))
    with pytest.raises(RuntimeError, match="positions must be"):
        stack(7).forward(x.clone(), cos_t, sin_t, *tail, positions=pos[:2])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_decode_stack_matmul_of_several_block_types(kernels, dtype):
    """A fused weight whose parts have different block types (Gemma 3's q/k Q5_0 beside v Q8_0) is one MatmulSpec
    with the later parts in `more`: their outputs follow the first part's columns, each part with its slice of the
    bias, the same bits as the fixed route over the whole dequantized weight (route 7, exact weights, as above).
    The stack also takes a gate/up of two parts (no fused SwiGLU then), and the Gemma extras (QK-norm, sandwich
    norms, GeGLU, a second rotary table)."""
    ext = kernels.ext
    g = torch.Generator().manual_seed(31)
    route = 7
    qkv_parts = [(Q.Q5_0, (H + KVH) * D), (Q.Q8_0, KVH * D)]
    gate_up_parts = [(Q.Q4_K, INTER), (Q.Q6_K, INTER)]
    raws = {}

    def parts_spec(name, parts, k, bias, fixed: bool):
        raw = [random_blocks(t, n, k, seed=200 + i + 10 * len(name)) for i, (t, n) in enumerate(parts)]
        raws[name] = raw
        if fixed:
            w = torch.cat([dequantize(r, t) for r, (t, _) in zip(raw, parts, strict=True)])
            return ext.MatmulSpec(5, w.to(dtype), bias, [kernels.fixed_pack(w)], 0)
        specs, start = [], 0
        for r, (t, n) in zip(raw, parts, strict=True):
            b = None if bias is None else bias[start : start + n].contiguous()
            specs.append((route, None, b, kernels.quant_pack(torch.from_numpy(r), int(t)), int(t), n))
            start += n
        return ext.MatmulSpec(*specs[0], more=[ext.MatmulSpec(*spec) for spec in specs[1:]])

    bias = torch.randn((H + 2 * KVH) * D, generator=g).to(dtype)
    norm = {name: (torch.rand(n, generator=g) + 0.5).to(dtype) for name, n in
            (("ln1", HIDDEN), ("ln2", HIDDEN), ("q", D), ("k", D), ("attn_out", HIDDEN), ("mlp_out", HIDDEN))}
    kc, vc = torch.randn(8, BS, KVH, D, generator=g).to(dtype), torch.randn(8, BS, KVH, D, generator=g).to(dtype)
    o_raw, down_raw = random_blocks(Q.Q8_0, HIDDEN, H * D, seed=41), random_blocks(Q.Q4_0, HIDDEN, INTER, seed=42)

    def single(raw, t, fixed: bool):
        if fixed:
            w = dequantize(raw, t)
            return ext.MatmulSpec(5, w.to(dtype), None, [kernels.fixed_pack(w)], 0)
        return ext.MatmulSpec(route, None, None, kernels.quant_pack(torch.from_numpy(raw), int(t)), int(t),
                              n=raw.shape[0])

    def stack(fixed: bool, gemma: bool):
        extras = dict(q_norm=norm["q"], k_norm=norm["k"], attn_out_norm=norm["attn_out"],
                      mlp_out_norm=norm["mlp_out"], local_rope=True) if gemma else {}
        layer = ext.DecodeLayer(norm["ln1"], norm["ln2"], parts_spec("qkv", qkv_parts, HIDDEN, bias, fixed),
                                single(o_raw, Q.Q8_0, fixed), parts_spec("gate_up", gate_up_parts, HIDDEN, None, fixed),
                                single(down_raw, Q.Q4_0, fixed), kc.clone(), vc.clone(), **extras)
        return ext.DecodeStack([layer], H, KVH, 1e-6, D**-0.5, False, gelu=gemma, norm_once=gemma)

    seq_lens = torch.tensor([5, 17, 9])
    block_tables = torch.tensor([[0, 1], [2, 3], [4, 5]])
    pos = seq_lens - 1
    slots = block_tables[torch.arange(3), pos // BS] * BS + pos % BS
    ang, ang_local = torch.rand(3, D // 2, generator=g) * 6, torch.rand(3, D // 2, generator=g) * 6
    x = torch.randn(3, HIDDEN, generator=g).to(dtype)
    args = (ang.cos(), ang.sin(), slots, block_tables, seq_lens)
    for gemma in (False, True):
        local = (ang_local.cos(), ang_local.sin()) if gemma else ()
        ref = stack(True, gemma).forward(x.clone(), *args, *local)
        out = stack(False, gemma).forward(x.clone(), *args, *local)
        assert out.dtype == dtype and torch.equal(out, ref), gemma
        if gemma:  # the second table is used: the first one in its place gives other numbers
            assert not torch.equal(stack(False, True).forward(x.clone(), *args, *args[:2]), ref)
            with pytest.raises(RuntimeError, match="cos_local"):
                stack(False, True).forward(x.clone(), *args)


def test_decode_stack_rejects_a_bad_quant_spec(kernels):
    ext = kernels.ext
    raw = torch.from_numpy(random_blocks(Q.Q8_0, 32, 64, seed=11))
    packed = kernels.quant_pack(raw, int(Q.Q8_0))
    norm = torch.ones(64)
    kv = torch.zeros(2, BS, 1, 64)

    def one_layer(spec):
        return ext.DecodeStack([ext.DecodeLayer(norm, norm, spec, spec, spec, spec, kv, kv)], 1, 1, 1e-6, 0.125)

    with pytest.raises(RuntimeError, match="quant_types"):
        one_layer(ext.MatmulSpec(7, None, None, packed, int(Q.Q2_K), n=32))
    with pytest.raises(RuntimeError, match="quant_types"):
        one_layer(ext.MatmulSpec(7, None, None, packed, int(Q.Q8_0)))  # neither n nor a weight


# ---- DecodeStack's team (one parallel region per decode step of few sequences) ------------------------------


@needs_bf16
@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("bf16_route", BF16_ROUTES, indirect=True)
@pytest.mark.parametrize("model", ["plain", "gemma", "int8"])
def test_decode_stack_team_gives_the_bits_of_a_region_per_op(kernels, bf16_route, model):
    """A step of 1-4 sequences (1-16 on AMX) on the quantized routes (8, 9) runs as one team (every op in one parallel
    region, the threads meeting at a barrier between ops): the same bits as with a parallel region per op
    (set_decode_team(False)), on 1 and 2 threads, with a sliding window. plain: the bf16 route (its SwiGLU fused into
    gate_up), a qkv bias; gemma: QK-norm, the sandwich norms rounded once, GeGLU, the sliding layer's own rotary table
    and a qkv of two parts of different block types; int8: the int8 activations route (9) everywhere, biases on qkv
    and gate_up; one sequence of 1,100 keys (its attention split into partitions). 5 sequences (17 on AMX), the strict
    attention and more threads than CPUs take the old path.
    A bad block table raises inside the team as outside it, and the stack still runs afterwards."""
    ext = kernels.ext
    if model == "int8" and not ext.has_quant_i8():
        pytest.skip("no int8 route in this build")
    route, gemma = (9 if model == "int8" else 8), model == "gemma"
    g = torch.Generator().manual_seed(21)
    shapes = {"qkv": ((H + 2 * KVH) * D, HIDDEN), "o": (HIDDEN, H * D), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER)}
    kinds = iter([Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q4_0, Q.Q5_K, Q.Q5_1])

    def norm_weight(n: int) -> torch.Tensor:
        return (torch.rand(n, generator=g) + 0.5).bfloat16()

    def spec(qtype, n: int, k: int, seed: int, bias=None, more=()):
        packed = kernels.quant_pack(torch.from_numpy(random_blocks(qtype, n, k, seed=seed)), int(qtype))
        return ext.MatmulSpec(route, None, bias, packed, int(qtype), n=n, more=list(more))

    layers = []
    for i in range(2):
        mats = {}
        for j, (name, (n, k)) in enumerate(shapes.items()):
            qtype, seed = next(kinds), 300 + 10 * i + j
            if gemma and name == "qkv":  # q and k of one block type, v of another: two parts
                v = KVH * D
                mats[name] = spec(qtype, n - v, k, seed, more=[spec(Q.Q8_0, v, k, seed + 5)])
                continue
            bias = torch.randn(n, generator=g).bfloat16() if name == "qkv" or (model == "int8" and name == "gate_up") \
                else None
            mats[name] = spec(qtype, n, k, seed, bias if not gemma else None)
        extra = {}
        if gemma:
            extra = dict(q_norm=norm_weight(D), k_norm=norm_weight(D), attn_out_norm=norm_weight(HIDDEN),
                         mlp_out_norm=norm_weight(HIDDEN), local_rope=i == 1)
        layers.append((norm_weight(HIDDEN), norm_weight(HIDDEN), mats, 8 * i, extra))  # layer 1: an 8-key window
    caches = [(torch.randn(80, BS, KVH, D, generator=g).bfloat16(), torch.randn(80, BS, KVH, D, generator=g).bfloat16())
              for _ in layers]

    def stack(strict: bool = False):
        built = [ext.DecodeLayer(ln1, ln2, *(mats[n] for n in shapes), kc.clone(), vc.clone(), window=window, **extra)
                 for (ln1, ln2, mats, window, extra), (kc, vc) in zip(layers, caches, strict=True)]
        return ext.DecodeStack(built, H, KVH, 1e-6, D**-0.5, strict, gelu=gemma, norm_once=gemma)

    seq_lens = torch.tensor([5, 17, 9, 30, 12] + torch.randint(1, 32, (12,), generator=g).tolist())
    block_tables = torch.arange(34).view(17, 2)
    angles = torch.rand(17, D // 2, generator=g) * 6
    local = torch.rand(17, D // 2, generator=g) * 6  # the local_rope layer's table
    x = torch.randn(17, HIDDEN, generator=g).bfloat16()
    w = (torch.rand(HIDDEN, generator=g) + 0.5).bfloat16()

    def run(b: int, team: bool, strict: bool = False, tables=block_tables, lens=seq_lens):
        pos = lens[:b] - 1
        slots = tables[torch.arange(b), pos // BS] * BS + pos % BS
        before = ext.set_decode_team(team)
        try:
            s = stack(strict)
            out = s.forward(x[:b].clone(), angles[:b].cos(), angles[:b].sin(), slots, tables[:b], lens[:b],
                            local[:b].cos(), local[:b].sin(), final_norm=w)
            # a second step: the next position of each sequence, over the K/V the first one wrote
            nxt = s.forward(out.clone(), angles[:b].sin(), angles[:b].cos(), slots + 1, tables[:b], lens[:b] + 1,
                            local[:b].sin(), local[:b].cos())
            return out, nxt
        finally:
            ext.set_decode_team(before)

    # The few-rows kernels' reach: 4 rows, 16 for the bf16 matmuls on AMX tiles (the int8 route: 4 at a time).
    most = 16 if ext.amx_active() else 4
    for nt in (1, 2):
        torch.set_num_threads(nt)
        for b in (1, 2, 4, 5, 16, 17):
            ref = run(b, team=False)
            steps = ext.decode_team_steps()
            got = run(b, team=True)
            # which path ran (not a team with more threads than CPUs)
            team = b <= most and nt <= len(os.sched_getaffinity(0))
            assert ext.decode_team_steps() - steps == (2 if team else 0), (nt, b)
            assert all(torch.equal(r, o) for r, o in zip(ref, got, strict=True)), (nt, b)
            assert not torch.equal(ref[0], ref[1])  # the second step differs: the comparison sees each step
        # One sequence of 1,100 keys (blocks 10-79): on 2 threads the decode attention splits it into partitions (in
        # the team: each member's partitions, a team_sync, then the combine shared out).
        long = dict(tables=torch.arange(10, 80).unsqueeze(0), lens=torch.tensor([1100]))
        steps = ext.decode_team_steps()
        assert all(torch.equal(r, o) for r, o in zip(run(1, False, **long), run(1, True, **long), strict=True)), nt
        assert ext.decode_team_steps() - steps == (2 if nt <= len(os.sched_getaffinity(0)) else 0)
        steps = ext.decode_team_steps()
        strict = run(3, team=True, strict=True)
        assert ext.decode_team_steps() == steps
        assert all(torch.equal(r, o) for r, o in zip(run(3, team=False, strict=True), strict, strict=True))
    bad = block_tables.clone()
    bad[1, 1] = 99  # outside the 16-block cache
    with pytest.raises(RuntimeError, match="outside the cache|block id"):
        run(2, team=True, tables=bad)
    assert all(torch.equal(r, o) for r, o in zip(run(2, team=False), run(2, team=True), strict=True))


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize("arch", ["native", "x86-64-v3"])
@pytest.mark.parametrize("route", [7, 9], ids=["float32", "int8"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (6, 3)], ids=["kv2", "kv1", "kv3"])
def test_decode_stack_team_on_float32_activations(arch, route, heads):
    """A float32 stack on the float32 quantized route (7: quant_linear's AVX2 GEMV, whose groups the members claim,
    claim_for) or the int8 activations route (9) runs a step of 1-4 sequences as one team too, with the same bits as a
    parallel region per op. The decode attention splits its tasks in the team: the fused AVX-512 kernel's (native on an
    AVX-512 CPU), or the AVX2 kernel's (sequence, kv head) tasks (x86-64-v3, an AVX2-only CPU's build) -- or, where
    those pairs do not split evenly between 2 threads (1 or 3 of them: 1 or 3 kv heads at 1 sequence, 1 at 3), its
    passes split in turn (decode_phased: scores by 64-key chunks, softmax by head, P.V by pass), here also over one
    sequence of 300 keys. 5 sequences take the old path (4 rows at most with a float32 route, AMX or not; the int8
    route: 16 on AMX). A bad block table raises inside the team as outside it."""
    H, KVH = heads
    ext = __import__("pagedserve.kernels", fromlist=["x"]).load_extension(arch)
    assert ext is not None
    if route == 9 and not ext.has_quant_i8():
        pytest.skip("no int8 route in this build")
    g = torch.Generator().manual_seed(23)
    shapes = {"qkv": ((H + 2 * KVH) * D, HIDDEN), "o": (HIDDEN, H * D), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER)}
    kinds = iter([Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q4_0, Q.Q5_K, Q.Q5_1])

    def spec(name: str, seed: int):
        n, k = shapes[name]
        qtype = next(kinds)
        packed = ext.quant_pack(torch.from_numpy(random_blocks(qtype, n, k, seed=seed)), int(qtype))
        bias = torch.randn(n, generator=g) if name == "qkv" else None
        return ext.MatmulSpec(route, None, bias, packed, int(qtype), n=n)

    layers = [({name: spec(name, 400 + 10 * i + j) for j, name in enumerate(shapes)}, 8 * i) for i in range(2)]
    norms = [(torch.rand(HIDDEN, generator=g) + 0.5, torch.rand(HIDDEN, generator=g) + 0.5) for _ in layers]
    caches = [(torch.randn(40, BS, KVH, D, generator=g), torch.randn(40, BS, KVH, D, generator=g)) for _ in layers]
    lens = torch.tensor([5, 17, 9, 30, 12])
    tables = torch.arange(10).view(5, 2)
    angles = torch.rand(5, D // 2, generator=g) * 6
    x = torch.randn(5, HIDDEN, generator=g)
    w = torch.rand(HIDDEN, generator=g) + 0.5

    def run(b: int, team: bool, tables=tables, lens=lens):
        built = [ext.DecodeLayer(ln1, ln2, *(mats[n] for n in shapes), kc.clone(), vc.clone(), window=window)
                 for (mats, window), (ln1, ln2), (kc, vc) in zip(layers, norms, caches, strict=True)]
        s = ext.DecodeStack(built, H, KVH, 1e-6, D**-0.5, False)
        pos = lens[:b] - 1
        slots = tables[torch.arange(b), pos // BS] * BS + pos % BS
        before = ext.set_decode_team(team)
        try:
            out = s.forward(x[:b].clone(), angles[:b].cos(), angles[:b].sin(), slots, tables[:b], lens[:b],
                            final_norm=w)
            nxt = s.forward(out.clone(), angles[:b].sin(), angles[:b].cos(), slots + 1, tables[:b], lens[:b] + 1)
            return out, nxt
        finally:
            ext.set_decode_team(before)

    for nt in (1, 2):
        torch.set_num_threads(nt)
        for b in (1, 2, 4, 5):
            ref = run(b, team=False)
            steps = ext.decode_team_steps()
            got = run(b, team=True)
            most = 16 if route == 9 and ext.amx_active() else 4
            team = b <= most and nt <= len(os.sched_getaffinity(0))
            assert ext.decode_team_steps() - steps == (2 if team else 0), (nt, b)
            assert ref[0].dtype == torch.float32 and not torch.equal(ref[0], ref[1])
            assert all(torch.equal(r, o) for r, o in zip(ref, got, strict=True)), (nt, b)
        long = dict(tables=torch.arange(10, 30).unsqueeze(0), lens=torch.tensor([300]))  # 5 key chunks
        assert all(torch.equal(r, o) for r, o in zip(run(1, False, **long), run(1, True, **long), strict=True)), nt
    bad = tables.clone()
    bad[1, 1] = 99  # outside the 40-block cache
    with pytest.raises(RuntimeError, match="outside the cache|block id"):
        run(2, team=True, tables=bad)
    assert all(torch.equal(r, o) for r, o in zip(run(2, team=False), run(2, team=True), strict=True))
