"""Data parallelism: N engine replicas, each in a process of its own, behind one API server.

`pagedserve serve --data-parallel-size N` starts N replica processes (multiprocessing 'spawn'; the loop
is engine/replica.py). Each builds its own LLMEngine from the server's config with data_parallel_size=1
and, unless --num-threads is given, cores // N torch threads: its own threads, KV pool and prefix
cache. `DPAsyncEngine` stands where AsyncLLMEngine stands for one engine (same methods, same errors),
and `DPEngineView` where the LLMEngine stands (tokenizer, model name, limits, grammar checks, stats).

In the API process, one sender thread per replica pickles commands onto its pipe (the event loop never
blocks on a pipe) and one reader thread per replica takes its outputs and stats and puts each output
into its request's OutputCollector; a supervisor thread expires timed-out requests, logs the stats line
and stops everything at shutdown.

Routing (`Router`): a replica's load is its running + waiting sequences as it last reported them, plus
the sequences sent to it since (its reports count what it has taken in). A prompt with at least one full
KV block (block_size tokens; text prompts are tokenized here) goes to the replica that got the last
prompt with the same first block — its prefix cache likely holds it — unless that replica's load exceeds
the least loaded one's by more than AFFINITY_SLACK sequences; then (and for shorter prompts) it goes to
the least loaded replica, ties taken in turn, and that replica becomes the prefix's home.

Limits as with one engine: `max_queue_len` applies per replica (each refuses a request when its own
waiting sequences would exceed it: up to N x max_queue_len wait in all, and since the router picks the
least loaded, a 429 means every replica is about full). The request timeout is kept here and aborts the
request on its replica. A client that goes away aborts its request on the replica holding it, which
frees its blocks there.

A replica that dies (its pipe closes): its in-flight requests end with EngineDeadError (503, or an error
event mid-stream), new requests go to the live ones only, and /health stays 200 with a body listing the
dead replica ("status": "degraded") — 503 only when every replica is dead or stalled. A dead replica is
not restarted. /metrics puts `engine="<index>"` on every series (vLLM's label; totals are a `sum()`
away); a dead replica's gauges drop to 0 and its counters stay at their last reported values. The
dashboard shows one replica at a time (`/dashboard/state?replica=I`, default 0) through a "trace"
command the replica answers.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.config import EngineConfig, usable_cores
from pagedserve.core.affinity import PrefixAffinity
from pagedserve.engine.async_engine import (
    DEFAULT_MAX_QUEUE_LEN,
    DEFAULT_STALL_TIMEOUT_S,
    AsyncLLMEngine,
    EngineDeadError,
    OutputCollector,
    RequestTimeoutError,
    _Stream,
)
from pagedserve.engine.replica import ReplicaInfo, replica_main
from pagedserve.engine.stats import EngineStats
from pagedserve.metrics import EngineMetrics
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve")

AFFINITY_SLACK = 4  # sequences a prefix's home replica may be more loaded than the least loaded one
MAX_AFFINITY_PREFIXES = 65_536  # first blocks remembered (least recently routed forgotten first)
STOP_TIMEOUT_S = 15.0  # a replica told to shut down that has not exited by then is terminated


# ---- routing ---------------------------------------------------------------------------------------
class Router:
    """Least loaded replica, with prefix affinity on the prompt's first full KV block (module docstring)."""

    def __init__(self, block_size: int, slack: int = AFFINITY_SLACK, max_prefixes: int = MAX_AFFINITY_PREFIXES):
        self.block_size = block_size
        self.slack = slack
        self.max_prefixes = max_prefixes
        self._affinity: PrefixAffinity[int] = PrefixAffinity(slack, max_prefixes)

    def choose(self, token_ids: Sequence[int] | None, loads: Sequence[int | None]) -> int:
        """The replica for a prompt; loads[i] is None for a dead replica. EngineDeadError if all are."""
        live = [i for i, load in enumerate(loads) if load is not None]
        if not live:
            raise EngineDeadError("every data-parallel replica has died")
        key = None if token_ids is None or len(token_ids) < self.block_size else tuple(token_ids[: self.block_size])
        return self._affinity.choose(live, loads.__getitem__, int, len(loads), key)


