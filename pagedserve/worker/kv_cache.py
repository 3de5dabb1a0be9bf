"""The physical paged KV cache: per layer, K and V tensors of shape [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import torch

from pagedserve.kernels import huge_pages as hp
from pagedserve.model.config import ModelConfig


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str = "cpu",
    huge_pages: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """huge_pages (on the CPU): each tensor in memory the OS may back with 2 MB pages (kernels/huge_pages.py)."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)

    def zeros() -> torch.Tensor:
        if huge_pages and torch.device(device).type == "cpu":
            return hp.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    return [(zeros(), zeros()) for _ in range(cfg.num_layers)]
