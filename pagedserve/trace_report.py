"""`pagedserve trace`: run a workload through the engine and write one self-contained HTML report.

The report is built from the engine's own StepRecords (plus, per request, its arrival step and final
output): per-step token bars against the budget, queue sizes and preemptions, KV blocks over time, a
timeline per request, and the block-table map of any step. The JSON it embeds (also written beside the
HTML) has the shape `engine_trace_data()` returns, so the live `/dashboard` can render the same charts
with the same `PagedTrace.render(data)` from pagedserve/static/trace.js.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING

from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.engine import LLMEngine
    from pagedserve.outputs import RequestOutput

TRACE_VERSION = 1
# Per-request, per-step states (the timeline's colours).
WAITING, PREFILL, DECODE, STALLED, PREEMPTED = "waiting", "prefill", "decode", "stalled", "preempted"


# ---- the workload --------------------------------------------------------------------------------
@dataclass
class TraceRequest:
    prompt: str | list[int]
    params: SamplingParams
    arrival_step: int = 0
    abort_step: int | None = None  # abort the request before this step, if it is still running
    request_id: str = ""


_DEMO_TEXT = (
    "The paged KV cache stores the keys and values of every token in fixed-size blocks. A block table "
    "maps each request's logical token positions to physical blocks, so memory is allocated on demand, "
    "shared between requests with a common prefix, and returned the moment a request finishes. The "
    "scheduler gives every step one token budget: running requests decode a token each, long prompts are "
    "prefilled in chunks, and when blocks run out the newest request is preempted and recomputed later. "
    "Continuous batching lets requests join and leave the batch between steps instead of waiting for the "
    "slowest member of a static batch to finish."
)


def demo_workload(scale: float = 1.0) -> list[TraceRequest]:
    """Twelve requests of different prompt lengths and max_tokens, arriving over the first steps.

    Sized (with demo_engine_overrides) so chunked prefill and preemption both happen; some stop on a
    stop string, most on length, and one is aborted.
    """
    words = _DEMO_TEXT.split()
    specs = [  # (arrival step, prompt words, max_tokens, stop)
        (0, 12, 24, None), (0, 70, 16, None), (1, 30, 28, None), (2, 8, 20, ["."]),
        (3, 95, 12, None), (5, 20, 32, None), (6, 45, 18, ["\n"]), (8, 5, 26, None),
        (10, 60, 14, None), (12, 25, 30, None), (14, 40, 22, ["."]), (16, 15, 20, None),
    ]
    out = []
    for i, (arrival, n_words, max_tokens, stop) in enumerate(specs):
        start = (i * 7) % 20
        prompt = " ".join((words * 2)[start : start + n_words])
        params = SamplingParams(temperature=0.0, max_tokens=max(2, int(max_tokens * scale)), stop=stop)
        abort = arrival + 12 if i == 9 else None
        out.append(TraceRequest(prompt, params, arrival, abort, f"req-{i:02d}"))
    return out


def demo_engine_overrides() -> dict:
    # 24 blocks × 16 tokens = 384 tokens of KV for ~900 tokens of demand: preemption; a 64-token budget
    # against prompts of up to ~130 tokens: chunked prefill.
    return {"num_kv_blocks": 24, "max_num_batched_tokens": 64, "max_num_seqs": 8, "keep_block_tables": True}


def load_prompts_file(path: str, default_params: SamplingParams) -> list[TraceRequest]:
    """One prompt per line, or JSON lines: {"prompt", "max_tokens", "temperature", "stop", "arrival_step"}."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"prompts: {path}:{lineno}: bad JSON: {e}") from None
                if "prompt" not in obj:
                    raise ValueError(f"prompts: {path}:{lineno}: a JSON line needs a 'prompt'")
                keys = ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed")
                overrides = {k: obj[k] for k in keys if k in obj}
                params = default_params.clone(**overrides) if overrides else default_params
                out.append(TraceRequest(obj["prompt"], params, int(obj.get("arrival_step", 0)),
                                        obj.get("abort_step"), str(obj.get("id", f"req-{len(out):02d}"))))
            else:
                out.append(TraceRequest(line, default_params, 0, None, f"req-{len(out):02d}"))
    if not out:
        raise ValueError(f"prompts: {path} has no prompts")
    return out