# ---- the engine's stand-in ---------------------------------------------------------------------------
def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The replicas' stats added up (KV usage is then over all of their blocks)."""
    from pagedserve.spec_decode.speculator import SpecDecodeStats

    numeric = [f.name for f in dataclasses.fields(EngineStats) if f.name not in ("finished_by_reason", "spec_decode")]
    totals = {name: sum(getattr(s, name) for s in stats) for name in numeric}
    reasons: dict[str, int] = {}
    for s in stats:
        for reason, count in s.finished_by_reason.items():
            reasons[reason] = reasons.get(reason, 0) + count
    specs = [s.spec_decode for s in stats if s.spec_decode is not None]
    spec = None
    if specs:
        width = max(len(sp.accepted_per_pos) for sp in specs)
        spec = SpecDecodeStats(
            sum(sp.num_drafts for sp in specs), sum(sp.num_draft_tokens for sp in specs),
            sum(sp.num_accepted_tokens for sp in specs),
            [sum(sp.accepted_per_pos[i] for sp in specs if i < len(sp.accepted_per_pos)) for i in range(width)],
        )
    return EngineStats(**totals, finished_by_reason=reasons, spec_decode=spec)


class DPEngineView:
    """What the server reads from "the engine" (ServerContext.engine, EngineMetrics), for N replicas:
    the tokenizer (loaded here from the path the replicas resolved), the model's name and limits, a
    StructuredOutputManager to check grammars before a request is sent (the replica compiles it again),
    and stats: per replica as last reported, and their sum."""

    def __init__(self, info: ReplicaInfo, replicas: list[_Replica]) -> None:
        from pagedserve.structured_output.manager import StructuredOutputManager
        from pagedserve.tokenizer import Tokenizer

        self.info = info
        self.model_path = info.model_path
        self.served_model_name = info.served_model_name
        self.max_model_len = info.max_model_len
        self.data_parallel_size = len(replicas)
        self.tokenizer = Tokenizer(info.model_path, info.architecture)
        self.structured = StructuredOutputManager(self.tokenizer, info.vocab_size, list(info.eos_token_ids))
        self._replicas = replicas

    def replica_stats(self) -> list[EngineStats]:
        return [r.stats for r in self._replicas]

    def stats(self) -> EngineStats:
        return sum_stats(self.replica_stats())

    @property
    def step_count(self) -> int:
        return self.stats().step_count


# ---- one replica, seen from the API process ---------------------------------------------------------
@dataclass(eq=False)
class _Replica:
    index: int
    process: multiprocessing.process.BaseProcess
    commands: object  # Connection: our sending end of its command pipe
    results: object  # Connection: our receiving end of its results pipe
    info: ReplicaInfo | None = None
    stats: EngineStats | None = None
    num_sent: int = 0  # sequences sent to it
    num_added: int = 0  # of which it had taken in at its last report
    last_report: float = 0.0
    alive: bool = True
    dead_reason: str | None = None
    outbox: queue.SimpleQueue | None = None
    reader: threading.Thread | None = None
    sender: threading.Thread | None = None

    @property
    def load(self) -> int | None:
        """Running + waiting sequences, counting those sent since its last report; None when dead."""
        if not self.alive or self.stats is None:
            return None
        return self.stats.num_running + self.stats.num_waiting + max(0, self.num_sent - self.num_added)

    def send(self, msg: tuple) -> None:
        if self.alive and self.outbox is not None:
            self.outbox.put(msg)


@dataclass(eq=False)
class _Entry:
    """A request in flight: the replica holding it and where its outputs go."""

    replica: int
    stream: _Stream


def _terminate(replicas: list[_Replica], timeout: float = 5.0) -> None:
    """At interpreter exit (or a failed start): close the pipes (replicas exit on EOF), then kill."""
    for r in replicas:
        try:
            r.commands.close()
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    for r in replicas:
        r.process.join(max(0.0, deadline - time.monotonic()))
        if r.process.is_alive():
            r.process.terminate()
            r.process.join(2.0)


