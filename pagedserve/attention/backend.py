"""The attention seam: a backend prepares per-step metadata once, then runs attention per layer.

The model never sees requests: `slot_mapping` (where each new token's K/V goes) and `block_tables`
(where each sequence's earlier K/V lives) are the only ties between a token and the paged KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pagedserve.kernels import CpuKernels


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step of a flat batch of B sequences and T new tokens."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block_id * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padded with 0; seq_lens says what is real)
    seq_lens: torch.Tensor  # [B] int64: context length after this step (computed + new tokens)
    query_start_loc: torch.Tensor  # [B + 1] int64: offsets of each sequence's new tokens in the flat batch
    query_lens: list[int]  # host copies, for backends that need shapes without a device sync
    seq_lens_host: list[int]
    block_size: int
    # The step's default attention window (a token sees only the last `sliding_window` positions, itself
    # included) for layers that pass none; None: full causal attention. Models pass each layer's own
    # window to `forward` instead (Gemma interleaves sliding and global layers).
    sliding_window: int | None = None
    prepared: dict[str, Any] = field(default_factory=dict)  # backend-specific, built once per step

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's K/V ([T, KVH, D]) into the paged caches ([num_blocks, block_size, KVH, D])."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def effective_window(meta: AttentionMetadata, window: int | None) -> int | None:
    """The window that changes something this step: None when no sequence is longer than the window
    (every key of every row is then inside it), so the window-free kernels give the same result."""
    window = window if window is not None else meta.sliding_window
    if window is None or max(meta.seq_lens_host, default=0) <= window:
        return None
    return window


class AttentionBackend:
    """Base class. `forward` writes the new K/V into the cache (unless k and v are None: the caller wrote
    them already) and returns attention output [T, H, D]. q's rows may be strided (a view of qkv).

    Per layer: `window` (sliding-window attention: a row sees its last `window` positions; None: the
    metadata's default) and `softcap` (scores -> softcap * tanh(scores / softcap) before the mask and the
    softmax, Gemma 2)."""

    name = "base"
    # Every query row's attention is computed by the strict mode's row kernel (paged_attention_rows), so a
    # fused whole-model kernel (DecodeStack) must use that kernel too.
    row_invariant = False

    def __init__(self, kernels: CpuKernels | None = None) -> None:
        self.kernels = kernels

    def runs_decode_kernel(self, meta: AttentionMetadata) -> bool:
        """Whether this step's attention is the C++ paged decode kernel (every sequence decodes one token),
        so a fused whole-model kernel that calls it (DecodeStack) computes what this backend would."""
        return False

    def check_device(self, device: torch.device | str) -> None:
        """A ValueError unless this backend can run for tensors on `device` (called once, at start-up)."""

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step, before the first layer: build whatever index tensors are reused."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError
