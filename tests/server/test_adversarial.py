"""The project's adversarial suite (issue 12): a barrage of malformed and hostile requests over every
endpoint while victim streams run, and hypothesis-driven fuzzing of the request bodies. Every answer is a
4xx with OpenAI's error body or a valid 200; never a 5xx; no victim is harmed; the server is healthy
and gives the same greedy text afterwards."""

from __future__ import annotations

import itertools
import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import start_server, stream_text

from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine
from pagedserve.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.slow

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
# Values no field should choke on (the raw JSON texts stand for what json.dumps cannot write).
HOSTILE_VALUES = [None, -1, 0, 1, 2**31, 2**63, 2**64, -(2**64), 10**30, 1e308, -1e308, 1e-320, 0.5, "x", "",
                  "\ud800", True, [], [1, 2], ["\udfff"], {}, {"a": 1}, [[1, 2], [3]], "RAW:NaN", "RAW:Infinity",
                  "RAW:-Infinity"]
FIELDS = {
    CMPL: ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids",
           "min_tokens", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "echo",
           "best_of", "suffix", "stream", "stream_options", "ignore_eos", "include_stop_str_in_output", "model"],
    CHAT: ["messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "temperature", "n",
           "seed", "stop", "stream", "model"],
    "/tokenize": ["prompt", "messages", "add_special_tokens", "model"],
    "/detokenize": ["tokens", "model"],
}
BASE = {CMPL: {"prompt": "hi", "max_tokens": 3}, CHAT: {"messages": MSGS, "max_tokens": 3},
        "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1, 2]}}


def encode(body: dict) -> bytes:
    """JSON as a client would send it; "RAW:x" values go in unquoted (NaN, Infinity: Python's json.loads,
    and so the server, accept them)."""
    text = json.dumps(body)
    for raw in ("NaN", "-Infinity", "Infinity"):
        text = text.replace(f'"RAW:{raw}"', raw)
    return text.encode()


def barrage() -> list[tuple[str, bytes]]:
    cases = []
    for path, fields in FIELDS.items():
        for field, value in itertools.product(fields, HOSTILE_VALUES):
            if field in ("max_tokens", "max_completion_tokens") and (value is None or (
                    isinstance(value, int) and not isinstance(value, bool) and value > 8)):
                value = 2**63  # a valid huge (or absent: up to max_model_len) max_tokens would just run long
            if field == "n" and isinstance(value, int) and value > 128:
                value = 10**9
            cases.append((path, encode({**BASE[path], field: value})))
    # bodies that are not objects, or not JSON
    for path in FIELDS:
        for raw in (b"", b"[1, 2]", b'"text"', b"{not json", b"\xff\xfe", b"null", b'{"prompt": "hi"' * 3):
            cases.append((path, raw))
    return cases


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(dtype="float32"))
    app = build_app(engine, log_interval_s=0)
    srv, thread, url = start_server(app, timeout_graceful_shutdown=5)
    yield engine, url
    srv.handle_exit(signal.SIGTERM, None)
    thread.join(30)


def check_answer(r: httpx.Response, where) -> None:
    assert r.status_code < 500, (where, r.status_code, r.text[:300])
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert r.text.rstrip().endswith("data: [DONE]") and events, (where, r.text[:300])
        assert not any("error" in e for e in events), (where, events)
        return
    body = r.json()
    if r.status_code >= 400:
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (where, body)
    else:
        assert isinstance(body, dict) and ("choices" in body or "tokens" in body or "prompt" in body), (where, body)


def test_barrage_over_every_endpoint_harms_nobody(server):
    engine, url = server
    victim = {"prompt": "The history of the printing press", "max_tokens": 40, "temperature": 0,
              "ignore_eos": True}
    before = httpx.post(url + CMPL, json=victim, timeout=120).json()["choices"][0]["text"]
    cases = barrage()
    assert len(cases) >= 200
    statuses: dict[int, int] = {}
    with ThreadPoolExecutor(3) as victims, httpx.Client(base_url=url, timeout=120) as http:
        running = [victims.submit(stream_text, url, victim) for _ in range(3)]
        for path, raw in cases:
            r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            check_answer(r, (path, raw[:120]))
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert [v.result() for v in running] == [before] * 3
    assert statuses.get(400, 0) > 100 and statuses.get(200, 0) > 10, statuses
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.post(url + CMPL, json=victim, timeout=120).json()["choices"][0]["text"] == before
    s = engine.stats()
    assert s.num_unfinished_requests == s.num_running == s.num_waiting == 0


JSON_LEAF = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=12)
JSON = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=8)


@st.composite
def fuzzed_body(draw):
    path = draw(st.sampled_from(list(FIELDS)))
    body = dict(BASE[path])
    for field in draw(st.lists(st.sampled_from(FIELDS[path]), max_size=4, unique=True)):
        body[field] = draw(JSON)
    if path in (CMPL, CHAT):  # a valid request runs: keep it short
        body["max_tokens"] = draw(st.none() | st.integers(-3, 4))
        body["max_completion_tokens"] = None
        body.pop("stream", None)
    return path, body


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=fuzzed_body())
def test_fuzzed_bodies_never_get_a_5xx(server, case):
    engine, url = server
    path, body = case
    if body.get("max_tokens") is None and path in (CMPL, CHAT):
        body["max_tokens"] = 2
    r = httpx.post(url + path, content=encode(body), headers={"Content-Type": "application/json"}, timeout=120)
    check_answer(r, (path, body))
