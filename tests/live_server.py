"""Start a real uvicorn server for an app in a background thread (shared by the server-facing tests)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import uvicorn

from pagedserve.entrypoints.cli.serve import GracefulServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_in_thread(server: uvicorn.Server) -> threading.Thread:
    """Run a uvicorn server in a daemon thread; returns once it accepts connections."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.02)
    return thread


def start_server(app, **config) -> tuple[GracefulServer, threading.Thread, str]:
    """Run `app` (a pagedserve app) on 127.0.0.1 at a free port; returns once it accepts connections."""
    port = free_port()
    server = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config),
                            app.state.async_engine)
    return server, run_in_thread(server), f"http://127.0.0.1:{port}"


def stream_text(url: str, body: dict, headers: dict | None = None) -> str:
    """Stream a /v1/completions request to its end; its whole text (no error event may come)."""
    text = ""
    with httpx.Client(base_url=url, headers=headers or {}, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    text += chunk["choices"][0]["text"]
    return text
