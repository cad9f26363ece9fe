"""The HTTP layer: an OpenAI-compatible API in front of one `mmkv.Engine`. `create_app` wires the
pieces; each resource has its router (routes_files, routes_chat, routes_skills, routes_models,
routes_ops), the edge middleware caps bodies, and every error leaves as OpenAI's error JSON.
Nothing here knows a tensor; the engine's answer is passed through unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from .auth import KeyRing
from .context import ServerContext
from .edge import RequestEdge
from .errors import install_error_handlers
from .files import FileStore
from .image_prep import ImagePreparer
from .metrics import ServerMetrics
from .routes_chat import chat_router
from .routes_files import files_router
from .routes_models import models_router
from .routes_ops import ops_router
from .routes_page import page_router
from .routes_skills import skills_router
from .routes_streams import streams_router
from .schemas import ErrorResponse
from .settings import ServerSettings
from .skill_quota import SkillQuota
from .worker import EngineWorker

log = logging.getLogger("mmkv.server")

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 408, 413, 429, 500, 503, 507)
}


def create_app(engine, settings: ServerSettings = ServerSettings()) -> FastAPI:
    """The FastAPI app serving `engine`. The engine is owned by the app's worker thread from
    start-up to shut-down (only `engine.prepare_image`, which is thread-safe, also runs on the
    image threads): do not call it from elsewhere while the app runs."""
    shadow = None
    if settings.shadow_rate > 0:
        from mmkv.request.shadow import ShadowMonitor  # here: importing the server must not import torch

        shadow = ShadowMonitor(settings.shadow_rate, settings.shadow_alert, settings.shadow_window,
                               blend=settings.shadow_blend, target=settings.shadow_target,
                               select=engine.settings.blend_select)
    worker = EngineWorker(engine, settings.max_queue, settings.max_batch, settings.prefill_chunk, shadow,
                          prefill_slice_ms=settings.prefill_slice_ms, ride_prefill=settings.ride_prefill,
                          preempt_prefill=settings.preempt_prefill)
    metrics = ServerMetrics(worker.live_stats, lambda: worker.queue_depth,
                            shadow.snapshot if shadow is not None else None)
    tiers = getattr(engine, "tiers", None)  # disk / shared tiers (mmkv/store/tiers.py): durable files, shared tenants
    ctx = ServerContext(
        worker=worker, metrics=metrics, settings=settings,
        keys=KeyRing(settings.api_keys, secret=tiers.tenant_secret() if tiers is not None else None),
        files=FileStore(settings.file_store_bytes, settings.key_file_bytes, settings.key_files,
                        durable=tiers.registry if tiers is not None else None),
        images=ImagePreparer(engine.prepare_image, settings.image_threads, settings.max_pending_images),
        skill_quota=SkillQuota(settings.skill_store_bytes, settings.key_skill_bytes, settings.key_skills),
        model_names=settings.served_model_names or (engine.model_id,), started=int(time.time()))

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        worker.start()
        log.info("engine worker started", extra={"model": ctx.model_id, "max_queue": settings.max_queue})
        yield
        ctx.images.close()
        await asyncio.to_thread(worker.stop)

    # No /docs or /redoc: their pages load scripts from a CDN, which an offline or locked-down
    # deployment cannot reach (and should not trust). /openapi.json is the schema.
    # strict_content_type=False: a JSON body sent with no Content-Type is read as JSON (as OpenAI's
    # API reads it); one sent under another type is a 415 naming the header (server/errors.py).
    app = FastAPI(title="mmkv", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  strict_content_type=False, generate_unique_id_function=lambda route: route.name,
                  description="OpenAI-compatible multimodal chat with upload-once images and KV reuse.")
    app.state.ctx = ctx
    app.add_middleware(RequestEdge, max_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s,
                       metrics=metrics)
    install_error_handlers(app)
    # Each router writes its full paths: /metrics labels requests by the route's own path.
    for router in (files_router(ctx), chat_router(ctx), skills_router(ctx), models_router(ctx), streams_router(ctx)):
        app.include_router(router, responses=_ERROR_RESPONSES)
    app.include_router(ops_router(ctx))
    app.include_router(page_router())
    _describe_switches(app.openapi(), settings)
    return app


def _describe_switches(openapi: dict[str, Any], settings: ServerSettings) -> None:
    """The published schema (generated once, then served as is) says what this server's switches
    let a request ask for: with fidelity off, `mmkv.fidelity` may only be false."""
    if not settings.allow_fidelity:
        fidelity = openapi["components"]["schemas"]["MMKVOptions"]["properties"]["fidelity"]
        fidelity["enum"] = [False]
        fidelity["description"] += " Off on this server (mmkv serve --allow-fidelity): true is a 400."
