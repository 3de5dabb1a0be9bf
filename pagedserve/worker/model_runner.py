"""SchedulerOutput → flat tensors → model → logits of each sampling request's last token.

The flat batch concatenates every scheduled request's new tokens. Positions and slot mappings are
computed with tensor ops from per-request (start, length) pairs, not per token in Python.
"""

from __future__ import annotations

import torch

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.model.llama import KVCache, LlamaForCausalLM


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCache,
        backend: AttentionBackend,
        block_size: int,
        device: str = "cpu",
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = device

    def prepare_inputs(self, out: SchedulerOutput):
        sched = out.scheduled
        query_lens = [len(s.token_ids) for s in sched]
        starts = [s.start_pos for s in sched]
        seq_lens = [a + b for a, b in zip(starts, query_lens, strict=True)]
        num_tokens = sum(query_lens)
        input_ids = torch.tensor([t for s in sched for t in s.token_ids], dtype=torch.long)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        query_start_loc = torch.zeros(len(sched) + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        # position of token t of sequence i = start_i + (t - query_start_i)
        offsets = torch.repeat_interleave(torch.tensor(starts, dtype=torch.long) - query_start_loc[:-1], q_lens)
        positions = torch.arange(num_tokens, dtype=torch.long) + offsets
        max_blocks = max(len(s.block_table) for s in sched)
        block_tables = torch.zeros(len(sched), max_blocks, dtype=torch.long)
        for i, s in enumerate(sched):
            block_tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(len(sched)), q_lens)
        slot_mapping = block_tables[seq_index, positions // self.block_size] * self.block_size + (
            positions % self.block_size
        )
        sample_rows = [i for i, s in enumerate(sched) if s.sample]
        logits_indices = query_start_loc[1:][sample_rows] - 1
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            block_tables=block_tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            query_start_loc=query_start_loc.to(dev),
            query_lens=query_lens,
            seq_lens_host=seq_lens,
            block_size=self.block_size,
        )
        return input_ids.to(dev), positions.to(dev), meta, logits_indices.to(dev), sample_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Logits [num_sampling_requests, vocab] and which scheduled rows they belong to."""
        input_ids, positions, meta, logits_indices, sample_rows = self.prepare_inputs(out)
        logits = self.model(input_ids, positions, self.kv_caches, self.backend, meta, logits_indices)
        return logits, sample_rows
