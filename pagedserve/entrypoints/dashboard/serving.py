"""GET /dashboard (the page, assets inline) and GET /dashboard/state (the engine's trace data as JSON,
the last steps only, computed on the engine thread between steps)."""

from __future__ import annotations

from fastapi.responses import HTMLResponse, JSONResponse

from pagedserve.engine.trace import engine_trace_data
from pagedserve.entrypoints.dashboard.views import dashboard_html
from pagedserve.entrypoints.openai.serving_engine import ServerContext

DASHBOARD_STEPS = 300  # steps of history the live view shows


def dashboard_page() -> HTMLResponse:
    return HTMLResponse(dashboard_html())


async def dashboard_state(ctx: ServerContext) -> JSONResponse:
    return JSONResponse(await ctx.async_engine.call(lambda e: engine_trace_data(e, max_steps=DASHBOARD_STEPS)))
