"""The Speculator: which requests propose draft tokens this step, how many, and what came of them.

A request proposes when it is decoding (one token to compute), has room for the drafts (max_tokens,
max_model_len) and asks for nothing that drafts cannot carry yet (a grammar, penalties, min_tokens still
to go); the whole step proposes nothing while more than `disable_by_batch_size` requests run. With backoff,
a request whose drafts were all rejected twice in a row pauses for 2, 4, ... 64 steps.

The proposals go into `Request.spec_token_ids`; the scheduler budgets and allocates slots for them, the
target scores them in its step and the rejection sampler decides what is kept (engine.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedserve.core.request import Request, RequestStatus
from pagedserve.sampling.metadata import has_penalty
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.ngram import NgramProposer

MAX_PAUSE_STEPS = 64


@dataclass
class SpecDecodeStats:
    """Running totals, with vLLM's metric names (spec_decode_num_drafts etc.)."""

    num_drafts: int = 0  # proposals verified (one per request per step that had one)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at draft position i

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos))


@dataclass(slots=True)
class _Backoff:
    misses: int = 0  # proposals in a row that kept nothing
    paused_until: int = -1  # the step at which this request may propose again


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._backoff: dict[str, _Backoff] = {}
        self.last_propose_s = 0.0

    @classmethod
    def create(cls, config: SpeculativeConfig, engine) -> Speculator:
        if config.method == "ngram":
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            from pagedserve.spec_decode.draft_model import DraftModelProposer

            proposer = DraftModelProposer(config, engine.config, engine.model_config, engine.model_path,
                                          engine.dtype, engine.kv_manager.num_blocks, engine.kv_manager,
                                          engine.max_model_len)
        return cls(config, proposer)

    def _room(self, req: Request, max_model_len: int, constrained: bool) -> int:
        """How many drafts this request can take now (0: none)."""
        p = req.sampling_params
        if (req.status != RequestStatus.RUNNING or req.num_computed_tokens != req.num_tokens - 1 or constrained
                or has_penalty(p) or req.num_output_tokens < p.min_tokens):
            return 0
        # The step makes up to k + 1 tokens: never past max_tokens or max_model_len.
        return max(0, min(self.config.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1,
                          max_model_len - req.num_tokens - 1))

    def propose(self, running: list[Request], step: int, max_model_len: int, constrained) -> None:
        """Set `spec_token_ids` of the running requests that speculate this step. constrained(request_id):
        whether the request is under a grammar."""
        t0 = time.perf_counter()
        self.last_propose_s = 0.0
        limit = self.config.disable_by_batch_size
        if not running or (limit is not None and len(running) > limit):
            return
        batch = []
        for req in running:
            b = self._backoff.get(req.request_id)
            if b is not None and step < b.paused_until:
                continue
            k = self._room(req, max_model_len, constrained(req.request_id))
            if k > 0:
                batch.append((req, k))
        if batch:
            by_id = {req.request_id: (req, k) for req, k in batch}
            for rid, draft in self.proposer.propose(batch).items():
                req, k = by_id[rid]
                req.spec_token_ids = draft[:k]
        self.last_propose_s = time.perf_counter() - t0

    def on_verified(self, req: Request, num_drafts: int, num_accepted: int, step: int) -> None:
        """After the target's step, for each request that proposed (num_drafts 0: it was not scheduled, or
        its drafts were dropped for want of budget)."""
        self.proposer.on_verified(req, num_drafts, num_accepted)
        if not num_drafts:
            return
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_pos[i] += 1
        if not self.config.backoff:
            return
        b = self._backoff.setdefault(req.request_id, _Backoff())
        if num_accepted:
            b.misses = 0
        else:
            b.misses += 1
            if b.misses >= 2:
                b.paused_until = step + 1 + min(MAX_PAUSE_STEPS, 2 ** (b.misses - 1))

    def drop(self, request_id: str) -> None:
        self.proposer.drop(request_id)
        self._backoff.pop(request_id, None)
