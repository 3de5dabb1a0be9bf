"""`pagedserve router` (issue 18, part 4): the routing rule, the prefix key and the load parsing on their own;
then two real pagedserve servers on the bundled model (one engine each, built once for the module) behind
routers started per test, and a fake backend that dies mid-response."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from live_server import free_port, run_in_thread, stream_text

from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine
from pagedserve.entrypoints.cli.main import build_parser
from pagedserve.entrypoints.cli.serve import GracefulServer
from pagedserve.entrypoints.openai.api_server import build_app
from pagedserve.entrypoints.router import Router, _events_end, build_router_app, parse_load, prefix_key

CONFIG = dict(dtype="float32", num_kv_blocks=160, max_num_seqs=8, max_model_len=1024)
LONG_TOKENS = 1000  # seconds of generation: long requests are cut (disconnect) well before their end
BACKEND_KEY = "backend-key"
BACKEND_AUTH = {"Authorization": f"Bearer {BACKEND_KEY}"}
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is",
           "My favourite colour is", "In 1969, the first", "Water boils at", "The three primary colours are",
           "A haiku about rain:", "The opposite of hot is", "Dear diary, today", "To make tea, first"]
SHARED = "You are a helpful assistant who answers questions about lighthouses, tides and the sea. Question: "


# ---- the rule, the key and the load, without servers --------------------------------------------------
def _router(n: int = 2, **kw) -> Router:
    r = Router([f"http://10.0.0.{i}:8000" for i in range(n)], **kw)
    for b in r.backends:
        b.healthy = True
        b.report_load(0)
    return r


def test_choose_prefers_the_prefix_home_within_the_slack():
    r = _router(slack=2)
    a, b = r.backends
    home = r.choose(7)
    assert r.choose(7) is home  # an idle tie: affinity wins over taking turns
    other = b if home is a else a
    assert r.choose(None) is not r.choose(None)  # no prefix: ties are taken in turn
    home.reported_load = 2
    assert r.choose(7) is home  # within the slack
    home.reported_load = 3
    assert r.choose(7) is other  # beyond it: the least loaded, which becomes the home
    home.reported_load = 0
    assert r.choose(7) is other
    other.healthy = False
    assert r.choose(7) is home and r.choose(None) is home  # only healthy backends
    assert r.choose(7, exclude=[home]) is None
    home.healthy = False
    assert r.choose(None) is None


def test_in_flight_requests_count_until_the_next_scrape():
    r = _router()
    a, b = r.backends
    releases = [r.choose(None).lease() for _ in range(4)]
    assert a.load == b.load == 2 and a.in_flight == 2  # a burst spreads before any scrape
    a.report_load(5)  # the scrape sees a's two requests (and others')
    assert a.load == 5 and a.in_flight == 2
    for release in releases:
        release()
        release()  # twice does nothing
    assert a.in_flight == b.in_flight == 0 and a.load == 5 and b.load == 0
    b.load_known = False  # its /metrics failed: its load is what the router has open there
    release = b.lease()
    assert b.load == 1 and a.load == 5
    release()
    assert b.load == 0


def test_the_prefix_map_forgets_the_least_recent():
    r = _router(max_prefixes=2)
    for key in (1, 2, 3):
        r.choose(key)
    assert list(r._affinity._home) == [2, 3]


def test_prefix_key_is_the_first_block():
    comp, chat = "/v1/completions", "/v1/chat/completions"
    long = "x" * 64
    assert prefix_key(comp, {"prompt": long + "a"}) == prefix_key(comp, {"prompt": long + "b"}) is not None
    assert prefix_key(comp, {"prompt": "x" * 63}) is None  # shorter than a block: least loaded
    assert prefix_key(comp, {"prompt": [long + "a", "other"]}) == prefix_key(comp, {"prompt": long})
    ids = list(range(16))
    assert prefix_key(comp, {"prompt": ids + [1]}) == prefix_key(comp, {"prompt": [ids + [2]]}) is not None
    assert prefix_key(comp, {"prompt": ids[:15]}) is None and prefix_key(comp, {"prompt": 5}) is None
    sys_msg = {"role": "system", "content": SHARED}
    k1 = prefix_key(chat, {"messages": [sys_msg, {"role": "user", "content": "Why?"}]})
    k2 = prefix_key(chat, {"messages": [sys_msg, {"role": "user", "content": [{"type": "text", "text": "How?"}]}]})
    assert k1 == k2 is not None
    assert k1 != prefix_key(chat, {"messages": [{"role": "user", "content": SHARED}]})  # the role counts
    assert prefix_key("/tokenize", {"prompt": long}) is None and prefix_key(comp, None) is None


def test_load_is_running_plus_waiting_over_every_label_set():
    pagedserve = ('# TYPE pagedserve:num_requests_running gauge\n'
                  'pagedserve:num_requests_running{engine="0",model_name="m"} 2.0\n'
                  'pagedserve:num_requests_running{engine="1",model_name="m"} 1.0\n'
                  '# TYPE pagedserve:num_requests_waiting gauge\n'
                  'pagedserve:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
                  '# TYPE pagedserve:kv_cache_usage_perc gauge\n'
                  'pagedserve:kv_cache_usage_perc{model_name="m"} 0.5\n')
    assert parse_load(pagedserve) == 7
    vllm = 'vllm:num_requests_running{model_name="a"} 3\nvllm:num_requests_waiting{model_name="a"} 0\n'
    assert parse_load(vllm) == 3
    for bad in ("process_cpu_seconds_total 1.0\n", "garbage {\n"):
        with pytest.raises(ValueError):
            parse_load(bad)


def test_events_end_and_bad_urls_and_the_command_line():
    assert _events_end(b"data: 1\n\ndata: 2\n\ndata: {") == 18 and _events_end(b"data: {") == 0
    assert _events_end(b"data: 1\r\n\r\n") == 11
    for bad in ([], ["localhost:8000"], ["http://a:1", "http://a:1/"]):
        with pytest.raises(ValueError, match="backend"):
            Router(bad)
    args = build_parser().parse_args(["router", "--backend", "http://a:1", "--backend", "http://b:2",
                                      "--health-interval", "0.5", "--backend-api-key", "k"])
    assert args.backend == ["http://a:1", "http://b:2"] and args.health_interval == 0.5
    assert args.backend_api_key == "k" and args.func.__name__ == "cmd_router"


# ---- servers in threads --------------------------------------------------------------------------------
class Backends:
    """Two pagedserve servers over two engines; a stopped one can be started again on its port."""

    def __init__(self) -> None:
        self.engines = [LLMEngine(EngineConfig(**CONFIG)) for _ in range(2)]
        self.model = self.engines[0].served_model_name
        self.ports = [free_port(), free_port()]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.servers: list[tuple[GracefulServer, threading.Thread] | None] = [None, None]
        for i in range(2):
            self.start(i)

    def start(self, i: int) -> None:
        app = build_app(self.engines[i], api_key=BACKEND_KEY, log_interval_s=0)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.ports[i], log_level="warning",
                                timeout_graceful_shutdown=5)
        server = GracefulServer(config, app.state.async_engine, shutdown_timeout_s=5)
        self.servers[i] = (server, run_in_thread(server))

    def stop(self, i: int) -> None:
        if self.servers[i] is not None:
            server, thread = self.servers[i]
            server.handle_exit(signal.SIGTERM, None)
            thread.join(30)
            assert not thread.is_alive()
            self.servers[i] = None

    def successes(self, i: int) -> float:
        """Finished requests, from the backend's own /metrics (every finish reason)."""
        text = httpx.get(f"{self.urls[i]}/metrics", headers=BACKEND_AUTH).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pagedserve:request_success_total{"))

    def wait_idle(self, timeout: float = 15.0) -> None:
        deadline = time.time() + timeout
        while any((s := e.stats()).num_running or s.num_waiting for e in self.engines):
            assert time.time() < deadline, "the backends did not go idle"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def backends():
    pool = Backends()
    yield pool
    for i in range(2):
        pool.stop(i)


@contextmanager
def router_at(urls: list[str], **kw) -> Iterator[tuple[str, Router]]:
    """A router app on a free port in a thread: its URL and its Router."""
    kw.setdefault("health_interval_s", 60.0)  # only the start-up check unless a test asks for more
    app = build_router_app(urls, **kw)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = run_in_thread(server)
    try:
        yield f"http://127.0.0.1:{port}", app.state.router
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive()


def _body(model: str, prompt, **kw) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **kw}


