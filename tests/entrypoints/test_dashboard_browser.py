"""The live /dashboard renders in headless Chromium while a real server serves requests, and changes."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
from live_server import start_server
from test_trace_browser import ARTIFACTS, _errors_box, _run_chromium

from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine
from pagedserve.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(dtype="float32", keep_block_tables=True, max_num_batched_tokens=64))
    srv, thread, url = start_server(build_app(engine, log_interval_s=0))
    yield engine, url
    srv.should_exit = True
    thread.join(30)


def _load(url: str, stop: threading.Event) -> None:
    """Keep the engine busy with a stream of completions until told to stop."""
    with httpx.Client(base_url=url, timeout=120) as http:
        i = 0
        while not stop.is_set() and i < 200:
            http.post("/v1/completions", json={"prompt": f"Count to ten, attempt {i}:", "max_tokens": 24,
                                               "temperature": 0, "ignore_eos": True})
            i += 1


def _dump(tmp_path, url: str) -> str:
    proc = _run_chromium(tmp_path, url, "--dump-dom", "--enable-logging=stderr", "--v=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_dashboard_renders_live_and_changes(server, tmp_path):
    engine, url = server
    stop = threading.Event()
    loaders = [threading.Thread(target=_load, args=(url, stop), daemon=True) for _ in range(3)]
    for t in loaders:
        t.start()
    try:
        deadline = time.time() + 60
        while engine.step_count < 3:
            assert time.time() < deadline, "the engine never stepped"
            time.sleep(0.1)
        first = _dump(tmp_path, f"{url}/dashboard")
        steps_first = engine.step_count
        while engine.step_count < steps_first + 5:
            time.sleep(0.1)
        second = _dump(tmp_path, f"{url}/dashboard")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        proc = _run_chromium(tmp_path, f"{url}/dashboard", f"--screenshot={shot}")
        assert proc.returncode == 0 and shot.exists()
    finally:
        stop.set()
        for t in loaders:
            t.join(120)
    for dom in (first, second):
        assert _errors_box(dom) == ""
        assert re.search(r'<main id="app"[^>]*data-rendered="1"', dom), "dashboard did not render"
        for chart in ("chart-tokens", "chart-kv", "chart-timeline", "block-grid"):
            assert f'id="{chart}"' in dom, chart
        assert "updated" in dom  # the status line shows a successful poll, not an error

    def newest_step(dom: str) -> int:
        return int(re.search(r'data-selected-step="(\d+)"', dom).group(1))

    assert newest_step(second) > newest_step(first)  # the dashboard follows the engine as it serves
