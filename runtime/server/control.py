"""Control API: `GET /health`, `GET /v1/stats`, `POST /v1/cache/rebuild` (elastic memory)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from ..engine.scheduler import RebuildError
from .core import ServerState, read_json
from .errors import ApiError
from .schemas import RebuildRequest, request_body


def memory(state: ServerState) -> dict[str, Any]:
    p = state.scheduler.plan
    return {"dense_bytes": p.dense_bytes, "kv_tokens": p.kv_tokens, "kv_bytes": p.kv_bytes,
            "expert_slots": p.expert_slots, "expert_bytes": p.expert_bytes,
            "prefix_cache_tokens": p.prefix_tokens, "prefix_cache_bytes": p.prefix_bytes,
            "graph_kv_tokens": p.graph_tokens, "graph_kv_bytes": p.graph_bytes,
            "prefill_workspace_bytes": p.workspace_bytes,
            "device_total_bytes": p.total_bytes,
            "budget_bytes": p.budget_bytes, "host_pool_bytes": state.rt.pool.nbytes}


def router(state: ServerState) -> APIRouter:
    r = APIRouter()

    @r.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": state.model_name}

    @r.get("/v1/stats")
    async def stats() -> dict:
        store = state.rt.store
        e = store.stats.totals()
        return {"model": state.model_name, "requests": state.scheduler.stats(),
                "experts": {"strategy": store.strategy, "cache_slots": store.cache.capacity,
                            "resident": store.resident(), "active": e.active, "hits": e.hits,
                            "misses": e.misses, "fills": e.fills, "cpu": e.cpu,
                            "miss_rate": round(store.stats.miss_rate, 4)},
                "memory": memory(state),
                "prefix_cache": state.rt.prefix_cache.info() if state.rt.prefix_cache else None}

    @r.post("/v1/cache/rebuild", openapi_extra=request_body(RebuildRequest))
    async def rebuild(request: Request) -> dict:
        """New expert-cache and/or KV budgets, applied between scheduler steps; refused or rolled
        back (409, the old split in force) when they cannot be allocated."""
        req = await read_json(request, RebuildRequest)
        try:
            await asyncio.wrap_future(state.scheduler.rebuild(req.experts, req.kv_tokens))
        except RebuildError as e:
            raise ApiError(409, f"rebuild refused, the old split stays: {e}", code="rebuild_failed") from None
        return {"applied": True, "memory": memory(state)}

    return r
