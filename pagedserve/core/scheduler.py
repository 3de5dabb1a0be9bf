"""The scheduler: one token budget per step, no separate prefill and decode phases.

Every request only has `num_computed_tokens` catching up with its tokens. Each step, running requests
go first (a decode token each, or their next prefill chunk), then waiting requests in arrival order,
until the token budget (`max_num_batched_tokens`) or `max_num_seqs` is used up. A prompt larger than
what is left of the budget is prefilled in chunks over several steps. When blocks run out the newest
running request is preempted (blocks freed, recomputed later) and no new request is admitted that step.
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


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits admitted this step

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
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
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
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._emit(req, num_new, out)
                budget -= num_new
                i += 1
        return budget

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the KV, keep the tokens, go back to the front of the queue."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
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

    def _emit(self, req: Request, num_new: int, out: SchedulerOutput) -> None:
        start = req.num_computed_tokens
        end = start + num_new
        is_prefill = start < req.num_prompt_tokens or end < req.num_tokens or num_new > 1
        out.scheduled.append(
            ScheduledRequest(
                request_id=req.request_id,
                token_ids=req.all_token_ids[start:end],
                start_pos=start,
                block_table=self.kv.block_table(req.request_id),
                sample=end == req.num_tokens,
                is_prefill=is_prefill,
            )
        )
        out.num_scheduled_tokens += num_new
        if is_prefill:
            out.num_prefill_tokens += num_new
        else:
            out.num_decode_tokens += num_new

    # ---- after the model ran ---------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Advance computed counts and append the sampled tokens. Whether a request stops is decided by
        the engine (engine/stop.py), which then calls `finish`."""
        for s in out.scheduled:
            req = self.requests[s.request_id]
            req.num_computed_tokens += len(s.token_ids)
            token = sampled.get(s.request_id)
            if token is not None:
                req.append_output_token(token)

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
