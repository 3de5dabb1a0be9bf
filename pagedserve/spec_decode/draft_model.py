"""Draft-model proposals: a smaller model with the same vocabulary guesses the next K tokens greedily.

The draft runs inside the engine, with its own ModelRunner and its own paged KV cache tensors, indexed by
the target's block tables: a block id means the same token positions in both caches, so the draft needs
no block manager of its own. Before it writes ahead of the target (its own guesses d1..d(K-1)), it asks
the target's KV cache manager for those lookahead slots; the target's verification step then uses them,
and the update frees the ones whose guesses were rejected.

Each request keeps how many of its positions hold valid draft K/V (`computed`). A proposal first feeds the
draft every real token it has not seen (the whole prompt the first time), then one guess per pass; after
verification only the positions of accepted tokens stay valid. Preemption frees the blocks, so the draft
starts over. Every pass batches all the requests that propose this step.

The draft proposes greedily (its argmax): a deterministic proposal, which rejection sampling accepts
with probability p_target(token), so sampling keeps the target's distribution exactly (as vLLM's
rejection sampler does for drafts given without probabilities).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_math import human_bytes
from pagedserve.core.request import Request
from pagedserve.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedserve.model.config import ModelConfig
from pagedserve.sampling.metadata import SamplingMetadata
from pagedserve.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("pagedserve")


@dataclass(slots=True)
class _DraftState:
    computed: int = 0  # leading positions whose draft K/V is valid
    base: int = 0  # the sequence's length when the last proposal was made
    preemptions: int = 0  # the request's preemption count then (a preemption frees the blocks)


def greedy_metadata(num_rows: int) -> SamplingMetadata:
    return SamplingMetadata(num_rows=num_rows, all_greedy=True, all_plain_greedy=True, greedy=None,
                            temperature=None, top_k=None, top_p=None, min_p=None, generators=[None] * num_rows,
                            num_logprobs=[None] * num_rows)


def truncate_layers(model: nn.Module, cfg: ModelConfig, num_layers: int) -> ModelConfig:
    """Keep the model's first `num_layers` decoder layers (its embedding, final norm and head stay)."""
    if num_layers > cfg.num_layers:
        raise ValueError(f"speculative_config.draft_num_layers: {num_layers} exceeds the draft model's "
                         f"{cfg.num_layers} layers")
    model.layers = nn.ModuleList(list(model.layers)[:num_layers])
    cfg = dataclasses.replace(cfg, num_layers=num_layers,
                              layer_types=None if cfg.layer_types is None else cfg.layer_types[:num_layers])
    model.config = cfg
    return cfg


class DraftModelProposer:
    def __init__(self, spec: SpeculativeConfig, config, target_cfg: ModelConfig, target_path: str,
                 dtype: torch.dtype, num_blocks: int, kv: KVCacheManager, max_model_len: int) -> None:
        # Imported here: the worker imports the model stack, which the n-gram path never needs.
        from pagedserve.kernels import CpuKernels
        from pagedserve.model.loader import load_model
        from pagedserve.worker.kv_cache import allocate_kv_cache
        from pagedserve.worker.model_runner import ModelRunner

        kernels = CpuKernels.from_config(config) if config.gguf_in_place else None
        source = spec.model if spec.model is not None else target_path
        try:
            loaded = load_model(source, dtype, config.device, kernels=kernels)
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        cfg = loaded.config
        if spec.draft_num_layers is not None:
            cfg = truncate_layers(loaded.model, cfg, spec.draft_num_layers)
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({cfg.vocab_size} tokens) is not "
                             f"the target's ({target_cfg.vocab_size}); a draft model needs the same tokenizer")
        if cfg.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model: the draft's context ({cfg.max_position_embeddings}) is "
                             f"shorter than max_model_len ({max_model_len})")
        self.config = cfg
        self.kv = kv
        self.kv_caches = allocate_kv_cache(cfg, num_blocks, config.block_size, dtype, config.device,
                                          config.huge_pages)
        self.runner = ModelRunner(loaded.model, self.kv_caches, config, loaded.gguf_blocks)
        elem = torch.tensor([], dtype=dtype).element_size()
        cache_bytes = 2 * cfg.num_layers * num_blocks * config.block_size * cfg.num_kv_heads * cfg.head_dim * elem
        logger.info("draft model: %d layers (%s), %s of weights, its KV cache %s (%d blocks, the target's ids)",
                    cfg.num_layers, source if spec.model else "the target's first layers",
                    human_bytes(loaded.model.weight_bytes()), human_bytes(cache_bytes), num_blocks)
        self._state: dict[str, _DraftState] = {}

    def propose(self, batch: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """batch: (request, most tokens to propose) → request id → its k guesses."""
        work: list[tuple[Request, int, _DraftState]] = []
        for req, k in batch:
            st = self._state.get(req.request_id)
            if st is None or st.preemptions != req.num_preemptions:
                st = self._state[req.request_id] = _DraftState(preemptions=req.num_preemptions)
            # The draft writes positions up to num_tokens + k - 2 (the last real token, then its own guesses
            # but the last); the target's verification uses one more, which its schedule allocates. These
            # lookahead slots are not offered to the prefix cache: their K/V is not written yet.
            if self.kv.allocate_slots(req, k, cache=False) is None:
                continue  # blocks are short: no proposal (never a preemption for a guess)
            st.base = req.num_tokens
            work.append((req, k, st))
        if not work:
            return {}
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _, _ in work}
        wanted = {req.request_id: k for req, k, _ in work}
        # Pass 1: every real token the draft has not seen; then one guess per pass.
        step = [(req, req.all_token_ids[st.computed :], st.computed) for req, _, st in work]
        for j in range(max(k for _, k, _ in work)):
            tokens = self._run(step)
            nxt = []
            for (req, fed, start), tok in zip(step, tokens, strict=True):
                st = self._state[req.request_id]
                st.computed = start + len(fed)
                drafts[req.request_id].append(tok)
                if j + 1 < wanted[req.request_id]:
                    nxt.append((req, [tok], st.computed))
            step = nxt
            if not step:
                break
        return drafts

    def _run(self, step: list[tuple[Request, list[int], int]]) -> list[int]:
        sched = SchedulerOutput(scheduled=[
            ScheduledRequest(req.request_id, fed, start, self.kv.block_table(req.request_id), True, len(fed) > 1)
            for req, fed, start in step
        ])
        return self.runner.execute(sched, greedy_metadata(len(step))).token_ids

    def on_verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """After the target's step: only the positions of real tokens keep valid draft K/V."""
        st = self._state.get(req.request_id)
        if st is not None:
            st.computed = min(st.computed, st.base + num_accepted)

    def drop(self, request_id: str) -> None:
        self._state.pop(request_id, None)
