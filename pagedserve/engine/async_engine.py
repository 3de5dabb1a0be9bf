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
from dataclasses import dataclass

from pagedserve.engine.engine import LLMEngine, Prompt
from pagedserve.metrics import EngineMetrics
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve")


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass


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
    def __init__(self, engine: LLMEngine, log_interval_s: float = 10.0, metrics: EngineMetrics | None = None):
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

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (consumers get a finished 'abort' output) and stop the thread."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the asyncio side ------------------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, queue: asyncio.Queue,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; its outputs go to `queue`. Raises the engine's ValueError for bad input."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        stream = _Stream(asyncio.get_running_loop(), queue)
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
        queue: asyncio.Queue = asyncio.Queue()
        finished = False
        try:
            await self.add_request(request_id, prompt, params, queue, arrival_time)
            while True:
                out = await queue.get()
                while not queue.empty():  # outputs are cumulative: a slow consumer may skip to the latest
                    out = queue.get_nowait()
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
            try:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self._dispatch(outputs)
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
        try:
            self._dispatch(self.engine.abort_all())
        except Exception:
            logger.exception("abort at shutdown failed")
        for stream in self._streams.values():
            stream.put(EngineDeadError("the server is shutting down"))
        self._streams.clear()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.log_interval_s and now - self._last_log >= self.log_interval_s:
            self._last_log = now
            self.metrics.log_stats(now)
