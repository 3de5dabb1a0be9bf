"""Every fast attention backend equals torch_ref on random mixed batches: prefill chunks that start over
previously cached context, fresh prefills, decodes, shared prefix blocks and shuffled block tables."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.attention import AttentionBackend, AttentionMetadata, get_backend
from pagedserve.attention.cpu import BatchedGatherBackend
from pagedserve.kernels import CpuKernels

# "batched" sends decodes to the C++ kernel when it builds; "batched-gather" is its pure-PyTorch path;
# "batch_invariant" (the strict mode) runs every row through the C++ row kernel (no sliding window).
FAST_BACKENDS = ("batched", "batched-gather", "batch_invariant")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def random_batch(
    rng: random.Random, kinds: list[str], block_size: int, num_blocks: int, share_prefix: bool = False,
    sliding_window: int | None = None,
) -> tuple[AttentionMetadata, int]:
    """kinds: per sequence "decode" (1 new token after cached context), "chunk" (several new tokens after
    cached context) or "prefill" (several new tokens, no context). Returns the metadata and T."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared: list[int] = []
    if share_prefix:  # a prefix-cache hit: full blocks that several sequences' tables start with
        shared = [free.pop() for _ in range(rng.randint(1, 3))]
    query_lens, seq_lens, tables = [], [], []
    for kind in kinds:
        prefix = shared if share_prefix and kind != "prefill" else []
        cached = len(prefix) * block_size
        if kind == "decode":
            cached += rng.randint(0 if prefix else 1, 3 * block_size)
            q = 1
        elif kind == "chunk":
            cached += rng.randint(0 if prefix else 1, 3 * block_size)
            q = rng.randint(2, 2 * block_size + 3)
        else:
            q = rng.randint(2, 3 * block_size)
        total = cached + q
        table = list(prefix) + [free.pop() for _ in range(-(-total // block_size) - len(prefix))]
        query_lens.append(q)
        seq_lens.append(total)
        tables.append(table)
    width = max(len(t) for t in tables) + rng.randint(0, 2)  # extra padding columns must be ignored
    slots = []
    for q, s, t in zip(query_lens, seq_lens, tables, strict=True):
        slots += [t[p // block_size] * block_size + p % block_size for p in range(s - q, s)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0),
        query_lens=query_lens,
        seq_lens_host=seq_lens,
        block_size=block_size,
        sliding_window=sliding_window,
    )
    return meta, sum(query_lens)


def make_backend(name: str) -> AttentionBackend:
    if name == "batched-gather":  # the batched backend without the C++ decode kernel
        return BatchedGatherBackend(None)
    return get_backend(name, CpuKernels.build())


def _fresh_meta(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                             meta.query_lens, meta.seq_lens_host, meta.block_size, meta.sliding_window)


def run_both(backend: str, meta: AttentionMetadata, num_tokens: int, heads: int, kv_heads: int, head_dim: int,
             dtype: torch.dtype, num_blocks: int, seed: int, layers: int = 2):
    """Run `layers` attention layers (prepare once per step, as the model does) through the reference and
    `backend` on identical random inputs and caches; return both outputs and final caches."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, meta.block_size, kv_heads, head_dim)
    results = []
    for name in ("torch_ref", backend):
        g.manual_seed(seed)
        be = make_backend(name)
        m = _fresh_meta(meta)
        be.prepare(m)
        outs, caches = [], []
        for _ in range(layers):
            k_cache = torch.randn(shape, generator=g).to(dtype)
            v_cache = torch.randn(shape, generator=g).to(dtype)
            q = torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype)
            k = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(dtype)
            v = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(dtype)
            outs.append(be.forward(q, k, v, k_cache, v_cache, m, head_dim**-0.5))
            caches.append((k_cache, v_cache))
        results.append((outs, caches))
    return results


MIXES = {
    "mixed": ["decode", "chunk", "prefill", "decode", "chunk", "decode"],
    "decodes": ["decode"] * 5,
    "prefills": ["prefill", "prefill", "prefill"],
    "chunks": ["chunk", "chunk"],
    "single-decode": ["decode"],
    "single-chunk": ["chunk"],
}


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(8, 2, 32, 4), (4, 4, 16, 16), (6, 1, 64, 8), (12, 1, 80, 16)])
def test_backend_matches_reference(backend, dtype, mix, heads, kv_heads, head_dim, block_size):
    # trial 0: full causal attention; 1 and 2: a sliding window (1 = only the token itself); 2 and 3 share
    # prefix blocks between sequences.
    for trial, window in enumerate([None, 1, 7, None]):
        if backend == "batch_invariant" and window is not None:
            continue
        rng = random.Random(f"{mix}-{heads}-{block_size}-{trial}")
        kinds = list(MIXES[mix])
        rng.shuffle(kinds)
        num_blocks = 64
        meta, num_tokens = random_batch(rng, kinds, block_size, num_blocks, share_prefix=trial >= 2,
                                       sliding_window=window)
        (ref_out, ref_caches), (out, caches) = run_both(backend, meta, num_tokens, heads, kv_heads, head_dim,
                                                        dtype, num_blocks, seed=trial)
        tol = TOLERANCE[dtype]
        for layer, (a, b) in enumerate(zip(ref_out, out, strict=True)):
            assert a.dtype == b.dtype == dtype and a.shape == b.shape == (num_tokens, heads, head_dim)
            diff = (a.float() - b.float()).abs().max().item()
            assert diff <= tol, f"trial {trial} layer {layer}: max |diff| {diff} (kinds {kinds})"
        for (rk, rv), (k, v) in zip(ref_caches, caches, strict=True):  # both wrote the same slots
            assert torch.equal(rk, k) and torch.equal(rv, v)


def test_reference_against_dense_attention():
    """torch_ref itself against plain causal attention on contiguous K/V (one prefill chunk after
    cached context, GQA, shuffled blocks)."""
    rng = random.Random(0)
    block_size, heads, kv_heads, d = 4, 6, 2, 8
    cached, q_len = 9, 6
    total = cached + q_len
    table = rng.sample(range(16), -(-total // block_size))
    k_all, v_all = torch.randn(total, kv_heads, d), torch.randn(total, kv_heads, d)
    q = torch.randn(q_len, heads, d)
    k_cache, v_cache = torch.zeros(16, block_size, kv_heads, d), torch.zeros(16, block_size, kv_heads, d)
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(total)])
    k_cache.view(-1, kv_heads, d)[slots[:cached]] = k_all[:cached]
    v_cache.view(-1, kv_heads, d)[slots[:cached]] = v_all[:cached]
    meta = AttentionMetadata(slots[cached:], torch.tensor([table]), torch.tensor([total]),
                             torch.tensor([0, q_len]), [q_len], [total], block_size)
    out = get_backend("torch_ref").forward(q, k_all[cached:], v_all[cached:], k_cache, v_cache, meta, d**-0.5)
    keys = k_all.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    values = v_all.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    scores = q.transpose(0, 1) @ keys.transpose(1, 2) * d**-0.5  # [H, Q, S]
    mask = torch.arange(total)[None, :] > torch.arange(cached, total)[:, None]
    expected = (scores.masked_fill(mask, float("-inf")).softmax(-1) @ values).transpose(0, 1)
    assert (out - expected).abs().max().item() <= 1e-5


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        get_backend("nope")


def _one_sequence(meta: AttentionMetadata, b: int, lo: int, hi: int) -> AttentionMetadata:
    """Metadata of query rows [lo, hi) of sequence b alone (its earlier rows already in the cache)."""
    start = int(meta.query_start_loc[b])
    ql = meta.query_lens[b]
    seq_len = meta.seq_lens_host[b] - ql + hi
    return AttentionMetadata(meta.slot_mapping[start + lo : start + hi], meta.block_tables[b : b + 1].clone(),
                             torch.tensor([seq_len]), torch.tensor([0, hi - lo]), [hi - lo], [seq_len],
                             meta.block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (12, 1, 80, 4)])
def test_batch_invariant_rows_are_the_same_bits_alone_and_in_chunks(dtype, heads, kv_heads, head_dim, block_size):
    """The strict mode's attention: a row's output is bit-identical whether its sequence runs in a mixed
    batch, alone, or with its new rows split into two chunks (both the tiled kernel, head_dim % 16 == 0,
    and the generic one)."""
    rng = random.Random(f"bi-{head_dim}")
    kinds = ["decode", "chunk", "prefill", "decode", "chunk", "prefill"]
    meta, T = random_batch(rng, kinds, block_size, 96, share_prefix=True)
    g = torch.Generator().manual_seed(7)
    shape = (96, block_size, kv_heads, head_dim)
    k_cache0 = torch.randn(shape, generator=g).to(dtype)
    v_cache0 = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(T, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype)
    be = make_backend("batch_invariant")
    kc, vc = k_cache0.clone(), v_cache0.clone()
    full = be.forward(q, k, v, kc, vc, _fresh_meta(meta), head_dim**-0.5)
    for b, ql in enumerate(meta.query_lens):
        start = int(meta.query_start_loc[b])
        for cut in sorted({ql, max(1, ql // 2)}):  # whole, then in two chunks
            kc, vc = k_cache0.clone(), v_cache0.clone()
            parts = []
            for lo, hi in ((0, cut), (cut, ql)):
                if lo == hi:
                    continue
                rows = slice(start + lo, start + hi)
                parts.append(be.forward(q[rows], k[rows], v[rows], kc, vc, _one_sequence(meta, b, lo, hi),
                                        head_dim**-0.5))
            assert torch.equal(torch.cat(parts), full[start : start + ql]), (b, cut)
