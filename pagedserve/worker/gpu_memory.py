"""Sizing the KV cache from GPU memory, as vLLM does: load the weights, run one warm-up step at the
step's token budget on a throw-away cache, measure its peak activation memory, then give the KV cache
what `gpu_memory_utilization` of the GPU leaves (core/kv_math.GpuMemoryPlan).

The measuring goes through a small `MemoryStats` interface (CUDA's allocator statistics on a GPU), so the
warm-up step and the arithmetic run, and are tested, on the CPU too.
"""

from __future__ import annotations

import torch

from pagedserve.attention import AttentionBackend, AttentionMetadata
from pagedserve.core.kv_math import GpuMemoryPlan, blocks_for_tokens
from pagedserve.model.config import ModelConfig
from pagedserve.worker.kv_cache import allocate_kv_cache


class CudaMemory:
    """The allocator statistics of one CUDA device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def total_and_free(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return total, free

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def release(self) -> None:
        torch.cuda.empty_cache()


@torch.inference_mode()
def warm_up_step(model, backend: AttentionBackend, cfg: ModelConfig, num_tokens: int, num_seqs: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """One prefill step of `num_tokens` tokens in `num_seqs` sequences (the step budget and the most
    sequences a step holds) on a cache just big enough for it; the float32 logits of each sequence's last
    token (what the sampler then reads). The cache is dropped on return."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lens = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
    per_seq = [blocks_for_tokens(n, block_size) for n in lens]
    caches = allocate_kv_cache(cfg, sum(per_seq), block_size, dtype, device)
    width = max(per_seq)
    tables, first = [], 0
    for n in per_seq:
        tables.append(list(range(first, first + n)) + [0] * (width - n))
        first += n
    positions = torch.cat([torch.arange(n) for n in lens])
    seq_index = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(lens))
    block_tables = torch.tensor(tables, dtype=torch.long)
    slots = block_tables[seq_index, positions // block_size] * block_size + positions % block_size
    starts = torch.tensor([0, *lens]).cumsum(0)
    meta = AttentionMetadata(slot_mapping=slots.to(device), block_tables=block_tables.to(device),
                             seq_lens=torch.tensor(lens, device=device), query_start_loc=starts.to(device),
                             query_lens=lens, seq_lens_host=lens, block_size=block_size)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    return model(input_ids, positions.to(device), caches, backend, meta, (starts[1:] - 1).to(device))


def plan_kv_cache(model, backend: AttentionBackend, cfg: ModelConfig, *, weight_bytes: int, utilization: float,
                  num_tokens: int, num_seqs: int, block_size: int, dtype: torch.dtype, device, memory) -> GpuMemoryPlan:
    """Measure a warm-up step's peak activation memory (above what was allocated before it, the weights)
    and share the GPU's memory out. The sampler's working set is counted by softmax-sorting the logits
    as top-p sampling does."""
    memory.release()
    before = memory.allocated()
    memory.reset_peak()
    logits = warm_up_step(model, backend, cfg, num_tokens, num_seqs, block_size, dtype, device)
    probs, _ = logits.softmax(-1).sort(dim=-1, descending=True)
    probs.cumsum(-1)
    del logits, probs
    peak = max(0, memory.peak() - before)
    memory.release()
    total, free = memory.total_and_free()
    # In use on the device but not by this engine's tensors: the CUDA context, other processes.
    other = max(0, (total - free) - memory.reserved())
    return GpuMemoryPlan(total=total, utilization=utilization, weights=weight_bytes, peak_activation=peak,
                         other=other)
