"""pagedserve's C++ CPU kernels (pagedserve/kernels/csrc) against plain PyTorch written as the reference model
(HF transformers' Llama, and Gemma's norms and GeGLU) computes: RMSNorm (both roundings, per head too), residual
add + RMSNorm, rotary + K/V cache write, SwiGLU, GeGLU and
paged decode attention (rows named by index, strided queries, GQA groups wider than one task's 8 heads,
head sizes that are not multiples of 64). The portable (AVX2) build is checked the same way."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedserve.attention import write_kv
from pagedserve.attention.torch_ref import gather_context
from pagedserve.kernels import load_extension
from pagedserve.model.layers import apply_rotary
from pagedserve.model.matmul import pack_weight, packed_linear
from tests.kernels.test_quant_gemm import random_blocks

DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]
# "native": built for this CPU (AVX-512 where it has it); "x86-64-v3": the portable AVX2 build.
ARCHS = ["native", "x86-64-v3"]


@pytest.fixture(scope="module", params=ARCHS)
def kernels(request):
    k = load_extension(request.param)
    assert k is not None, "the C++ kernels must build wherever a compiler is (as in CI)"
    if request.param == "x86-64-v3":
        assert not k.has_avx512()
    return k


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: one rounding step either way
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_rms_norm_and_fused_add(kernels, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 200, generator=g) * 3).to(dtype)
    res = torch.randn(rows, 200, generator=g).to(dtype)
    w = torch.rand(200, generator=g).to(dtype) + 0.5
    assert close(kernels.rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5), dtype)
    # strided rows (a slice of a wider tensor) are read in place
    wide = torch.randn(rows, 300, generator=g).to(dtype)
    assert close(kernels.rms_norm(wide[:, :200], w, 1e-6), ref_rms_norm(wide[:, :200], w, 1e-6), dtype)
    expect_res = x + res
    expect_x = ref_rms_norm(expect_res, w, 1e-5)
    kernels.fused_add_rms_norm(x, res, w, 1e-5)  # in place
    assert torch.equal(res, expect_res)
    assert close(x, expect_x, dtype)


def test_bf16_stores_keep_denormals_and_infinities(kernels):
    """The kernels' bf16 stores round as torch does also where a sum is a float32 denormal (the AVX512-BF16
    conversion they use flushes those: such vectors must take the integer rounding) or infinite, and keep -0."""
    tiny = 2.0 ** -126  # the smallest normal float32 (and bf16)
    x = torch.full((3, 64), 0.75).bfloat16()
    res = torch.full((3, 64), -0.5).bfloat16()
    x[0, :16], res[0, :16] = 1.5 * tiny, -tiny  # sums 2^-127: a denormal, representable in bf16
    x[1, 16:19], res[1, 16:19] = torch.tensor([3e38, -0.0, 1.0]), torch.tensor([3e38, -0.0, float("inf")])
    x[2, 40], res[2, 40] = 1.25 * tiny, -tiny  # one denormal among normal values
    want = (x.float() + res.float()).bfloat16()
    assert (want[0, :16].float() == 2.0 ** -127).all() and torch.isinf(want[1, 16]) and torch.isinf(want[1, 18])
    kernels.fused_add_rms_norm(x, res, torch.ones(64).bfloat16(), 1e-6)
    assert torch.equal(res.view(torch.int16), want.view(torch.int16))


def ref_rms_norm_once(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (transformers' Gemma3RMSNorm with the stored 1 + w): float32 all the way, rounded once."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm_rounds_once_where_asked(kernels, dtype):
    """once=True is Gemma's formula, once=False Llama's, in the plain, the fused and the per-head norms; in bf16 the
    two differ in about a quarter of the elements, and each kernel agrees with its own formula on all but the rare
    float32 ties of a different summation order."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(40, 256, generator=g) * 3).to(dtype)
    w = (torch.rand(256, generator=g) * 2 + 0.3).to(dtype)
    once, llama = ref_rms_norm_once(x, w, 1e-6), ref_rms_norm(x, w, 1e-6)
    got_once, got_llama = kernels.rms_norm(x, w, 1e-6, True), kernels.rms_norm(x, w, 1e-6, False)
    assert close(got_once, once, dtype) and close(got_llama, llama, dtype)
    if dtype == torch.bfloat16:
        assert (once != llama).float().mean() > 0.1  # the two formulas are told apart here
        assert (got_once != once).float().mean() < 0.01
        assert (got_llama != llama).float().mean() < 0.01
    else:
        assert torch.equal(got_once, got_llama)  # float32: nothing to round
    res = torch.randn(40, 256, generator=g).to(dtype)
    xc, rc = x.clone(), res.clone()
    kernels.fused_add_rms_norm(xc, rc, w, 1e-6, True)
    assert torch.equal(rc, x + res) and close(xc, ref_rms_norm_once(x + res, w, 1e-6), dtype)
    # Per head inside qkv rows: q heads with q_w, k heads with k_w, v untouched.
    T, H, KVH, D = 7, 4, 2, 64
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)
    qw, kw = (torch.rand(D, generator=g) + 0.5).to(dtype), (torch.rand(D, generator=g) + 0.5).to(dtype)
    for flag in (True, False):
        out = qkv.clone()
        kernels.rms_norm_heads(out, qw, kw, H, KVH, 1e-6, flag)
        q, k, v = out.split([H * D, KVH * D, KVH * D], dim=-1)
        q0, k0, v0 = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        ref = ref_rms_norm_once if flag else ref_rms_norm
        assert close(q.reshape(-1, D), ref(q0.reshape(-1, D), qw, 1e-6), dtype)
        assert close(k.reshape(-1, D), ref(k0.reshape(-1, D), kw, 1e-6), dtype)
        if dtype == torch.bfloat16:
            assert (q.reshape(-1, D) != ref(q0.reshape(-1, D), qw, 1e-6)).float().mean() < 0.01
        assert torch.equal(v, v0)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_gelu_tanh_and_mul(kernels, dtype):
    """GeGLU: F.gelu(gate, approximate="tanh") (rounded to the dtype) * up, finite far out on both sides."""
    g = torch.Generator().manual_seed(2)
    gu = (torch.randn(9, 2 * 150, generator=g) * 4).to(dtype)
    gu[0, 0], gu[0, 1] = -200.0, 200.0
    out = kernels.gelu_tanh_and_mul(gu)
    ref = (F.gelu(gu[:, :150].float(), approximate="tanh").to(dtype) * gu[:, 150:]).to(dtype)
    assert out.shape == (9, 150) and close(out, ref, dtype) and torch.isfinite(out).all()
    if dtype == torch.bfloat16:  # the same bf16 values but for rare ties of the float32 arithmetic ...
        body = gu[:, :150] > -3
        assert (out != ref)[body].float().mean() < 0.01
        # ... except far out on the negative side, where torch's 0.5 x (1 + tanh(y)) cancels (to 0 from x < -5)
        # and x / (1 + e^(-2 y)) keeps the tiny value: apart by at most 1e-4 there.
        assert (out.float() - ref.float())[~body].abs().max() < 1e-4


