"""`pagedserve` command line: generate, chat, serve, bench, kv, trace (one module per command)."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedserve.entrypoints.cli import bench, chat, router, serve, trace, worker
from pagedserve.entrypoints.cli.args import add_engine_args, engine_config_from_args


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="stream a continuation of one or more prompts")
    p.add_argument("prompts", nargs="+", help="prompt text(s)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--explain", action="store_true",
                   help="show one prompt's journey: tokens, blocks, each step's decision, top-5 candidates")
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)


def _add_kv(sub) -> None:
    p = sub.add_parser("kv", help="KV-cache arithmetic: bytes per block, blocks and tokens that fit")
    p.add_argument("--model", default=None, help="read the numbers from a model: a local path or a Hugging Face "
                   "hub id org/name (default: bundled, if no numbers)")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a hub model id (default: main)")
    p.add_argument("--layers", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float16", help="KV element type: float32, float16, bfloat16, fp8")
    p.add_argument("--memory-gb", type=float, default=None, help="KV memory to plan for")
    p.add_argument("--request-len", type=int, default=None, help="tokens per request, for the concurrency line")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks the model is split over: each block holds one rank's share of the KV heads")
    p.set_defaults(func=cmd_kv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM inference engine with a paged KV cache")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_kv(sub)
    for module in (serve, chat, bench, trace, worker, router):
        module.register(sub)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    if args.explain:
        from pagedserve.entrypoints.cli.explain import run_explain

        return run_explain(args, engine_config_from_args(args, keep_block_tables=True))
    from pagedserve.entrypoints.cli.generate import run_generate

    return run_generate(args, engine_config_from_args(args))


def cmd_kv(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.cli.kv import run_kv

    return run_kv(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command == "serve" else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
