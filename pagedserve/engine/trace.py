"""StepRecord: what the engine did in one step. Feeds metrics, `pagedserve trace` and the dashboard."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class StepRecord:
    step: int
    start_time: float
    duration_s: float
    token_budget: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    scheduled: dict[str, int]  # request id → tokens computed this step
    prefill_requests: list[str]
    num_running: int
    num_waiting: int
    blocks_allocated: int
    blocks_freed: int
    blocks_evicted: int
    num_used_blocks: int
    num_cached_free_blocks: int
    num_free_blocks: int
    preempted: list[str] = field(default_factory=list)
    finished: dict[str, str] = field(default_factory=dict)  # request id → finish reason
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0
    block_tables: dict[str, list[int]] | None = None  # only when the engine is asked to keep them

    def to_dict(self) -> dict:
        return asdict(self)
