"""`pagedserve router`: one OpenAI-compatible endpoint in front of several servers (entrypoints/router.py)."""

from __future__ import annotations

import argparse

import uvicorn

from pagedserve.entrypoints.router import DEFAULT_HEALTH_INTERVAL_S, DEFAULT_REQUEST_TIMEOUT_S
from pagedserve.envs import ENV

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def register(sub) -> None:
    p = sub.add_parser("router", help="route requests over several OpenAI-compatible servers "
                                      "(least loaded, prefix affinity, health checks)")
    p.add_argument("--backend", action="append", required=True, metavar="URL",
                   help="a backend server, e.g. http://10.0.0.2:8000 (pagedserve serve or vLLM); repeat for more")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=ENV.api_key,
                   help="require 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY; /health stays open); "
                        "the client's header is forwarded to the backends")
    p.add_argument("--backend-api-key", default=None,
                   help="send 'Authorization: Bearer KEY' to the backends instead of the client's header")
    p.add_argument("--health-interval", type=float, default=DEFAULT_HEALTH_INTERVAL_S,
                   help="seconds between checks of every backend's /health and /metrics")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                   help="seconds to wait for a backend's next byte before the request fails")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM/SIGINT, seconds in-flight requests may still finish")
    p.set_defaults(func=cmd_router)


def cmd_router(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.router import build_router_app

    app = build_router_app(args.backend, api_key=args.api_key, backend_api_key=args.backend_api_key,
                           health_interval_s=args.health_interval, request_timeout_s=args.request_timeout)
    print(f"pagedserve router: http://{args.host}:{args.port}/v1 over {', '.join(args.backend)}", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    uvicorn.Server(config).run()
    return 0
