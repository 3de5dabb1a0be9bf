"""POST /v1/chat/completions: messages in, an assistant message out, through the model's chat template;
streaming and non-streaming shapes, and the logprobs shape of this endpoint. Tools, tool_choice and
reasoning are planned and parsed in serving_tools.py; structured outputs compile in ServerContext."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, OpenAIError
from pagedserve.entrypoints.openai.serving_engine import (
    Run,
    ServerContext,
    SSEResponse,
    guarded,
    ranked,
    sse_chunk,
    usage,
)
from pagedserve.entrypoints.openai.serving_tools import ToolPlan
from pagedserve.outputs import CompletionOutput, Logprob


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, raw: Request):
    tok = ctx.tokenizer
    ctx.check_model(body.model)
    plan = ToolPlan.from_request(body, ctx.tool_options)
    text, ids = await ctx.in_tokenizer_thread(templated_ids, tok, body.messages, body.add_generation_prompt,
                                              plan.tools or None)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError("top_logprobs: requires logprobs to be true", param="top_logprobs")
    top = body.top_logprobs or 0
    params = body.sampling_params(max_tokens, top if body.logprobs else None)
    forced = plan.structured_outputs()
    if forced is not None:
        if params.structured_outputs is not None:
            raise OpenAIError(f"tool_choice: {plan.mode} tool calls cannot be combined with another "
                              "structured-output constraint", param="tool_choice")
        params = params.clone(structured_outputs=forced)
    await ctx.compile_structured(params)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    run = Run(ctx.async_engine)
    await run.add([(rid, {"prompt": text, "prompt_token_ids": ids})], params)
    created = int(time.time())
    if body.stream:
        return SSEResponse(stream_chat(run, body, rid, created, ctx.model_name, len(ids), top, plan), run)
    if not await run.wait(raw):
        return Response(status_code=499)
    out = run.finished[rid]
    choices = []
    for o in out.outputs:
        message, finish_reason = plan.message(o.text, o.finish_reason)
        choices.append({
            "index": o.index, "message": message,
            "logprobs": chat_logprobs(o, 0, len(o.token_ids), top) if body.logprobs else None,
            "finish_reason": finish_reason, "stop_reason": o.stop_reason,
        })
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
        "choices": choices,
        "usage": usage(len(ids), sum(len(o.token_ids) for o in out.outputs)),
    }


def templated_ids(tok, messages: list[ChatMessage], add_generation_prompt: bool,
                  tools: list[dict] | None = None) -> tuple[str, list[int]]:
    text = apply_template(tok, messages, add_generation_prompt, tools)
    return text, tok.encode(text, add_special_tokens=False)


def apply_template(tok, messages: list[ChatMessage], add_generation_prompt: bool,
                   tools: list[dict] | None = None) -> str:
    if not messages:
        raise OpenAIError("messages: must be a non-empty list", param="messages")
    try:
        return tok.apply_chat_template([m.as_template_dict() for m in messages], add_generation_prompt, tools)
    except ValueError as e:
        raise OpenAIError.from_value_error(e) from None
    except Exception as e:  # a template that raises on this conversation (e.g. role order) is bad input
        raise OpenAIError(f"messages: the chat template rejected them: {e}", param="messages") from None


def chat_logprobs(o: CompletionOutput, start: int, end: int, k: int) -> dict:
    def item(lp: Logprob) -> dict:
        tok = lp.decoded_token or ""
        return {"token": tok, "logprob": max(lp.logprob, -9999.0), "bytes": list(tok.encode("utf-8"))}

    content = []
    for tid, entry in zip(o.token_ids[start:end], (o.logprobs or [])[start:end], strict=False):
        chosen = entry.get(tid) or Logprob(float("-inf"))
        content.append({**item(chosen), "top_logprobs": [item(lp) for lp in ranked(entry, k)]})
    return {"content": content}


def stream_chat(run: Run, body: ChatCompletionRequest, rid: str, created: int, model: str,
                 prompt_tokens: int, top: int, plan: ToolPlan) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[str]:
        streamers = [plan.streamer() for _ in range(body.n)]
        sent_tokens = [0] * body.n
        done: set[int] = set()

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            return sse_chunk(rid, "chat.completion.chunk", created, model, choices, usage)

        for j in range(body.n):
            yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for out in run.outputs():
            for o in out.outputs:
                if o.index in done:
                    continue
                final = o.finish_reason is not None
                delta = streamers[o.index].update(o.text, final)
                if not delta and not final:
                    continue  # nothing to show yet (held back: a stop string or a tool-call marker)
                start, end = sent_tokens[o.index], len(o.token_ids)
                sent_tokens[o.index] = end
                if final:
                    done.add(o.index)
                lp = chat_logprobs(o, start, end, top) if body.logprobs else None
                yield chunk([{"index": o.index, "delta": delta, "logprobs": lp,
                              "finish_reason": streamers[o.index].finish_reason(o.finish_reason),
                              "stop_reason": o.stop_reason}])
        if body.include_usage:
            completion_tokens = sum(len(o.token_ids) for out in run.finished.values() for o in out.outputs)
            yield chunk([], usage(prompt_tokens, completion_tokens))

    return guarded(events(), run)
