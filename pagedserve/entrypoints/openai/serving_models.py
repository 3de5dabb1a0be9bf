"""GET /v1/models: the one model this server serves."""

from __future__ import annotations

from pagedserve.entrypoints.openai.serving_engine import ServerContext


def list_models(ctx: ServerContext) -> dict:
    return {"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": ctx.created_at, "owned_by": "pagedserve",
        "root": ctx.engine.model_path, "parent": None, "max_model_len": ctx.engine.max_model_len,
    }]}
