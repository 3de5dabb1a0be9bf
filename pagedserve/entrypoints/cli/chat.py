"""`pagedserve chat`: an interactive terminal chat with the model (streams the answer, keeps history)."""

from __future__ import annotations

import argparse
import sys
import uuid

from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine
from pagedserve.entrypoints.cli.args import add_engine_args, engine_config_from_args
from pagedserve.sampling_params import SamplingParams

HELP = "Type a message. Commands: /exit (or Ctrl-D) to quit, /reset to forget the conversation."


def register(sub) -> None:
    c = sub.add_parser("chat", help="interactive chat in the terminal (streams; /exit to quit)")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-tokens", type=int, default=512)
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--top-p", type=float, default=0.95)
    add_engine_args(c, positional_model=True)
    c.set_defaults(func=lambda args: run_chat(args, engine_config_from_args(args)))


def run_chat(args: argparse.Namespace, config: EngineConfig, input_fn=input, out=sys.stdout) -> int:
    engine = LLMEngine(config)
    tok = engine.tokenizer
    if not tok.has_chat_template:
        raise ValueError("model: this model has no chat template; use `pagedserve generate --raw`")
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = list(system)
    out.write(f"pagedserve chat — {engine.served_model_name}. {HELP}\n")
    while True:
        try:
            line = input_fn("\n> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = list(system)
            out.write("(conversation cleared)\n")
            continue
        history.append({"role": "user", "content": text})
        try:
            answer = _answer(engine, history, args, out)
        except ValueError as e:
            out.write(f"error: {e}\n")
            history.pop()
            continue
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the chat
            engine.abort_all()
            out.write("\n(interrupted)\n")
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})


def _answer(engine: LLMEngine, history: list[dict], args: argparse.Namespace, out) -> str:
    tok = engine.tokenizer
    prompt = tok.apply_chat_template(history)
    ids = tok.encode(prompt, add_special_tokens=False)
    room = engine.max_model_len - len(ids)
    if room < 1:
        raise ValueError("messages: the conversation is longer than max_model_len; /reset to start again")
    params = SamplingParams(max_tokens=min(args.max_tokens, room), temperature=args.temperature,
                            top_p=args.top_p)
    rid = f"chat-{uuid.uuid4().hex[:8]}"
    engine.add_request(rid, {"prompt": prompt, "prompt_token_ids": ids}, params)
    shown, text = 0, ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            text = o.outputs[0].text
            out.write(text[shown:])
            out.flush()
            shown = len(text)
            if o.error:
                out.write(f"\n[error: {o.error}]")
    out.write("\n")
    return text
