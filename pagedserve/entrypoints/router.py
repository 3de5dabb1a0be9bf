"""`pagedserve router`: one OpenAI-compatible endpoint in front of several servers (issue 18).

The backends are OpenAI-compatible servers of the same model: `pagedserve serve`, or vLLM. The router
forwards each request's body as it came, streams each response back as it arrives (SSE event by event),
and passes a backend's error responses through with their status and body.

Load: a backend's load is its running + waiting requests as its `/metrics` last reported them
(`pagedserve:num_requests_running` + `pagedserve:num_requests_waiting`, or vLLM's `vllm:` gauges,
summed over label sets), plus the requests the router has sent there since that scrape and that are
still in flight, so a burst spreads before the next scrape (requests sent before it are in the scrape). A backend
whose /metrics gives no load counts as the requests the router has open there.

Routing (engine/data_parallel.py's rule between replicas, in the spirit of sglang's cache-aware router,
with an exact first-block match instead of its radix tree): a prompt whose first block was routed before
goes to the backend that got it last (an LRU map of prefix hash -> backend: its prefix cache likely still
holds the block), unless that backend is unhealthy or its load exceeds the least loaded backend's by more
than `slack` requests; otherwise, and for prompts shorter than a block, it goes to the least loaded
healthy backend (ties taken in turn), which becomes the prefix's home. The prefix is what the router can
see without a tokenizer (`prefix_key`): the first 16 token ids of a token-id prompt (one KV block at the
default --block-size); for a text prompt its first 64 characters (about 16 tokens of English); for a chat
the first 64 characters of its messages' text, each written "role: content\\n" (the chat template, which
the router does not know, only adds the same text around them). For several prompts, the first one.

Health: every `health_interval_s` the router GETs each backend's /health (200: healthy, anything else
or no answer: unhealthy) and /metrics (the load). A backend that refuses the connection, times out or
answers 503 before anything was sent to the client is marked unhealthy at once and the request is tried
once more on another healthy backend; the next health check that passes makes it healthy again. A
backend that fails mid-response cannot be retried: a stream gets an error event, another response is
cut (the connection is dropped, never a truncated 200 body that looks whole). With no healthy backend
the router answers 503 with OpenAI's error body. A client that disconnects closes the upstream request,
so the backend aborts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.core.affinity import PrefixAffinity
from pagedserve.entrypoints.openai.middleware import DEFAULT_MAX_BODY_BYTES, RequestGuard
from pagedserve.metrics import CONTENT_TYPE

logger = logging.getLogger("pagedserve")

DEFAULT_HEALTH_INTERVAL_S = 2.0
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # longest wait for a backend's next byte (a long non-streamed completion)
CONNECT_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 5.0  # a busy backend may be slow to answer /metrics: not a reason to call it down
AFFINITY_SLACK = 4  # requests a prefix's home may be more loaded than the least loaded backend
MAX_AFFINITY_PREFIXES = 65_536  # prefixes remembered (the least recently routed forgotten first)
PREFIX_TOKENS = 16  # one KV block at the default --block-size
PREFIX_CHARS = 64  # about 16 tokens of English text
MAX_TRIES = 2  # the first try and one retry on another backend
DISCONNECT_POLL_S = 0.2  # how often a client waiting for a non-streamed answer is checked
PROXIED = (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
           ("POST", "/detokenize"), ("GET", "/v1/models"))
ROUTED_BY_PREFIX = frozenset({"/v1/completions", "/v1/chat/completions"})
LOAD_GAUGES = frozenset({"pagedserve:num_requests_running", "pagedserve:num_requests_waiting",
                         "vllm:num_requests_running", "vllm:num_requests_waiting"})
# Per-connection headers (RFC 9110 7.6.1) and those httpx sets itself are not forwarded either way.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                        "upgrade", "proxy-authorization", "proxy-authenticate"})
NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "accept-encoding"}
NOT_RETURNED = HOP_BY_HOP | {"content-length", "content-encoding"}  # bodies are relayed decoded


# ---- what the router knows about a backend ------------------------------------------------------------
@dataclass(eq=False)
class Backend:
    """One upstream server. `load` is what routing compares (module docstring)."""

    url: str
    index: int
    healthy: bool = False  # until the first health check passes
    reported_load: float = 0.0  # running + waiting at the last scrape of /metrics
    load_known: bool = False  # the last scrape gave a load (else: the router's own count of requests there)
    in_flight: int = 0  # requests the router has open there
    fresh: int = 0  # of those, the ones sent since the last scrape (not in reported_load yet)
    epoch: int = 0  # scrapes so far: tells a request whether it is still fresh
    error: str | None = None
    last_check: float | None = None
    routed: int = 0  # requests it answered (any status)
    failures: int = 0  # refused connections, timeouts, 503s, failures mid-response

    @property
    def load(self) -> float:
        return self.reported_load + self.fresh if self.load_known else float(self.in_flight)

    def lease(self) -> Callable[[], None]:
        """Count a request here until the returned function is called (calling it again does nothing)."""
        self.in_flight += 1
        self.fresh += 1
        epoch, released = self.epoch, False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1
                if self.epoch == epoch:
                    self.fresh -= 1

        return release

    def report_load(self, load: float) -> None:
        """A scrape: from now on the requests in flight are counted in `reported_load`."""
        self.reported_load, self.fresh, self.epoch, self.load_known = load, 0, self.epoch + 1, True

    def view(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "load": self.reported_load, "in_flight": self.in_flight,
                "error": self.error, "last_check": self.last_check}


def parse_load(metrics_text: str) -> float:
    """running + waiting requests from a backend's Prometheus text, summed over label sets (a model name,
    a data-parallel engine index...). ValueError if the text has neither gauge or does not parse."""
    total, seen = 0.0, False
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in LOAD_GAUGES:
                total += sample.value
                seen = True
    if not seen:
        raise ValueError("has no num_requests_running / num_requests_waiting gauge")
    return total


# ---- the prefix a request is routed by --------------------------------------------------------------------
def prefix_key(path: str, payload: object) -> int | None:
    """A hash of the request's first prompt block (module docstring), or None: too short, not a
    generating endpoint, or a body the backend will refuse anyway."""
    if path not in ROUTED_BY_PREFIX or not isinstance(payload, dict):
        return None
    if path == "/v1/chat/completions":
        return _text_key(_chat_text(payload.get("messages")))
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # several prompts: the first one
    if isinstance(prompt, str):
        return _text_key(prompt)
    head = prompt[:PREFIX_TOKENS] if isinstance(prompt, list) else []
    if len(head) == PREFIX_TOKENS and all(isinstance(t, int) for t in head):
        return hash(("tokens", tuple(head)))
    return None


def _text_key(text: str) -> int | None:
    return hash(("text", text[:PREFIX_CHARS])) if len(text) >= PREFIX_CHARS else None


def _chat_text(messages: object) -> str:
    """The messages' text in order, "role: content\\n" each (text parts of a content list joined)."""
    if not isinstance(messages, list):
        return ""
    lines = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        lines.append(f"{m.get('role', '')}: {content if isinstance(content, str) else ''}\n")
    return "".join(lines)


