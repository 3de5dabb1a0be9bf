"""What the engine tells the outside about itself (LLMEngine.stats() / get_request()): plain values,
copied out, so metrics, bench, trace, explain, chat and the dashboard never reach into the scheduler,
the KV cache manager or the block pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.spec_decode.speculator import SpecDecodeStats


@dataclass(frozen=True, slots=True)
class EngineStats:
    step_count: int
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences waiting (new or preempted)
    num_unfinished_requests: int  # user requests (one per add_request, whatever n)
    num_kv_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int  # free, but still holding a cached prefix
    num_free_blocks: int  # free and empty
    # running totals since the engine started
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_computed_prefill_tokens: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found there
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's totals (None: not configured)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV blocks in use (1.0 = full)."""
        return self.num_used_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """One live sequence (a sample of a user request)."""

    request_id: str
    parent_id: str | None
    status: str  # waiting | running | preempted
    arrival_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    max_tokens: int
    holds_blocks: bool  # has KV blocks allocated now
