"""`pagedserve serve`: the OpenAI-compatible server, with a graceful stop on SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from pagedserve.entrypoints.cli.args import add_engine_args, engine_config_from_args
from pagedserve.envs import ENV

logger = logging.getLogger("pagedserve")


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=ENV.api_key,
                   help="require 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY; "
                        "/health stays open)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: from the model)")
    p.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between stats log lines while busy")
    add_engine_args(p, positional_model=True)
    # Block tables per step feed the live /dashboard block map.
    p.set_defaults(func=lambda args: cmd_serve(args, engine_config_from_args(args, keep_block_tables=True)))


def cmd_serve(args: argparse.Namespace, config) -> int:
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.engine.engine import LLMEngine
    from pagedserve.entrypoints.openai.api_server import build_app
    from pagedserve.metrics import EngineMetrics

    engine = LLMEngine(config)
    aengine = AsyncLLMEngine(engine, args.log_interval, EngineMetrics(engine))
    app = build_app(engine, api_key=args.api_key, async_engine=aengine)
    server = GracefulServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5),
        aengine,
    )
    logger.info("serving %s on http://%s:%d/v1", engine.served_model_name, args.host, args.port)
    server.run()
    return 0


class GracefulServer(uvicorn.Server):
    """On SIGINT/SIGTERM: abort in-flight requests at once (their streams end with finish_reason 'abort'),
    let uvicorn close, and exit 0 instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, async_engine) -> None:
        super().__init__(config)
        self.async_engine = async_engine

    def handle_exit(self, sig, frame) -> None:
        self.async_engine.request_stop()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