@pytest.mark.parametrize("D", [32, 64, 40])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rotary_write_kv(kernels, dtype, D):
    T, H, KVH, BS, NB = 11, 6, 2, 4, 20
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)
    pos = torch.randint(0, 500, (T,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = pos.float().unsqueeze(1) * inv
    cos, sin = ang.cos(), ang.sin()
    slots = torch.randperm(NB * BS, generator=g)[:T]
    kc, vc = torch.zeros(NB, BS, KVH, D, dtype=dtype), torch.zeros(NB, BS, KVH, D, dtype=dtype)
    rk, rv = kc.clone(), vc.clone()
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    eq = apply_rotary(q.reshape(T, H, D), cos, sin)
    ek = apply_rotary(k.reshape(T, KVH, D), cos, sin)
    write_kv(ek, v.reshape(T, KVH, D), rk, rv, slots)
    kernels.rotary_write_kv(qkv, cos, sin, kc, vc, slots, H, KVH)
    assert close(qkv[:, : H * D].reshape(T, H, D), eq, dtype)
    assert close(kc, rk, dtype) and torch.equal(vc, rv)
    assert kc.abs().sum() > 0
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.rotary_write_kv(qkv, cos, sin, kc, vc, slots + NB * BS, H, KVH)


def test_rotary_write_kv_bf16_bits(kernels):
    """The AVX-512 bf16 path's bits: x1 c - (x2 s) and x2 c + (x1 s), each product in parentheses rounded to float32
    and the rest one fused multiply-add (emulated in float64: exact here, then rounded once), then bf16 -- what the
    scalar loop compiles to. Enough rows that a rounding order other than this one shows (plain products and a
    subtraction differ from it in a few of these elements)."""
    if not kernels.has_avx512():
        pytest.skip("the scalar loop's contraction is the compiler's choice")
    T, H, KVH, D = 512, 6, 2, 64
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g).bfloat16()
    ang = torch.randint(0, 4096, (T,), generator=g).float().unsqueeze(1) * (
        1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
    cos, sin = ang.cos(), ang.sin()
    x = qkv[:, : (H + KVH) * D].float().reshape(T, H + KVH, 2, D // 2).double()
    x1, x2, c, s = x[:, :, 0], x[:, :, 1], cos.double()[:, None], sin.double()[:, None]
    f32 = lambda v: v.float().double()  # noqa: E731
    want = torch.stack([x1 * c - f32(x2 * s), x2 * c + f32(x1 * s)], dim=2).float().bfloat16()
    plain = torch.stack([f32(x1 * c) - f32(x2 * s), f32(x2 * c) + f32(x1 * s)], dim=2).float().bfloat16()
    assert not torch.equal(want, plain)
    kc = torch.zeros(T // 16, 16, KVH, D).bfloat16()
    kernels.rotary_write_kv(qkv, cos, sin, kc, torch.zeros_like(kc), torch.arange(T), H, KVH)
    assert torch.equal(qkv[:, : (H + KVH) * D].reshape(T, H + KVH, 2, D // 2), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_and_mul(kernels, dtype):
    g = torch.Generator().manual_seed(1)
    gu = (torch.randn(9, 2 * 150, generator=g) * 6).to(dtype)
    gu[0, 0] = -200.0  # far negative: silu underflows to -0, never NaN
    out = kernels.silu_and_mul(gu)
    ref = F.silu(gu[:, :150]) * gu[:, 150:]
    assert out.shape == (9, 150) and close(out, ref, dtype)
    assert torch.isfinite(out).all()


def test_silu_and_mul_float32_is_within_a_few_ulp_everywhere(kernels):
    """float32 silu(g) * 1 (the vector form's own e^x on AVX2 builds; the scalar expf in a row's last I % 8 lanes and
    elsewhere) against float64: within 8 float32 ulp over g in [-80, 80], the whole row and in rows of 5 (the scalar
    form only); below -80, where e^-g is capped at e^80, finite and within 1e-30 of 0."""
    g = torch.linspace(-80, 80, 200_005, dtype=torch.float32)
    ref = F.silu(g.double())
    ulp = torch.from_numpy(np.spacing(np.abs(ref.float().numpy()))).double()
    for width in (200_005, 5):  # one row (8-lane groups, then a 5-lane tail), then rows of 5
        gr = g.reshape(-1, width)
        out = kernels.silu_and_mul(torch.cat([gr, torch.ones_like(gr)], dim=1)).reshape(-1).double()
        assert ((out - ref).abs() <= 8 * ulp).all(), width
    far = torch.linspace(-1e4, -80.001, 999)[None, :]
    out = kernels.silu_and_mul(torch.cat([far, torch.ones_like(far)], dim=1))
    assert torch.isfinite(out).all() and (out.abs() <= 1e-30).all()


def paged_setup(B, H, KVH, D, BS, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 5 * BS, (B,), generator=g)
    width = int(-(-lens.max() // BS)) + 1
    nb = B * width + 3
    ids = torch.randperm(nb, generator=g)
    tables = ids[: B * width].view(B, width).contiguous()
    kc = torch.randn(nb, BS, KVH, D, generator=g).to(dtype)
    vc = torch.randn(nb, BS, KVH, D, generator=g).to(dtype)
    return lens, tables, kc, vc, g


def ref_decode(q, kc, vc, tables, lens, scale, window=None):
    out = []
    group = q.shape[1] // kc.shape[2]
    for b in range(len(lens)):
        first = 0 if window is None else max(0, int(lens[b]) - window)  # a sliding window: the last `window` keys
        keys = gather_context(kc, tables[b], int(lens[b]))[first:].float().repeat_interleave(group, 1)
        vals = gather_context(vc, tables[b], int(lens[b]))[first:].float().repeat_interleave(group, 1)
        p = torch.einsum("hd,shd->hs", q[b].float(), keys).mul(scale).softmax(-1)
        out.append(torch.einsum("hs,shd->hd", p, vals))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("H", "KVH", "D"), [(9, 3, 64), (12, 1, 80), (4, 4, 128), (6, 2, 24), (16, 2, 48)])
def test_paged_decode_attention(kernels, dtype, H, KVH, D):
    B, BS = 7, 8
    lens, tables, kc, vc, g = paged_setup(B, H, KVH, D, BS, dtype, seed=H * D)
    scale = D**-0.5
    # Queries live inside a wider qkv-like buffer (strided rows) at scattered token rows of the batch.
    T = B + 5
    buf = torch.randn(T, (H + 2 * KVH) * D, generator=g).to(dtype)
    q = buf[:, : H * D].view(T, H, D)
    rows = torch.randperm(T, generator=g)[:B]
    out = torch.full((T, H, D), 7.0, dtype=dtype)
    kernels.paged_decode_attention(q, kc, vc, tables, lens, rows, out, scale)
    expect = ref_decode(q[rows], kc, vc, tables, lens, scale)
    assert close(out[rows], expect, dtype)
    untouched = torch.ones(T, dtype=torch.bool)
    untouched[rows] = False
    assert (out[untouched] == 7.0).all()
    # a batch of only decodes: row b is token b, no index needed
    out2 = torch.empty(B, H, D, dtype=dtype)
    kernels.paged_decode_attention(q[:B], kc, vc, tables, lens, torch.empty(0, dtype=torch.long), out2, scale)
    assert close(out2, ref_decode(q[:B], kc, vc, tables, lens, scale), dtype)


@pytest.mark.parametrize("threads", [2, 3])
def test_claimed_ranges_cover_the_work_once_and_a_slow_threads_share_moves(kernels, threads):
    """claim_for's split (claim_ranges): each thread owns a fixed share of [0, n) and claims it from its front upward
    in adjacent ranges (on an even host, as a fixed split walks it); a thread done with its own share takes the rest of
    another's from its back. With one thread sleeping per item, the others finish its share: every item is claimed
    exactly once, the slow thread takes fewer than its share (the others its share's back), and each thread's own
    ranges start at its share's front, each where the last ended. With no thread slowed, every item is still claimed
    once."""
    n = 200
    for slow, slow_us in ((1, 300), (-1, 0)):
        got = kernels.claim_ranges_trace(n, threads, slow, slow_us)
        seen = sorted((b, e) for _, b, e in got)
        assert seen[0][0] == 0 and seen[-1][1] == n and all(b < e for b, e in seen)
        assert all(seen[i][1] == seen[i + 1][0] for i in range(len(seen) - 1))  # no gap, no overlap
        for t in range(threads):
            lo, hi = n * t // threads, n * (t + 1) // threads
            own = [(b, e) for u, b, e in got if u == t and lo <= b < hi]
            assert not own or own[0][0] == lo  # its share from the front (all of it taken by others: none)
            assert all(own[i][1] == own[i + 1][0] for i in range(len(own) - 1))  # upward, adjacent
        if slow >= 0:
            lo, hi = n * slow // threads, n * (slow + 1) // threads
            taken = sum(e - b for u, b, e in got if u == slow)
            assert taken < hi - lo, taken  # fewer than its fixed share
            others = [(b, e) for u, b, e in got if u != slow and lo <= b < hi]
            assert others and max(e for _, e in others) == hi  # the others took its share's back


@pytest.mark.parametrize("arch", ["native", "x86-64-v3"])
@pytest.mark.parametrize("threads", [2, 3])
def test_claimed_work_gives_the_bits_of_a_fixed_share(arch, threads):
    """Where the kernels hand their items to whichever thread is free (parallel_claims: the float32 decode attention's
    sequences at 4 or more per thread, the row attention's tiles, the many-rows quant_linear's row blocks x panels;
    claim_for: the few-rows GEMV's ranges of panels), an item's result does not depend on the thread or the order: a
    batch of 24 sequences gives each sequence's bits alone (one sequence: a fixed share of its kv heads) and the
    reference's values; the row attention and quant_linear (and quant_linear_silu at 1-4 rows) give the bits of one
    thread."""
    ext = load_extension(arch)
    assert ext is not None
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        H, KVH, D, BS, B = 9, 3, 64, 16, 24
        lens, tables, kc, vc, g = paged_setup(B, H, KVH, D, BS, torch.float32, seed=threads)
        lens[::5] += 120  # some longer contexts among them (still inside their tables)
        width = tables.shape[1]
        lens.clamp_(max=width * BS)
        q = torch.randn(B, H, D, generator=g)
        scale, no_rows = D**-0.5, torch.empty(0, dtype=torch.long)
        out = torch.empty(B, H, D)
        ext.paged_decode_attention(q, kc, vc, tables, lens, no_rows, out, scale)
        assert close(out, ref_decode(q, kc, vc, tables, lens, scale), torch.float32)
        for b in range(B):
            one = torch.empty(1, H, D)
            ext.paged_decode_attention(q[b : b + 1], kc, vc, tables[b : b + 1], lens[b : b + 1], no_rows, one, scale)
            assert torch.equal(one[0], out[b]), b
        # the row attention over prompt chunks of several 12-row tiles (every tile claimed, the last first)
        qlens = torch.tensor([37, 5, 64, 1])
        seq = torch.minimum(lens[:4] + qlens, torch.tensor(width * BS))
        qsl = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(qlens, 0)])
        qr = torch.randn(int(qsl[-1]), H, D, generator=g)
        rows = ext.paged_attention_rows(qr, kc, vc, tables[:4], seq, qsl, scale, 0)
        torch.set_num_threads(1)
        assert torch.equal(ext.paged_attention_rows(qr, kc, vc, tables[:4], seq, qsl, scale, 0), rows)
        # quant_linear's many rows: one row block (130 rows), and row blocks over weights widened first (400 rows)
        qt = gguf.GGMLQuantizationType.Q4_1
        raw = torch.from_numpy(random_blocks(qt, 80, 1536, seed=threads))
        packed = ext.quant_pack(raw, int(qt))
        for M in (130, 400):
            x = torch.randn(M, 1536, generator=g)
            torch.set_num_threads(1)
            alone = ext.quant_linear(x, packed, int(qt), 80, 1536, None, torch.float32)
            torch.set_num_threads(threads)
            assert torch.equal(ext.quant_linear(x, packed, int(qt), 80, 1536, None, torch.float32), alone), M
        # the few-rows GEMV's panel groups (1-2 rows: 33 pairs of panels; 3-4: 66 panels) and the fused SwiGLU's gate /
        # up pairs, claimed as ranges (claim_for; 2 threads from both ends, 3 in claiming order): every range once,
        # the reference's values and one thread's bits
        N, K = 1056, 256
        raw = random_blocks(qt, N, K, seed=threads + 1)
        packed = ext.quant_pack(torch.from_numpy(raw), int(qt))
        weight = torch.from_numpy(gguf.quants.dequantize(raw, qt)).float()
        for M in (1, 2, 3, 4):
            x = torch.randn(M, K, generator=g)
            torch.set_num_threads(threads)
            few = ext.quant_linear(x, packed, int(qt), N, K, None, torch.float32)
            silu = ext.quant_linear_silu(x, packed, int(qt), N, K)
            ref = x @ weight.T
            assert close(few, ref, torch.float32), M
            gate, up = ref.chunk(2, dim=1)
            assert close(silu, F.silu(gate) * up, torch.float32), M
            torch.set_num_threads(1)
            assert torch.equal(ext.quant_linear(x, packed, int(qt), N, K, None, torch.float32), few), M
            assert torch.equal(ext.quant_linear_silu(x, packed, int(qt), N, K), silu), M
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("amx", [pytest.param(False, id="vdpbf16ps"), pytest.param(True, id="amx")])
@pytest.mark.parametrize(("H", "KVH", "D"), [(9, 3, 64), (12, 1, 64), (2, 2, 64), (8, 2, 128), (4, 1, 256)])
def test_paged_decode_attention_bf16_with_16_key_blocks(kernels, amx, H, KVH, D):
    """bf16 queries and cache, D a multiple of 64, 16-token blocks: where AMX is active the scores and P.V run on
    tiles (a cache block's 16 K rows as D / 32 A tiles, two 16-key runs at a time, the last run partial; P.V 64 d at
    a time over interleaved V pairs); both routes match the reference."""
    if amx and not kernels.amx_active():
        pytest.skip("no AMX on this CPU (or not granted)")
    B, BS, dtype = 6, 16, torch.bfloat16
    lens, tables, kc, vc, g = paged_setup(B, H, KVH, D, BS, dtype, seed=H + 7 * KVH)
    lens[0], lens[1] = 1, 33  # one key; two full 16-key runs and one key of a third
    q = torch.randn(B, H, D, generator=g).to(dtype)
    scale = D**-0.5
    before = kernels.amx_active()
    try:
        kernels.set_amx(amx)
        out = torch.empty(B, H, D, dtype=dtype)
        kernels.paged_decode_attention(q, kc, vc, tables, lens, torch.empty(0, dtype=torch.long), out, scale)
    finally:
        kernels.set_amx(before)
    assert close(out, ref_decode(q, kc, vc, tables, lens, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("H", "KVH", "D", "BS"), [(9, 3, 64, 16), (4, 2, 32, 8), (12, 1, 80, 16), (6, 2, 128, 4)])
def test_paged_decode_attention_sliding_window(kernels, dtype, H, KVH, D, BS):
    """With a window (Gemma's sliding layers) a sequence attends to its last `window` keys only: the kernel starts at
    the block of the first of them and masks the keys before it in that block. Windows of one key, under a block,
    a block, and over it; contexts shorter than, equal to and just over the window, block-aligned or not."""
    B = 10
    lens, tables, kc, vc, g = paged_setup(B, H, KVH, D, BS, dtype, seed=3 * H + D + BS)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    scale = D**-0.5
    no_rows = torch.empty(0, dtype=torch.long)
    for window in (1, BS - 3, BS, BS + 5, 2 * BS):
        lens[:5] = torch.tensor([window - 1 if window > 1 else 1, window, window + 1, window + BS, 3 * BS + 1])
        out = torch.empty(B, H, D, dtype=dtype)
        kernels.paged_decode_attention(q, kc, vc, tables, lens, no_rows, out, scale, window)
        assert close(out, ref_decode(q, kc, vc, tables, lens, scale, window), dtype), window
        # the window matters for the longer contexts (the reference without it differs there) ...
        cut = lens > window
        assert cut.any() and not close(out[cut], ref_decode(q, kc, vc, tables, lens, scale)[cut], dtype)
        # ... and a window no context exceeds (or none, 0) is the plain kernel, bit for bit
        plain = torch.empty(B, H, D, dtype=dtype)
        kernels.paged_decode_attention(q, kc, vc, tables, lens, no_rows, plain, scale)
        wide = torch.empty(B, H, D, dtype=dtype)
        kernels.paged_decode_attention(q, kc, vc, tables, lens, no_rows, wide, scale, int(lens.max()))
        assert torch.equal(wide, plain) and torch.equal(out[~cut], plain[~cut])
    with pytest.raises(RuntimeError, match="window"):
        kernels.paged_decode_attention(q, kc, vc, tables, lens, no_rows, out, scale, -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("H", "KVH", "D", "BS"), [(9, 3, 64, 16), (4, 1, 256, 16), (6, 2, 32, 8)])
def test_paged_decode_attention_long_contexts(kernels, dtype, H, KVH, D, BS):
    """Where a batch has few tasks (one sequence: KVH tasks), the AVX-512 kernel splits each sequence of 1,024 keys
    or more into partitions of whole cache blocks, attends to each alone and combines them (split-K). Single
    sequences of contexts under, at and past the split points, several thousand keys, a window whose first key lies
    inside a partition, 600 keys (split in 256-key partitions where one kv head leaves a thread idle): against the
    reference and the batch's result (split too where it has few tasks)."""
    g = torch.Generator().manual_seed(H + D + BS)
    lens = torch.tensor([1023, 1024, 1025, 1535, 3001, 40, 600, 4100])
    B = len(lens)
    width = -(-int(lens.max()) // BS)
    nb = B * width + 1
    tables = torch.randperm(nb, generator=g)[: B * width].view(B, width).contiguous()
    kc = torch.randn(nb, BS, KVH, D, generator=g).to(dtype)
    vc = torch.randn(nb, BS, KVH, D, generator=g).to(dtype)
    q = (torch.randn(B, H, D, generator=g) * 3).to(dtype)  # peaked softmaxes: outputs of order 1, not ~0
    scale = D**-0.5
    no_rows = torch.empty(0, dtype=torch.long)
    for window in (0, 1500):
        out = torch.empty(B, H, D, dtype=dtype)
        kernels.paged_decode_attention(q, kc, vc, tables, lens, no_rows, out, scale, window)
        ref = ref_decode(q, kc, vc, tables, lens, scale, window or None)
        assert close(out, ref, dtype), window
        assert (out.float() - ref).norm() / ref.norm() < (1e-5 if dtype == torch.float32 else 5e-3)
        for b in range(B):
            one = torch.empty(1, H, D, dtype=dtype)
            kernels.paged_decode_attention(q[b : b + 1], kc, vc, tables[b : b + 1], lens[b : b + 1], no_rows, one,
                                           scale, window)
            assert close(one[0], ref[b], dtype) and close(one[0], out[b], dtype), (window, b)
            assert (one[0].float() - ref[b]).norm() / ref[b].norm() < (1e-5 if dtype == torch.float32 else 5e-3)


def test_paged_decode_attention_rejects_bad_tables(kernels):
    lens, tables, kc, vc, _ = paged_setup(3, 4, 2, 32, 4, torch.float32, seed=0)
    q = torch.randn(3, 4, 32)
    out = torch.empty_like(q)
    no_rows = torch.empty(0, dtype=torch.long)
    bad = tables.clone()
    bad[1, 0] = kc.shape[0] + 5
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.paged_decode_attention(q, kc, vc, bad, lens, no_rows, out, 0.1)
    too_long = lens.clone()
    too_long[0] = tables.shape[1] * 4 + 1
    with pytest.raises(RuntimeError, match="seq_len"):
        kernels.paged_decode_attention(q, kc, vc, tables, too_long, no_rows, out, 0.1)


def test_packed_bf16_linear_equals_linear():
    """Where oneDNN can pre-pack bf16 weights (native bf16 CPUs), the packed matmul gives F.linear's
    numbers for any row count; elsewhere nothing is packed."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 96, generator=g).bfloat16()
    b = torch.randn(300, generator=g).bfloat16()
    packed = pack_weight(w, 16)
    if packed is None:
        from pagedserve.model.matmul import onednn_packing_available

        assert not onednn_packing_available()
        pytest.skip("this CPU has no native bf16: weights stay unpacked")
    for rows in (1, 5, 16, 200):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        exact = F.linear(x.float(), w.float(), b.float())
        got = packed_linear(x, packed, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 300)
        assert torch.allclose(got.float(), exact, rtol=1e-2, atol=1e-2)
    assert pack_weight(w.float(), 16) is None  # float32 stays on MKL


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("vocab", [1, 20, 33, 1000, 49153])
def test_argmax_rows_is_torch_argmax(kernels, dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    if vocab > 40:  # ties: the first maximum wins, wherever the two copies sit
        logits[1, 3] = logits[1, vocab - 2] = 99.0
        logits[2, 17] = logits[2, 18] = 99.0
        logits[3, vocab - 1] = 99.0
    assert torch.equal(kernels.argmax_rows(logits), logits.argmax(-1))
    wide = torch.randn(6, vocab + 7, generator=g).to(dtype)  # strided rows
    assert torch.equal(kernels.argmax_rows(wide[:, :vocab]), wide[:, :vocab].argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("vocab", [1, 7, 33, 1000, 49153])
def test_argmax_rows_gives_minus_one_for_a_row_with_a_nan(kernels, dtype, vocab):
    """A NaN anywhere in a row (first, in the vector part, in the tail, beside a larger logit) makes its index -1, the
    row the sampler then refuses; the other rows keep torch.argmax's index. Each build's own path (AVX-512, AVX2's
    8-lane scan, the scalar loop) sees it: a plain `v > best` scan gave 0 or a finite maximum's index."""
    g = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(8, vocab, generator=g).to(dtype)
    logits[3, 0] = 99.0  # a real maximum before the NaN
    bad = {0: 0, 1: vocab - 1, 2: vocab // 2, 3: min(vocab - 1, 17)}
    for r, at in bad.items():
        logits[r, at] = float("nan")
    if vocab > 1:
        logits[4, vocab - 1] = float("inf")  # +inf is a logit like any other: its index
    got = kernels.argmax_rows(logits)
    ref = logits.argmax(-1)
    for r in range(8):
        assert int(got[r]) == (-1 if r in bad else int(ref[r])), (r, vocab)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [64, 576, 100])
def test_bf16_gemv_equals_linear(kernels, rows, k):
    if not kernels.has_bf16_gemv():
        pytest.skip("built without AVX512-BF16")
    g = torch.Generator().manual_seed(rows * k)
    w = torch.randn(130, k, generator=g).bfloat16()
    b = torch.randn(130, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    exact = F.linear(x.float(), w.float(), b.float())
    for bias, ref in ((b, exact), (None, exact - b.float())):
        got = kernels.gemv_bf16(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 130)
        assert torch.allclose(got.float(), ref, rtol=1e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="rows"):
        kernels.gemv_bf16(torch.randn(5, k).bfloat16(), w, None)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("n", [64, 70], ids=["regrouped", "row-layout"])
def test_gguf_gemv_equals_linear_on_the_dequantized_weights(kernels, qtype, rows, dtype, n):
    """The GEMVs over GGUF blocks (regrouped by 16 rows when N allows, else GGUF's row layout) compute
    with exactly the weights gguf-py dequantizes (what transformers' GGUF loader uses): float32 results
    agree up to rounding order."""
    import gguf
    import numpy as np

    from pagedserve.model.matmul import GGUF_TYPE_IDS, GgufMatmul

    if not kernels.has_gguf_gemv():
        pytest.skip("built without AVX-512")
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    g = torch.Generator().manual_seed(rows * n)
    dense = torch.randn(n, 96, generator=g).numpy().astype(np.float32)
    raw = gguf.quants.quantize(dense, kind)  # [n, 96 / 32 * block bytes] uint8
    weights = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(n, 96).astype(np.float32))
    type_id = GGUF_TYPE_IDS[qtype]
    matmul = GgufMatmul(kernels, type_id, torch.from_numpy(np.ascontiguousarray(raw)))
    assert matmul.regrouped == (n % 16 == 0)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    exact = F.linear(x.float(), weights, bias.float())
    for b, ref in ((bias, exact), (None, exact - bias.float())):
        got = matmul(x, b)
        assert got.dtype == dtype and got.shape == (rows, n)
        assert close(got, ref, dtype)
    assert not torch.allclose(weights, torch.from_numpy(dense))  # really quantized: the blocks matter
    with pytest.raises(RuntimeError, match="GGUF type"):
        kernels.gemv_gguf(x, torch.from_numpy(np.ascontiguousarray(raw)), 12, None)


def test_gguf_block_layouts_are_one_table(kernels):
    """csrc/gguf_layouts.h and model/matmul.py describe the same blocks, and both agree with gguf-py."""
    import gguf

    from pagedserve.model.matmul import GGUF_BLOCK_LAYOUTS

    cpp = {t: (name, bb, qo, qb, mo) for t, name, bb, qo, qb, mo in kernels.gguf_block_layouts()}
    py = {t: (lay.name, lay.block_bytes, lay.quant_offset, lay.quant_bytes, lay.min_offset)
          for t, lay in GGUF_BLOCK_LAYOUTS.items()}
    assert cpp == py and len(py) == 3
    for type_id, lay in GGUF_BLOCK_LAYOUTS.items():
        kind = gguf.GGMLQuantizationType(type_id)
        assert kind.name == lay.name
        assert gguf.GGML_QUANT_SIZES[kind] == (32, lay.block_bytes)
        assert lay.quant_offset + lay.quant_bytes == lay.block_bytes
        assert lay.has_min == (lay.name == "Q4_1")


def test_matmul_route_ids_agree_with_decode_stack(kernels):
    from pagedserve.model.matmul import Route

    python_only = (Route.PACKED, Route.LINEAR_F32)
    assert dict(kernels.matmul_routes()) == {r.name.lower(): int(r) for r in Route if r not in python_only}


def test_sample_logits_draws_the_torch_samplers_tokens(kernels):
    """The sampler's C++ draw (temperature, top-k / top-p / min-p, inverse CDF) on both builds: the torch path's
    tokens for the same uniforms (the full comparison is in tests/engine/test_sampler.py)."""
    from pagedserve.sampling.metadata import SamplingMetadata
    from pagedserve.sampling.sampler import Sampler

    rows, vocab = 40, 3000
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(rows, vocab, generator=g) * 3
    temps = torch.tensor([0.0, 0.6, 1.0, 1.8] * 10)
    top_k = torch.tensor([0, 0, 7, 100, 2000] * 8)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.99] * 10)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05] * 8)
    meta = SamplingMetadata(num_rows=rows, all_greedy=False, all_plain_greedy=False, greedy=temps == 0,
                            temperature=temps.masked_fill(temps == 0, 1.0).unsqueeze(1), top_k=top_k, top_p=top_p,
                            min_p=min_p, generators=[None] * rows)
    u = Sampler(seed=4)._uniforms([None] * rows)
    fused = kernels.sample_logits(logits, temps, top_k, top_p, min_p, u)
    assert fused.tolist() == Sampler(seed=4)(logits, meta).token_ids
    bad = logits.clone()
    bad[3, 5] = float("nan")
    bad[5] = float("-inf")  # (row 4 is greedy)
    assert kernels.sample_logits(bad, temps, top_k, top_p, min_p, u)[[3, 5]].tolist() == [-1, -1]