# ---- running it ----------------------------------------------------------------------------------
@dataclass
class TraceRecorder:
    """What the step records do not hold: arrivals, aborts, exact computed counts, final outputs."""

    arrival_step: dict[str, int] = field(default_factory=dict)
    abort_step: dict[str, int] = field(default_factory=dict)
    computed: dict[int, dict[str, int]] = field(default_factory=dict)  # step → {id: num_computed_tokens}
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    prompts: dict[str, str | None] = field(default_factory=dict)

    def snapshot(self, engine: LLMEngine, step: int) -> None:
        reqs = engine.scheduler.requests
        self.computed[step] = {rid: r.num_computed_tokens for rid, r in reqs.items() if r.num_computed_tokens}


def run_workload(engine: LLMEngine, workload: list[TraceRequest], max_steps: int = 10_000) -> TraceRecorder:
    """Add each request at its arrival step, step until all are done; record what the trace needs."""
    rec = TraceRecorder()
    pending = sorted(enumerate(workload), key=lambda p: (p[1].arrival_step, p[0]))
    pending = [w for _, w in pending]
    aborts: dict[int, list[str]] = {}
    first_step = engine.step_count
    while pending or engine.has_unfinished_requests():
        step = engine.step_count
        if step - first_step >= max_steps:
            raise RuntimeError(f"trace: workload not done after {max_steps} steps")
        while pending and pending[0].arrival_step <= step - first_step:
            w = pending.pop(0)
            rid = w.request_id or f"req-{len(rec.arrival_step):02d}"
            engine.add_request(rid, w.prompt, w.params)
            rec.arrival_step[rid] = step
            rec.prompts[rid] = w.prompt if isinstance(w.prompt, str) else None
            if w.abort_step is not None:
                aborts.setdefault(first_step + w.abort_step, []).append(rid)
        for rid in aborts.pop(step, []):
            for out in engine.abort_request(rid):
                rec.outputs[out.request_id] = out
                rec.abort_step[rid] = step
        if not engine.has_unfinished_requests():
            # Nothing to run until the next arrival; an empty step keeps step numbers aligned.
            engine.step()
            continue
        for out in engine.step():
            if out.finished:
                rec.outputs[out.request_id] = out
        rec.snapshot(engine, step)
    return rec


# ---- the JSON ------------------------------------------------------------------------------------
def _step_dict(r, t0: float) -> dict:
    d = r.to_dict()
    d.pop("block_tables", None)
    d["t"] = round(r.start_time - t0, 6)
    d["duration_s"] = round(r.duration_s, 6)
    return d


