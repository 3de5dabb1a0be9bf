"""`pagedserve bench`: each mode runs end to end and writes its JSON (fields checked, never the speed)."""

from __future__ import annotations

import argparse
import json

import pytest
from fastapi import Request
from live_server import start_server

from pagedserve.entrypoints.cli.bench import random_prompts, run_serve
from pagedserve.entrypoints.cli.main import main

pytestmark = pytest.mark.slow


def test_random_prompts_are_seeded_and_in_range():
    a, b = random_prompts(4, 16, 0), random_prompts(4, 16, 0)
    assert a == b and random_prompts(4, 16, 1) != a
    assert all(len(p) == 16 and all(1000 <= t < 20000 for t in p) for p in a)


def test_bench_throughput_json(tmp_path):
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--num-prompts", "8", "--input-len", "16", "--output-len", "8",
               "--dtype", "float32", "--quiet", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "throughput" and r["num_prompts"] == 8 and r["input_len"] == 16 and r["output_len"] == 8
    assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0 and r["elapsed_s"] > 0
    # ignore_eos + max_tokens: exactly 8 tokens per request, so the rates agree with each other.
    assert r["output_tokens_per_s"] == pytest.approx(8 * r["requests_per_s"], rel=1e-6)
    assert r["total_tokens_per_s"] == pytest.approx(24 * r["requests_per_s"], rel=1e-6)
    assert r["computed_prefill_tokens"] == 8 * 16 and r["machine"]["cores"] >= 1
    assert r["num_scheduler_steps"] == 8  # the offline API's runs of decode steps
    # Against this machine's GEMM roofline: the run's FLOPs at the measured rate over its time.
    roof = r["roofline"]
    assert roof["bound"] == "float32 GEMM" and roof["share"] == pytest.approx(
        roof["total_gflop"] / roof["gemm_gflops"] / r["elapsed_s"])


def test_bench_throughput_sampled(tmp_path):
    """--temperature / --top-p / --top-k / --min-p: every request samples with them, and the JSON says so."""
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "6", "--temperature",
               "0.8", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.01", "--dtype", "float32", "--quiet",
               "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.01}
    assert r["output_tokens_per_s"] == pytest.approx(6 * r["requests_per_s"], rel=1e-6)


def test_bench_latency_json(tmp_path):
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--input-len", "8", "--output-len", "6", "--num-iters", "2",
               "--dtype", "float32", "--quiet", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "latency" and r["num_iters"] == 2 and r["num_scheduler_steps"] == 8
    assert 0 < r["ttft_s_mean"] < r["e2e_s_mean"] and r["tpot_s_mean"] > 0
    assert r["decode_tokens_per_s"] == pytest.approx(1 / r["tpot_s_mean"])
    roof = r["roofline"]  # single-stream decode: bound by the bytes a step reads
    assert roof["bound"] == "memory read" and roof["share"] == pytest.approx(
        r["decode_tokens_per_s"] / roof["limit_decode_tokens_per_s"])


def test_bench_latency_compare_hf_in_another_dtype(tmp_path, hf_gguf_parse_once):
    """bf16 pagedserve against HF float32 in one run: the targets are ratios to HF's float32 rate."""
    out = tmp_path / "lat.json"
    # transformers still loads its model from the GGUF (the same model), parsing the file once, not twice.
    with hf_gguf_parse_once():
        rc = main(["bench", "latency", "--input-len", "8", "--output-len", "4", "--num-iters", "1", "--dtype",
                   "bfloat16", "--compare-hf", "--hf-dtype", "float32", "--quiet", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["dtype"] == "bfloat16" and r["hf"]["dtype"] == "float32"
    assert r["decode_tokens_per_s_ratio_vs_hf"] == pytest.approx(
        r["decode_tokens_per_s"] / r["hf"]["decode_tokens_per_s"])


def test_bench_serve_against_a_live_server(tmp_path):
    from pagedserve.config import EngineConfig
    from pagedserve.engine.engine import LLMEngine
    from pagedserve.entrypoints.openai.api_server import build_app

    srv, thread, url = start_server(build_app(LLMEngine(EngineConfig(dtype="float32")), log_interval_s=0))
    try:
        args = argparse.Namespace(base_url=url, served_model=None, api_key=None,
                                  num_prompts=6, input_len=12, output_len=5, seed=0,
                                  request_rate=float("inf"), max_concurrency=3)
        r = run_serve(args)
        # A short soak: requests for 3 s, half of them dropped part-way by the client.
        soak = run_serve(argparse.Namespace(**{**vars(args), "duration": 3.0, "abort_fraction": 0.5,
                                               "output_len": 16, "max_concurrency": 4}))
    finally:
        srv.should_exit = True
        thread.join(30)
    assert soak["dropped"] > 0 and soak["completed"] > 0 and soak["failed"] == 0, soak
    assert soak["num_prompts"] == soak["dropped"] + soak["completed"]
    assert soak["server_start"]["rss_bytes"] > 0 and soak["server_end"]["rss_bytes"] > 0
    assert soak["server_end"]["kv_cache_usage"] == 0 and soak["server_end"]["num_running"] == 0
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["model"] == "SmolLM2-135M-Instruct"
    for key in ("ttft_s_p50", "ttft_s_p99", "tpot_s_mean", "itl_s_p90", "output_tokens_per_s"):
        assert r[key] > 0, key
    assert r["ttft_s_p50"] <= r["ttft_s_p99"]


def test_bench_serve_opens_every_stream_it_is_asked_for():
    """128 prompts at once are 128 concurrent streams at the server (httpx's default pool had capped them at
    100: the other 28 waited for the first ones to finish, and `bench serve` measured a smaller batch than
    asked); --max-concurrency still caps them."""
    import asyncio

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse, StreamingResponse
    from live_server import free_port, run_in_thread

    app = FastAPI()
    state = {"open": 0, "peak": 0, "target": 0, "all_open": None}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return ""

    @app.post("/v1/completions")
    async def completions(request: Request):  # (Request: imported at module level, for FastAPI to resolve)
        await request.json()
        state["open"] += 1
        state["peak"] = max(state["peak"], state["open"])
        if state["open"] >= state["target"]:
            state["all_open"].set()
        try:  # each stream waits until `target` of them are open at once (or gives up after a while)
            await asyncio.wait_for(state["all_open"].wait(), 10)
        except TimeoutError:
            pass

        async def body():
            try:
                chunk = {"choices": [{"index": 0, "text": "x"}]}
                for _ in range(2):
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["open"] -= 1

        return StreamingResponse(body(), media_type="text/event-stream")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = run_in_thread(server)
    try:
        results = {}
        for prompts, concurrency in ((128, None), (12, 5)):
            state.update(peak=0, target=concurrency or prompts, all_open=asyncio.Event())
            args = argparse.Namespace(base_url=f"http://127.0.0.1:{port}", served_model="m", api_key=None,
                                      num_prompts=prompts, input_len=4, output_len=2, seed=0,
                                      request_rate=float("inf"), max_concurrency=concurrency)
            results[prompts] = (run_serve(args), state["peak"])
    finally:
        server.should_exit = True
        thread.join(30)
    r, peak = results[128]
    assert r["completed"] == 128 and r["failed"] == 0 and peak == 128
    r, peak = results[12]
    assert r["completed"] == 12 and r["failed"] == 0 and peak == 5
