"""Prometheus metrics with vLLM's names under the `pagedserve:` prefix (units: seconds).

Gauges and counters are read from the engine when /metrics is scraped (a custom collector), so the
engine keeps plain integer counters and knows nothing about Prometheus. With data parallelism every
series carries vLLM's `engine="<replica index>"` label (the replicas' stats as last reported).
Latency histograms are fed by the async engine's loop as tokens arrive. Each server app owns its own
CollectorRegistry, so tests can build several apps in one process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from pagedserve.engine.engine import LLMEngine
    from pagedserve.engine.stats import EngineStats
    from pagedserve.outputs import RequestOutput

logger = logging.getLogger("pagedserve")

PREFIX = "pagedserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Reads the engine's running totals at scrape time. With engine labels (data parallelism), the
    engine is a DPEngineView: one series per replica, labelled engine="<index>" as vLLM does."""

    def __init__(self, engine: LLMEngine, engine_labels: list[str] | None = None) -> None:
        self.engine = engine
        self.engine_labels = engine_labels

    def collect(self):
        name = self.engine.served_model_name
        if self.engine_labels is None:
            per_engine = [([name], self.engine.stats())]
            labels = ["model_name"]
        else:
            per_engine = [([name, label], s)
                          for label, s in zip(self.engine_labels, self.engine.replica_stats(), strict=True)]
            labels = ["model_name", "engine"]

        def family(kind, metric: str, doc: str, value_of, extra: str | None = None):
            f = kind(PREFIX + metric, doc, labels=labels + ([extra] if extra else []))
            for values, stats in per_engine:
                value = value_of(stats)
                if extra is None:
                    f.add_metric(values, value)
                else:  # value: [(extra label value, value)]
                    for key, v in value:
                        f.add_metric(values + [key], v)
            return f

        def gauge(metric: str, doc: str, value_of) -> GaugeMetricFamily:
            return family(GaugeMetricFamily, metric, doc, value_of)

        def counter(metric: str, doc: str, value_of, extra: str | None = None) -> CounterMetricFamily:
            return family(CounterMetricFamily, metric, doc, value_of, extra)

        yield gauge("num_requests_running", "Requests in the running batch.", lambda s: s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", lambda s: s.kv_cache_usage)
        yield counter("num_preemptions", "Preemptions (recompute) so far.", lambda s: s.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens received.", lambda s: s.num_prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", lambda s: s.num_generation_tokens)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      lambda s: s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda s: s.prefix_cache_hits)
        yield counter("request_success", "Finished requests by finish reason.",
                      lambda s: sorted(s.finished_by_reason.items()), extra="finished_reason")
        specs = [s for _, s in per_engine if s.spec_decode is not None]
        if specs:  # speculative decoding, with vLLM's names (every replica runs the same config)
            per_engine = [(v, s) for v, s in per_engine if s.spec_decode is not None]
            yield counter("spec_decode_num_drafts", "Draft proposals verified (one per request per step).",
                          lambda s: s.spec_decode.num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                          lambda s: s.spec_decode.num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens the target accepted.",
                          lambda s: s.spec_decode.num_accepted_tokens)
            yield counter("spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position.",
                          lambda s: [(str(pos), c) for pos, c in enumerate(s.spec_decode.accepted_per_pos)],
                          extra="position")


@dataclass(frozen=True, slots=True)
class _Latencies:
    """The latency histograms of one engine (the labelled children)."""

    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    queue_time: Histogram


