"""Data parallelism (issue 18): `--data-parallel-size 2` behind one API server. Two replica processes on the
bundled model (spawned once for the module), compared with one in-process engine; the routing rule and
the stats arithmetic on their own (no processes)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import start_server

from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import EngineDeadError
from pagedserve.engine.data_parallel import DPAsyncEngine, Router, sum_stats
from pagedserve.engine.stats import EngineStats
from pagedserve.entrypoints.openai.api_server import build_app
from pagedserve.sampling_params import SamplingParams

CONFIG = dict(dtype="float32", num_kv_blocks=48, max_num_seqs=8, max_model_len=256)
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is",
           "My favourite colour is", "In 1969, the first", "Water boils at", "The three primary colours are"]
LONG = "Here is a long story about a lighthouse keeper who lived alone on a rocky island far away, and"


# ---- the rule and the arithmetic, without processes ------------------------------------------------
def test_router_prefers_the_prefix_home_within_the_slack():
    r = Router(block_size=4, slack=2)
    a, b = [1, 2, 3, 4, 9], [1, 2, 3, 4, 8, 8]  # same first block
    home = r.choose(a, [0, 0])
    assert r.choose(b, [0, 0]) == home  # an idle tie: affinity wins over taking turns
    other = 1 - home
    loads = [0, 0]
    loads[home], loads[other] = 2, 0
    assert r.choose(b, loads) == home  # within the slack
    loads[home] = 3
    assert r.choose(b, loads) == other  # beyond it: the least loaded, which becomes the home
    loads[home] = 0
    loads[other] = 1
    assert r.choose(a, loads) == other
    assert r.choose(a, [None, 5] if other == 1 else [5, None]) == other  # only live replicas
    with pytest.raises(EngineDeadError):
        r.choose(a, [None, None])


def test_router_balances_short_prompts_and_forgets_old_prefixes():
    r = Router(block_size=16, max_prefixes=2)
    assert sorted(r.choose([1, 2], [0, 0]) for _ in range(4)) == [0, 0, 1, 1]  # ties taken in turn
    assert r.choose([5], [3, 1]) == 1 and r.choose(None, [0, 2]) == 0
    for k in range(3):
        r.choose([k] * 16, [0, 0])
    assert len(r._affinity._home) == 2 and (0,) * 16 not in r._affinity._home


def _stats(**kw) -> EngineStats:
    base = dict(step_count=1, num_running=1, num_waiting=0, num_unfinished_requests=1, num_kv_blocks=10,
                num_used_blocks=5, num_cached_free_blocks=0, num_free_blocks=5, num_preemptions=0,
                num_prompt_tokens=7, num_generation_tokens=3, num_computed_prefill_tokens=7,
                prefix_cache_queries=7, prefix_cache_hits=0, finished_by_reason={"stop": 1, "length": 2})
    return EngineStats(**{**base, **kw})


def test_sum_stats_adds_the_replicas():
    total = sum_stats([_stats(), _stats(num_used_blocks=0, finished_by_reason={"length": 1, "abort": 4})])
    assert total.num_running == 2 and total.num_prompt_tokens == 14 and total.num_kv_blocks == 20
    assert total.kv_cache_usage == 0.25
    assert total.finished_by_reason == {"stop": 1, "length": 3, "abort": 4}


def test_offline_llm_names_data_parallel_size():
    from pagedserve import LLM

    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size"):
        DPAsyncEngine(EngineConfig(data_parallel_size=1))


# ---- two replicas behind one server ------------------------------------------------------------------
def reference_texts() -> list[str]:
    """DP=1: the same prompts through one in-process engine."""
    from pagedserve import LLM

    llm = LLM(**CONFIG)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def dp():
    with ThreadPoolExecutor(1) as pool:  # the reference engine loads while the replicas do
        ref = pool.submit(reference_texts)
        aengine = DPAsyncEngine(EngineConfig(data_parallel_size=2, **CONFIG), log_interval_s=0)
        ref.result()
    app = build_app(aengine.view, async_engine=aengine, log_interval_s=0)
    server, thread, url = start_server(app, timeout_graceful_shutdown=5)
    aengine.reference = ref.result()
    yield aengine, url
    server.handle_exit(signal.SIGTERM, None)
    thread.join(30)
    assert not thread.is_alive() and not aengine.is_running
    assert not any(r.process.is_alive() for r in aengine.replicas)


def complete(url: str, prompt: str, max_tokens: int = 12) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def metric(text: str, name: str, **labels) -> float:
    """The value of one series; every label given must match."""
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    raise AssertionError(f"no series {name} {labels}")


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


def wait_for(cond, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def idle(aengine: DPAsyncEngine) -> bool:
    return all(s.num_running == 0 and s.num_waiting == 0 and s.num_used_blocks == 0
               for s, r in zip(aengine.view.replica_stats(), aengine.replicas, strict=True) if r.alive)


def test_greedy_texts_equal_one_engine_and_both_replicas_work(dp):
    aengine, url = dp
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda p: complete(url, p), PROMPTS))
    assert texts == aengine.reference
    per = aengine.view.replica_stats()
    done = [s.finished_by_reason.get("length", 0) for s in per]
    assert sum(done) == len(PROMPTS) and min(done) >= 2, done  # both did work
    text = scrape(url)
    for i in (0, 1):
        assert metric(text, "pagedserve:request_success_total", engine=str(i), finished_reason="length") == done[i]
        assert metric(text, "pagedserve:e2e_request_latency_seconds_count", engine=str(i)) == done[i]
        assert metric(text, "pagedserve:num_requests_running", engine=str(i), model_name=MODEL) == 0
    assert 'engine="2"' not in text
    assert aengine.view.stats().num_generation_tokens == 12 * len(PROMPTS)


def test_same_first_block_goes_to_the_same_replica(dp):
    aengine, url = dp
    before = [s.num_prompt_tokens for s in aengine.view.replica_stats()]
    for ending in (" and a dog.", " and a cat.", " and a bird."):
        complete(url, LONG + ending, max_tokens=2)
    grew = [s.num_prompt_tokens - b for s, b in zip(aengine.view.replica_stats(), before, strict=True)]
    assert sorted(g > 0 for g in grew) == [False, True], grew  # one replica took all three
    hits = [s.prefix_cache_hits for s in aengine.view.replica_stats()]
    assert max(hits) >= 32  # the second and third found the first's blocks there


def test_client_disconnect_frees_blocks_on_its_replica(dp):
    aengine, url = dp
    wait_for(lambda: idle(aengine), what="idle replicas")
    aborts = sum(s.finished_by_reason.get("abort", 0) for s in aengine.view.replica_stats())
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 3:
                break
        used = [s.num_used_blocks for s in aengine.view.replica_stats()]
        assert sorted(u > 0 for u in used) == [False, True], used  # held on one replica only
    wait_for(lambda: idle(aengine), what="the aborted request's blocks to be freed")
    stats = aengine.view.replica_stats()
    assert sum(s.finished_by_reason.get("abort", 0) for s in stats) == aborts + 1
    assert aengine.num_in_flight == 0


def test_structured_outputs_checked_here_and_constrained_there(dp):
    _, url = dp
    base = {"model": MODEL, "prompt": "The best season is", "temperature": 0, "max_tokens": 8}
    r = httpx.post(f"{url}/v1/completions", json={**base, "structured_outputs": {"regex": "(unclosed"}}, timeout=60)
    assert r.status_code == 400 and "invalid regex" in r.json()["error"]["message"]
    for _ in range(2):  # one per replica (idle ties are taken in turn)
        r = httpx.post(f"{url}/v1/completions", json={**base, "guided_choice": ["summer", "winter"]}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("summer", "winter"), r.text


def test_request_timeout_is_408_and_aborts_on_the_replica(dp):
    aengine, url = dp
    aengine.request_timeout_s = 0.5  # read by the supervisor thread at each check
    try:
        body = {"model": MODEL, "prompt": LONG, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
    finally:
        aengine.request_timeout_s = None
    wait_for(lambda: idle(aengine), what="the timed-out request's blocks to be freed")
    assert aengine.num_in_flight == 0


def test_dashboard_state_is_per_replica(dp):
    aengine, url = dp
    r = httpx.get(f"{url}/dashboard/state", params={"replica": 1}, timeout=30)
    assert r.status_code == 200 and r.json()["steps"]
    r = httpx.get(f"{url}/dashboard/state", params={"replica": 2}, timeout=30)
    assert r.status_code == 400 and "replica" in r.json()["error"]["message"]


def test_a_dead_replica_fails_its_requests_and_the_other_serves(dp):
    """Last in the module: it kills a replica."""
    aengine, url = dp
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    wait_for(lambda: idle(aengine), what="idle replicas")
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    events = []
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    break
        (victim,) = [i for i, s in enumerate(aengine.view.replica_stats()) if s.num_running]
        os.kill(aengine.replicas[victim].info.pid, signal.SIGKILL)
        t0 = time.time()
        events += [line[6:] for line in lines if line.startswith("data: ")]
        assert time.time() - t0 < 20
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert f"replica {victim}" in error["message"] and "died" in error["message"]
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200
    detail = health.json()
    assert detail["status"] == "degraded"
    assert [x["status"] for x in detail["replicas"]] == ["dead" if i == victim else "ok" for i in (0, 1)]
    survivor = 1 - victim
    before = aengine.view.replica_stats()[survivor].finished_by_reason.get("length", 0)
    assert [complete(url, p, max_tokens=3) != "" for p in PROMPTS[:3]] == [True] * 3
    assert aengine.view.replica_stats()[survivor].finished_by_reason.get("length", 0) == before + 3
    assert metric(scrape(url), "pagedserve:num_requests_running", engine=str(victim)) == 0
