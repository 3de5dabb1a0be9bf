"""Streaming and result shaping for the server: request groups feeding one queue, SSE chunks in
OpenAI's shapes, logprobs, and the completion / chat event streams."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError

logger = logging.getLogger("pagedserve")
DISCONNECT_POLL_S = 0.5

# ---- a group of engine requests feeding one queue ---------------------------------------------------
class Run:
    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending: list[str] = []
        self.finished: dict[str, RequestOutput] = {}

    async def add(self, requests: list[tuple[str, dict]], params: SamplingParams) -> None:
        """Queue all at once (they join the same step); any failure aborts them all."""
        self.pending.extend(rid for rid, _ in requests)  # before awaiting: a cancelled add is still aborted
        try:
            results = await asyncio.gather(
                *(self.engine.add_request(rid, prompt, params, self.queue) for rid, prompt in requests),
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
        if isinstance(error, EngineDeadError):
            raise OpenAIError(str(error), 503, "server_error")
        raise error

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yield outputs (the latest per request) until all have finished."""
        while len(self.finished) < len(self.pending):
            item = await self.queue.get()
            latest: dict[str, RequestOutput] = {}
            while True:
                if isinstance(item, BaseException):
                    raise OpenAIError(str(item), 500, "server_error")
                latest[item.request_id] = item
                if self.queue.empty():
                    break
                item = self.queue.get_nowait()
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


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


# ---- logprobs in OpenAI's two shapes -----------------------------------------------------------------
def completion_logprobs(o: CompletionOutput, start: int, end: int, offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(o.token_ids[start:end], (o.logprobs or [])[start:end], strict=False):
        chosen = entry.get(tid) or Logprob(float("-inf"))
        piece = chosen.decoded_token or ""
        tokens.append(piece)
        token_lps.append(max(chosen.logprob, -9999.0))  # JSON has no -inf
        tops.append({(lp.decoded_token or ""): max(lp.logprob, -9999.0) for lp in _ranked(entry)})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _ranked(entry: dict[int, Logprob], k: int | None = None) -> list[Logprob]:
    top = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
    return [lp for lp in top if k is None or lp.rank <= k]


def chat_logprobs(o: CompletionOutput, start: int, end: int, k: int) -> dict:
    def item(lp: Logprob) -> dict:
        tok = lp.decoded_token or ""
        return {"token": tok, "logprob": max(lp.logprob, -9999.0), "bytes": list(tok.encode("utf-8"))}

    content = []
    for tid, entry in zip(o.token_ids[start:end], (o.logprobs or [])[start:end], strict=False):
        chosen = entry.get(tid) or Logprob(float("-inf"))
        content.append({**item(chosen), "top_logprobs": [item(lp) for lp in _ranked(entry, k)]})
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Deltas:
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


async def _guarded(events: AsyncIterator[str], run: Run) -> AsyncIterator[str]:
    """Ends every stream with [DONE]; an error mid-stream becomes an error event."""
    try:
        async for e in events:
            yield e
    except OpenAIError as err:
        yield _sse(err.body())
    except EngineDeadError as err:
        yield _sse(OpenAIError(str(err), 500, "server_error").body())
    finally:
        run.abort()
    yield _sse("[DONE]")


def _sse_chunk(rid: str, obj: str, created: int, model: str, choices: list[dict], usage: dict | None) -> str:
    """One stream chunk in OpenAI's shape; `usage` only on the last one (stream_options.include_usage)."""
    d = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        d["usage"] = usage
    return _sse(d)


def stream_completion(run: Run, body: CompletionRequest, base: str, created: int, model: str,
                       index_of: dict[str, int], prompts: list[dict], echo: list[str]) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[str]:
        deltas = _Deltas()

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            return _sse_chunk(base, "text_completion", created, model, choices, usage)

        if echo:
            for i in index_of.values():
                for j in range(body.n):
                    yield chunk([{"index": i * body.n + j, "text": echo[i], "logprobs": None,
                                  "finish_reason": None}])
        async for out in run.outputs():
            i = index_of[out.request_id]
            for o in out.outputs:
                index = i * body.n + o.index
                sent_chars = deltas.chars.get(index, 0)
                got = deltas.take(index, o)
                if got is None:
                    continue
                text, start, end = got
                lp = completion_logprobs(o, start, end, sent_chars) if body.logprobs is not None else None
                yield chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason": o.finish_reason,
                              "stop_reason": o.stop_reason}])
        if body.include_usage:
            prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
            completion_tokens = sum(len(o.token_ids) for out in run.finished.values() for o in out.outputs)
            yield chunk([], usage(prompt_tokens, completion_tokens))

    return _guarded(events(), run)


def stream_chat(run: Run, body: ChatCompletionRequest, rid: str, created: int, model: str,
                 prompt_tokens: int, top: int) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[str]:
        deltas = _Deltas()

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            return _sse_chunk(rid, "chat.completion.chunk", created, model, choices, usage)

        for j in range(body.n):
            yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for out in run.outputs():
            for o in out.outputs:
                got = deltas.take(o.index, o)
                if got is None:
                    continue
                text, start, end = got
                lp = chat_logprobs(o, start, end, top) if body.logprobs else None
                delta = {"content": text} if text else {}
                yield chunk([{"index": o.index, "delta": delta, "logprobs": lp,
                              "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}])
        if body.include_usage:
            completion_tokens = sum(len(o.token_ids) for out in run.finished.values() for o in out.outputs)
            yield chunk([], usage(prompt_tokens, completion_tokens))

    return _guarded(events(), run)