class EngineMetrics:
    def __init__(self, engine: LLMEngine, registry: CollectorRegistry | None = None,
                 engine_labels: list[str] | None = None) -> None:
        """engine_labels: data parallelism — `engine` is a DPEngineView and every series carries
        engine="<label>" (one per replica, in replica order); `observe` then names the replica."""
        self.engine = engine
        self.registry = registry or CollectorRegistry()
        self.registry.register(_EngineCollector(engine, engine_labels))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc. (soak runs read RSS)
        labels = ["model_name"] if engine_labels is None else ["model_name", "engine"]
        self.model_name = engine.served_model_name
        specs = (("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
                 ("inter_token_latency_seconds", "Time between two output tokens.", ITL_BUCKETS),
                 ("time_per_output_token_seconds", "Time per output token (same as ITL).", ITL_BUCKETS),
                 ("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS),
                 ("request_queue_time_seconds", "Arrival to first scheduled.", E2E_BUCKETS))
        parents = [Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)
                   for name, doc, buckets in specs]
        if engine_labels is None:
            self._latencies = {None: _Latencies(*(h.labels(self.model_name) for h in parents))}
        else:
            self._latencies = {label: _Latencies(*(h.labels(self.model_name, label) for h in parents))
                               for label in engine_labels}
        first = next(iter(self._latencies.values()))
        self.ttft, self.itl, self.tpot, self.e2e, self.queue_time = (
            first.ttft, first.itl, first.tpot, first.e2e, first.queue_time)
        self._last: dict[str, tuple[float, int]] = {}  # request id → (last token time, tokens seen)
        self._log_state = self._snapshot(time.monotonic())

    # ---- fed by the async engine loop (one thread; with data parallelism, one per replica) ------------
    def observe(self, out: RequestOutput, now: float | None = None, engine: str | None = None) -> None:
        """Record latencies for one RequestOutput (all of its n samples together); `engine`: the label of
        the replica that produced it (data parallelism only)."""
        now = time.time() if now is None else now
        h = self._latencies[engine]
        m = out.metrics
        num_tokens = sum(len(o.token_ids) for o in out.outputs)
        prev = self._last.get(out.request_id)
        if prev is None:
            if num_tokens and m is not None and m.first_token_time is not None:
                h.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
                if m.first_scheduled_time is not None:
                    h.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
                self._last[out.request_id] = (now, num_tokens)
        elif num_tokens > prev[1]:
            per_token = (now - prev[0]) / (num_tokens - prev[1])
            for _ in range(num_tokens - prev[1]):
                h.itl.observe(per_token)
                h.tpot.observe(per_token)
            self._last[out.request_id] = (now, num_tokens)
        if out.finished:
            self._last.pop(out.request_id, None)
            if m is not None:
                h.e2e.observe(max(0.0, (m.finished_time or now) - m.arrival_time))

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- the periodic one-line log ---------------------------------------------------------------
    def _snapshot(self, t: float) -> tuple[float, EngineStats]:
        return t, self.engine.stats()

    def log_stats(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        t0, s0 = self._log_state
        t1, s1 = self._log_state = self._snapshot(now)
        dt = max(t1 - t0, 1e-9)
        queries = s1.prefix_cache_queries - s0.prefix_cache_queries
        hit = 100.0 * (s1.prefix_cache_hits - s0.prefix_cache_hits) / queries if queries > 0 else 0.0
        line = (
            f"Avg prompt throughput: {(s1.num_computed_prefill_tokens - s0.num_computed_prefill_tokens) / dt:.1f} "
            f"tokens/s, Avg generation throughput: "
            f"{(s1.num_generation_tokens - s0.num_generation_tokens) / dt:.1f} tokens/s, Running: "
            f"{s1.num_running} reqs, Waiting: {s1.num_waiting} reqs, KV cache usage: {100 * s1.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit:.1f}%"
        )
        if s1.spec_decode is not None:
            drafted = s1.spec_decode.num_draft_tokens - (s0.spec_decode.num_draft_tokens if s0.spec_decode else 0)
            kept = s1.spec_decode.num_accepted_tokens - (s0.spec_decode.num_accepted_tokens if s0.spec_decode else 0)
            line += (f", Spec decode: {kept} of {drafted} draft tokens accepted"
                     f" ({100.0 * kept / drafted if drafted else 0.0:.1f}%)")
        logger.info(line)
        return line
