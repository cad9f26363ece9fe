"""/health and /metrics: open even with API keys (they show no tenant's data); /v1/mmkv/fidelity,
the fidelity monitor's summary, behind the keys like every /v1 route."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from .context import ServerContext
from .metrics import CONTENT_TYPE


def ops_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        ok = ctx.worker.alive
        # The shared tier down: requests still answer (lower tiers, recompute), so 200, but say so.
        shared = ctx.files.durable.shared if ctx.files.durable is not None else None
        degraded = shared is not None and not await asyncio.to_thread(shared.check)
        status = "engine worker stopped" if not ok else "degraded" if degraded else "ok"
        body = {"status": status, "model": ctx.model_id, "queue_depth": ctx.worker.queue_depth, "busy": ctx.worker.busy}
        if shared is not None:
            body["shared_tier"] = "down" if degraded else "ok"
        return JSONResponse(body, status_code=200 if ok else 503)

    @router.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    @router.get("/v1/mmkv/fidelity")
    async def fidelity_summary(_tenant: str = Depends(ctx.tenant_of)) -> JSONResponse:
        """The online fidelity monitor (`--shadow-rate`): per fast-path kind, how many requests were
        recomputed exactly and compared, how many agreed (with an exact 95% interval), dropped,
        the window's agreement and alerts. `enabled` false when the monitor is off."""
        shadow = ctx.worker.scheduler.shadow
        if shadow is None:
            return JSONResponse({"object": "mmkv.fidelity", "enabled": False})
        return JSONResponse({"object": "mmkv.fidelity", "enabled": True, **await asyncio.to_thread(shadow.snapshot)})

    return router
