"""`pagedserve trace`: run a workload through the engine and write one self-contained HTML report.

The report is built from the engine's own StepRecords (plus, per request, its arrival step and final
output): per-step token bars against the budget, queue sizes and preemptions, KV blocks over time, a
timeline per request, and the block-table map of any step. The JSON it embeds (also written beside the
HTML) is `engine.trace.engine_trace_data()`, the shape the live `/dashboard` renders with the same
`PagedTrace.render(data)` (entrypoints/dashboard/static/trace.js).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.engine.trace import TraceRecorder, engine_trace_data
from pagedserve.entrypoints.cli.args import add_engine_args, engine_config_from_args
from pagedserve.entrypoints.dashboard.views import write_report
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.engine import LLMEngine


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


# ---- the command ---------------------------------------------------------------------------------
def register(sub) -> None:
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
    p.set_defaults(func=run_trace)


def run_trace(args: argparse.Namespace) -> int:
    from pagedserve.engine.engine import LLMEngine

    demo = args.demo or not args.prompts
    # The demo picks small values so chunked prefill and preemption show up; flags given still win.
    overrides = demo_engine_overrides() if demo else {"max_num_batched_tokens": 2048, "max_num_seqs": 128}
    for name in ("max_num_batched_tokens", "max_num_seqs", "num_kv_blocks"):
        if getattr(args, name, None) is not None:
            overrides[name] = getattr(args, name)
    overrides["keep_block_tables"] = True
    config = engine_config_from_args(args, **overrides)
    if demo:
        workload = demo_workload(args.demo_scale)
    else:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=config.seed)
        workload = load_prompts_file(args.prompts, params)
    engine = LLMEngine(config)
    recorder = run_workload(engine, workload)
    data = engine_trace_data(engine, recorder=recorder)
    if data["steps"]:  # open the block map at the fullest step
        data["selected_step"] = max(data["steps"], key=lambda s: s["num_used_blocks"])["step"]
    json_path = write_report(data, args.output, args.json, f"pagedserve trace — {engine.served_model_name}")
    t = data["totals"]
    print(f"{len(workload)} requests, {t['steps']} steps, {t['scheduled_tokens']} tokens computed "
          f"({t['prefill_tokens']} prefill, {t['decode_tokens']} decode, "
          f"{t['recomputed_tokens']} recomputed), {t['preemptions']} preemptions", file=sys.stderr)
    if t.get("draft_tokens"):
        print(f"speculative decoding: {t['accepted_tokens']} of {t['draft_tokens']} draft tokens accepted",
              file=sys.stderr)
    print(f"wrote {args.output} and {json_path}", file=sys.stderr)
    return 0
