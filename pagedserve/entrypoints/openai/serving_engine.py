"""What every OpenAI endpoint shares: the server's context (engine, model name, tokenizer), a group of
engine requests feeding one queue (`Run`), the SSE response and chunks, usage, stream deltas, and the
ranking of logprobs. The endpoints' own shapes live in serving_completion.py and serving_chat.py."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    OutputCollector,
    QueueFullError,
    RequestTimeoutError,
)
from pagedserve.engine.engine import LLMEngine
from pagedserve.entrypoints.openai.protocol import OpenAIError
from pagedserve.entrypoints.openai.serving_tools import ToolOptions
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import Tokenizer

logger = logging.getLogger("pagedserve")
T = TypeVar("T")
DISCONNECT_POLL_S = 0.5
RETRY_AFTER_S = 1  # what a 429 (queue full) tells the client to wait


@dataclass
class ServerContext:
    """What the endpoint handlers need: the engine (read-only from here), its async front, the model."""

    engine: LLMEngine
    async_engine: AsyncLLMEngine
    tool_options: ToolOptions = field(default_factory=ToolOptions)
    created_at: int = field(default_factory=lambda: int(time.time()))
    # Tokenizing and chat templating run here, off the event loop (one thread: the HF tokenizer is used
    # by one caller at a time besides the engine thread's incremental detokenizers).
    dashboard_cache: dict = field(default_factory=dict)  # entrypoints/dashboard: the state of the last step
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="pagedserve-tokenizer"))

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *args)

    async def compile_structured(self, params: SamplingParams) -> None:
        """Compile the request's grammar (if any) off the event loop and the engine thread; an invalid
        schema, regex or grammar is a 400 naming the problem. The engine then finds it in its cache."""
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            await asyncio.wrap_future(self.engine.structured.prepare(spec))
        except ValueError as e:
            raise OpenAIError.from_value_error(e) from None

    def close(self) -> None:
        self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise OpenAIError(f"The model `{name}` does not exist; this server serves `{self.model_name}`.", 404,
                              param="model", code="model_not_found")


# ---- a group of engine requests feeding one queue ---------------------------------------------------
class Run:
    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.collector = OutputCollector()
        self.pending: list[str] = []
        self.finished: dict[str, RequestOutput] = {}

    async def add(self, requests: list[tuple[str, dict]], params: SamplingParams) -> None:
        """Queue all at once (they join the same step); any failure aborts them all."""
        self.pending.extend(rid for rid, _ in requests)  # before awaiting: a cancelled add is still aborted
        try:
            results = await asyncio.gather(
                *(self.engine.add_request(rid, prompt, params, self.collector) for rid, prompt in requests),
                return_exceptions=True,
            )
        except BaseException:
            self.abort()
            raise
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is None:
            return
        self.abort()
        if isinstance(error, ValueError):
            raise OpenAIError.from_value_error(error)
        if isinstance(error, QueueFullError):
            raise OpenAIError(str(error), 429, "rate_limit_exceeded", code="queue_full",
                              headers={"Retry-After": str(RETRY_AFTER_S)})
        if isinstance(error, EngineDeadError):
            raise OpenAIError(str(error), 503, "server_error")
        raise error

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yield outputs (the latest per request) until all have finished."""
        while len(self.finished) < len(self.pending):
            latest = await self.collector.get()
            for item in latest.values():
                if isinstance(item, EngineDeadError):  # shut down (or the loop died) before it finished
                    raise OpenAIError(str(item), 503, "server_error")
                if isinstance(item, RequestTimeoutError):
                    raise OpenAIError(str(item), 408, "timeout", code="request_timeout")
                if isinstance(item, BaseException):
                    raise OpenAIError(str(item), 500, "server_error")
            for out in latest.values():
                if out.error:
                    raise OpenAIError(out.error, 500, "server_error")
                if out.finished:
                    self.finished[out.request_id] = out
                yield out

    def abort(self) -> None:
        for rid in self.pending:
            if rid not in self.finished:
                self.engine.abort(rid)

    async def wait(self, request: Request) -> bool:
        """Collect everything (no streaming); abort if the client disconnects. True if all finished."""

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
            self.disconnected = True
            self.abort()

        self.disconnected = False
        watcher = asyncio.create_task(watch())
        try:
            async for _ in self.outputs():
                pass
        finally:
            watcher.cancel()
            self.abort()
        return not self.disconnected and len(self.finished) == len(self.pending)


class SSEResponse(StreamingResponse):
    """StreamingResponse that aborts its run whatever way the response ends (disconnect included)."""

    def __init__(self, content, run: Run) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.abort()


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


# ---- shared shapes -----------------------------------------------------------------------------------
def ranked(entry: dict[int, Logprob], k: int | None = None) -> list[Logprob]:
    top = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
    return [lp for lp in top if k is None or lp.rank <= k]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Deltas:
    """What has been sent per choice: characters of text and number of tokens."""

    def __init__(self) -> None:
        self.chars: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.done: set[int] = set()

    def take(self, index: int, o: CompletionOutput) -> tuple[str, int, int] | None:
        """(new text, first new token, end token) if there is something to send for this choice."""
        if index in self.done:
            return None
        c, t = self.chars.get(index, 0), self.tokens.get(index, 0)
        text = o.text[c:]
        if not text and o.finish_reason is None:
            return None
        self.chars[index], self.tokens[index] = len(o.text), len(o.token_ids)
        if o.finish_reason is not None:
            self.done.add(index)
        return text, t, len(o.token_ids)


async def guarded(events: AsyncIterator[str], run: Run) -> AsyncIterator[str]:
    """Ends every stream with [DONE]; an error mid-stream becomes an error event."""
    try:
        async for e in events:
            yield e
    except OpenAIError as err:
        yield sse(err.body())
    except EngineDeadError as err:
        yield sse(OpenAIError(str(err), 500, "server_error").body())
    finally:
        run.abort()
    yield sse("[DONE]")


def sse_chunk(rid: str, obj: str, created: int, model: str, choices: list[dict], usage: dict | None) -> str:
    """One stream chunk in OpenAI's shape; `usage` only on the last one (stream_options.include_usage)."""
    d = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        d["usage"] = usage
    return sse(d)
