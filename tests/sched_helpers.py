"""The scheduler's half of an engine step for model-free tests: append the sampled tokens, then apply the
engine's token-level stops (engine/stop.py) and finish what stopped, as LLMEngine does."""

from __future__ import annotations

from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.engine.stop import check_stop


def update(sched: Scheduler, out: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Request]:
    """sampled: a token per sampling request, or (speculative decoding) its accepted drafts and one more.
    Returns the requests that finished."""
    finished = []

    def on_token(req: Request, index: int, token: int) -> bool:
        status = check_stop(req, token, None, sched.config.max_model_len)
        if status is not None:
            sched.finish(req, status)
            finished.append(req)
        return status is not None

    sched.update(out, sampled, on_token)
    return finished
