"""The CUDA attention backend: Triton kernels over the paged KV cache (attention/triton_kernels.py).

A step's sequences are tiled once per step (in `prepare`'s first use, cached in the metadata): a decode
(one new token) is one tile; a prefill chunk is cut into tiles of query tokens. Decodes and prefill
chunks are two launches of the same kernel with different tile heights, so a decode does not pay a
prefill tile's rows. The K/V of the step are written through `slot_mapping` by a Triton kernel too.

A CUDA-graph decode step (worker/cuda_graph.py) hands in its own static tiles
(`meta.prepared["static_tiles"]`), so nothing here reads a host-side list while a graph is captured; the
kernel reads every length it needs from the device tensors.

Also runs on the CPU through Triton's interpreter (TRITON_INTERPRET=1), which is how the test suite
checks it against `torch_ref`; without a GPU and without the interpreter it refuses to start.
"""

from __future__ import annotations

import torch

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata


def _kernels():
    try:
        import pagedserve.attention.triton_kernels as triton_kernels
    except ImportError as e:  # no triton in this environment
        raise ValueError(f"attention_backend: 'triton' needs the triton package ({e})") from e
    return triton_kernels


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, kernels=None) -> None:
        super().__init__(kernels)  # the C++ CPU kernels are never used here
        self.tk = _kernels()

    def check_device(self, device: torch.device | str) -> None:
        """A ValueError unless the kernels can run for tensors on `device` (a GPU, or the interpreter)."""
        if torch.device(device).type == "cpu" and not self.tk.INTERPRETED:
            raise ValueError("attention_backend: 'triton' runs on a CUDA GPU; on the CPU only through Triton's "
                             "interpreter (TRITON_INTERPRET=1 set before start), which is for tests")

    def _tiles(self, meta: AttentionMetadata, group: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """[(tile sequence ids, tile first query tokens, query tokens per tile)] for this step, per launch;
        built at the first layer (they depend on the heads), not in `prepare`."""
        static = meta.prepared.get("static_tiles")
        if static is not None:
            return static
        key = ("triton_tiles", group)
        if key not in meta.prepared:
            dev = meta.slot_mapping.device
            launches = []
            decode_tokens = self.tk.tile_q_for(group, self.tk.MIN_ROWS)
            prefill_tokens = self.tk.tile_q_for(group, self.tk.PREFILL_ROWS)
            decodes = [i for i, n in enumerate(meta.query_lens) if n == 1]
            if decodes:
                launches.append((torch.tensor(decodes, dtype=torch.int32, device=dev),
                                 torch.zeros(len(decodes), dtype=torch.int32, device=dev), decode_tokens))
            seqs, starts = [], []
            for i, n in enumerate(meta.query_lens):
                if n > 1:
                    for t0 in range(0, n, prefill_tokens):
                        seqs.append(i)
                        starts.append(t0)
            if seqs:
                launches.append((torch.tensor(seqs, dtype=torch.int32, device=dev),
                                 torch.tensor(starts, dtype=torch.int32, device=dev), prefill_tokens))
            meta.prepared[key] = launches
        return meta.prepared[key]

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window=None,
                softcap=None) -> torch.Tensor:
        # Every sliding window is applied in the kernel (never dropped by a host-side length test, which a
        # captured graph could not redo).
        window = window if window is not None else meta.sliding_window
        if k is not None:  # None: the caller already wrote this step's K/V
            self.tk.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        group = q.shape[1] // k_cache.shape[2]
        for tile_seq, tile_q, tokens in self._tiles(meta, group):
            self.tk.paged_attention(q, out, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, tile_seq, tile_q, tokens, scale, window, softcap)
        return out