def _segments(states: list[tuple[int, str, int]]) -> list[dict]:
    """Merge per-step states into runs; each prefill chunk stays its own segment."""
    segs: list[dict] = []
    for step, state, tokens in states:
        last = segs[-1] if segs else None
        if last and last["state"] == state and state != PREFILL and last["to"] == step - 1:
            last["to"] = step
            last["tokens"] += tokens
        else:
            segs.append({"state": state, "from": step, "to": step, "tokens": tokens})
    return segs


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
    t0 = recs[0].start_time if recs else 0.0
    first = recs[0].step if recs else engine.step_count
    steps = [_step_dict(r, t0) for r in recs]

    # Arrival step of each request: recorded, or the first step that started after its arrival time.
    arrivals = {rid: s for rid, s in rec.arrival_step.items()}
    live = {r.request_id: r for r in list(engine.scheduler.running) + list(engine.scheduler.waiting)}
    for rid, req in live.items():
        if rid not in arrivals:
            later = (r.step for r in recs if r.start_time >= req.arrival_time)
            arrivals[rid] = next(later, engine.step_count)
    for r in recs:
        for rid in r.scheduled:
            arrivals[rid] = min(arrivals.get(rid, r.step), r.step)
        for rid in r.preempted:
            arrivals[rid] = min(arrivals.get(rid, r.step), r.step)

    requests = []
    held_by_step: list[dict[str, dict]] = [dict() for _ in recs]
    for rid in sorted(arrivals, key=lambda k: (arrivals[k], k)):
        requests.append(_request_entry(rid, arrivals[rid], recs, first, rec, engine, held_by_step))

    totals = {
        "steps": len(recs),
        "scheduled_tokens": sum(r.num_scheduled_tokens for r in recs),
        "prefill_tokens": sum(r.num_prefill_tokens for r in recs),
        "decode_tokens": sum(r.num_decode_tokens for r in recs),
        "preemptions": sum(len(r.preempted) for r in recs),
        "recomputed_tokens": sum(q["recomputed_tokens"] for q in requests),
        "prompt_tokens": sum(q["prompt_tokens"] or 0 for q in requests),
        "generated_tokens": sum(q["output_tokens"] or 0 for q in requests),
        "finished": {k: v for k, v in engine.finished_by_reason.items()},
    }
    return {
        "version": TRACE_VERSION,
        "model": engine.served_model_name,
        "config": {
            "block_size": cfg.block_size, "num_blocks": engine.kv_manager.num_blocks,
            "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs,
            "max_model_len": engine.max_model_len, "enable_prefix_caching": cfg.enable_prefix_caching,
            "dtype": str(engine.dtype).replace("torch.", ""), "keep_block_tables": cfg.keep_block_tables,
        },
        "first_step": first,
        "steps": steps,
        "requests": requests,
        "block_tables": held_by_step,
        "totals": totals,
    }


def _request_entry(rid: str, arrival: int, recs: list, first: int, rec: TraceRecorder,
                   engine: LLMEngine, held_by_step: list[dict]) -> dict:
    """Walk the steps for one request: its state each step, recompute and the blocks it holds."""
    states: list[tuple[int, str, int]] = []
    admitted = False
    finish_step = finish_reason = None
    computed_total = recomputed = since_admission = 0
    preemptions = 0
    table: list[int] | None = None
    abort_at = rec.abort_step.get(rid)
    live_req = engine.scheduler.requests.get(rid)
    for i in range(max(0, arrival - first), len(recs)):  # step numbers are consecutive
        r = recs[i]
        s = r.step
        if abort_at is not None and s >= abort_at:
            finish_step, finish_reason = abort_at, "abort"
            break
        tokens = r.scheduled.get(rid, 0)
        if rid in r.preempted:
            state = PREEMPTED
            preemptions += 1
            recomputed += since_admission
            admitted, since_admission, table = False, 0, None
        elif tokens:
            state = PREFILL if rid in r.prefill_requests else DECODE
            admitted = True
            since_admission += tokens
            computed_total += tokens
            if r.block_tables is not None and rid in r.block_tables:
                table = r.block_tables[rid]
        else:
            state = STALLED if admitted else WAITING
        states.append((s, state, tokens))
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
    if live_req is not None and recs and table is not None and rid in engine.kv_manager.req_blocks:
        held_by_step[-1].setdefault(rid, {"blocks": table, "tokens": None})
        if held_by_step[-1][rid]["tokens"] is None and recs[-1].step == engine.step_count - 1:
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
        "segments": _segments(states),
    }


# ---- the HTML ------------------------------------------------------------------------------------
def static_text(name: str) -> str:
    return resources.files("pagedserve").joinpath("static", name).read_text(encoding="utf-8")


