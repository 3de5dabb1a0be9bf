"""Start a real uvicorn server for an app in a background thread (shared by the server-facing tests)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from pagedserve.entrypoints.cli.serve import GracefulServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(app, **config) -> tuple[GracefulServer, threading.Thread, str]:
    """Run `app` on 127.0.0.1 at a free port; returns once it accepts connections."""
    port = free_port()
    server = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config),
                            app.state.async_engine)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"
