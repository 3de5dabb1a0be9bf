"""AsyncLLMEngine: an asyncio front for the (not thread-safe) LLMEngine.

One dedicated thread owns the engine. It applies queued commands (add / abort) between steps, runs
engine.step() while there is work, and hands every RequestOutput to the asyncio queue of the request it
belongs to via loop.call_soon_threadsafe. When idle it sleeps on an Event that new commands set. All
requests share the engine's continuous batch; a request leaves it at once when its consumer goes away
(abort frees its KV blocks in the next command pass).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedserve.engine.engine import LLMEngine, Prompt
from pagedserve.metrics import EngineMetrics
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve")


class EngineDeadError(RuntimeError):
    pass


class RequestTimeoutError(RuntimeError):
    """The request waited and ran longer than the server's request_timeout_s (HTTP 408)."""


class QueueFullError(RuntimeError):
    """More sequences are waiting than the server admits (`max_queue_len`): try again later (HTTP 429)."""


DEFAULT_MAX_QUEUE_LEN = 1024  # waiting sequences (a request with n samples counts n)
DEFAULT_STALL_TIMEOUT_S = 60.0  # no step for this long while work is pending: /health answers 503


class OutputCollector:
    """Where the engine thread delivers the outputs of one or more requests, for one asyncio consumer.

    Outputs are cumulative (each holds all the text and tokens so far), so a newer output of a request
    replaces the pending one: however slowly the consumer reads, it holds at most one pending output per
    request (as vLLM's RequestOutputCollector). An error is never replaced.
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._pending: dict[str, RequestOutput | BaseException] = {}
        self._ready = asyncio.Event()

    def put_threadsafe(self, request_id: str, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self._put, request_id, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass

    def _put(self, request_id: str, item: RequestOutput | BaseException) -> None:
        if not isinstance(self._pending.get(request_id), BaseException):
            self._pending[request_id] = item
        self._ready.set()

    async def get(self) -> dict[str, RequestOutput | BaseException]:
        """Wait for and take everything pending: request id -> its latest output (or its error)."""
        await self._ready.wait()
        self._ready.clear()
        items, self._pending = self._pending, {}
        return items

    @property
    def num_pending(self) -> int:
        return len(self._pending)


@dataclass
class _Stream:
    collector: OutputCollector
    request_id: str
    arrival: float = field(default_factory=time.monotonic)

    def put(self, item: RequestOutput | BaseException) -> None:
        self.collector.put_threadsafe(self.request_id, item)


@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    arrival_time: float
    stream: _Stream
    future: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run a read-only function on the engine thread, between steps (the engine is not thread-safe)."""

    fn: object
    future: concurrent.futures.Future


