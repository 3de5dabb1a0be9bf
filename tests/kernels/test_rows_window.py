"""Sliding windows in the prefill row kernels (paged_attention_rows / paged_attention_rows_into with window > 0:
each row sees its last `window` positions, itself included; Gemma 3's and Mistral's prefill). Every route — the
bf16 flash-style kernel (vdpbf16ps, or AMX tiles where the CPU has them), the strict float32 kernels tiled (D % 16
== 0) and plain — on the native and the portable (x86-64-v3) builds: against float64 attention with the window's
mask, still row kernels (a row's bits do not depend on how its prompt is chunked or on the other rows), and a
window that cuts nothing gives the window-free kernel's bits."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import load_extension
from tests.kernels.test_rows_attention_bf16 import reference

BS, NB = 16, 80
# (query dtype, cache dtype, H, KVH, D): the bf16 kernel where built (Gemma 3's D = 256 too); float32 queries take
# the strict kernels, tiled for D % 16 == 0, plain for D = 24.
CASES = [(torch.bfloat16, torch.bfloat16, 9, 3, 64), (torch.bfloat16, torch.bfloat16, 4, 1, 256),
         (torch.float32, torch.float32, 9, 3, 64), (torch.float32, torch.bfloat16, 4, 2, 32),
         (torch.float32, torch.float32, 6, 2, 24)]
IDS = ["bf16-d64", "bf16-d256", "fp32-d64", "fp32q-bf16cache-d32", "fp32-d24"]
WINDOWS = [1, 5, 16, 33, 64, 150]
# Sequence 0: 63 cached keys + 37 new rows; sequence 1: a 200-token prompt in one chunk.
SEQ_LENS, QSL = torch.tensor([100, 200]), torch.tensor([0, 37, 237])
CUTS = [0, 3, 50, 81, 130, 199, 200]  # sequence 1 in chunks ending inside 16- and 32-key blocks


@pytest.fixture(scope="module", params=["native", "x86-64-v3"])
def ext(request):
    k = load_extension(request.param)
    assert k is not None, "the C++ kernels must build wherever a compiler is"
    return k


def routes(ext, qdtype):
    """The AMX switch settings to run: both where AMX is (bf16 queries only: the float32 kernels have no AMX)."""
    return [False, True] if qdtype == torch.bfloat16 and hasattr(ext, "set_amx") and ext.set_amx(True) else [None]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_windows_match_float64_and_stay_row_kernels(ext, case):
    qdtype, cdtype, H, KVH, D = case
    g = torch.Generator().manual_seed(D + H)
    kc = torch.randn(NB, BS, KVH, D, generator=g).to(cdtype)
    vc = torch.randn(NB, BS, KVH, D, generator=g).to(cdtype)
    perm = torch.randperm(NB, generator=g)
    bt = torch.stack([perm[:16], perm[16:32]]).contiguous()
    q = torch.randn(237, H, D, generator=g).to(qdtype)
    bf16_route = qdtype == torch.bfloat16 and ext.has_quant_bf16()
    tol_max, tol_mean = (2e-2, 1e-3) if bf16_route or qdtype == torch.bfloat16 else (1e-5, 1e-6)
    one = bt[1:]
    for amx in routes(ext, qdtype):
        if amx is not None:
            assert ext.set_amx(amx) == amx
        try:
            plain = ext.paged_attention_rows(q, kc, vc, bt, SEQ_LENS, QSL, D**-0.5)
            # A window no row's context exceeds cuts nothing: the window-free bits.
            assert torch.equal(ext.paged_attention_rows(q, kc, vc, bt, SEQ_LENS, QSL, D**-0.5, 200), plain)
            for window in WINDOWS:
                out = ext.paged_attention_rows(q, kc, vc, bt, SEQ_LENS, QSL, D**-0.5, window)
                assert out.dtype == qdtype and out.shape == q.shape
                err = (out.double() - reference(q, kc, vc, bt, SEQ_LENS, QSL, window)).abs()
                assert err.max() < tol_max and err.mean() < tol_mean, (window, amx, err.max().item())
                parts = [ext.paged_attention_rows(q[37 + lo:37 + hi], kc, vc, one, torch.tensor([hi]),
                                                  torch.tensor([0, hi - lo]), D**-0.5, window)
                         for lo, hi in zip(CUTS[:-1], CUTS[1:], strict=True)]
                assert torch.equal(torch.cat(parts), out[37:]), (window, amx)
                # q as a model hands it over: heads of a wider qkv row (row stride (H + 3) D), read in place.
                qkv = torch.zeros(237, (H + 3) * D, dtype=qdtype)
                qkv[:, : H * D] = q.flatten(1)
                strided = qkv[:, : H * D].view(237, H, D)
                assert torch.equal(ext.paged_attention_rows(strided, kc, vc, bt, SEQ_LENS, QSL, D**-0.5, window), out)
                # The same rows among others of a step (the _into entry: a step's prefill rows among its decodes), q
                # strided as well.
                rows = torch.arange(3, 240)
                into = torch.zeros(240, H, D, dtype=qdtype)
                wide = torch.zeros(240, (H + 3) * D, dtype=qdtype)[:, : H * D].view(240, H, D)
                wide[3:] = q
                ext.paged_attention_rows_into(wide, kc, vc, bt, SEQ_LENS, QSL, rows, into, D**-0.5, window)
                assert torch.equal(into[3:], out) and (into[:3] == 0).all()
        finally:
            if amx is not None:
                ext.set_amx(True)


def test_bad_window_raises(ext):
    kc = torch.zeros(4, BS, 1, 32)
    q = torch.zeros(3, 2, 32)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        ext.paged_attention_rows(q, kc, kc, torch.zeros(1, 1, dtype=torch.long), torch.tensor([3]),
                                 torch.tensor([0, 3]), 1.0, -1)


@pytest.mark.parametrize("window", [0, 5000], ids=["no-window", "window"])
def test_float32_rows_past_the_shared_key_budget(ext, window):
    """The tiled float32 kernel transposes each sequence's keys once per call and shares them among its row tiles,
    up to 16M floats of transposed keys; past that (here 8 kv heads x 16,400 keys x D 128) each tile transposes its
    own as before. That route too matches float64 attention and stays a row kernel (a chunk's rows are the bits of
    the same rows in a longer call)."""
    KVH, D, S, T = 8, 128, 16400, 20
    nb = (S + BS - 1) // BS
    g = torch.Generator().manual_seed(7)
    kc = torch.randn(nb + 3, BS, KVH, D, generator=g)
    vc = torch.randn(nb + 3, BS, KVH, D, generator=g)
    bt = torch.randperm(nb + 3, generator=g)[:nb].view(1, -1).contiguous()
    q = torch.randn(T, KVH, D, generator=g)
    lens, qsl = torch.tensor([S]), torch.tensor([0, T])
    out = ext.paged_attention_rows(q, kc, vc, bt, lens, qsl, D**-0.5, window)
    err = (out.double() - reference(q, kc, vc, bt, lens, qsl, window or None)).abs()
    assert err.max() < 1e-5 and err.mean() < 1e-6, err.max().item()
    tail = ext.paged_attention_rows(q[7:], kc, vc, bt, lens, torch.tensor([0, T - 7]), D**-0.5, window)
    assert torch.equal(tail, out[7:])
