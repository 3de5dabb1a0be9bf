"""Triton kernels over the paged KV cache (the CUDA attention backend's, attention/triton_backend.py).

- `write_kv`: a step's K/V ([T, KVH, D]) into the caches ([num_blocks, block_size, KVH, D]) through
  `slot_mapping`; a negative slot is skipped (the padded rows of a CUDA-graph decode step).
- `paged_attention`: one kernel for decode, prefill and mixed steps. A program takes a tile of a
  sequence's query tokens and one KV head, with every query head of that KV head's group as extra rows
  (GQA: the group shares each K/V load), and walks the sequence's keys through its block table with an
  online softmax (flash attention): causal, an optional sliding window and soft-capping, prefix-cache
  hits included (the context is whatever the block table holds before the new tokens). Loop bounds are
  read inside the kernel, so a decode step launches with a grid that depends only on its batch size
  (CUDA graphs replay it with new inputs).

They run natively on a GPU, and on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before
Triton is imported), where the test suite checks them against `torch_ref`. The interpreter's `tl.dot`
mishandles bfloat16 operands (Triton 3.6), so there the operands are widened to float32 first
(`UPCAST`); on a GPU bf16 operands go to the tensor cores with float32 accumulation, and float32 operands
use full-precision ("ieee") products, never TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.envs import triton_interpret

# Query rows per program: the query tokens of a tile times the (padded) heads of a GQA group. tl.dot
# needs at least 16 rows on a GPU.
MIN_ROWS = 16
PREFILL_ROWS = 64
KEYS_PER_ITER = 64  # keys loaded per inner iteration (several KV blocks, through the block table)


INTERPRETED = triton_interpret()  # as Triton saw it when it decorated the kernels below


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slots, stride_kt, stride_kh, stride_vt, stride_vh,
                     KVH: tl.constexpr, D: tl.constexpr, KVH_PAD: tl.constexpr, D_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    if slot >= 0:
        h = tl.arange(0, KVH_PAD)
        d = tl.arange(0, D_PAD)
        mask = (h[:, None] < KVH) & (d[None, :] < D)
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        dst = slot.to(tl.int64) * (KVH * D) + h[:, None] * D + d[None, :]
        tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
        tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KVH, D] (rows may be strided, the last dim contiguous); caches contiguous."""
    num_tokens, kvh, d = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        KVH=kvh, D=d, KVH_PAD=triton.next_power_of_2(kvh), D_PAD=triton.next_power_of_2(d))


@triton.jit
def _attend_keys(q, m_i, l_i, acc, start, hi, pos, seq, kvh, d, d_ok, k_cache, v_cache, block_tables, stride_bt,
                 scale, softcap, window, KVH: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Keys [start, start + BLOCK_N) (those < hi) folded into the running softmax (m_i, l_i, acc)."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    block = tl.load(block_tables + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
    kv_off = slot[:, None] * (KVH * D) + kvh * D + d[None, :]
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh written with exp (no libdevice needed)
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    visible = n_ok[None, :] & (n[None, :] <= pos[:, None])
    if HAS_WINDOW:
        visible = visible & (n[None, :] > pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet stays at 0
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tile_seq, tile_q,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, scale, softcap, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TILE_Q: tl.constexpr, KVH: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq + tile)
    q0 = tl.load(tile_q + tile)  # the tile's first query token, within its sequence's new tokens
    q_begin = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_begin
    seq_len = tl.load(seq_lens + seq)
    first_pos = seq_len - q_len  # position of the sequence's first new token

    ROWS: tl.constexpr = TILE_Q * GROUP_PAD
    r = tl.arange(0, ROWS)
    qi = q0 + r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    tok = (q_begin + qi).to(tl.int64)
    pos = first_pos + qi
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D_PAD], dtype=tl.float32)
    # Keys [lo, hi): up to the tile's last valid position (causal), from the window's start.
    last = tl.minimum(q0 + TILE_Q, q_len) - 1
    hi = tl.minimum(first_pos + last + 1, seq_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos + q0 - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if INTERPRETER:  # the interpreter cannot take a loaded length as a range() bound
        start = lo
        while start < hi:
            m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, start, hi, pos, seq, kvh, d, d_ok, k_cache, v_cache,
                                         block_tables, stride_bt, scale, softcap, window, KVH, D, BLOCK_SIZE,
                                         BLOCK_N, HAS_WINDOW, HAS_SOFTCAP, UPCAST, PRECISION)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, start, hi, pos, seq, kvh, d, d_ok, k_cache, v_cache,
                                         block_tables, stride_bt, scale, softcap, window, KVH, D, BLOCK_SIZE,
                                         BLOCK_N, HAS_WINDOW, HAS_SOFTCAP, UPCAST, PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def tile_q_for(group: int, rows: int) -> int:
    """Query tokens per tile so that tokens × padded group heads make `rows` (at least one token)."""
    return max(1, rows // triton.next_power_of_2(group))


def paged_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    tile_seq: torch.Tensor, tile_q: torch.Tensor, tile_tokens: int, scale: float,
                    window: int | None = None, softcap: float | None = None) -> None:
    """Attention of the tiles (tile_seq[i]: a sequence, tile_q[i]: its first query token in the tile,
    `tile_tokens` query tokens each) into `out` ([T, H, D], rows of other sequences untouched).

    q, out: [T, H, D] (rows may be strided, the last dim contiguous); caches [num_blocks, block_size,
    KVH, D], contiguous; block_tables [B, max_blocks]; seq_lens [B]; query_start_loc [B + 1]."""
    num_tiles = tile_seq.shape[0]
    if num_tiles == 0:
        return
    _, num_heads, head_dim = q.shape
    _, block_size, kvh, _ = k_cache.shape
    group = num_heads // kvh
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    upcast = INTERPRETED
    precision = "ieee" if upcast or q.dtype == torch.float32 else "tf32"  # tf32 is unused for bf16 operands
    _paged_attention_kernel[(num_tiles, kvh)](
        q, out, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tile_seq, tile_q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        scale, softcap if softcap is not None else 1.0, window if window is not None else 0,
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), TILE_Q=tile_tokens, KVH=kvh,
        D=head_dim, D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, BLOCK_N=KEYS_PER_ITER,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, UPCAST=upcast, PRECISION=precision,
        INTERPRETER=INTERPRETED,
    )
