"""The scheduler: one token budget per step, no separate prefill and decode phases.

Every request only has `num_computed_tokens` catching up with its tokens. Each step, running requests
go first (a decode token each, or their next prefill chunk), then waiting requests in arrival order,
until the token budget (`max_num_batched_tokens`) or `max_num_seqs` is used up. A prompt larger than
what is left of the budget is prefilled in chunks over several steps. When blocks run out the newest
running request is preempted (blocks freed, recomputed later) and no new request is admitted that step.

Speculative decoding: a decoding request may carry draft tokens (`Request.spec_token_ids`). They count
against the token budget and get lookahead KV slots like any token; when the budget or the blocks fall
short, drafts are dropped before anything else (never a preemption for a guess). After the step, only the
accepted drafts count as computed, and the slots of rejected ones go back to the pool (`update`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # position of token_ids[0] (= num_computed_tokens before this step)
    block_table: list[int]
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    is_prefill: bool
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens, the tail of token_ids


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits admitted this step
    num_spec_tokens: int = 0  # draft tokens scheduled (part of num_scheduled_tokens and num_decode_tokens)
    # Multi-step (schedule's num_steps): every scheduled request decodes this many tokens in a row, the model
    # feeding each step's greedy token to the next; each has the slots for them. 1: one step as usual.
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    # ---- admission -------------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Reject a request that could never run, instead of leaving it waiting forever."""
        total = num_prompt_tokens + max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds max_model_len ({self.config.max_model_len})"
            )
        blocks = self.kv.blocks_needed(total)
        if blocks > self.kv.num_blocks:
            raise ValueError(
                f"prompt: this request needs {blocks} KV blocks ({total} tokens) but the whole cache has "
                f"{self.kv.num_blocks}; raise num_kv_blocks / kv_cache_memory_gb or lower max_tokens"
            )

    def add_request(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.max_tokens)
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self, num_steps: int = 1) -> SchedulerOutput:
        """The next step. num_steps > 1 (the engine's multi-step, asked only while every running request decodes
        greedily): when nobody waits and every running request decodes one token, each gets the slots of up to
        num_steps tokens (no more than its max_tokens leaves) and the step runs that many decode steps in a row
        (SchedulerOutput.num_steps); otherwise, or where the blocks for that are short, a step as usual."""
        out = SchedulerOutput()
        if num_steps > 1 and self._schedule_steps(out, num_steps):
            return out
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            spec = req.spec_token_ids[: budget - 1] if req.num_tokens - req.num_computed_tokens == 1 else []
            while self.kv.allocate_slots(req, num_new + len(spec)) is None:
                if spec:  # drop the guesses before taking anyone's blocks
                    spec = []
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._emit(req, num_new, out, spec)
                budget -= num_new + len(spec)
                i += 1
        return budget

    def _schedule_steps(self, out: SchedulerOutput, num_steps: int) -> bool:
        running = self.running
        if self.waiting or not running or len(running) > self.config.max_num_batched_tokens:
            return False
        if any(r.num_tokens - r.num_computed_tokens != 1 or r.spec_token_ids for r in running):
            return False
        n = min(num_steps, *(r.max_tokens - r.num_output_tokens for r in running))
        if n < 2:
            return False
        for i, req in enumerate(running):
            if self.kv.allocate_slots(req, n) is None:  # short of blocks: give back the lookahead, one step
                for r in running[:i]:
                    self.kv.trim(r, r.num_computed_tokens)
                return False
        for req in running:
            self._emit(req, 1, out)
        out.num_steps = n
        out.num_scheduled_tokens = out.num_decode_tokens = n * len(running)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the KV, keep the tokens, go back to the front of the queue."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        # The victim is the newest running request, so it was not scheduled earlier in this step.
        out.preempted.append(req.request_id)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            computed = self.kv.get_computed_blocks(req)
            num_cached = len(computed) * self.kv.block_size
            num_new = min(req.num_tokens - num_cached, budget)
            if self.kv.allocate_slots(req, num_new, computed) is None:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.kv.record_prefix_lookup(req.num_tokens, num_cached)
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.num_cached_tokens += num_cached
            self._emit(req, num_new, out)
            budget -= num_new

    def _emit(self, req: Request, num_new: int, out: SchedulerOutput, spec: list[int] | None = None) -> None:
        start = req.num_computed_tokens
        end = start + num_new
        is_prefill = start < req.num_prompt_tokens or end < req.num_tokens or num_new > 1
        spec = list(spec or ())
        out.scheduled.append(
            ScheduledRequest(
                request_id=req.request_id,
                token_ids=req.all_token_ids[start:end] + spec,
                start_pos=start,
                block_table=self.kv.block_table(req.request_id),
                sample=end == req.num_tokens,
                is_prefill=is_prefill,
                spec_token_ids=spec,
            )
        )
        out.num_scheduled_tokens += num_new + len(spec)
        out.num_spec_tokens += len(spec)
        if is_prefill:
            out.num_prefill_tokens += num_new
        else:
            out.num_decode_tokens += num_new + len(spec)

    # ---- after the model ran ---------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]], on_token=None) -> None:
        """Advance computed counts and append the sampled tokens: one per sampling request, or with drafts the
        accepted drafts and one more. Whether a request stops is decided by the engine (engine/stop.py):
        `on_token(request, index, token)` runs after each token is appended and returns True when the request
        finished (it then calls `finish`); the tokens after that one are dropped."""
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:
                continue
            tokens = sampled.get(s.request_id)
            if isinstance(tokens, int):
                tokens = [tokens]
            num_drafts = len(s.spec_token_ids)
            accepted = len(tokens) - 1 if tokens and num_drafts else 0
            if out.num_steps > 1:  # multi-step: the input token's K/V and each fed-back token's, one per token
                req.num_computed_tokens += len(tokens or ())
            else:
                req.num_computed_tokens += len(s.token_ids) - num_drafts + accepted
            req.spec_token_ids = []
            # Lookahead slots of rejected (or dropped) drafts go back; without drafts this frees nothing.
            self.kv.trim(req, req.num_computed_tokens)
            for i, token in enumerate(tokens or ()):
                req.append_output_token(token)
                if on_token is not None and on_token(req, i, token):
                    break

    def finish(self, req: Request, status: RequestStatus, keep_cached: bool = True) -> None:
        """Finish (or abort) a request in any state and free its blocks at once (keep_cached: see
        KVCacheManager.free)."""
        if req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req, keep_cached)
        self.kv.forget(req)
        self.requests.pop(req.request_id, None)
