"""POST /v1/completions: prompts in, text out, as OpenAI's legacy completions API (with vLLM's extra
sampling fields); streaming and non-streaming shapes, and the logprobs shape of this endpoint."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pagedserve.entrypoints.openai.protocol import (
    MAX_PROMPTS,
    MAX_SEQUENCES_PER_REQUEST,
    CompletionRequest,
    OpenAIError,
)
from pagedserve.entrypoints.openai.serving_engine import (
    Deltas,
    Run,
    ServerContext,
    SSEResponse,
    guarded,
    ranked,
    sse_chunk,
    usage,
)
from pagedserve.outputs import CompletionOutput, Logprob


async def create_completion(ctx: ServerContext, body: CompletionRequest, raw: Request):
    tok = ctx.tokenizer
    ctx.check_model(body.model)
    prompts = await ctx.in_tokenizer_thread(completion_prompts, tok, body.prompt)
    if body.echo and body.logprobs is not None:
        raise OpenAIError("echo: echo together with logprobs is not supported", param="echo")
    if body.suffix:
        raise OpenAIError("suffix: not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise OpenAIError("best_of: only best_of == n is supported", param="best_of")
    params = body.sampling_params(body.max_tokens, body.logprobs)
    await ctx.compile_structured(params)
    if len(prompts) * params.n > MAX_SEQUENCES_PER_REQUEST:
        raise OpenAIError(f"n: {len(prompts)} prompts x n={params.n} exceeds {MAX_SEQUENCES_PER_REQUEST} sequences "
                          "per request", param="n")
    base = f"cmpl-{uuid.uuid4().hex}"
    run = Run(ctx.async_engine)
    await run.add([(f"{base}-{i}", prompt) for i, prompt in enumerate(prompts)], params)
    index_of = {f"{base}-{i}": i for i in range(len(prompts))}
    echo = await ctx.in_tokenizer_thread(echo_texts, tok, prompts) if body.echo else []
    created = int(time.time())
    if body.stream:
        gen = stream_completion(run, body, base, created, ctx.model_name, index_of, prompts, echo)
        return SSEResponse(gen, run)
    if not await run.wait(raw):
        return Response(status_code=499)  # the client went away; nobody reads this
    choices, completion_tokens = [], 0
    for rid, out in run.finished.items():
        prompt_text = echo[index_of[rid]] if echo else ""
        for o in out.outputs:
            completion_tokens += len(o.token_ids)
            lp = completion_logprobs(o, 0, len(o.token_ids), 0) if body.logprobs is not None else None
            choices.append({
                "index": index_of[rid] * body.n + o.index,
                "text": prompt_text + o.text,
                "logprobs": lp, "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
            })
    choices.sort(key=lambda c: c["index"])
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    return {
        "id": base, "object": "text_completion", "created": created, "model": ctx.model_name,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def echo_texts(tok, prompts: list[dict]) -> list[str]:
    return [tok.decode(p["prompt_token_ids"]) if p["prompt"] is None else p["prompt"] for p in prompts]


def completion_prompts(tok, prompt) -> list[dict]:
    """string | [string] | [ids] | [[ids]] → [{"prompt", "prompt_token_ids"}]."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif not prompt:
        raise OpenAIError("prompt: must not be empty", param="prompt")
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if len(items) > MAX_PROMPTS:
        raise OpenAIError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(items)}", param="prompt")
    out = []
    for p in items:
        if not p:
            raise OpenAIError("prompt: must not be empty", param="prompt")
        if isinstance(p, str):
            out.append({"prompt": p, "prompt_token_ids": tok.encode(p)})
        else:
            out.append({"prompt": None, "prompt_token_ids": list(p)})
    return out


def completion_logprobs(o: CompletionOutput, start: int, end: int, offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(o.token_ids[start:end], (o.logprobs or [])[start:end], strict=False):
        chosen = entry.get(tid) or Logprob(float("-inf"))
        piece = chosen.decoded_token or ""
        tokens.append(piece)
        token_lps.append(max(chosen.logprob, -9999.0))  # JSON has no -inf
        tops.append({(lp.decoded_token or ""): max(lp.logprob, -9999.0) for lp in ranked(entry)})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def stream_completion(run: Run, body: CompletionRequest, base: str, created: int, model: str,
                       index_of: dict[str, int], prompts: list[dict], echo: list[str]) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[str]:
        deltas = Deltas()

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            return sse_chunk(base, "text_completion", created, model, choices, usage)

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

    return guarded(events(), run)
