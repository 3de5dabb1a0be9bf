"""A request as the scheduler sees it: tokens, how many are computed, and a status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        return {"finished_stopped": "stop", "finished_length": "length", "finished_aborted": "abort"}.get(
            self.value
        )


@dataclass(eq=False)
class Request:
    """One sequence. Prefill and decode are the same thing here: tokens not yet computed."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = 16  # resolved against max_model_len at add_request
    arrival_time: float = field(default_factory=time.time)
    parent_id: str | None = None
    index: int = 0  # which of the parent's n samples this is
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit of the first schedule (-1: not scheduled yet)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Speculative decoding: draft tokens proposed for the next step (never part of all_token_ids: only the
    # ones the target accepts become tokens).
    spec_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
