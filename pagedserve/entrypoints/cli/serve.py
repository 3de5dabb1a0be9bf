"""`pagedserve serve`: the OpenAI-compatible server, with a graceful stop on SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import threading

import uvicorn

from pagedserve.engine.async_engine import DEFAULT_MAX_QUEUE_LEN
from pagedserve.entrypoints.cli.args import add_engine_args, engine_config_from_args
from pagedserve.entrypoints.dashboard.serving import DASHBOARD_STEPS
from pagedserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedserve.envs import ENV

logger = logging.getLogger("pagedserve")
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


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
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM/SIGINT, seconds in-flight requests may still finish before they are aborted")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may wait and run in all; older ones end with an error (408)")
    p.add_argument("--max-queue-len", type=int, default=DEFAULT_MAX_QUEUE_LEN,
                   help="sequences that may wait for the batch; beyond, new requests get 429 with Retry-After")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model call tools on its own (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how tool calls are found in the model's output (hermes for the bundled model)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split <think>...</think> into message.reasoning_content")
    add_engine_args(p, positional_model=True)
    # Block tables per step feed the live /dashboard block map; a server keeps them (and its step records)
    # only for as many steps as the dashboard shows, so memory stays bounded however long it runs.
    p.set_defaults(func=lambda args: cmd_serve(args, engine_config_from_args(
        args, keep_block_tables=True, max_block_table_records=DASHBOARD_STEPS, max_step_records=4 * DASHBOARD_STEPS)))


def cmd_serve(args: argparse.Namespace, config) -> int:
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.engine.engine import LLMEngine
    from pagedserve.entrypoints.openai.api_server import build_app
    from pagedserve.entrypoints.openai.serving_tools import ToolOptions
    from pagedserve.metrics import EngineMetrics

    try:
        tool_options = ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)
    except ValueError as e:
        raise SystemExit(f"pagedserve serve: {e}") from None
    if config.data_parallel_size > 1:  # N replica processes; this one holds no engine (data_parallel.py)
        from pagedserve.engine.data_parallel import DPAsyncEngine

        try:
            aengine = DPAsyncEngine(config, args.log_interval, args.max_queue_len,
                                    request_timeout_s=args.request_timeout)
        except RuntimeError as e:  # a replica failed to start: its error, not a traceback of this process
            raise SystemExit(f"pagedserve serve: {e}") from None
        engine = aengine.view
    else:
        engine = LLMEngine(config)
        aengine = AsyncLLMEngine(engine, args.log_interval, EngineMetrics(engine), args.max_queue_len,
                                 request_timeout_s=args.request_timeout)
    app = build_app(engine, api_key=args.api_key, async_engine=aengine, tool_options=tool_options)
    server = GracefulServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5),
        aengine,
        args.shutdown_timeout,
    )
    logger.info("serving %s on http://%s:%d/v1", engine.served_model_name, args.host, args.port)
    server.run()
    return 0


class GracefulServer(uvicorn.Server):
    """On SIGINT/SIGTERM: stop taking requests (503), let those in flight finish for up to
    `shutdown_timeout_s`, then abort the rest (their clients get an error, never a cut-off 200), let
    uvicorn close, and exit 0 instead of re-raising the signal. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, async_engine, shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S):
        super().__init__(config)
        self.async_engine = async_engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self._draining: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        self._captured_signals.clear()
        if self._draining is not None:  # the second signal: no more waiting
            self._stop(sig, frame)
            return
        self.async_engine.begin_drain()
        self._draining = threading.Thread(target=self._drain, args=(sig, frame), name="pagedserve-drain",
                                          daemon=True)
        self._draining.start()

    def _drain(self, sig, frame) -> None:
        if not self.async_engine.wait_drained(self.shutdown_timeout_s):
            logger.warning("shutdown: %d requests still in flight after %.0f s; aborting them",
                           self.async_engine.num_in_flight, self.shutdown_timeout_s)
        self._stop(sig, frame)

    def _stop(self, sig, frame) -> None:
        self.async_engine.request_stop()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