def _post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers or {}, timeout=120)


def _routed(router: Router) -> list[int]:
    return [b.routed for b in router.backends]


# ---- the two real backends ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_burst_spreads_over_both_backends_with_the_same_texts(backends):
    bodies = [_body(backends.model, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(bodies)) as pool:
        direct = list(pool.map(lambda b: _post(backends.urls[0], "/v1/completions", b, BACKEND_AUTH), bodies))
    before = [backends.successes(i) for i in range(2)]
    with router_at(backends.urls, backend_api_key=BACKEND_KEY) as (url, router):
        with ThreadPoolExecutor(len(bodies)) as pool:
            routed = list(pool.map(lambda b: _post(url, "/v1/completions", b), bodies))
        counts = _routed(router)
        bad = {"model": backends.model, "prompt": "x", "max_tokens": -1}  # a 400 passes through as it is
        r, d = _post(url, "/v1/completions", bad), _post(backends.urls[0], "/v1/completions", bad, BACKEND_AUTH)
        assert r.status_code == d.status_code == 400 and r.json() == d.json() and r.json()["error"]["param"]
        models = httpx.get(f"{url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [backends.model]
    assert all(r.status_code == 200 for r in routed + direct), [r.text for r in routed if r.status_code != 200]
    texts = [r.json()["choices"][0]["text"] for r in routed]
    assert texts == [r.json()["choices"][0]["text"] for r in direct] and len(set(texts)) > 6
    served = [backends.successes(i) - before[i] for i in range(2)]
    assert served == counts and sum(counts) == len(PROMPTS) and min(counts) >= 3, counts


@pytest.mark.slow
def test_streams_are_relayed_as_they_come_and_a_disconnect_aborts(backends):
    body = _body(backends.model, "Tell me about the sea.", max_tokens=12)
    chat = {"model": backends.model, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8,
            "temperature": 0}
    with router_at(backends.urls, backend_api_key=BACKEND_KEY) as (url, router):
        assert stream_text(url, body) == stream_text(backends.urls[1], body, BACKEND_AUTH)
        r, d = _post(url, "/v1/chat/completions", chat), _post(backends.urls[0], "/v1/chat/completions", chat,
                                                              BACKEND_AUTH)
        assert r.json()["choices"][0]["message"] == d.json()["choices"][0]["message"]
        tok = {"model": backends.model, "prompt": "Hello there"}
        assert _post(url, "/tokenize", tok).json() == _post(backends.urls[1], "/tokenize", tok, BACKEND_AUTH).json()
        backends.wait_idle()
        aborted = sum(e.stats().finished_by_reason.get("abort", 0) for e in backends.engines)
        long = _body(backends.model, "Write a very long story.", max_tokens=LONG_TOKENS, stream=True)
        with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=long) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            lines = s.iter_lines()  # held: a reader that is dropped closes its stream
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            assert sum(e.stats().num_running for e in backends.engines) == 1  # relayed while generating
        # The client left: the router closes its upstream stream and the backend aborts the request
        # (long before its end), and the router no longer counts it.
        backends.wait_idle(timeout=5)
        assert sum(e.stats().finished_by_reason.get("abort", 0) for e in backends.engines) == aborted + 1
        deadline = time.time() + 5
        while any(b.in_flight for b in router.backends):
            assert time.time() < deadline
            time.sleep(0.02)


@pytest.mark.slow
def test_a_shared_prefix_goes_to_the_same_backend(backends):
    with router_at(backends.urls, backend_api_key=BACKEND_KEY) as (url, router):
        def backend_of(path: str, body: dict) -> int:
            before = _routed(router)
            assert _post(url, path, body).status_code == 200
            after = _routed(router)
            return next(i for i in range(2) if after[i] > before[i])

        comp = "/v1/completions"
        # Equal (idle) loads: new prefixes take turns, so two in a row go to different backends...
        assert backend_of(comp, _body(backends.model, "Seagulls " * 8)) != \
            backend_of(comp, _body(backends.model, "Penguins " * 8))
        # ...but the same first block goes where it went before.
        first = backend_of(comp, _body(backends.model, SHARED + "How tall is the tallest one?"))
        assert backend_of(comp, _body(backends.model, SHARED + "Who keeps them?")) == first
        ids = list(range(100, 120))
        first = backend_of(comp, _body(backends.model, ids))
        assert backend_of(comp, _body(backends.model, ids[:16] + [5, 6])) == first
        sys_msg = {"role": "system", "content": SHARED}
        chats = [{"model": backends.model, "max_tokens": 2, "temperature": 0,
                  "messages": [sys_msg, {"role": "user", "content": q}]} for q in ("Why?", "When?")]
        assert backend_of("/v1/chat/completions", chats[0]) == backend_of("/v1/chat/completions", chats[1])


@pytest.mark.slow
def test_the_load_backends_report_steers_requests(backends):
    """Two long requests sent straight to backend 0: once the router's scrape sees them, new requests go to 1
    (which the scrapes see with at most the one request the router has open there)."""
    backends.wait_idle()
    long = _body(backends.model, "Write a very long story.", max_tokens=LONG_TOKENS, stream=True)
    with router_at(backends.urls, backend_api_key=BACKEND_KEY, health_interval_s=0.1) as (url, router), \
            httpx.Client(base_url=backends.urls[0], headers=BACKEND_AUTH, timeout=60) as http, ExitStack() as busy:
        streams = [busy.enter_context(http.stream("POST", "/v1/completions", json=long)) for _ in range(2)]
        readers = [s.iter_lines() for s in streams]  # held: a reader that is dropped closes its stream
        for lines in readers:
            next(line for line in lines if line.startswith("data: "))
        _wait_for(lambda: router.backends[0].reported_load == 2)
        for p in PROMPTS[:3]:
            assert _post(url, "/v1/completions", _body(backends.model, p)).status_code == 200
        assert _routed(router) == [0, 3]
        metrics = httpx.get(f"{url}/metrics").text
        assert _metric(metrics, "pagedserve_router:backend_load", backends.urls[0]) == 2
        assert _metric(metrics, "pagedserve_router:requests_routed_total", backends.urls[1]) == 3
    backends.wait_idle()


def _metric(text: str, name: str, backend: str) -> float:
    prefix = f'{name}{{backend="{backend}"}} '
    return float(next(line for line in text.splitlines() if line.startswith(prefix))[len(prefix):])


@pytest.mark.slow
def test_auth_at_the_router_and_toward_the_backends(backends):
    body = _body(backends.model, "Hello")
    key = {"Authorization": "Bearer router-key"}
    with router_at(backends.urls, api_key="router-key", backend_api_key=BACKEND_KEY) as (url, _):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for r in (_post(url, "/v1/completions", body, headers), httpx.get(f"{url}/v1/models", headers=headers),
                      httpx.get(f"{url}/metrics", headers=headers)):
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/health").status_code == 200  # open
        assert _post(url, "/v1/completions", body, key).status_code == 200  # sent on with the backend key
    with router_at(backends.urls, api_key=BACKEND_KEY) as (url, router):  # the client's header is forwarded
        assert _post(url, "/v1/completions", body, BACKEND_AUTH).status_code == 200
        assert all(b.error is None for b in router.backends)  # its key also reads the backends' /metrics
    with router_at(backends.urls) as (url, router):  # no key anywhere: the backends' 401 comes through
        r = _post(url, "/v1/completions", body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert all(b.healthy and b.error == "/metrics answered 401" for b in router.backends)


@pytest.mark.slow
def test_a_stopped_backend_is_routed_around_and_none_left_is_503(backends):
    urls = backends.urls
    try:
        with router_at(urls, backend_api_key=BACKEND_KEY) as (url, router), \
                router_at(urls, backend_api_key=BACKEND_KEY, health_interval_s=0.1) as (checked_url, checked):
            backends.stop(1)
            # No check has run since: requests in turn reach the stopped one, fail to connect, and are retried.
            for p in PROMPTS[:4]:
                r = _post(url, "/v1/completions", _body(backends.model, p))
                assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
            assert [b.failures for b in router.backends] == [0, 1] and _routed(router) == [4, 0]
            health = httpx.get(f"{url}/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            down = health.json()["backends"][1]
            assert down["url"] == urls[1] and not down["healthy"] and "ConnectError" in down["error"]
            metrics = httpx.get(f"{url}/metrics").text
            assert _metric(metrics, "pagedserve_router:backend_healthy", urls[1]) == 0
            assert _metric(metrics, "pagedserve_router:backend_healthy", urls[0]) == 1
            assert _metric(metrics, "pagedserve_router:backend_failures_total", urls[1]) == 1
            _wait_for(lambda: not checked.backends[1].healthy)  # the checks saw it too, with no request
            assert checked.backends[0].healthy

            backends.stop(0)
            for u in (url, checked_url):
                r = _post(u, "/v1/completions", _body(backends.model, "Anyone?"))
                err = r.json()["error"]
                assert r.status_code == 503 and err["code"] == 503 and err["param"] is None and err["message"]
                assert err["type"] == "service_unavailable"
            assert httpx.get(f"{url}/health").status_code == 503
            assert 'pagedserve_router:requests_unroutable_total 1.0' in httpx.get(f"{url}/metrics").text

            backends.start(1)  # back on its port: the next check makes it healthy again
            _wait_for(lambda: checked.backends[1].healthy)
            assert _post(checked_url, "/v1/completions", _body(backends.model, "Back?")).status_code == 200
    finally:
        for i in range(2):
            if backends.servers[i] is None:
                backends.start(i)


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


# ---- fake backends: a 503, a death mid-response --------------------------------------------------------------
def _fake_backend(name: str, busy: bool = False) -> FastAPI:
    """vLLM's gauge names (load 3). POST /v1/completions: prompt "die" sends one event and a half, then the
    connection drops; otherwise 503 if `busy`, else {"backend": name}."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse('vllm:num_requests_running{model_name="m"} 2\n'
                                 'vllm:num_requests_waiting{model_name="m"} 1\n')

    @app.post("/v1/completions")
    async def completions(body: dict):
        if body.get("prompt") != "die":
            return JSONResponse({"backend": name}, status_code=503 if busy else 200)

        async def events():
            yield b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choi'
            raise RuntimeError("the backend died")

        return StreamingResponse(events(), media_type="text/event-stream" if body.get("stream") else "text/plain")

    return app


@contextmanager
def fakes(*apps: FastAPI) -> Iterator[list[str]]:
    servers = [uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="critical"))
               for app in apps]
    threads = [run_in_thread(server) for server in servers]
    try:
        yield [f"http://127.0.0.1:{server.config.port}" for server in servers]
    finally:
        for server, thread in zip(servers, threads, strict=True):
            server.should_exit = True
            thread.join(10)


def test_a_503_is_retried_on_another_backend():
    with fakes(_fake_backend("a", busy=True), _fake_backend("b")) as urls, router_at(urls) as (url, router):
        assert [b.reported_load for b in router.backends] == [3, 3]  # vLLM's gauges
        r = _post(url, "/v1/completions", {"prompt": "hi"})  # a first (a tie, its turn): 503, then b
        assert r.status_code == 200 and r.json() == {"backend": "b"}
        a = router.backends[0]
        assert not a.healthy and a.failures == 1 and a.error == "answered 503" and _routed(router) == [0, 1]


def test_a_backend_failing_mid_response():
    with fakes(_fake_backend("a")) as urls, router_at(urls) as (url, router):
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "die", "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and lines[0] == 'data: {"choices": [{"text": "a"}]}'
        assert "backend failed mid-stream" in json.loads(lines[1][6:])["error"]["message"]
        assert lines[2:] == ["data: [DONE]"]  # never the half event
        assert not router.backends[0].healthy and router.backends[0].failures == 1
        router.backends[0].healthy = True
        with pytest.raises(httpx.RemoteProtocolError):  # not streamed: the connection drops, no short 200
            httpx.post(f"{url}/v1/completions", json={"prompt": "die"})
        assert router.backends[0].failures == 2