class DPAsyncEngine:
    """AsyncLLMEngine's interface over N replica processes. The constructor starts them and returns once
    every one has loaded the model (a replica that fails to start fails the constructor, with its error)."""

    generate = AsyncLLMEngine.generate  # add_request + collector + abort on close: nothing engine-specific

    def __init__(self, config: EngineConfig, log_interval_s: float = 10.0,
                 max_queue_len: int | None = DEFAULT_MAX_QUEUE_LEN,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, request_timeout_s: float | None = None) -> None:
        n = config.data_parallel_size
        if n < 2:
            raise ValueError(f"data_parallel_size: DPAsyncEngine needs 2 or more replicas, got {n}; one engine "
                             "runs in AsyncLLMEngine")
        if max_queue_len is not None and (not isinstance(max_queue_len, int) or max_queue_len < 1):
            raise ValueError(f"max_queue_len: must be a positive integer, got {max_queue_len!r}")
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {request_timeout_s!r}")
        self.max_queue_len = max_queue_len
        self.stall_timeout_s = stall_timeout_s
        self.request_timeout_s = request_timeout_s
        self.log_interval_s = log_interval_s
        self.replica_config = dataclasses.replace(
            config, data_parallel_size=1, num_threads=config.num_threads or max(1, usable_cores() // n))
        self._lock = threading.Lock()
        self._streams: dict[str, _Entry] = {}
        self._calls: dict[int, tuple[int, concurrent.futures.Future, str | None]] = {}
        self._call_ids = itertools.count()
        self._stop = threading.Event()
        self._stopping = False
        self._draining = False
        self._supervisor: threading.Thread | None = None
        self.replicas: list[_Replica] = []
        self._spawn(n, max_queue_len)
        atexit.register(_terminate, list(self.replicas))
        try:
            self.view = DPEngineView(self.replicas[0].info, self.replicas)
        except BaseException:
            _terminate(self.replicas)
            raise
        self.engine = self.view
        self.router = Router(self.replica_config.block_size)
        self.metrics = EngineMetrics(self.view, engine_labels=[str(r.index) for r in self.replicas])
        for r in self.replicas:
            r.outbox = queue.SimpleQueue()
            r.sender = threading.Thread(target=self._send_loop, args=(r,), name=f"pagedserve-dp-send-{r.index}",
                                        daemon=True)
            r.reader = threading.Thread(target=self._read_loop, args=(r,), name=f"pagedserve-dp-read-{r.index}",
                                        daemon=True)
            r.sender.start()
            r.reader.start()

    def _spawn(self, n: int, max_queue_len: int | None) -> None:
        ctx = multiprocessing.get_context("spawn")
        for i in range(n):
            cmd_recv, cmd_send = ctx.Pipe(duplex=False)
            res_recv, res_send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=replica_main, name=f"pagedserve-replica-{i}",
                               args=(i, self.replica_config, cmd_recv, res_send, max_queue_len))
            proc.start()
            cmd_recv.close()  # the replica holds these ends: EOF on ours means it is gone
            res_send.close()
            self.replicas.append(_Replica(i, proc, cmd_send, res_recv))
        logger.info("data parallel: started %d replicas (%d threads each); loading the model", n,
                    self.replica_config.num_threads)
        try:
            for r in self.replicas:
                self._await_ready(r)
        except BaseException:
            _terminate(self.replicas)
            raise
        logger.info("data parallel: %d replicas ready (pids %s)", n, ", ".join(str(r.info.pid) for r in self.replicas))

    @staticmethod
    def _await_ready(r: _Replica) -> None:
        while not r.results.poll(1.0):
            if not r.process.is_alive():
                break
        try:
            msg = r.results.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"data-parallel replica {r.index} exited during start-up (exit code "
                               f"{r.process.exitcode})") from None
        if msg[0] == "failed":
            _, kind, text = msg
            raise (ValueError(text) if kind == "ValueError" else RuntimeError(
                f"data-parallel replica {r.index} failed to start: {kind}: {text}"))
        _, r.info, r.stats = msg
        r.last_report = time.monotonic()

    # ---- life cycle (as AsyncLLMEngine) --------------------------------------------------------------
    def start(self) -> None:
        if self._supervisor is not None or self._stopping:
            return
        self._supervisor = threading.Thread(target=self._supervise, name="pagedserve-dp", daemon=True)
        self._supervisor.start()

    def request_stop(self) -> None:
        """Abort everything in flight and stop the replicas, from the supervisor thread; returns at once."""
        self._stop.set()

    def begin_drain(self) -> None:
        self._draining = True

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def wait_drained(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.num_in_flight

    def shutdown(self, timeout: float = 30.0) -> None:
        self.request_stop()
        if self._supervisor is not None:
            self._supervisor.join(timeout)
        else:
            self._stop_all()
        for r in self.replicas:
            if r.reader is not None:
                r.reader.join(2.0)

    @property
    def is_running(self) -> bool:
        return self._supervisor is not None and self._supervisor.is_alive()

    def replica_problems(self) -> dict[int, str]:
        """Replica index -> why it is not serving (dead, or no progress for stall_timeout_s with work)."""
        problems = {}
        now = time.monotonic()
        busy = {e.replica for e in list(self._streams.values())}
        for r in self.replicas:
            if not r.alive:
                problems[r.index] = r.dead_reason or f"replica {r.index} is not running"
            elif r.index in busy and now - r.last_report > self.stall_timeout_s:
                problems[r.index] = (f"replica {r.index} has made no progress for {now - r.last_report:.0f} s with "
                                     "requests pending")
        return problems

    def unhealthy_reason(self) -> str | None:
        """None while any replica serves (a dead one is listed by health_detail, with 200); else why 503."""
        if not self.is_running:
            return "engine loop is not running"
        if self._draining:
            return "the server is shutting down"
        problems = self.replica_problems()
        if len(problems) == len(self.replicas):
            return "no data-parallel replica is serving: " + "; ".join(problems.values())
        return None

    def health_detail(self) -> dict:
        """/health's body: each replica's state; "degraded" when some (not all) are down."""
        problems = self.replica_problems()
        replicas = [{"index": r.index, "pid": r.info.pid if r.info else None,
                     "status": "ok" if r.index not in problems else ("dead" if not r.alive else "stalled"),
                     **({"reason": problems[r.index]} if r.index in problems else {})} for r in self.replicas]
        return {"status": "degraded" if problems else "ok", "data_parallel_size": len(self.replicas),
                "replicas": replicas}

    # ---- the asyncio side --------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams, collector: OutputCollector,
                          arrival_time: float | None = None) -> None:
        """Route and send a request; returns once its replica took it (its ValueError for bad input,
        QueueFullError when its queue is full, EngineDeadError when no replica serves)."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        if self._draining:
            raise EngineDeadError("the server is shutting down")
        ids = await self._routing_ids(prompt)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            replica = self.replicas[self.router.choose(ids, [r.load for r in self.replicas])]
            self._streams[request_id] = _Entry(replica.index, _Stream(collector, request_id))
            call_id = next(self._call_ids)
            self._calls[call_id] = (replica.index, fut, request_id)
            replica.num_sent += params.n
        replica.send(("add", call_id, request_id, prompt, params, arrival_time or time.time()))
        await asyncio.wrap_future(fut)

    async def _routing_ids(self, prompt) -> list[int] | None:
        """The prompt's token ids for routing (a text prompt is tokenized off the event loop; the replica
        still gets the prompt as given, so it validates and tokenizes it exactly as one engine does)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                return list(ids) if isinstance(ids, list | tuple) else None
            prompt = prompt.get("prompt")
        if isinstance(prompt, list | tuple):
            return list(prompt)
        if isinstance(prompt, str) and prompt:
            try:
                return await asyncio.to_thread(self.view.tokenizer.encode, prompt)
            except Exception:  # the replica reports what is wrong with it
                return None
        return None

    def abort(self, request_id: str) -> None:
        """Abort a request on the replica holding it (idempotent; unknown ids are ignored). Any thread."""
        entry = self._streams.get(request_id)
        if entry is None:
            return
        self.metrics.forget(request_id)
        self.replicas[entry.replica].send(("abort", request_id))

    async def call(self, fn):
        raise NotImplementedError("call(fn) runs a function on one in-process engine; with data_parallel_size > 1 "
                                  "every replica is a process of its own (use trace_data for the dashboard)")

    async def trace_data(self, max_steps: int | None, replica: int = 0) -> dict:
        """engine_trace_data of one replica (the dashboard's view), computed there between steps."""
        if not isinstance(replica, int) or not 0 <= replica < len(self.replicas):
            raise ValueError(f"replica: must be in [0, {len(self.replicas)}), got {replica!r}")
        r = self.replicas[replica]
        if not r.alive:
            raise EngineDeadError(r.dead_reason or f"replica {replica} is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = (replica, fut, None)
        r.send(("trace", call_id, max_steps))
        return await asyncio.wrap_future(fut)

    # ---- the pipes -----------------------------------------------------------------------------------
    def _send_loop(self, r: _Replica) -> None:
        while (msg := r.outbox.get()) is not None:
            try:
                r.commands.send(msg)
            except (OSError, ValueError):  # its pipe is closed: the reader finds out why
                return

    def _read_loop(self, r: _Replica) -> None:
        while True:
            try:
                msg = r.results.recv()
            except (EOFError, OSError):
                break
            except Exception:  # one message that does not unpickle must not stop the replica's outputs
                logger.exception("replica %d sent a message that could not be read", r.index)
                continue
            r.last_report = time.monotonic()
            kind = msg[0]
            if kind == "step":
                _, outputs, r.stats, r.num_added = msg
                self._dispatch(r, outputs)
            elif kind == "reply":
                self._resolve(*msg[1:])
            elif kind == "error":
                self._fail_replica(r.index, EngineDeadError(msg[2]), msg[1])
        self._on_exit(r)

    def _dispatch(self, r: _Replica, outputs: list[RequestOutput]) -> None:
        now = time.time()
        label = str(r.index)
        for out in outputs:
            try:
                self.metrics.observe(out, now, engine=label)
            except Exception:  # metrics must never break serving
                logger.exception("metrics update failed")
            with self._lock:
                entry = self._streams.get(out.request_id)
                if entry is not None and entry.replica != r.index:
                    entry = None
                if entry is not None and out.finished:
                    del self._streams[out.request_id]
            if entry is not None:
                entry.stream.put(out)  # freshly unpickled: nobody else holds it

    def _resolve(self, call_id: int, error: BaseException | None, value) -> None:
        with self._lock:
            replica, fut, request_id = self._calls.pop(call_id, (None, None, None))
            if error is not None and request_id is not None:  # refused: it never entered the replica
                entry = self._streams.get(request_id)
                if entry is not None and entry.replica == replica:
                    del self._streams[request_id]
        if fut is None:
            return
        try:
            fut.set_exception(error) if error is not None else fut.set_result(value)
        except concurrent.futures.InvalidStateError:  # its caller was cancelled
            pass

    def _fail_replica(self, index: int, error: BaseException, request_ids: list[str] | None = None,
                      calls: bool = False) -> None:
        """End requests on replica `index` (all, or `request_ids`) with `error`; with calls, its pending
        calls (adds, traces) too."""
        with self._lock:
            ids = [rid for rid, e in self._streams.items() if e.replica == index and
                   (request_ids is None or rid in request_ids)]
            entries = [self._streams.pop(rid) for rid in ids]
            pending = [c for c, (i, _, _) in self._calls.items() if i == index] if calls else []
            futures = [self._calls.pop(c)[1] for c in pending]
        for rid, e in zip(ids, entries, strict=True):
            self.metrics.forget(rid)
            e.stream.put(error)
        for fut in futures:
            try:
                fut.set_exception(error)
            except concurrent.futures.InvalidStateError:
                pass

    def _on_exit(self, r: _Replica) -> None:
        r.process.join(1.0)
        r.alive = False
        r.outbox.put(None)
        if self._stopping:
            return
        r.dead_reason = (f"data-parallel replica {r.index} (pid {r.info.pid}) died (exit code "
                         f"{r.process.exitcode})")
        # Nothing runs there any more; its counters keep their last reported values (never go back).
        r.stats = dataclasses.replace(r.stats, num_running=0, num_waiting=0, num_unfinished_requests=0,
                                      num_used_blocks=0, num_cached_free_blocks=0, num_free_blocks=0)
        logger.error("%s; its requests end with an error, the other replicas keep serving", r.dead_reason)
        self._fail_replica(r.index, EngineDeadError(f"{r.dead_reason} before this request finished"), calls=True)

    # ---- the supervisor thread ---------------------------------------------------------------------
    def _supervise(self) -> None:
        last_log = time.monotonic()
        while not self._stop.wait(0.2):
            try:
                self._expire()
                now = time.monotonic()
                if self.log_interval_s and now - last_log >= self.log_interval_s and self._streams:
                    last_log = now
                    self.metrics.log_stats(now)
            except Exception:
                logger.exception("data-parallel supervisor error")
        self._stop_all()

    def _expire(self) -> None:
        if self.request_timeout_s is None:
            return
        now = time.monotonic()
        with self._lock:
            expired = [(rid, e) for rid, e in self._streams.items() if now - e.stream.arrival > self.request_timeout_s]
            for rid, _ in expired:
                del self._streams[rid]
        for rid, e in expired:  # the abort is on its way before the caller hears of the timeout
            self.replicas[e.replica].send(("abort", rid))
            self.metrics.forget(rid)
            e.stream.put(RequestTimeoutError(f"request timed out after {self.request_timeout_s:g} s"))

    def _stop_all(self) -> None:
        """Fail what is in flight (never a cut-off text), tell the replicas to exit, wait, then kill."""
        self._stopping = True
        with self._lock:
            entries, self._streams = list(self._streams.values()), {}
            futures, self._calls = [f for _, f, _ in self._calls.values()], {}
        for fut in futures:
            try:
                fut.set_exception(EngineDeadError("the server is shutting down"))
            except concurrent.futures.InvalidStateError:
                pass
        for e in entries:
            e.stream.put(EngineDeadError("the server shut down before this request finished"))
        for r in self.replicas:
            r.send(("shutdown",))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for r in self.replicas:
            r.process.join(max(0.0, deadline - time.monotonic()))
            if r.process.is_alive():
                logger.warning("replica %d did not exit; terminating it", r.index)
                r.process.terminate()
                r.process.join(2.0)
            if r.outbox is not None:
                r.outbox.put(None)
        logger.info("data parallel: replicas stopped")
