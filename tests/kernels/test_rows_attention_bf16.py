"""The prefill row kernel for bf16 queries and a bf16 cache (paged_attention_rows on AVX512-BF16 builds:
flash-style, vdpbf16ps for both matmuls, or AMX tiles where the CPU has them): against float64 attention over the
same bf16 values, and still a row kernel (a row's bits do not depend on how its prompt is chunked, on the other
rows, or on q's stride), on each route."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import load_extension

H, KVH, D, BS, NB = 9, 3, 64, 16, 300


@pytest.fixture(scope="module")
def ext():
    k = load_extension("native")
    assert k is not None
    if not k.has_quant_bf16():  # the same build condition (AVX512-BF16)
        pytest.skip("the bf16 row kernel needs an AVX512-BF16 build")
    return k


@pytest.fixture(scope="module")
def cache():
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(NB, BS, KVH, D, generator=g).bfloat16()
    vc = torch.randn(NB, BS, KVH, D, generator=g).bfloat16()
    return kc, vc, torch.randperm(NB, generator=g)


@pytest.fixture(params=[pytest.param(False, id="vdpbf16ps"), pytest.param(True, id="amx")])
def route(ext, request):
    """The kernel's route for one test (a process-wide switch, restored after)."""
    if request.param and not ext.set_amx(True):
        pytest.skip("no AMX on this CPU (or not granted)")
    assert ext.set_amx(request.param) == request.param
    yield request.param
    ext.set_amx(True)


