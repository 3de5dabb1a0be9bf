"""The physical paged KV cache: per layer, K and V tensors of shape [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

import torch

from pagedserve.model.config import ModelConfig


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_layers)
    ]