async def _payload(body: bytes) -> object:
    """The JSON body, for the prefix only (the body is forwarded as it came); None if it is not JSON."""
    try:
        if len(body) > 1 << 20:  # a large body is parsed off the event loop
            return await asyncio.to_thread(json.loads, body)
        return json.loads(body)
    except ValueError:
        return None


# ---- errors in OpenAI's shape ---------------------------------------------------------------------------
def openai_error(status: int, message: str, type_: str, code: int | str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class _ClientGone(Exception):
    """The client disconnected before the backend answered."""


# ---- the router -----------------------------------------------------------------------------------------
class Router:
    """The backends' state, the routing rule, the health checks and the proxying (module docstring)."""

    def __init__(
        self, backends: Sequence[str], slack: float = AFFINITY_SLACK, max_prefixes: int = MAX_AFFINITY_PREFIXES,
        health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        api_key: str | None = None, backend_api_key: str | None = None,
    ) -> None:
        urls = [u.rstrip("/") for u in backends]
        if not urls:
            raise ValueError("backend: give at least one backend URL")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"backend: {u!r} is not an http:// or https:// URL")
        if len(set(urls)) != len(urls):
            raise ValueError("backend: a URL is given twice")
        if health_interval_s <= 0:
            raise ValueError(f"health_interval: must be > 0, got {health_interval_s}")
        self.backends = [Backend(u, i) for i, u in enumerate(urls)]
        self.slack, self.max_prefixes = slack, max_prefixes
        self.health_interval_s, self.request_timeout_s = health_interval_s, request_timeout_s
        self.api_key, self.backend_api_key = api_key, backend_api_key
        self.num_unroutable = 0  # requests answered 503: no healthy backend
        self._affinity: PrefixAffinity[Backend] = PrefixAffinity(slack, max_prefixes)
        self._client: httpx.AsyncClient | None = None
        self._checker: asyncio.Task | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_RouterCollector(self))

    # ---- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Check every backend once (so the first requests know which are up), then keep checking."""
        timeout = httpx.Timeout(self.request_timeout_s, connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits)
        await self.check_all()
        self._checker = asyncio.create_task(self._health_loop(), name="pagedserve-router-health")

    async def stop(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
            self._checker = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ---- routing ----------------------------------------------------------------------------------------
    def choose(self, key: int | None, exclude: Sequence[Backend] = ()) -> Backend | None:
        """The backend for a request with prefix hash `key` (None: no prefix); None if none is healthy."""
        healthy = [b for b in self.backends if b.healthy and b not in exclude]
        if not healthy:
            return None
        return self._affinity.choose(healthy, lambda b: b.load, lambda b: b.index, len(self.backends), key)

    # ---- health -----------------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop the checks for good
                logger.exception("router: health check failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(b) for b in self.backends))

    async def _check(self, b: Backend) -> None:
        """/health decides healthy; /metrics gives the load (a healthy backend without it keeps serving,
        its load the requests the router has open there, with the reason in `error`)."""
        try:
            health = await self._client.get(f"{b.url}/health", timeout=HEALTH_TIMEOUT_S)
            metrics = await self._client.get(f"{b.url}/metrics", headers=self._backend_auth(None),
                                             timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as e:
            self.mark_down(b, _describe(e), failure=False)
            return
        finally:
            b.last_check = time.time()
        if health.status_code != 200:
            self.mark_down(b, f"/health answered {health.status_code}", failure=False)
            return
        if not b.healthy:
            logger.info("router: backend %s is healthy", b.url)
        b.healthy, b.error = True, None
        try:
            if metrics.status_code != 200:
                raise ValueError(f"answered {metrics.status_code}")
            b.report_load(parse_load(metrics.text))
        except ValueError as e:
            b.load_known, b.error = False, f"/metrics {e}"

    def mark_down(self, b: Backend, reason: str, failure: bool = True) -> None:
        """Unhealthy until a health check passes. `failure`: a request failed there (not a check)."""
        if b.healthy:
            logger.warning("router: backend %s is down: %s", b.url, reason)
        b.healthy, b.error = False, reason
        b.failures += failure

    def health(self) -> JSONResponse:
        up = any(b.healthy for b in self.backends)
        body = {"status": "ok" if up else "unavailable", "backends": [b.view() for b in self.backends]}
        return JSONResponse(body, status_code=200 if up else 503)

    # ---- proxying ---------------------------------------------------------------------------------------
    async def proxy(self, request: Request) -> Response:
        """Send the request to the backend `choose` picks; once more to another if that one fails
        before answering; 503 if no healthy backend is left."""
        body = await request.body()
        key = prefix_key(request.url.path, await _payload(body))
        tried: list[Backend] = []
        while len(tried) < MAX_TRIES and (backend := self.choose(key, exclude=tried)) is not None:
            tried.append(backend)
            response = await self._try(request, backend, body, last=len(tried) == MAX_TRIES)
            if response is not None:
                return response
        self.num_unroutable += 1
        detail = "; ".join(f"{b.url}: {b.error}" for b in tried or self.backends if b.error)
        message = "no healthy backend to serve the request" + (f" ({detail})" if detail else "")
        return openai_error(503, message, "service_unavailable", 503)

    async def _try(self, request: Request, backend: Backend, body: bytes, last: bool) -> Response | None:
        """The backend's response, streaming; None if it failed before answering (it is marked down)."""
        release, answered = backend.lease(), False
        try:
            upstream = await self._send(request, backend, body)
            answered = True
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it: nginx's "client closed request", for the log
        except httpx.TransportError as e:  # refused, timed out, closed before answering: nothing sent yet
            self.mark_down(backend, _describe(e))
            return None
        finally:
            if not answered:
                release()
        if upstream.status_code == 503 and not last:  # shutting down or its engine died: try another
            await upstream.aclose()
            release()
            self.mark_down(backend, "answered 503")
            return None
        backend.routed += 1
        return RelayResponse(upstream, release, on_error=lambda e: self.mark_down(backend, _describe(e)))

    async def _send(self, request: Request, backend: Backend, body: bytes) -> httpx.Response:
        """Send and wait for the response head; a client that leaves meanwhile cancels it (the backend
        sees the connection close and aborts the request)."""
        url = f"{backend.url}{request.url.path}" + (f"?{request.url.query}" if request.url.query else "")
        upstream = self._client.build_request(request.method, url, content=body,
                                              headers=self._forwarded_headers(request))
        sending = asyncio.ensure_future(self._client.send(upstream, stream=True))
        try:
            while True:
                done, _ = await asyncio.wait({sending}, timeout=DISCONNECT_POLL_S)
                if done:
                    return sending.result()
                if await request.is_disconnected():
                    raise _ClientGone
        finally:
            if not sending.done():
                sending.cancel()

    def _forwarded_headers(self, request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k not in NOT_FORWARDED}
        headers.update(self._backend_auth(request))
        return headers

    def _backend_auth(self, request: Request | None) -> dict[str, str]:
        """--backend-api-key if given; else the client's own Authorization header (for a health check:
        the router's --api-key, which the backends then share)."""
        if self.backend_api_key is not None:
            key = self.backend_api_key
        elif request is None:
            key = self.api_key
        else:
            auth = request.headers.get("authorization")
            return {"authorization": auth} if auth else {}
        return {"authorization": f"Bearer {key}"} if key is not None else {}


# ---- a backend's response, relayed --------------------------------------------------------------------
class RelayResponse(StreamingResponse):
    """A backend's response streamed through as it arrives. However it ends (done, client gone, backend
    gone) the upstream response is closed, which closes or frees the connection: a backend still
    generating sees the disconnect and aborts the request."""

    def __init__(self, upstream: httpx.Response, release: Callable[[], None],
                 on_error: Callable[[Exception], None]) -> None:
        headers = {k: v for k, v in upstream.headers.items() if k not in NOT_RETURNED}
        self.sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        super().__init__(self._relay(), status_code=upstream.status_code, headers=headers)
        self.upstream, self.release, self.on_error = upstream, release, on_error

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()
            await self.upstream.aclose()

    async def _relay(self) -> AsyncIterator[bytes]:
        pending = b""  # SSE: the start of an event not complete yet
        try:
            async for chunk in self.upstream.aiter_bytes():
                if not self.sse:
                    yield chunk
                    continue
                pending += chunk
                end = _events_end(pending)
                if end:
                    yield pending[:end]
                    pending = pending[end:]
        except httpx.HTTPError as e:
            self.on_error(e)
            if not self.sse:
                raise  # the connection is dropped: the client sees a failure, not a short body
            error = {"error": {"message": f"backend failed mid-stream: {_describe(e)}", "type": "server_error",
                               "param": None, "code": 502}}
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
            return
        if pending:
            yield pending


def _events_end(buffer: bytes) -> int:
    """Where the last complete SSE event in `buffer` ends (0: none), so a client never gets half an
    event followed by the router's error event."""
    ends = [i + len(sep) for sep in (b"\n\n", b"\r\n\r\n") if (i := buffer.rfind(sep)) >= 0]
    return max(ends, default=0)


# ---- /metrics -------------------------------------------------------------------------------------------
class _RouterCollector:
    """Reads the backends' state when /metrics is scraped."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        def per_backend(kind, name: str, doc: str, value_of):
            family = kind(f"pagedserve_router:{name}", doc, labels=["backend"])
            for b in self.router.backends:
                family.add_metric([b.url], value_of(b))
            return family

        yield per_backend(GaugeMetricFamily, "backend_healthy", "1 if the backend passed its last health check.",
                          lambda b: float(b.healthy))
        yield per_backend(GaugeMetricFamily, "backend_load", "Running + waiting requests at the last scrape, "
                          "plus those routed there since.", lambda b: b.load)
        yield per_backend(GaugeMetricFamily, "backend_in_flight", "Requests the router has open on the backend.",
                          lambda b: b.in_flight)
        yield per_backend(CounterMetricFamily, "requests_routed", "Requests the backend answered.",
                          lambda b: b.routed)
        yield per_backend(CounterMetricFamily, "backend_failures", "Requests that failed on the backend "
                          "(refused, timed out, 503, broken mid-response).", lambda b: b.failures)
        yield CounterMetricFamily("pagedserve_router:requests_unroutable", "Requests answered 503: no healthy "
                                  "backend.", value=self.router.num_unroutable)


# ---- the app --------------------------------------------------------------------------------------------
def build_router_app(
    backends: list[str], api_key: str | None = None, backend_api_key: str | None = None,
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S, slack: float = AFFINITY_SLACK,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The router's app: its own /health and /metrics, the OpenAI endpoints proxied (module docstring).
    api_key: clients must send it (checked before the body is read; /health stays open)."""
    router = Router(backends, slack=slack, health_interval_s=health_interval_s,
                    request_timeout_s=request_timeout_s, api_key=api_key, backend_api_key=backend_api_key)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="pagedserve router", lifespan=lifespan)
    app.state.router = router
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return openai_error(exc.status_code, str(exc.detail), "invalid_request_error", code)

    @app.exception_handler(Exception)
    async def _router_error(_: Request, exc: Exception):  # a gateway's failure is a 502, never a bare 500
        logger.exception("router: unhandled error")
        return openai_error(502, f"router error: {_describe(exc)}", "server_error", 502)

    @app.get("/health")
    async def health():
        return router.health()

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE)

    for method, path in PROXIED:
        app.add_api_route(path, router.proxy, methods=[method], include_in_schema=False)
    return app
