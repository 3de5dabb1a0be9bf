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
    """Built at most once per engine step, however many dashboards poll."""

    def build(engine) -> dict:
        cached = ctx.dashboard_cache.get("state")
        if cached is None or cached[0] != engine.step_count:
            cached = ctx.dashboard_cache["state"] = (engine.step_count, engine_trace_data(engine, DASHBOARD_STEPS))
        return cached[1]

    return JSONResponse(await ctx.async_engine.call(build))
