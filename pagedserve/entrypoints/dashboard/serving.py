"""GET /dashboard (the page, assets inline) and GET /dashboard/state (the engine's trace data as JSON,
the last steps only, computed on the engine thread between steps; with data parallelism, one replica's:
`?replica=I`)."""

from __future__ import annotations

from fastapi.responses import HTMLResponse, JSONResponse

from pagedserve.engine.async_engine import EngineDeadError
from pagedserve.engine.trace import engine_trace_data
from pagedserve.entrypoints.dashboard.views import dashboard_html
from pagedserve.entrypoints.openai.protocol import OpenAIError
from pagedserve.entrypoints.openai.serving_engine import ServerContext

DASHBOARD_STEPS = 300  # steps of history the live view shows


def dashboard_page() -> HTMLResponse:
    return HTMLResponse(dashboard_html())


async def dashboard_state(ctx: ServerContext, replica: int = 0) -> JSONResponse:
    """Built at most once per engine step, however many dashboards poll. With data parallelism the view
    is one replica's (`replica`, default 0), computed in its process; one engine has only replica 0."""
    trace_data = getattr(ctx.async_engine, "trace_data", None)
    if trace_data is not None:
        try:
            return JSONResponse(await trace_data(DASHBOARD_STEPS, replica))
        except ValueError as e:
            raise OpenAIError(str(e), 400, param="replica") from None
        except EngineDeadError as e:
            raise OpenAIError(str(e), 503, "server_error") from None
    if replica != 0:
        raise OpenAIError(f"replica: this server runs one engine (replica 0), got {replica}", 400, param="replica")

    def build(engine) -> dict:
        cached = ctx.dashboard_cache.get("state")
        if cached is None or cached[0] != engine.step_count:
            cached = ctx.dashboard_cache["state"] = (engine.step_count, engine_trace_data(engine, DASHBOARD_STEPS))
        return cached[1]

    return JSONResponse(await ctx.async_engine.call(build))
