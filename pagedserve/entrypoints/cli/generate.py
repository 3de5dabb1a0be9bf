"""`pagedserve generate`: stream continuations of prompts through one engine (continuous batching)."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine
from pagedserve.sampling_params import SamplingParams


def sampling_from_args(args: argparse.Namespace, engine: LLMEngine) -> SamplingParams:
    """The command's sampling flags; each request is seeded with the engine's --seed."""
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        stop=args.stop, seed=engine.config.seed,
    )


def build_prompt(engine: LLMEngine, text: str, raw: bool) -> dict:
    tok = engine.tokenizer
    if raw or not tok.has_chat_template:
        return {"prompt": text, "prompt_token_ids": tok.encode(text)}
    templated = tok.apply_chat_template([{"role": "user", "content": text}])
    return {"prompt": templated, "prompt_token_ids": tok.encode(templated, add_special_tokens=False)}


def run_generate(args: argparse.Namespace, config: EngineConfig) -> int:
    engine = LLMEngine(config)
    params = sampling_from_args(args, engine)
    ids = []
    for i, text in enumerate(args.prompts):
        rid = f"cli-{i}"
        engine.add_request(rid, build_prompt(engine, text, args.raw), params)
        ids.append(rid)
    if len(ids) == 1:
        return _stream_one(engine, ids[0])
    return _stream_many(engine, ids, args.prompts)


def _stream_one(engine: LLMEngine, rid: str) -> int:
    shown = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
            if out.finished:
                sys.stdout.write(f"\n[finish_reason={out.outputs[0].finish_reason}, "
                                 f"{len(out.prompt_token_ids)} prompt + {len(out.outputs[0].token_ids)} "
                                 "generated tokens]\n")
    return 0


def _stream_many(engine: LLMEngine, ids: list[str], prompts: list[str]) -> int:
    texts = dict.fromkeys(ids, "")
    reasons: dict[str, str | None] = dict.fromkeys(ids)
    console = Console()

    def render() -> Group:
        return Group(*(
            Panel(Text(texts[rid]), title=Text(prompts[i]), subtitle=reasons[rid] or "generating…")
            for i, rid in enumerate(ids)
        ))

    with Live(render(), console=console, refresh_per_second=8, transient=False) as live:
        while engine.has_unfinished_requests():
            for out in engine.step():
                texts[out.request_id] = out.outputs[0].text
                if out.finished:
                    reasons[out.request_id] = f"finish_reason={out.outputs[0].finish_reason}"
            live.update(render())
    return 0
