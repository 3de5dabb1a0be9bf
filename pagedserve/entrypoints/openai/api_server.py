"""OpenAI-compatible HTTP server: the app, its error handling, auth and routing.

Endpoints: /v1/completions (serving_completion.py), /v1/chat/completions (serving_chat.py), /tokenize and
/detokenize (serving_tokenize.py), /v1/models (serving_models.py), /dashboard (entrypoints/dashboard),
/metrics, /health. Every generating handler turns a request into one engine request per prompt (n samples
each), all feeding one asyncio queue (`Run`), then either collects the final outputs or streams the
deltas over SSE; a client that goes away has its requests aborted at once.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.async_engine import DEFAULT_MAX_QUEUE_LEN, AsyncLLMEngine
from pagedserve.engine.engine import LLMEngine
from pagedserve.entrypoints.dashboard import serving as serving_dashboard
from pagedserve.entrypoints.openai import protocol, serving_models, serving_tokenize
from pagedserve.entrypoints.openai.middleware import DEFAULT_MAX_BODY_BYTES, RequestGuard
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagedserve.entrypoints.openai.serving_chat import create_chat_completion
from pagedserve.entrypoints.openai.serving_completion import create_completion
from pagedserve.entrypoints.openai.serving_engine import ServerContext
from pagedserve.entrypoints.openai.serving_tools import ToolOptions
from pagedserve.metrics import CONTENT_TYPE, EngineMetrics

if TYPE_CHECKING:
    from pagedserve.engine.data_parallel import DPAsyncEngine, DPEngineView

logger = logging.getLogger("pagedserve")


# The alternatives of a union body (POST /tokenize) appear in error locations by their model's name.
_MODEL_NAMES = {name for name, obj in vars(protocol).items() if isinstance(obj, type) and issubclass(obj, BaseModel)}


def _field_path(error: dict) -> list[str]:
    """The field an error is about: its location without "body" and without union alternatives' names."""
    return [str(x) for x in error.get("loc", ()) if x != "body" and x not in _MODEL_NAMES]


# ---- the app -------------------------------------------------------------------------------------
def build_app(
    engine: LLMEngine | DPEngineView, api_key: str | None = None, log_interval_s: float = 10.0,
    async_engine: AsyncLLMEngine | DPAsyncEngine | None = None, max_queue_len: int | None = DEFAULT_MAX_QUEUE_LEN,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tool_options: ToolOptions | None = None,
) -> FastAPI:
    """tool_options: --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser (serving_tools.py).

    Data parallelism: pass a DPAsyncEngine as async_engine and its `view` as engine (no LLMEngine in
    this process)."""
    aengine = async_engine or AsyncLLMEngine(engine, log_interval_s, EngineMetrics(engine), max_queue_len)
    ctx = ServerContext(engine, aengine, tool_options or ToolOptions())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(aengine.shutdown)
            ctx.close()

    app = FastAPI(title="pagedserve", lifespan=lifespan)
    app.state.engine = engine
    app.state.async_engine = aengine

    # ---- errors -----------------------------------------------------------------------------------
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = _field_path(first)
        param = loc[0] if loc else None
        if first.get("type") == "json_invalid":
            message, param = f"invalid JSON body: {first.get('ctx', {}).get('error', '')}".strip(), None
        else:
            # A union field (prompt, stop, content) fails once per alternative: list them all.
            same = [e for e in errors if _field_path(e)[:1] == loc[:1]]
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

    # Authentication and the body-size bound run before FastAPI reads anything (middleware.py).
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes)

    # ---- routes: one serving module per endpoint family ----------------------------------------------
    @app.get("/health")
    async def health():
        reason = aengine.unhealthy_reason()
        if reason is not None:
            raise OpenAIError(reason, 503, "server_error")
        detail = getattr(aengine, "health_detail", None)  # data parallel: each replica's state
        return JSONResponse(detail() if detail is not None else {})

    @app.get("/v1/models")
    async def models():
        return serving_models.list_models(ctx)

    @app.get("/metrics")
    async def prometheus():
        return Response(aengine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/dashboard")
    async def dashboard():
        return serving_dashboard.dashboard_page()

    @app.get("/dashboard/state")
    async def dashboard_state(replica: int = 0):
        return await serving_dashboard.dashboard_state(ctx, replica)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest):
        return await serving_tokenize.tokenize(ctx, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await serving_tokenize.detokenize(ctx, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(ctx, body, raw)

    return app
