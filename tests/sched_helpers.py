"""The scheduler's half of an engine step for model-free tests: append the sampled tokens, then apply the
engine's token-level stops (engine/stop.py) and finish what stopped, as LLMEngine does; and an engine stepped to
the end with its block bookkeeping checked after every step."""

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


def run_checking_blocks(eng, prompts: list, params: list) -> dict:
    """Add requests r0, r1, ... and step the engine until they finish, checking after every step that each running
    request holds exactly the blocks of its computed tokens (shared prefix blocks counted once); at the end, that
    nothing is held. Returns request id -> its final RequestOutput."""
    from pagedserve.core.kv_math import blocks_for_tokens

    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", p, sp)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        for req in eng.scheduler.running:
            assert len(eng.kv_manager.block_table(req.request_id)) == blocks_for_tokens(
                req.num_computed_tokens, eng.config.block_size)
        held = sum(len(eng.kv_manager.block_table(r.request_id)) for r in eng.scheduler.running)
        assert eng.kv_manager.pool.num_used_blocks <= held
    assert eng.kv_manager.pool.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in eng.kv_manager.pool.blocks)
    return outs
