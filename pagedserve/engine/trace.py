"""What the engine did, step by step: StepRecord (one per step) and the trace data built from them.

`engine_trace_data(engine)` is the one JSON shape that `pagedserve trace` embeds in its report and the
live `/dashboard` polls; both render it with the same `PagedTrace.render(data)` (entrypoints/dashboard).
It reads the engine only through its read API (stats, live requests, step records).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.engine.engine import LLMEngine
    from pagedserve.engine.stats import RequestInfo
    from pagedserve.outputs import RequestOutput

TRACE_VERSION = 1
# Per-request, per-step states (the timeline's colours).
WAITING, PREFILL, DECODE, STALLED, PREEMPTED = "waiting", "prefill", "decode", "stalled", "preempted"


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
    # Structured outputs: rows under a grammar this step, the time filling their token masks took (on its
    # own thread, beside the forward pass) and how much of it the sampler still had to wait for.
    num_constrained: int = 0
    mask_s: float = 0.0
    mask_wait_s: float = 0.0
    # Speculative decoding: draft tokens scored this step (part of num_decode_tokens), how many of them the
    # target accepted, per request what was proposed (as scheduled) and kept, and the proposing time.
    num_spec_tokens: int = 0
    num_accepted_tokens: int = 0
    spec_drafts: dict[str, list[int]] = field(default_factory=dict)
    spec_accepted: dict[str, int] = field(default_factory=dict)
    propose_s: float = 0.0
    block_tables: dict[str, list[int]] | None = None  # only when the engine is asked to keep them
    # Multi-step (num_scheduler_steps): the decode steps this record's step ran in a row (scheduled and the token
    # counts cover them all).
    num_steps: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TraceRecorder:
    """What the step records do not hold: arrivals, aborts, exact computed counts, final outputs."""

    arrival_step: dict[str, int] = field(default_factory=dict)
    abort_step: dict[str, int] = field(default_factory=dict)
    computed: dict[int, dict[str, int]] = field(default_factory=dict)  # step → {id: num_computed_tokens}
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    prompts: dict[str, str | None] = field(default_factory=dict)

    def snapshot(self, engine: LLMEngine, step: int) -> None:
        live = engine.live_requests()
        self.computed[step] = {r.request_id: r.num_computed_tokens for r in live if r.num_computed_tokens}


# ---- the trace JSON ------------------------------------------------------------------------------
def _step_dict(r, t0: float) -> dict:
    d = r.to_dict()
    d.pop("block_tables", None)
    d["t"] = round(r.start_time - t0, 6)
    d["duration_s"] = round(r.duration_s, 6)
    return d


def _segments(states: list[tuple[int, str, int, int, int]]) -> list[dict]:
    """Merge per-step states into runs; each prefill chunk stays its own segment.

    `tokens` are the tokens scored (as scheduled, draft tokens included); a segment in which the request
    speculated also carries `draft_tokens` and `accepted_tokens`."""
    segs: list[dict] = []
    for step, state, tokens, drafts, accepted in states:
        last = segs[-1] if segs else None
        if last and last["state"] == state and state != PREFILL and last["to"] == step - 1:
            last["to"] = step
            last["tokens"] += tokens
        else:
            last = {"state": state, "from": step, "to": step, "tokens": tokens}
            segs.append(last)
        if drafts:
            last["draft_tokens"] = last.get("draft_tokens", 0) + drafts
            last["accepted_tokens"] = last.get("accepted_tokens", 0) + accepted
    return segs


def _spec_totals(recs: list, spec_config) -> dict:
    """Speculative decoding over the steps shown: proposals verified, draft tokens, accepted ones and how
    many were accepted at each draft position (as SpecDecodeStats counts them)."""
    drafts = [(len(d), r.spec_accepted.get(rid, 0)) for r in recs for rid, d in r.spec_drafts.items() if d]
    k = spec_config.num_speculative_tokens if spec_config is not None else max((n for n, _ in drafts), default=0)
    per_pos = [0] * k
    for _, a in drafts:
        for i in range(min(a, k)):
            per_pos[i] += 1
    draft_tokens = sum(r.num_spec_tokens for r in recs)
    accepted = sum(r.num_accepted_tokens for r in recs)
    return {
        "drafts": len(drafts),
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        "accepted_per_pos": per_pos,
    }


def _split_lookahead(recs: list, held_by_step: list[dict[str, dict]], block_size: int) -> None:
    """A step's block table is taken when it is scheduled: with drafts it holds lookahead blocks for their
    slots, and those of rejected drafts go back to the pool at the end of the step. Where the tokens kept
    are known, keep only the blocks they fill; the returned ones become `draft_blocks` of that step."""
    for r, held in zip(recs, held_by_step, strict=True):
        for rid, h in held.items():
            if h["tokens"] is None:
                continue
            keep = -(-h["tokens"] // block_size)
            if len(h["blocks"]) > keep:
                extra = h["blocks"][keep:]
                h["blocks"] = h["blocks"][:keep]
                if rid in r.spec_drafts:
                    h["draft_blocks"] = extra


def engine_trace_data(engine: LLMEngine, max_steps: int | None = None,
                      recorder: TraceRecorder | None = None) -> dict:
    """The trace JSON from a live engine: its StepRecords (the last `max_steps`), requests and blocks.

    Works on any engine (the dashboard calls it on the serving one); a TraceRecorder adds exact arrivals,
    aborts, computed-token counts and final outputs. Block tables need EngineConfig(keep_block_tables=True).
    """
    recs = list(engine.step_records)
    if max_steps is not None:
        recs = recs[-max_steps:] if max_steps > 0 else []
    rec = recorder or TraceRecorder()
    cfg = engine.config
    stats = engine.stats()
    t0 = recs[0].start_time if recs else 0.0
    first = recs[0].step if recs else stats.step_count
    steps = [_step_dict(r, t0) for r in recs]

    # Arrival step of each request: recorded, or the first step that started after its arrival time.
    arrivals = {rid: s for rid, s in rec.arrival_step.items()}
    for req in engine.live_requests():
        if req.request_id not in arrivals:
            later = (r.step for r in recs if r.start_time >= req.arrival_time)
            arrivals[req.request_id] = next(later, stats.step_count)
    for r in recs:
        for rid in r.scheduled:
            arrivals[rid] = min(arrivals.get(rid, r.step), r.step)
        for rid in r.preempted:
            arrivals[rid] = min(arrivals.get(rid, r.step), r.step)

    requests = []
    held_by_step: list[dict[str, dict]] = [dict() for _ in recs]
    for rid in sorted(arrivals, key=lambda k: (arrivals[k], k)):
        requests.append(_request_entry(rid, arrivals[rid], recs, first, rec, engine.get_request(rid),
                                       stats.step_count, held_by_step))

    _split_lookahead(recs, held_by_step, cfg.block_size)
    spec = engine.speculative_config
    totals = {
        "steps": len(recs),
        "scheduled_tokens": sum(r.num_scheduled_tokens for r in recs),
        "prefill_tokens": sum(r.num_prefill_tokens for r in recs),
        "decode_tokens": sum(r.num_decode_tokens for r in recs),
        "preemptions": sum(len(r.preempted) for r in recs),
        "recomputed_tokens": sum(q["recomputed_tokens"] for q in requests),
        "prompt_tokens": sum(q["prompt_tokens"] or 0 for q in requests),
        "generated_tokens": sum(q["output_tokens"] or 0 for q in requests),
        "finished": stats.finished_by_reason,
        **_spec_totals(recs, spec),
    }
    return {
        "version": TRACE_VERSION,
        "model": engine.served_model_name,
        "config": {
            "block_size": cfg.block_size, "num_blocks": stats.num_kv_blocks,
            "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs,
            "max_model_len": engine.max_model_len, "enable_prefix_caching": cfg.enable_prefix_caching,
            "dtype": str(engine.dtype).replace("torch.", ""), "keep_block_tables": cfg.keep_block_tables,
            "speculative_config": spec.to_dict() if spec is not None else None,
        },
        "first_step": first,
        "steps": steps,
        "requests": requests,
        "block_tables": held_by_step,
        "totals": totals,
    }


def _request_entry(rid: str, arrival: int, recs: list, first: int, rec: TraceRecorder,
                   live_req: RequestInfo | None, step_count: int, held_by_step: list[dict]) -> dict:
    """Walk the steps for one request: its state each step, recompute and the blocks it holds.

    Computed tokens are those whose K/V were kept: scheduled ones less the rejected drafts."""
    states: list[tuple[int, str, int, int, int]] = []
    admitted = False
    finish_step = finish_reason = None
    computed_total = recomputed = since_admission = 0
    draft_total = accepted_total = 0
    preemptions = 0
    table: list[int] | None = None
    abort_at = rec.abort_step.get(rid)
    for i in range(max(0, arrival - first), len(recs)):  # step numbers are consecutive
        r = recs[i]
        s = r.step
        if abort_at is not None and s >= abort_at:
            finish_step, finish_reason = abort_at, "abort"
            break
        tokens = r.scheduled.get(rid, 0)
        drafts = len(r.spec_drafts.get(rid, ()))
        accepted = min(r.spec_accepted.get(rid, 0), drafts)
        if rid in r.preempted:
            state = PREEMPTED
            preemptions += 1
            recomputed += since_admission
            admitted, since_admission, table = False, 0, None
        elif tokens:
            state = PREFILL if rid in r.prefill_requests else DECODE
            admitted = True
            kept = tokens - (drafts - accepted)
            since_admission += kept
            computed_total += kept
            draft_total += drafts
            accepted_total += accepted
            if r.block_tables is not None and rid in r.block_tables:
                table = r.block_tables[rid]
        else:
            state = STALLED if admitted else WAITING
        states.append((s, state, tokens, drafts if tokens else 0, accepted if tokens else 0))
        if table is not None:
            known = rec.computed.get(s, {}).get(rid)
            held_by_step[i][rid] = {"blocks": table, "tokens": known}
        if rid in r.finished:
            finish_step, finish_reason = s, r.finished[rid]
            break
    out = rec.outputs.get(rid)
    if out is not None and finish_step is not None and out.outputs:
        # After its last step a request has computed all its tokens but the last sampled one.
        held = held_by_step[finish_step - first].get(rid) if 0 <= finish_step - first < len(recs) else None
        if held is not None and held["tokens"] is None:
            held["tokens"] = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
    if out is not None:
        prompt_tokens = len(out.prompt_token_ids)
        output_tokens = len(out.outputs[0].token_ids) if out.outputs else 0
        if finish_reason is None and out.outputs and out.outputs[0].finish_reason:
            finish_reason = out.outputs[0].finish_reason
    elif live_req is not None:
        prompt_tokens, output_tokens = live_req.num_prompt_tokens, live_req.num_output_tokens
    else:
        prompt_tokens = output_tokens = None
    if live_req is not None and recs and table is not None and live_req.holds_blocks:
        held_by_step[-1].setdefault(rid, {"blocks": table, "tokens": None})
        if held_by_step[-1][rid]["tokens"] is None and recs[-1].step == step_count - 1:
            held_by_step[-1][rid]["tokens"] = live_req.num_computed_tokens
    text = rec.prompts.get(rid)
    return {
        "id": rid,
        "prompt": text[:200] if isinstance(text, str) else None,
        "arrival_step": arrival,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "finish_step": finish_step,
        "finish_reason": finish_reason,
        "num_preemptions": preemptions,
        "computed_tokens": computed_total,
        "recomputed_tokens": recomputed,
        "draft_tokens": draft_total,
        "accepted_tokens": accepted_total,
        "segments": _segments(states),
    }
