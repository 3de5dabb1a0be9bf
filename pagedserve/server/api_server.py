"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,
/tokenize, /detokenize. SSE streaming; a client that goes away has its requests aborted at once.

Every handler turns a request into one engine request per prompt (n samples each), all feeding one
asyncio queue (`Run`), then either collects the final outputs or streams the deltas.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.engine import LLMEngine
from pagedserve.metrics import CONTENT_TYPE, EngineMetrics
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagedserve.server.streaming import (
    Run,
    SSEResponse,
    chat_logprobs,
    completion_logprobs,
    stream_chat,
    stream_completion,
    usage,
)

logger = logging.getLogger("pagedserve")


# ---- the app -------------------------------------------------------------------------------------
def build_app(
    engine: LLMEngine, api_key: str | None = None, log_interval_s: float = 10.0,
    async_engine: AsyncLLMEngine | None = None,
) -> FastAPI:
    aengine = async_engine or AsyncLLMEngine(engine, log_interval_s, EngineMetrics(engine))
    metrics = aengine.metrics
    model_name = engine.served_model_name
    tok = engine.tokenizer
    created_at = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(aengine.shutdown)

    app = FastAPI(title="pagedserve", lifespan=lifespan)
    app.state.engine = engine
    app.state.async_engine = aengine

    # ---- errors -----------------------------------------------------------------------------------
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        if first.get("type") == "json_invalid":
            message, param = f"invalid JSON body: {first.get('ctx', {}).get('error', '')}".strip(), None
        else:
            # A union field (prompt, stop, content) fails once per alternative: list them all.
            same = [e for e in errors if [str(x) for x in e.get("loc", ()) if x != "body"][:1] == loc[:1]]
            msgs = list(dict.fromkeys(e.get("msg", "invalid value") for e in same))
            message = f"{param or 'body'}: {' or '.join(msgs[:4])}"
            if len(errors) > len(same):
                message += f" (and {len(errors) - len(same)} more errors)"
        return JSONResponse(OpenAIError(message, 400, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = OpenAIError(str(exc.detail), exc.status_code, code=code)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("unhandled error")
        err = OpenAIError(f"internal error: {exc}", 500, "server_error")
        return JSONResponse(err.body(), status_code=500)

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise OpenAIError("invalid or missing API key (send 'Authorization: Bearer <key>')", 401,
                              code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise OpenAIError(f"The model `{name}` does not exist; this server serves `{model_name}`.", 404,
                              param="model", code="model_not_found")

    auth = [Depends(check_api_key)]

    # ---- simple endpoints -------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not aengine.is_running:
            raise OpenAIError("engine loop is not running", 503, "server_error")
        return JSONResponse({})

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created_at, "owned_by": "pagedserve",
            "root": engine.model_path, "parent": None, "max_model_len": engine.max_model_len,
        }]}

    @app.get("/dashboard")
    async def dashboard():
        from pagedserve.trace_report import dashboard_html

        return HTMLResponse(dashboard_html())

    @app.get("/dashboard/state", dependencies=auth)
    async def dashboard_state():
        from pagedserve.trace_report import engine_trace_data

        return JSONResponse(await aengine.call(lambda e: engine_trace_data(e, max_steps=300)))

    @app.get("/metrics", dependencies=auth)
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest):
        check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            text = _apply_template(tok, body.messages, body.add_generation_prompt)
        else:
            text = body.prompt
        ids = tok.encode(text, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = tok.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(f"tokens: {bad} is not a token id in [0, {vocab})", param="tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    # ---- completions --------------------------------------------------------------------------------
    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        prompts = _completion_prompts(tok, body.prompt)
        if body.echo and body.logprobs is not None:
            raise OpenAIError("echo: echo together with logprobs is not supported", param="echo")
        if body.suffix:
            raise OpenAIError("suffix: not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise OpenAIError("best_of: only best_of == n is supported", param="best_of")
        params = body.sampling_params(body.max_tokens, body.logprobs)
        base = f"cmpl-{uuid.uuid4().hex}"
        run = Run(aengine)
        await run.add([(f"{base}-{i}", prompt) for i, prompt in enumerate(prompts)], params)
        index_of = {f"{base}-{i}": i for i in range(len(prompts))}
        echo = [tok.decode(p["prompt_token_ids"]) if p["prompt"] is None else p["prompt"] for p in prompts]
        echo = echo if body.echo else []
        created = int(time.time())
        if body.stream:
            gen = stream_completion(run, body, base, created, model_name, index_of, prompts, echo)
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
            "id": base, "object": "text_completion", "created": created, "model": model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    # ---- chat ---------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        text = _apply_template(tok, body.messages, body.add_generation_prompt)
        ids = tok.encode(text, add_special_tokens=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError("top_logprobs: requires logprobs to be true", param="top_logprobs")
        top = body.top_logprobs or 0
        params = body.sampling_params(max_tokens, top if body.logprobs else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        run = Run(aengine)
        await run.add([(rid, {"prompt": text, "prompt_token_ids": ids})], params)
        created = int(time.time())
        if body.stream:
            return SSEResponse(stream_chat(run, body, rid, created, model_name, len(ids), top), run)
        if not await run.wait(raw):
            return Response(status_code=499)
        out = run.finished[rid]
        choices = [{
            "index": o.index,
            "message": {"role": "assistant", "content": o.text},
            "logprobs": chat_logprobs(o, 0, len(o.token_ids), top) if body.logprobs else None,
            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
        } for o in out.outputs]
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": model_name,
            "choices": choices,
            "usage": usage(len(ids), sum(len(o.token_ids) for o in out.outputs)),
        }

    return app


# ---- helpers -----------------------------------------------------------------------------------------
def _apply_template(tok, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
    if not messages:
        raise OpenAIError("messages: must be a non-empty list", param="messages")
    try:
        return tok.apply_chat_template([m.as_template_dict() for m in messages], add_generation_prompt)
    except ValueError as e:
        raise OpenAIError.from_value_error(e) from None
    except Exception as e:  # a template that raises on this conversation (e.g. role order) is bad input
        raise OpenAIError(f"messages: the chat template rejected them: {e}", param="messages") from None


def _completion_prompts(tok, prompt) -> list[dict]:
    """string | [string] | [ids] | [[ids]] → [{"prompt", "prompt_token_ids"}]."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif not prompt:
        raise OpenAIError("prompt: must not be empty", param="prompt")
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    out = []
    for p in items:
        if not p:
            raise OpenAIError("prompt: must not be empty", param="prompt")
        if isinstance(p, str):
            out.append({"prompt": p, "prompt_token_ids": tok.encode(p)})
        else:
            out.append({"prompt": None, "prompt_token_ids": list(p)})
    return out
