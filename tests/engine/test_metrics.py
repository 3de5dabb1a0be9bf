"""Metrics and the async engine loop, on a fake engine (no model): fast and deterministic."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedserve.engine.stats import EngineStats
from pagedserve.metrics import EngineMetrics
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.sampling_params import SamplingParams


class FakeEngine:
    """Generates `max_tokens` tokens per request, one per step; step() raises while `fail` is set."""

    served_model_name = "fake"

    def __init__(self) -> None:
        self.num_preemptions = self.num_prompt_tokens = self.num_generation_tokens = 0
        self.num_computed_prefill_tokens = 0
        self.finished_by_reason = {"stop": 0, "length": 0, "abort": 0}
        self.parents: dict[str, list] = {}
        self.fail = False

    def stats(self) -> EngineStats:
        # KV usage 0.25 (1 of 4 blocks); 10 prompt tokens looked up in the prefix cache, 4 found.
        return EngineStats(
            step_count=0, num_running=0, num_waiting=0, num_unfinished_requests=len(self.parents),
            num_kv_blocks=4, num_used_blocks=1, num_cached_free_blocks=0, num_free_blocks=3,
            num_preemptions=self.num_preemptions, num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_computed_prefill_tokens=self.num_computed_prefill_tokens, prefix_cache_queries=10,
            prefix_cache_hits=4, finished_by_reason=dict(self.finished_by_reason),
        )

    def add_request(self, rid, prompt, params, arrival_time=None):
        if params.max_tokens > 100:
            raise ValueError("max_tokens: too many for the fake engine")
        self.parents[rid] = [[], params.max_tokens, RequestMetrics(arrival_time=arrival_time)]
        self.num_prompt_tokens += 3

    def has_unfinished_requests(self):
        return bool(self.parents)

    def _out(self, rid, reason=None):
        tokens, _, m = self.parents[rid]
        o = CompletionOutput(0, "x" * len(tokens), list(tokens), finish_reason=reason)
        return RequestOutput(rid, None, [1, 2, 3], [o], reason is not None, metrics=m)

    def step(self):
        if self.fail:
            raise RuntimeError("boom")
        outs = []
        for rid, (tokens, max_tokens, m) in list(self.parents.items()):
            tokens.append(7)
            m.first_token_time = m.first_token_time or m.arrival_time + 0.01
            self.num_generation_tokens += 1
            done = len(tokens) >= max_tokens
            outs.append(self._out(rid, "length" if done else None))
            if done:
                self.finished_by_reason["length"] += 1
                del self.parents[rid]
        return outs

    def abort_request(self, ids):
        ids = [ids] if isinstance(ids, str) else ids
        outs = [self._out(rid, "abort") for rid in ids if rid in self.parents]
        for rid in ids:
            self.parents.pop(rid, None)
        return outs

    def abort_all(self):
        return self.abort_request(list(self.parents))


def test_metrics_render_and_observe():
    engine = FakeEngine()
    m = EngineMetrics(engine)
    rm = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0)
    first = RequestOutput("r", None, [1], [CompletionOutput(0, "a", [5])], False, metrics=rm)
    m.observe(first, now=101.0)
    rm.finished_time = 103.0
    done = CompletionOutput(0, "abc", [5, 6, 7], finish_reason="length")
    last = RequestOutput("r", None, [1], [done], True, metrics=rm)
    m.observe(last, now=103.0)
    text = m.render().decode()
    assert 'pagedserve:time_to_first_token_seconds_sum{model_name="fake"} 1.0' in text
    assert 'pagedserve:inter_token_latency_seconds_count{model_name="fake"} 2.0' in text
    assert 'pagedserve:inter_token_latency_seconds_sum{model_name="fake"} 2.0' in text
    assert 'pagedserve:e2e_request_latency_seconds_sum{model_name="fake"} 3.0' in text
    assert 'pagedserve:kv_cache_usage_perc{model_name="fake"} 0.25' in text
    assert 'pagedserve:prefix_cache_hits_total{model_name="fake"} 4.0' in text
    assert "pagedserve:request_success_total" in text
    line = m.log_stats()
    assert "KV cache usage: 25.0%" in line and "Running: 0 reqs" in line
    EngineMetrics(engine)  # a second registry for the same engine: no duplicate-name clash


def test_async_engine_streams_aborts_and_survives_errors():
    engine = FakeEngine()
    aengine = AsyncLLMEngine(engine, log_interval_s=0)
    aengine.start()

    async def main():
        outs = [o async for o in aengine.generate("a", "p", SamplingParams(max_tokens=5))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5

        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in aengine.generate("b", "p", SamplingParams(max_tokens=1000)):
                pass

        # Closing the generator early aborts the request in the engine.
        gen = aengine.generate("c", "p", SamplingParams(max_tokens=100))
        await gen.__anext__()
        await gen.aclose()
        for _ in range(100):
            if "c" not in engine.parents:
                break
            await asyncio.sleep(0.01)
        assert "c" not in engine.parents

        # A step that raises fails the requests in flight, and the loop keeps serving.
        engine.fail = True
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in aengine.generate("d", "p", SamplingParams(max_tokens=5)):
                pass
        engine.fail = False
        outs = [o async for o in aengine.generate("e", "p", SamplingParams(max_tokens=3))]
        assert outs[-1].finished

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
        assert aengine.is_running
    finally:
        aengine.shutdown()
    assert not aengine.is_running


def test_a_reader_that_never_reads_holds_one_pending_output():
    """Outputs are cumulative, so the collector keeps only the latest per request: a client that stops
    reading costs one output, not one per generated token (issue 12's bounded delivery)."""
    from pagedserve.engine.async_engine import OutputCollector

    class Long(FakeEngine):
        def add_request(self, rid, prompt, params, arrival_time=None):
            self.parents[rid] = [[], params.max_tokens, RequestMetrics(arrival_time=arrival_time)]

    engine = Long()
    aengine = AsyncLLMEngine(engine, log_interval_s=0)
    aengine.start()

    async def main():
        collector = OutputCollector()
        await aengine.add_request("slow", "p", SamplingParams(max_tokens=2000), collector)
        await aengine.add_request("slow2", "p", SamplingParams(max_tokens=60), collector)
        while engine.parents:  # 2,000 steps, each delivering an output, none of them read
            await asyncio.sleep(0.005)
            assert collector.num_pending <= 2
        await asyncio.sleep(0.05)
        latest = await collector.get()
        assert set(latest) == {"slow", "slow2"} and collector.num_pending == 0
        assert latest["slow"].finished and len(latest["slow"].outputs[0].token_ids) == 2000
        assert latest["slow2"].finished and len(latest["slow2"].outputs[0].token_ids) == 60

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        aengine.shutdown()


def test_unhealthy_while_a_step_hangs_with_work_pending():
    import threading

    release = threading.Event()

    class Hanging(FakeEngine):
        def step(self):
            release.wait(5)
            return super().step()

    engine = Hanging()
    aengine = AsyncLLMEngine(engine, log_interval_s=0, stall_timeout_s=0.2)
    assert aengine.unhealthy_reason() == "engine loop is not running"
    aengine.start()

    async def main():
        assert aengine.unhealthy_reason() is None  # idle: healthy however long nothing happens
        await asyncio.sleep(0.3)
        assert aengine.unhealthy_reason() is None
        gen = aengine.generate("h", "p", SamplingParams(max_tokens=2))
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.6)
        reason = aengine.unhealthy_reason()
        assert reason is not None and "no progress" in reason
        release.set()
        await task
        async for _ in gen:
            pass
        await asyncio.sleep(0.05)
        assert aengine.unhealthy_reason() is None

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        release.set()
        aengine.shutdown()


def test_request_timeout_fails_only_the_old_request():
    from pagedserve.engine.async_engine import RequestTimeoutError

    class Slow(FakeEngine):
        def step(self):
            time.sleep(0.02)
            return super().step()

    engine = Slow()
    aengine = AsyncLLMEngine(engine, log_interval_s=0, request_timeout_s=0.5)
    aengine.start()

    async def main():
        async def run(rid, n):
            return [o async for o in aengine.generate(rid, "p", SamplingParams(max_tokens=n))]

        old = asyncio.ensure_future(run("old", 100))  # ~2 s of steps: past the timeout
        quick = await run("quick", 5)  # ~0.1 s: well within it
        assert quick[-1].finished and quick[-1].outputs[0].finish_reason == "length"
        with pytest.raises(RequestTimeoutError, match="timed out after 0.5 s"):
            await old
        assert "old" not in engine.parents  # aborted in the engine too

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        aengine.shutdown()
