"""Reference attention over the paged KV cache: one sequence at a time, exact float32 math.

Slow on purpose: every fast backend is tested against this one.
"""

from __future__ import annotations

import torch

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata, effective_window, write_kv


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` cached tokens of one sequence, in logical order: [seq_len, KVH, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:seq_len]


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window=None,
                softcap=None) -> torch.Tensor:
        window = effective_window(meta, window)
        if k is not None:  # None: the caller already wrote this step's K/V
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_host, strict=True)):
            keys = gather_context(k_cache, meta.block_tables[i], seq_len).float()
            values = gather_context(v_cache, meta.block_tables[i], seq_len).float()
            keys = keys.repeat_interleave(group, dim=1)  # [S, H, D]
            values = values.repeat_interleave(group, dim=1)
            qs = q[start : start + q_len].float()  # [Q, H, D]
            scores = torch.einsum("qhd,shd->hqs", qs, keys) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            # New tokens are the last q_len positions of the context: token i sees keys 0..pos_i.
            q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
            k_pos = torch.arange(seq_len).unsqueeze(0)
            hidden = k_pos > q_pos
            if window is not None:
                hidden |= k_pos <= q_pos - window
            scores = scores.masked_fill(hidden, float("-inf"))
            probs = scores.softmax(dim=-1)
            out[start : start + q_len] = torch.einsum("hqs,shd->qhd", probs, values).to(q.dtype)
            start += q_len
        return out
