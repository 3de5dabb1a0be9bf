"""CUDA graphs for decode steps: the whole model forward of a decode step, captured once per batch size
and replayed with new inputs (vLLM's cudagraph mode for decode).

A step whose rows are all one-token decodes (draft verifications unfold into such rows too), with at most
the largest captured batch, runs through a graph: its inputs are copied into static buffers, padded up to
the next captured size, and the graph is replayed. Padded rows write no K/V (slot -1, skipped by the
Triton K/V write) and attend to nothing (sequence length 0); their logits are dropped. Everything the
attention kernels need comes from device tensors (the Triton backend reads the static tiles handed in
`meta.prepared["static_tiles"]`, never a host list), so a replay computes what an eager step would.

`capture` is CUDA's by default; the tests pass an eager stand-in (replay = run the same function over the
same static buffers), which checks the buffers, the padding and the slicing on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pagedserve.attention import AttentionMetadata

logger = logging.getLogger("pagedserve")

MAX_DEFAULT_SIZE = 256


def default_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (at most 256), and max_num_seqs itself."""
    top = min(max_num_seqs, MAX_DEFAULT_SIZE)
    sizes = {n for n in (1, 2, 4, 8) if n <= top} | set(range(16, top + 1, 8)) | {top}
    return tuple(sorted(sizes))


def cuda_capture(pool=None) -> Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]:
    """fn -> (replay, the output tensor the replays refill): one warm-up run (compiles the Triton kernels),
    then torch.cuda.graph capture. Graphs share one memory pool."""

    def capture(fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph.replay, out

    return capture


def eager_capture(fn):
    """The CPU stand-in: a replay runs fn again on the same static buffers and refills the output."""
    out = fn()

    def replay():
        out.copy_(fn())

    return replay, out


class DecodeGraphs:
    def __init__(self, model, kv_caches, backend, sizes: tuple[int, ...], max_blocks: int, block_size: int,
                 device: torch.device | str, capture=None) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sizes = tuple(sorted(sizes))
        self.max_blocks = max_blocks
        self.block_size = block_size
        n = self.sizes[-1]
        dev = torch.device(device)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.long, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.long, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.long, device=dev)
        self.tile_seq = torch.arange(n, dtype=torch.int32, device=dev)
        self.tile_q = torch.zeros(n, dtype=torch.int32, device=dev)
        self.capture = capture or cuda_capture(torch.cuda.graph_pool_handle())
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.replays = 0  # steps served from a graph (tests and the log read it)
        self.padded_rows = 0

    def _meta(self, size: int) -> AttentionMetadata:
        group = self.model.config.num_heads // self.kv_caches[0][0].shape[2]
        tokens = self.backend.tk.tile_q_for(group, self.backend.tk.MIN_ROWS)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[: size + 1],
            query_lens=[1] * size, seq_lens_host=[self.max_blocks * self.block_size] * size,
            block_size=self.block_size,
            prepared={"static_tiles": [(self.tile_seq[:size], self.tile_q[:size], tokens)]})

    def capture_all(self) -> None:
        """Capture every size, largest first (the smaller graphs reuse the pool's memory)."""
        for size in reversed(self.sizes):
            meta = self._meta(size)

            def fn(size=size, meta=meta):
                return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self.backend, meta,
                                  self.logits_indices[:size])

            self.graphs[size] = self.capture(fn)
        logger.info("CUDA graphs captured for decode batch sizes %s", ", ".join(map(str, self.sizes)))

    def can_run(self, inputs) -> bool:
        _, _, meta, logits_indices = inputs
        rows = meta.num_seqs
        return (0 < rows <= self.sizes[-1] and all(q == 1 for q in meta.query_lens)
                and logits_indices.shape[0] == rows  # every row samples: the indices are 0..rows-1
                and meta.block_tables.shape[1] <= self.max_blocks)

    def run(self, inputs) -> torch.Tensor:
        input_ids, positions, meta, _ = inputs
        rows = meta.num_seqs
        size = next(s for s in self.sizes if s >= rows)
        width = meta.block_tables.shape[1]
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.slot_mapping[rows:size].fill_(-1)
        self.block_tables[:rows, :width].copy_(meta.block_tables)
        self.seq_lens[:rows].copy_(meta.seq_lens)
        self.seq_lens[rows:size].zero_()
        replay, out = self.graphs[size]
        replay()
        self.replays += 1
        self.padded_rows += size - rows
        return out[:rows].clone()
