"""End-to-end tests of the OpenAI-compatible server: a real uvicorn server on 127.0.0.1 (free port) in a
background thread, the bundled model in float32, and the official `openai` client."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")

from live_server import start_server, stream_text  # noqa: E402

from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.engine import LLMEngine  # noqa: E402
from pagedserve.entrypoints.cli.serve import GracefulServer  # noqa: E402
from pagedserve.entrypoints.openai.api_server import build_app  # noqa: E402

pytestmark = pytest.mark.slow

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class _Live:
    def __init__(self, engine: LLMEngine, server: GracefulServer, thread: threading.Thread, url: str) -> None:
        self.engine, self.server, self.thread, self.url = engine, server, thread, url
        self.http = httpx.Client(base_url=url, headers=AUTH, timeout=120)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        self.model = engine.served_model_name

    def stop(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)
        self.thread.join(30)


@pytest.fixture(scope="module")
def live():
    engine = LLMEngine(EngineConfig(dtype="float32"))
    app = build_app(engine, api_key=API_KEY, log_interval_s=1.0)
    server, thread, url = start_server(app, timeout_graceful_shutdown=5)
    live = _Live(engine, server, thread, url)
    yield live
    live.stop()
    assert not thread.is_alive()
    assert not app.state.async_engine.is_running


def _wait_idle(engine: LLMEngine, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while (s := engine.stats()).num_running or s.num_waiting or s.num_used_blocks:
        assert time.time() < deadline, "engine did not go idle"
        time.sleep(0.02)


# ---- the basics ------------------------------------------------------------------------------------
def test_health_models_and_auth(live):
    assert httpx.get(f"{live.url}/health").status_code == 200  # open without a key
    models = live.client.models.list()
    assert [m.id for m in models.data] == [live.model]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{live.url}/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401


def test_completion_and_usage(live):
    prompt = "The capital of France is"
    r = live.client.completions.create(model=live.model, prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == live.model and r.id
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason in ("length", "stop") and choice.text
    assert r.usage.prompt_tokens == len(live.engine.tokenizer.encode(prompt))
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    # Streamed: the same text, and a final usage chunk with the same counts.
    chunks = list(live.client.completions.create(
        model=live.model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()

    # Default max_tokens is 16 (OpenAI); token-id prompts and lists of prompts.
    ids = live.engine.tokenizer.encode(prompt)
    r2 = live.client.completions.create(model=live.model, prompt=[prompt, prompt], temperature=0,
                                        extra_body={"ignore_eos": True})
    assert [c.index for c in r2.choices] == [0, 1]
    assert r2.choices[0].text == r2.choices[1].text and r2.choices[0].text.startswith(choice.text)
    assert r2.usage.completion_tokens == 32 and r2.usage.prompt_tokens == 2 * len(ids)
    r3 = live.client.completions.create(model=live.model, prompt=[ids], max_tokens=8, temperature=0)
    assert r3.choices[0].text == choice.text

    r4 = live.client.completions.create(model=live.model, prompt=prompt, max_tokens=4, temperature=0,
                                        echo=True)
    assert r4.choices[0].text.startswith(prompt) and choice.text.startswith(r4.choices[0].text[len(prompt):])


def test_chat_streamed_and_not(live):
    messages = [{"role": "user", "content": "Name a primary color."}]
    r = live.client.chat.completions.create(model=live.model, messages=messages, max_tokens=12, temperature=0)
    assert r.object == "chat.completion"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    tok = live.engine.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens <= 12

    stream = live.client.chat.completions.create(
        model=live.model, messages=messages, max_completion_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.model_dump() == r.usage.model_dump()


def test_n_seed_and_stop(live):
    kw = dict(model=live.model, prompt="Once upon a time", max_tokens=6, temperature=1.0)
    a = live.client.completions.create(n=2, seed=1234, **kw)
    b = live.client.completions.create(n=2, seed=1234, **kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same text
    texts = ["", ""]
    for chunk in live.client.completions.create(n=2, seed=1234, stream=True, **kw):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    chat = dict(model=live.model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6,
                temperature=1.0, seed=7, n=2)
    c1 = live.client.chat.completions.create(**chat)
    c2 = live.client.chat.completions.create(**chat)
    assert len(c1.choices) == 2
    assert [c.message.content for c in c1.choices] == [c.message.content for c in c2.choices]

    # A stop string cuts the text before it; finish_reason is "stop".
    greedy = live.client.completions.create(model=live.model, prompt="1, 2, 3, 4,", max_tokens=12,
                                            temperature=0)
    text = greedy.choices[0].text
    stop = text.strip().split()[1] if len(text.split()) > 1 else text.strip()[:2]
    cut = live.client.completions.create(model=live.model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                         stop=[stop, "zzzz"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = live.client.completions.create(model=live.model, prompt="1, 2, 3, 4,", max_tokens=12,
                                              temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_logprobs(live):
    r = live.client.completions.create(model=live.model, prompt="Hello, my name is", max_tokens=5,
                                       temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert "".join(lp.tokens).startswith(r.choices[0].text[:1])

    c = live.client.chat.completions.create(model=live.model, messages=[{"role": "user", "content": "Hi!"}],
                                            max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)

    s = live.client.chat.completions.create(model=live.model, messages=[{"role": "user", "content": "Hi!"}],
                                            max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                            stream=True)
    streamed = [t for ch in s if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_tokenize_detokenize(live):
    r = live.http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == live.engine.tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == live.engine.max_model_len
    assert live.http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    chat = live.http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > r["count"]


# ---- concurrency: the continuous batch gives what one-at-a-time gives ---------------------------------
def test_concurrent_equals_sequential(live):
    # 16 distinct prompts, each sent twice at once: 32 requests in flight (the twins also share
    # prefix-cached blocks), compared with each distinct request run alone.
    distinct = [f"Q{i}: {i} plus {i} is" for i in range(16)]
    prompts = distinct + distinct[::-1]

    def ask(p: str) -> tuple[str, str]:
        r = live.client.completions.create(model=live.model, prompt=p, max_tokens=8, temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason

    alone = {p: ask(p) for p in distinct}
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(ask, prompts))
    assert together == [alone[p] for p in prompts]
    assert max(rec.num_running for rec in live.engine.step_records) > 1  # they really shared a batch
    _wait_idle(live.engine)


# ---- bad input: OpenAI error bodies, never a 5xx --------------------------------------------------------
def _bad_cases(model: str, max_model_len: int) -> list[tuple[str, object, int, str | None]]:
    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    return [
        (cmpl, {"model": model, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        (cmpl, {"model": model, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        (cmpl, {"model": model, "prompt": "hi", "n": 0}, 400, "n"),
        (cmpl, {"model": model, "prompt": "hi", "top_p": 0}, 400, "top_p"),
        (cmpl, {"model": model, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        (cmpl, {"model": model, "prompt": "hi", "max_tokens": max_model_len}, 400, "max_tokens"),
        (cmpl, {"model": model, "prompt": ""}, 400, "prompt"),
        (cmpl, {"model": model, "prompt": []}, 400, "prompt"),
        (cmpl, {"model": model, "prompt": [[]]}, 400, "prompt"),
        (cmpl, {"model": model, "prompt": 5}, 400, "prompt"),
        (cmpl, {"model": model, "prompt": [10**9]}, 400, "prompt_token_ids"),
        (cmpl, {"model": model, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        (cmpl, {"model": model, "prompt": "hi", "logprobs": 50}, 400, "logprobs"),
        (cmpl, {"model": model, "prompt": "hi", "seed": 2**70}, 400, "seed"),
        (cmpl, {"model": model, "prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
        (cmpl, {"model": model, "prompt": "hi", "min_tokens": 20}, 400, "min_tokens"),
        (cmpl, {"model": model, "prompt": "hi", "stop": [""]}, 400, "stop"),
        (cmpl, {"model": model}, 400, "prompt"),
        (cmpl, [1, 2], 400, None),
        (cmpl, "{not json", 400, None),
        (cmpl, {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
        (chat, {"model": model, "messages": []}, 400, "messages"),
        (chat, {"model": model, "messages": "hi"}, 400, "messages"),
        (chat, {"model": model, "messages": [{"content": "no role"}]}, 400, "messages"),
        (chat, {"model": model, "messages": msgs, "max_tokens": -3}, 400, "max_tokens"),
        (chat, {"model": model, "messages": msgs, "max_completion_tokens": max_model_len}, 400, "max_tokens"),
        (chat, {"model": model, "messages": msgs, "top_logprobs": 2}, 400, "top_logprobs"),
        (chat, {"model": model, "messages": msgs, "n": 1000}, 400, "n"),
        (chat, {"model": "no-such-model", "messages": msgs}, 404, "model"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/v1/nothing-here", {}, 404, None),
    ]


def test_bad_inputs_get_openai_errors(live):
    for path, body, status, param in _bad_cases(live.model, live.engine.max_model_len):
        if isinstance(body, str):
            r = live.http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = live.http.post(path, json=body)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (body, err)
        assert err["param"] == param, (body, err)
    # The openai client maps them to its exceptions, and the server still answers afterwards.
    with pytest.raises(openai.BadRequestError):
        live.client.completions.create(model=live.model, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        live.client.completions.create(model="nope", prompt="hi")
    r = live.client.completions.create(model=live.model, prompt="Still alive?", max_tokens=3, temperature=0)
    assert r.choices[0].text
    assert live.http.get("/health").status_code == 200
    _wait_idle(live.engine)


def _hostile_cases(model: str, vocab: int) -> list[tuple[str, object, str]]:
    """Requests that once answered 500 or harmed their neighbours (issue 12): (path, body, param of the 400)."""
    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    return [
        (cmpl, {"model": model, "prompt": "hi", "stop_token_ids": [10**9], "min_tokens": 1}, "stop_token_ids"),
        (cmpl, {"model": model, "prompt": "hi", "stop_token_ids": [vocab + 5], "min_tokens": 1}, "stop_token_ids"),
        (cmpl, {"model": model, "prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids"),
        (cmpl, {"model": model, "prompt": "hi", "top_k": 2**63, "temperature": 0.8}, "top_k"),
        (cmpl, {"model": model, "prompt": "hi", "top_k": 10**30, "temperature": 0.8}, "top_k"),
        (cmpl, {"model": model, "prompt": "hi", "top_k": vocab + 1, "temperature": 0.8}, "top_k"),
        (cmpl, {"model": model, "prompt": "hi", "n": 128, "seed": 2**64 - 5}, "seed"),
        (cmpl, {"model": model, "prompt": "hi", "n": 4, "seed": 2**63 - 2}, "seed"),
        (cmpl, {"model": model, "prompt": "hi \ud800"}, "prompt"),
        (cmpl, {"model": model, "prompt": ["ok", "\udfff"]}, "prompt"),
        (cmpl, {"model": model, "prompt": "hi", "stop": ["\ud800"]}, "stop"),
        (cmpl, '{"prompt": "hi", "temperature": Infinity}', "temperature"),
        (cmpl, '{"prompt": "hi", "top_p": NaN}', "top_p"),
        (cmpl, {"model": model, "prompt": "hi", "temperature": 1e308}, "temperature"),
        (cmpl, {"model": model, "prompt": "hi", "repetition_penalty": 1e-320}, "repetition_penalty"),
        (cmpl, '{"prompt": "hi", "presence_penalty": -Infinity}', "presence_penalty"),
        (cmpl, '{"prompt": "hi", "min_p": NaN}', "min_p"),
        (cmpl, {"model": model, "prompt": "hi", "stop_token_ids": list(range(2000))}, "stop_token_ids"),
        (cmpl, {"model": model, "prompt": "hi", "n": 129}, "n"),
        (cmpl, {"model": model, "prompt": "hi", "stop": ["x"] * 40}, "stop"),
        (cmpl, {"model": model, "prompt": "hi", "stop": ["x" * 600]}, "stop"),
        (cmpl, {"model": model, "prompt": ["hi"] * 300}, "prompt"),
        (cmpl, {"model": model, "prompt": ["hi"] * 10, "n": 100}, "n"),
        (chat, {"model": model, "messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        (chat, {"model": model, "messages": [{"role": "\ud800", "content": "x"}]}, "messages"),
        (chat, {"model": "\ud800", "messages": msgs}, "model"),
        (chat, {"model": model, "messages": msgs, "stop_token_ids": [10**9], "min_tokens": 1}, "stop_token_ids"),
        ("/tokenize", {"model": model, "prompt": "\ud800"}, "prompt"),
    ]


def test_hostile_requests_get_400_and_harm_no_neighbour(live):
    """Each request that once broke the step for everyone is a 400 naming its field, while a victim stream
    runs; the victim gives the same text as alone, and nothing is left running."""
    _wait_idle(live.engine)
    victim = {"model": live.model, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
              "ignore_eos": True}
    alone = live.http.post("/v1/completions", json=victim).json()["choices"][0]["text"]

    vocab = live.engine.tokenizer.vocab_size
    with ThreadPoolExecutor(2) as pool:
        victims = [pool.submit(stream_text, live.url, victim, AUTH) for _ in range(2)]
        for path, body, param in _hostile_cases(live.model, vocab):
            # json.dumps escapes lone surrogates as \\udXXX, as a client's JSON encoder would send them.
            raw = body if isinstance(body, str) else json.dumps(body)
            r = live.http.post(path, content=raw.encode(), headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (path, body, r.status_code, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["message"], (body, err)
        assert [v.result() for v in victims] == [alone, alone]
    _wait_idle(live.engine)
    assert not live.engine.parents and live.http.get("/health").status_code == 200


# ---- disconnect frees the request at once ---------------------------------------------------------------
def test_disconnect_aborts_and_frees_blocks(live):
    _wait_idle(live.engine)
    body = {"model": live.model, "prompt": "Write a very long story.", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            assert live.engine.kv_manager.pool.num_used_blocks > 0
    # Connection closed mid-stream: the request leaves the batch and its blocks go back to the pool
    # (long before its 4000 tokens could have been generated).
    _wait_idle(live.engine, timeout=10)
    assert not live.engine.parents

    # Not streamed: a client that gives up (read timeout) has its request aborted too.
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=1.0) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={**body, "stream": False})
    assert live.engine.parents  # still running when the client left
    _wait_idle(live.engine, timeout=10)


def test_metrics(live):
    live.client.completions.create(model=live.model, prompt="Metrics", max_tokens=3, temperature=0,
                                   extra_body={"ignore_eos": True})
    text = live.http.get("/metrics").text
    for name in (
        "pagedserve:num_requests_running", "pagedserve:num_requests_waiting",
        "pagedserve:kv_cache_usage_perc", "pagedserve:num_preemptions_total",
        "pagedserve:prompt_tokens_total", "pagedserve:generation_tokens_total",
        "pagedserve:time_to_first_token_seconds_bucket", "pagedserve:inter_token_latency_seconds_bucket",
        "pagedserve:time_per_output_token_seconds_bucket", "pagedserve:e2e_request_latency_seconds_bucket",
        "pagedserve:request_success_total", "pagedserve:prefix_cache_queries_total",
        "pagedserve:prefix_cache_hits_total",
    ):
        assert name in text, name

    def value(name: str, label: str = "") -> float:
        line = next(line for line in text.splitlines() if line.startswith(name + "{") and label in line)
        return float(line.rsplit(" ", 1)[1])

    assert value("pagedserve:prompt_tokens_total") == live.engine.num_prompt_tokens > 0
    assert value("pagedserve:generation_tokens_total") == live.engine.num_generation_tokens > 0
    assert value("pagedserve:request_success_total", 'finished_reason="length"') > 0
    assert value("pagedserve:e2e_request_latency_seconds_count") > 0
    assert value("pagedserve:num_requests_running") == 0
    assert httpx.get(f"{live.url}/metrics").status_code == 401


# ---- the front door: auth before the body, bounded bodies ------------------------------------------------
def _raw_request(url: str, head: str) -> bytes:
    """Send only the request head (no body) and read what the server answers."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def test_auth_is_checked_before_the_body_and_bodies_are_bounded(live):
    from pagedserve.entrypoints.openai.middleware import DEFAULT_MAX_BODY_BYTES

    big = DEFAULT_MAX_BODY_BYTES + 1
    # No key: 401 at once, although the announced body never comes.
    reply = _raw_request(live.url, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {big}\r\n"
                                   "Content-Type: application/json\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in reply
    # With the key, a body announced too large: 413 before reading it.
    reply = _raw_request(live.url, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {big}\r\n"
                                   f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413") and b"body_too_large" in reply

    def chunks():  # chunked, no length: cut off once past the bound
        piece = b" " * (1 << 20)
        for _ in range(DEFAULT_MAX_BODY_BYTES // len(piece) + 2):
            yield piece

    r = live.http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert live.http.get("/health").status_code == 200
    r = live.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


def test_abort_storm_leaves_the_engine_idle(live):
    """50 streams dropped at random points (some before their first token): afterwards nothing runs or
    waits and every KV block is back (but the prefix cache's), within a few seconds."""
    import random

    _wait_idle(live.engine)
    rng = random.Random(0)
    cut_after = [rng.randrange(0, 8) for _ in range(50)]

    def dropped(i: int) -> int:
        body = {"model": live.model, "prompt": f"Story {i}:", "max_tokens": 200, "temperature": 0.7,
                "seed": i, "ignore_eos": True, "stream": True, "n": 1 + i % 3}
        seen = 0
        with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if seen >= cut_after[i]:
                        break  # leaving the block closes the connection mid-stream
                    seen += line.startswith("data: ")
        return seen

    with ThreadPoolExecutor(16) as pool:
        assert sum(pool.map(dropped, range(50))) > 0
    _wait_idle(live.engine, timeout=10)
    s = live.engine.stats()
    assert s.num_running == s.num_waiting == s.num_unfinished_requests == s.num_used_blocks == 0
    r = live.http.post("/v1/completions", json={"prompt": "Still fine?", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and live.http.get("/health").status_code == 200


def test_shutdown_drains_then_fails_what_is_left(live):
    """Last test: SIGTERM stops new work (503), lets in-flight requests finish for shutdown_timeout_s,
    then ends the rest with an error (an error event in a stream, 503 otherwise), never a cut-off 200."""
    live.server.shutdown_timeout_s = 3.0
    long_body = {"model": live.model, "prompt": "Count forever:", "max_tokens": 4000, "ignore_eos": True}
    short_body = {"model": live.model, "prompt": "Say hi.", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    events: list[dict] = []
    with ThreadPoolExecutor(3) as pool, httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as http:
        cut = pool.submit(live.http.post, "/v1/completions", json=long_body)
        with http.stream("POST", "/v1/completions", json={**long_body, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            short = pool.submit(live.http.post, "/v1/completions", json=short_body)
            time.sleep(0.3)
            t0 = time.time()
            live.server.handle_exit(signal.SIGTERM, None)
            time.sleep(0.2)
            refused = httpx.post(f"{live.url}/v1/completions", json=short_body, headers=AUTH, timeout=10)
            health = httpx.get(f"{live.url}/health", timeout=10)
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        assert refused.status_code == 503 and health.status_code == 503
        assert short.result().status_code == 200  # finished within the drain
        assert short.result().json()["choices"][0]["finish_reason"] == "length"
        assert cut.result().status_code == 503  # not a 200 with a truncated text
        assert "error" in events[-1]
        assert all(e["choices"][0]["finish_reason"] != "abort" for e in events if e.get("choices"))
    live.thread.join(30)
    assert 2.5 < time.time() - t0 < 20
    assert not live.thread.is_alive()
    assert live.engine.stats().num_used_blocks == 0


# ---- a full queue answers 429 -----------------------------------------------------------------------------
def test_queue_full_gets_429_and_accepted_requests_complete():
    engine = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=1))
    app = build_app(engine, max_queue_len=2)
    server, thread, url = start_server(app, timeout_graceful_shutdown=5)
    body = {"prompt": "Count slowly:", "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    def post(_):
        start = time.time()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        return r, time.time() - start

    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(post, range(8)))
        ok = [r for r, _ in results if r.status_code == 200]
        full = [(r, dt) for r, dt in results if r.status_code == 429]
        assert len(ok) + len(full) == 8 and ok and full, [r.status_code for r, _ in results]
        for r in ok:
            assert r.json()["choices"][0]["finish_reason"] == "length"
        slowest_ok = max(dt for r, dt in results if r.status_code == 200)
        for r, dt in full:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "rate_limit_exceeded"
            assert dt < slowest_ok  # answered at once, not after waiting
        _wait_idle(engine)
    finally:
        server.handle_exit(signal.SIGTERM, None)
        thread.join(30)