def _inline_json(data: dict) -> str:
    # Inside <script type="application/json">: only "</" (and U+2028/9 for old parsers) need escaping.
    text = json.dumps(data, separators=(",", ":"))
    return text.replace("</", "<\\/").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def render_html(data: dict, title: str = "pagedserve trace") -> str:
    """One self-contained page: CSS, JS and data inline; no network access needed."""
    page = static_text("trace.html")
    # The title goes in first: the data and scripts inserted later must not be searched for placeholders.
    page = page.replace("__TITLE__", title.replace("&", "&amp;").replace("<", "&lt;"))
    parts = {
        "/*__TRACE_CSS__*/": static_text("trace.css"),
        "/*__TRACE_JS__*/": static_text("trace.js"),
        "__TRACE_DATA__": _inline_json(data),
    }
    for key, value in parts.items():
        page = page.replace(key, value, 1)
    return page


def dashboard_html() -> str:
    """The live dashboard page (polls ./dashboard/state for engine_trace_data JSON), assets inline."""
    page = static_text("dashboard.html")
    return page.replace("/*__TRACE_CSS__*/", static_text("trace.css"), 1).replace(
        "/*__TRACE_JS__*/", static_text("trace.js"), 1)


def write_report(
    data: dict, html_path: str, json_path: str | None = None, title: str = "pagedserve trace"
) -> str:
    json_path = json_path or os.path.splitext(html_path)[0] + ".json"
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(render_html(data, title))
    return json_path


# ---- the command ---------------------------------------------------------------------------------
def register(sub, add_engine_args, engine_config_from_args) -> None:
    p = sub.add_parser("trace", help="run a workload and write an HTML report of what the engine did")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", default=None, help="file: one prompt per line, or JSON lines")
    src.add_argument("--demo", action="store_true",
                     help="built-in workload with chunked prefill and preemption (the default)")
    p.add_argument("-o", "--output", default="trace.html",
                   help="HTML report (the trace JSON is written beside it)")
    p.add_argument("--json", default=None, help="where to write the trace JSON (default: OUTPUT with .json)")
    p.add_argument("--max-tokens", type=int, default=32, help="for --prompts lines without their own")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--demo-scale", type=float, default=1.0, help=argparse.SUPPRESS)
    add_engine_args(p)
    # None = "not given": the demo picks small values so chunked prefill and preemption show up.
    p.set_defaults(func=lambda args: run_trace(args, engine_config_from_args), max_num_batched_tokens=None,
                   max_num_seqs=None)


def run_trace(args: argparse.Namespace, engine_config_from_args) -> int:
    from pagedserve.engine.engine import LLMEngine

    if args.demo or not args.prompts:
        workload = demo_workload(args.demo_scale)
        overrides = demo_engine_overrides()
    else:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        workload = load_prompts_file(args.prompts, params)
        overrides = {"max_num_batched_tokens": 2048, "max_num_seqs": 128, "keep_block_tables": True}
    for name in ("max_num_batched_tokens", "max_num_seqs", "num_kv_blocks"):
        if getattr(args, name, None) is not None:
            overrides[name] = getattr(args, name)
    overrides["keep_block_tables"] = True
    engine = LLMEngine(engine_config_from_args(args, **overrides))
    recorder = run_workload(engine, workload)
    data = engine_trace_data(engine, recorder=recorder)
    if data["steps"]:  # open the block map at the fullest step
        data["selected_step"] = max(data["steps"], key=lambda s: s["num_used_blocks"])["step"]
    json_path = write_report(data, args.output, args.json, f"pagedserve trace — {engine.served_model_name}")
    t = data["totals"]
    print(f"{len(workload)} requests, {t['steps']} steps, {t['scheduled_tokens']} tokens computed "
          f"({t['prefill_tokens']} prefill, {t['decode_tokens']} decode, "
          f"{t['recomputed_tokens']} recomputed), {t['preemptions']} preemptions", file=sys.stderr)
    print(f"wrote {args.output} and {json_path}", file=sys.stderr)
    return 0