def reference(q, kc, vc, bt, seq_lens, qsl, window=None):
    """float64 attention over the same bf16 values (head shapes taken from q and the cache); window: each row over
    its last `window` positions only (tests/kernels/test_rows_window.py)."""
    H, KVH, D, BS = q.shape[1], kc.shape[2], q.shape[2], kc.shape[1]
    outs = []
    for b in range(len(seq_lens)):
        s_len, lo, hi = int(seq_lens[b]), int(qsl[b]), int(qsl[b + 1])
        idx = bt[b, : (s_len + BS - 1) // BS]
        k = kc[idx].flatten(0, 1)[:s_len].double().repeat_interleave(H // KVH, dim=1)
        v = vc[idx].flatten(0, 1)[:s_len].double().repeat_interleave(H // KVH, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[lo:hi].double(), k) * D**-0.5
        pos = torch.arange(s_len - (hi - lo), s_len).view(-1, 1)
        key = torch.arange(s_len).view(1, -1)
        hidden = key > pos
        if window is not None:
            hidden |= key <= pos - window
        s = s.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(outs)


def test_matches_float64_attention_and_stays_a_row_kernel(ext, cache, route):
    kc, vc, perm = cache
    g = torch.Generator().manual_seed(1)
    # Sequence 0: 63 cached keys + 37 new rows; sequence 1: a 200-token prompt in one chunk (an odd number of
    # 16-key blocks: the AMX route's 32-key blocks end half empty).
    seq_lens, qsl = torch.tensor([100, 200]), torch.tensor([0, 37, 237])
    bt = torch.stack([perm[:16], perm[16:32]]).contiguous()
    q = torch.randn(237, H, D, generator=g).bfloat16()
    out = ext.paged_attention_rows(q, kc, vc, bt, seq_lens, qsl, D**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    err = (out.double() - reference(q, kc, vc, bt, seq_lens, qsl)).abs()
    assert err.max() < 2e-2 and err.mean() < 1e-3  # bf16 output and bf16 probabilities
    one = bt[1:]
    # The 200-token prompt in two chunks of 100, and its last row alone.
    a = ext.paged_attention_rows(q[37:137], kc, vc, one, torch.tensor([100]), torch.tensor([0, 100]), D**-0.5)
    b = ext.paged_attention_rows(q[137:237], kc, vc, one, torch.tensor([200]), torch.tensor([0, 100]), D**-0.5)
    assert torch.equal(torch.cat([a, b]), out[37:])
    last = ext.paged_attention_rows(q[236:], kc, vc, one, torch.tensor([200]), torch.tensor([0, 1]), D**-0.5)
    assert torch.equal(last, out[236:])
    # Chunks that end inside a 16-key block and inside a 32-key block, and a row alone in its tile.
    cuts = [0, 3, 50, 81, 130, 199, 200]
    parts = [ext.paged_attention_rows(q[37 + lo:37 + hi], kc, vc, one, torch.tensor([hi]), torch.tensor([0, hi - lo]),
                                      D**-0.5) for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]
    assert torch.equal(torch.cat(parts), out[37:])
    # q as a strided view (rows of a wider qkv tensor).
    wide = torch.zeros(237, H * D + 2 * KVH * D, dtype=torch.bfloat16)
    wide[:, : H * D] = q.view(237, -1)
    strided = wide[:, : H * D].view(237, H, D)
    assert torch.equal(ext.paged_attention_rows(strided, kc, vc, bt, seq_lens, qsl, D**-0.5), out)


def test_the_routes_differ_only_by_summation(ext, cache):
    """Where AMX is, its kernel really runs (other bits than vdpbf16ps's) and agrees with it to bf16 rounding."""
    if not ext.set_amx(True):
        pytest.skip("no AMX on this CPU (or not granted)")
    kc, vc, perm = cache
    q = torch.randn(150, H, D, generator=torch.Generator().manual_seed(3)).bfloat16()
    bt, seq_lens, qsl = perm[:16].view(1, -1).contiguous(), torch.tensor([250]), torch.tensor([0, 150])
    amx = ext.paged_attention_rows(q, kc, vc, bt, seq_lens, qsl, D**-0.5)
    try:
        ext.set_amx(False)
        vdp = ext.paged_attention_rows(q, kc, vc, bt, seq_lens, qsl, D**-0.5)
    finally:
        ext.set_amx(True)
    assert not torch.equal(amx, vdp)
    assert (amx.float() - vdp.float()).abs().max() < 2e-2


def test_float32_queries_keep_the_float32_kernel(ext, cache):
    """Only bf16 queries over a bf16 cache take the bf16 kernel: float32 queries are not rounded."""
    kc, vc, perm = cache
    q = torch.randn(20, H, D, generator=torch.Generator().manual_seed(2))
    bt, seq_lens, qsl = perm[:4].view(1, -1).contiguous(), torch.tensor([20]), torch.tensor([0, 20])
    out = ext.paged_attention_rows(q, kc, vc, bt, seq_lens, qsl, D**-0.5)
    assert out.dtype == torch.float32
    assert (out.double() - reference(q, kc, vc, bt, seq_lens, qsl)).abs().max() < 1e-4


@pytest.mark.parametrize("shape", [(4, 2, 128), (8, 1, 32), (2, 2, 64)], ids=["d128-gqa2", "d32-mqa8", "d64-mha"])
def test_other_head_shapes(ext, route, shape):
    """Head sizes and GQA groups other than the bundled model's: the AMX kernel keeps O^T in tile registers only for
    D = 64 and in memory otherwise; both still match float64 attention and stay row kernels."""
    h, kvh, d = shape
    g = torch.Generator().manual_seed(4)
    kc = torch.randn(40, BS, kvh, d, generator=g).bfloat16()
    vc = torch.randn(40, BS, kvh, d, generator=g).bfloat16()
    bt = torch.randperm(40, generator=g)[:12].view(1, -1).contiguous()
    q = torch.randn(150, h, d, generator=g).bfloat16()
    seq_lens, qsl = torch.tensor([170]), torch.tensor([0, 150])  # 20 cached keys + 150 new rows
    out = ext.paged_attention_rows(q, kc, vc, bt, seq_lens, qsl, d**-0.5)
    err = (out.double() - reference(q, kc, vc, bt, seq_lens, qsl)).abs()
    assert err.max() < 2e-2 and err.mean() < 1e-3
    a = ext.paged_attention_rows(q[:67], kc, vc, bt, torch.tensor([87]), torch.tensor([0, 67]), d**-0.5)
    b = ext.paged_attention_rows(q[67:], kc, vc, bt, torch.tensor([170]), torch.tensor([0, 83]), d**-0.5)
    assert torch.equal(torch.cat([a, b]), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32-gather-route"])
def test_rows_into_reads_and_writes_its_rows_in_place(ext, cache, route, dtype):
    """paged_attention_rows_into (a step's prefill rows among its decode rows): the rows q[rows] through the kernel,
    written to out[rows] with the bits paged_attention_rows gives on the gathered rows; other rows of out untouched.
    Float32 queries take the gather + scatter fallback, with the same bits too."""
    kc, vc, perm = cache
    g = torch.Generator().manual_seed(5)
    q = torch.randn(300, H, D, generator=g).to(dtype)[::2]  # strided rows
    rows = torch.tensor(sorted(torch.randperm(150, generator=g)[:120].tolist()))  # 2 sequences: 70 + 50 rows
    seq_lens, qsl = torch.tensor([90, 50]), torch.tensor([0, 70, 120])
    bt = torch.stack([perm[:8], perm[8:16]]).contiguous()
    expected = ext.paged_attention_rows(q[rows], kc, vc, bt, seq_lens, qsl, D**-0.5)
    out = torch.full((150, H, D), 7.0, dtype=expected.dtype)
    ext.paged_attention_rows_into(q, kc, vc, bt, seq_lens, qsl, rows, out, D**-0.5)
    assert torch.equal(out[rows], expected)
    untouched = torch.ones(150, dtype=torch.bool)
    untouched[rows] = False
    assert (out[untouched] == 7.0).all()
    for bad in (torch.tensor(rows.tolist()[:-1] + [150]), torch.tensor(rows.tolist()[:-1] + [rows[0].item()])):
        with pytest.raises(RuntimeError, match="bad row"):  # outside q, or a row twice
            ext.paged_attention_rows_into(q, kc, vc, bt, seq_lens, qsl, bad, out, D**-0.5)
