"""Batched paged attention with no Python loop over requests.

Per step, sequences are split into two groups — decodes (one new token) and prefill chunks (several) —
so a long prefill does not pad every decode to its length. Decodes use a small C++ kernel that reads
K/V through the block table in place (pagedserve/kernels/csrc/attention.cpp); prefill chunks the C++ row
kernel (`paged_attention_rows`: each row over its own context in a fixed order, so chunking and batching
do not change a row); both take the layer's sliding window. Without the kernels, or with soft-capping
(Gemma 2), both gather each sequence's context through its block table in one indexing op, and a single
masked `scaled_dot_product_attention` call (GQA-aware) does the math (soft-capped: the same gather,
explicit scores). Index tensors are built once per step in `prepare`, masks once per step and window, and
reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata, effective_window, write_kv

_NO_ROWS = torch.empty(0, dtype=torch.long)


@dataclass(slots=True)
class _Group:
    token_index: torch.Tensor  # [G, max_q]: flat token index of each padded query slot
    q_pos: torch.Tensor  # [G, max_q]: position of each query slot (0 for padding)
    block_tables: torch.Tensor  # [G, num_blocks]
    out_rows: torch.Tensor  # flat token indices of the valid query slots, in padded order
    valid: torch.Tensor  # [G * max_q] indices of valid slots
    seq_lens: torch.Tensor  # [G]
    is_decode: bool
    q_start: torch.Tensor  # [G + 1]: offsets of each sequence's rows in q[out_rows]
    masks: dict  # window -> [G, 1, max_q, L] bool: key visible to query (gather path only), built on demand

    def mask(self, block_size: int, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            k_pos = torch.arange(self.block_tables.shape[1] * block_size, device=self.q_pos.device).view(1, 1, -1)
            q_pos = self.q_pos.unsqueeze(2)
            # Padded query slots have position 0: they look only at key 0 so their softmax stays finite.
            mask = (k_pos <= q_pos) & (k_pos < self.seq_lens.view(-1, 1, 1))
            if window is not None:
                mask &= k_pos > q_pos - window
            self.masks[window] = mask.unsqueeze(1)
        return self.masks[window]


def _build_group(meta: AttentionMetadata, seqs: list[int]) -> _Group:
    dev = meta.slot_mapping.device
    idx = torch.tensor(seqs, dtype=torch.long, device=dev)
    q_lens = torch.tensor([meta.query_lens[i] for i in seqs], dtype=torch.long, device=dev)
    seq_lens = meta.seq_lens[idx]
    max_q = max(meta.query_lens[i] for i in seqs)
    num_blocks = -(-max(meta.seq_lens_host[i] for i in seqs) // meta.block_size)
    j = torch.arange(max_q, device=dev)
    valid = j.unsqueeze(0) < q_lens.unsqueeze(1)
    token_index = torch.where(valid, meta.query_start_loc[idx].unsqueeze(1) + j, 0)
    return _Group(
        token_index=token_index,
        q_pos=torch.where(valid, (seq_lens - q_lens).unsqueeze(1) + j, 0),
        block_tables=meta.block_tables[idx, :num_blocks].contiguous(),
        out_rows=token_index[valid],
        valid=valid.flatten().nonzero().squeeze(1),
        seq_lens=seq_lens,
        is_decode=max_q == 1,
        q_start=torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0)]),
        masks={},
    )


class BatchedGatherBackend(AttentionBackend):
    """Decodes go to the C++ kernel that reads the paged cache in place, prefill chunks to the C++ row kernel, both
    with the layer's sliding window (when the kernels could be built and there is no soft-capping); otherwise the
    gather + SDPA path."""

    name = "batched"

    def runs_decode_kernel(self, meta: AttentionMetadata) -> bool:
        return (
            self.kernels is not None
            and meta.slot_mapping.device.type == "cpu"
            and all(q == 1 for q in meta.query_lens)
        )

    def prepare(self, meta: AttentionMetadata) -> None:
        decodes = [i for i, q in enumerate(meta.query_lens) if q == 1]
        prefills = [i for i, q in enumerate(meta.query_lens) if q > 1]
        meta.prepared["groups"] = [_build_group(meta, g) for g in (decodes, prefills) if g]

    def _kernels_apply(self, meta: AttentionMetadata, softcap: float | None) -> bool:
        """The step runs the C++ kernels: they are built, the step is on the CPU, and no soft-capping."""
        return self.kernels is not None and meta.slot_mapping.device.type == "cpu" and softcap is None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window=None,
                softcap=None) -> torch.Tensor:
        window = effective_window(meta, window)
        if k is not None:  # None: the caller already wrote this step's K/V (the fused rotary kernel)
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if "groups" not in meta.prepared:
            self.prepare(meta)
        groups = meta.prepared["groups"]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_heads, head_dim = q.shape[1], q.shape[2]
        # The kernels have no soft-capping: that takes the gather path.
        use_kernel = self._kernels_apply(meta, softcap)
        for g in groups:
            if g.is_decode and use_kernel:
                # Reads each query row of q in place and writes its output row of `out`; a batch of only
                # decodes needs no row index at all.
                rows = _NO_ROWS if len(groups) == 1 else g.out_rows
                self.kernels.paged_decode_attention(q, k_cache, v_cache, g.block_tables, g.seq_lens, rows, out, scale,
                                                    window)
                continue
            if use_kernel:
                # Prefill chunks: the C++ row kernel (the strict mode's): every row over its own context,
                # so a prompt's rows come out the same however it is chunked or batched, and the masked
                # half of causal attention is never computed.
                if len(groups) == 1:  # every row of the step, in order: q read in place, no copy back
                    return self.kernels.paged_attention_rows(q, k_cache, v_cache, g.block_tables, g.seq_lens,
                                                             g.q_start, scale, window)
                # Among decode rows: the kernel reads its rows of q and writes its rows of `out` in place.
                self.kernels.paged_attention_rows_into(q, k_cache, v_cache, g.block_tables, g.seq_lens, g.q_start,
                                                       g.out_rows, out, scale, window)
                continue
            G, max_q = g.token_index.shape
            keys = k_cache[g.block_tables].flatten(1, 2).transpose(1, 2)  # [G, KVH, L, D]
            values = v_cache[g.block_tables].flatten(1, 2).transpose(1, 2)
            queries = q[g.token_index].transpose(1, 2)  # [G, H, max_q, D]
            mask = g.mask(meta.block_size, window)
            if softcap is None:
                res = F.scaled_dot_product_attention(
                    queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
                )
            else:
                res = _softcapped_attention(queries, keys, values, mask, scale, softcap)
            res = res.transpose(1, 2).reshape(G * max_q, num_heads, head_dim)
            out[g.out_rows] = res[g.valid]
        return out


def _softcapped_attention(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """Gemma 2's attention ([G, H, Q, D] queries, [G, KVH, L, D] keys/values): float32 scores, capped
    (softcap * tanh(s / softcap)), masked, softmax, times values; cast back to q's dtype."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v).to(q.dtype)


class BatchInvariantBackend(BatchedGatherBackend):
    """Strict batch invariance (`EngineConfig.batch_invariant`): every query row, prefill or decode, runs
    the C++ row kernel (`paged_attention_rows`, csrc/attention.cpp) over its own context (its position + 1
    keys, read through the block table in block order, an exact float32 softmax).

    A row's arithmetic depends on nothing but its own context, so its output does not depend on the other
    rows of the step, on how its prompt was chunked, or on whether its prefix came from the cache (K/V
    are read from the cache, where this step's were written first). Rows of one prompt share the K/V
    reads in tiles. A layer's sliding window limits each row to its last `window` positions. Needs the kernels; no
    soft-capping."""

    name = "batch_invariant"
    row_invariant = True

    def prepare(self, meta: AttentionMetadata) -> None:
        if self.kernels is None:
            raise ValueError("batch_invariant: the attention needs the C++ kernels")

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window=None,
                softcap=None) -> torch.Tensor:
        if softcap is not None:
            raise ValueError("batch_invariant: attention soft-capping is not supported in the strict mode")
        if k is not None:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        self.prepare(meta)
        return self.kernels.paged_attention_rows(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                                 meta.query_start_loc, scale, effective_window(meta, window))