def _snapshot(out: RequestOutput) -> RequestOutput:
    """The engine keeps appending to a sample's logprobs list; hand the consumer its own copy."""
    for o in out.outputs:
        if o.logprobs is not None:
            o.logprobs = list(o.logprobs)
    return dataclasses.replace(out, outputs=list(out.outputs))


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, log_interval_s: float = 10.0, metrics: EngineMetrics | None = None,
                 max_queue_len: int | None = DEFAULT_MAX_QUEUE_LEN,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, request_timeout_s: float | None = None):
        """max_queue_len: sequences allowed to wait for the batch; a request beyond gets QueueFullError
        (None: no limit)."""
        if max_queue_len is not None and (not isinstance(max_queue_len, int) or max_queue_len < 1):
            raise ValueError(f"max_queue_len: must be a positive integer, got {max_queue_len!r}")
        self.max_queue_len = max_queue_len
        self.stall_timeout_s = stall_timeout_s
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {request_timeout_s!r}")
        self.request_timeout_s = request_timeout_s  # None: requests may take as long as they need
        self._next_expiry_check = 0.0
        self._draining = False
        self._last_progress = time.monotonic()  # the loop's last pass (a step, or an idle wake-up)
        self.engine = engine
        self.metrics = metrics if metrics is not None else EngineMetrics(engine)
        self.log_interval_s = log_interval_s
        self._commands: deque[_Add | _Abort | _Call] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._last_log = time.monotonic()
        self.errored: BaseException | None = None

    # ---- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run_loop, name="pagedserve-engine", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to abort everything in flight and stop; returns at once (signal-handler safe)."""
        self._stop.set()
        self._wake.set()

    def begin_drain(self) -> None:
        """Stop taking new requests (they get EngineDeadError: 503); those in flight go on."""
        self._draining = True

    @property
    def num_in_flight(self) -> int:
        """Requests added (or being added) whose consumer has not had their final output."""
        return len(self._streams) + sum(isinstance(c, _Add) for c in list(self._commands))

    def wait_drained(self, timeout: float) -> bool:
        """Block (not on the event loop) until nothing is in flight or `timeout` passed; True if drained."""
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.num_in_flight

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (consumers get EngineDeadError, never a cut-off text) and stop."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def unhealthy_reason(self) -> str | None:
        """None while the loop is alive and moving; else why /health should say 503."""
        if not self.is_running:
            return "engine loop is not running"
        if self._draining:
            return "the server is shutting down"
        executor = getattr(self.engine, "executor", None)  # a tensor-parallel rank gone: no step can run
        workers = executor.check_health() if executor is not None else None
        if workers is not None:
            return workers
        stalled = time.monotonic() - self._last_progress
        if (self._streams or self._commands) and stalled > self.stall_timeout_s:
            return f"engine loop has made no progress for {stalled:.0f} s with requests pending"
        return None

    # ---- the asyncio side ------------------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, collector: OutputCollector,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; its outputs go to `collector`. Raises the engine's ValueError for bad input."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        if self._draining:
            raise EngineDeadError("the server is shutting down")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        stream = _Stream(collector, request_id)
        self._commands.append(_Add(request_id, prompt, params, arrival_time or time.time(), stream, fut))
        self._wake.set()
        await asyncio.wrap_future(fut)

    async def call(self, fn):
        """fn(engine) evaluated on the engine thread between steps; returns its result."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.append(_Call(fn, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown ids are ignored). Safe from any thread."""
        self._commands.append(_Abort(request_id))
        self._wake.set()

    async def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams, arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs until finished. Closing or cancelling the generator aborts."""
        collector = OutputCollector()
        finished = False
        try:
            await self.add_request(request_id, prompt, params, collector, arrival_time)
            while True:
                out = (await collector.get())[request_id]  # outputs are cumulative: the latest is all
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    # ---- the engine thread -----------------------------------------------------------------------
    def _run_loop(self) -> None:
        logger.info("engine loop started")
        while not self._stop.is_set():
            self._last_progress = time.monotonic()
            try:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self._dispatch(outputs)
                self._expire()
                self._maybe_log()
            except Exception as e:  # never let one failure kill the loop; fail what is in flight
                logger.exception("engine loop error; aborting in-flight requests")
                self._fail_all(e)
        self._abort_all()
        logger.info("engine loop stopped")

    def _apply_commands(self) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if isinstance(cmd, _Abort):
                self.metrics.forget(cmd.request_id)
                outputs = self.engine.abort_request(cmd.request_id)
                self._dispatch(outputs)
                continue
            if not cmd.future.set_running_or_notify_cancel():
                continue
            if isinstance(cmd, _Call):
                try:
                    cmd.future.set_result(cmd.fn(self.engine))
                except Exception as e:
                    cmd.future.set_exception(e)
                continue
            if self.max_queue_len is not None and self.engine.stats().num_waiting + cmd.params.n > self.max_queue_len:
                cmd.future.set_exception(QueueFullError(
                    f"the server's queue is full ({self.max_queue_len} sequences waiting); retry later"))
                continue
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.arrival_time)
            except Exception as e:
                cmd.future.set_exception(e)
                continue
            self._streams[cmd.request_id] = cmd.stream
            cmd.future.set_result(None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        for out in outputs:
            try:
                self.metrics.observe(out, now)
            except Exception:  # metrics must never break serving
                logger.exception("metrics update failed")
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
            if stream is not None:
                stream.put(_snapshot(out))

    def _fail_all(self, error: Exception) -> None:
        ids = list(self._streams)
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("abort after an engine error failed")
        for rid in ids:
            stream = self._streams.pop(rid)
            stream.put(EngineDeadError(f"engine error: {error}"))

    def _abort_all(self) -> None:
        while self._commands:  # requests that never got in: tell their callers
            cmd = self._commands.popleft()
            if isinstance(cmd, _Add | _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineDeadError("the server is shutting down"))
        # The error goes first: a consumer must not take the aborted (cut-off) output for an answer.
        for stream in self._streams.values():
            stream.put(EngineDeadError("the server shut down before this request finished"))
        self._streams.clear()
        try:
            self._dispatch(self.engine.abort_all())  # metrics and block accounting; nobody left to deliver to
        except Exception:
            logger.exception("abort at shutdown failed")

    def _expire(self) -> None:
        """Fail (and abort) requests older than request_timeout_s; checked a few times a second."""
        now = time.monotonic()
        if self.request_timeout_s is None or now < self._next_expiry_check:
            return
        self._next_expiry_check = now + 0.2
        expired = [rid for rid, st in self._streams.items() if now - st.arrival > self.request_timeout_s]
        for rid in expired:
            # Abort in the engine before the caller hears of it: once the error arrives, the request's
            # blocks are free and it is gone from the scheduler.
            stream = self._streams.pop(rid)
            self.metrics.forget(rid)
            outputs = self.engine.abort_request(rid)
            stream.put(RequestTimeoutError(f"request timed out after {self.request_timeout_s:g} s"))
            self._dispatch(outputs)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.log_interval_s and now - self._last_log >= self.log_interval_s:
            self._last_log = now
            self.metrics.log_stats(now)
