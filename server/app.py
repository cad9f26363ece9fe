"""The HTTP layer: an OpenAI-compatible API in front of one `mmkv.Engine`.

Life of a chat request here: auth -> tenant -> schema check (422) -> content parts checked and
resolved to engine parts (400/404) -> one job on the engine worker (429 when the queue is full)
-> engine.generate, with text deltas streamed back as they decode -> OpenAI response plus the
`mmkv` report. Nothing here knows a tensor; the engine's answer is passed through unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmkv.errors import InvalidImageError, InvalidRequestError, MMKVError, UnknownImageError

from .auth import KeyRing
from .files import FileStore, FileStoreFullError, StoredFile, new_stored_file, resolve_image_url
from .metrics import CONTENT_TYPE, ServerMetrics
from .schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    ErrorResponse,
    FileDeleted,
    FileList,
    FileObject,
    ImageFilePart,
    ImageURLPart,
    MMKVReport,
    Model,
    ModelList,
    PromptTokensDetails,
    SkillCreate,
    SkillDeleted,
    SkillList,
    SkillObject,
    SkillPart,
    StateUpdatePart,
    TextPart,
    Usage,
    parse_content_part,
)
from .worker import EngineWorker, Job

log = logging.getLogger("mmkv.server")

_ARRIVED = "mmkv.arrived"  # scope key: perf_counter() when the request reached the server
_END = object()  # end of a stream of text deltas


@dataclass(frozen=True, slots=True)
class ServerSettings:
    api_keys: tuple[str, ...] = ()
    max_queue: int = 64  # engine jobs waiting before new ones get 429
    max_body_bytes: int = 32 << 20  # any request body, uploads and data: URLs included (413 above)
    file_store_bytes: int = 2 << 30  # uploaded image bytes kept, all tenants together
    max_images_per_request: int = 16
    allowed_image_url_prefixes: tuple[str, ...] = ()  # e.g. "https://images.example.com/", "file:///srv/img/"
    default_max_tokens: int = 512

    def __post_init__(self):
        assert self.max_queue >= 1, "max_queue must be at least 1"
        assert self.max_body_bytes > 0 and self.file_store_bytes > 0, "byte limits must be positive"
        assert self.max_images_per_request >= 0, "max_images_per_request must be >= 0"
        assert self.default_max_tokens >= 1, "the default max_tokens must be at least 1"


class BodyTooLargeError(MMKVError):
    http_status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class ClientDisconnected(Exception):
    """The client went away while its job waited or ran; the job has been cancelled."""


_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 422, 429, 500)
}


def error_json(status: int, message: str, error_type: str, code: str | None = None,
               param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _mmkv_error_response(exc: MMKVError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.http_status == 429 else None
    return error_json(exc.http_status, exc.message, exc.error_type, exc.code, exc.param, headers)


class _RequestEdge:
    """Pure-ASGI middleware: stamps arrival time, caps the body at `max_bytes` (413 however the
    app would have answered), and counts every response by route and status."""

    def __init__(self, app, max_bytes: int, metrics: ServerMetrics):
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[_ARRIVED] = time.perf_counter()
        too_large = BodyTooLargeError(f"request body is larger than {self.max_bytes} bytes")
        status = 500
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _mmkv_error_response(too_large)(scope, receive, send)
            self.metrics.observe_request(_endpoint(scope), 413)
            return
        received = 0
        exceeded = False

        async def capped_receive():
            nonlocal received, exceeded
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                exceeded = True
                raise too_large
            return message

        async def counted_send(message):
            nonlocal status
            if exceeded:  # the app answered a truncated body: answer 413 instead, once
                if message["type"] == "http.response.start":
                    status = 413
                    await _mmkv_error_response(too_large)(scope, receive, send)
                return
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, capped_receive, counted_send)
        finally:
            self.metrics.observe_request(_endpoint(scope), status)


def _endpoint(scope) -> str:
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"


def create_app(engine, settings: ServerSettings = ServerSettings()) -> FastAPI:
    """The FastAPI app serving `engine`. The engine is owned by the app's worker thread from
    start-up to shut-down: do not call it from elsewhere while the app runs."""
    worker = EngineWorker(engine, settings.max_queue)
    files = FileStore(settings.file_store_bytes)
    keys = KeyRing(settings.api_keys)
    metrics = ServerMetrics(lambda: worker.stats, lambda: worker.queue_depth)
    model_id = engine.model_id
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        worker.start()
        log.info("engine worker started", extra={"model": model_id, "max_queue": settings.max_queue})
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="mmkv", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible multimodal chat with upload-once images and KV reuse.")
    app.state.worker, app.state.files, app.state.metrics, app.state.settings = worker, files, metrics, settings
    app.add_middleware(_RequestEdge, max_bytes=settings.max_body_bytes, metrics=metrics)
    _install_error_handlers(app)

    def tenant_of(request: Request) -> str:
        return keys.tenant_for(request.headers.get("authorization"))

    async def run_job(request: Request, fn) -> tuple[Any, Job]:
        job = worker.submit(fn)
        return await _until_done(request, job, asyncio.wrap_future(job.future)), job

    async def _until_done(request: Request, job: Job, pending: asyncio.Future) -> Any:
        """`pending`'s result, unless the client disconnects first: then cancel the job."""
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({pending, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if pending in done:
                return pending.result()
            raise ClientDisconnected
        except (ClientDisconnected, asyncio.CancelledError):
            _cancel(job)
            pending.cancel()  # nobody will read its outcome
            raise
        finally:
            watcher.cancel()

    def _cancel(job: Job) -> None:
        if not job.future.done():
            worker.cancel(job)
            metrics.cancelled.inc()

    v1 = APIRouter(prefix="/v1", responses=_ERROR_RESPONSES)

    # ------------------------------------------------------------ files

    @v1.post("/files", response_model=FileObject)
    async def upload_file(request: Request, file: UploadFile = File(...), purpose: str = Form("vision"),
                          tenant: str = Depends(tenant_of)) -> FileObject:
        """Store an image, decode and check it, and precompile its KV. Same bytes, same id."""
        if purpose != "vision":
            raise InvalidRequestError(f"purpose must be 'vision', got {purpose!r}", param="purpose")
        data = await file.read()
        if not data:
            raise InvalidImageError("the uploaded file is empty", param="file")
        files.check_room(len(data))

        def add(engine, _should_stop):
            image_id = engine.add_image(data, tenant=tenant)
            return image_id, engine.image_info(image_id, tenant=tenant)

        try:
            (image_id, info), _ = await run_job(request, add)
        except InvalidImageError as exc:
            exc.param = exc.param or "file"
            raise
        stored = new_stored_file(tenant, image_id, file.filename or "image", file.content_type, data,
                                 info.width, info.height, info.image_tokens)
        try:
            stored = files.add(stored)
        except FileStoreFullError:  # a concurrent upload took the room: undo the engine side
            await run_job(request, lambda engine, _: engine.remove_image(image_id, tenant=tenant))
            raise
        return _file_object(stored)

    @v1.get("/files", response_model=FileList)
    async def list_files(tenant: str = Depends(tenant_of)) -> FileList:
        return FileList(data=[_file_object(f) for f in files.list(tenant)])

    @v1.get("/files/{file_id}", response_model=FileObject)
    async def get_file(file_id: str, tenant: str = Depends(tenant_of)) -> FileObject:
        return _file_object(files.get(tenant, file_id))

    @v1.get("/files/{file_id}/content", response_class=Response)
    async def get_file_content(file_id: str, tenant: str = Depends(tenant_of)) -> Response:
        stored = files.get(tenant, file_id)
        return Response(stored.data, media_type=stored.content_type)

    @v1.delete("/files/{file_id}", response_model=FileDeleted)
    async def delete_file(request: Request, file_id: str, tenant: str = Depends(tenant_of)) -> FileDeleted:
        """Drop the bytes and the image's cached KV."""
        files.get(tenant, file_id)
        try:
            await run_job(request, lambda engine, _: engine.remove_image(file_id, tenant=tenant))
        except UnknownImageError:
            pass  # the engine no longer has it; the bytes still go
        files.remove(tenant, file_id)
        return FileDeleted(id=file_id)

    # ------------------------------------------------------------ skills

    @v1.post("/skills", response_model=SkillObject)
    async def create_skill(request: Request, body: SkillCreate, tenant: str = Depends(tenant_of)) -> SkillObject:
        """Precompile a text skill in isolation; reference it with {"type": "skill", "skill_id": id}."""
        info, _ = await run_job(request, lambda engine, _: engine.skill_info(
            engine.add_skill(body.name, body.text, tenant=tenant), tenant=tenant))
        return _skill_object(info)

    @v1.get("/skills", response_model=SkillList)
    async def list_skills(request: Request, tenant: str = Depends(tenant_of)) -> SkillList:
        infos, _ = await run_job(request, lambda engine, _: engine.list_skills(tenant))
        return SkillList(data=[_skill_object(i) for i in infos])

    @v1.get("/skills/{skill_id}", response_model=SkillObject)
    async def get_skill(request: Request, skill_id: str, tenant: str = Depends(tenant_of)) -> SkillObject:
        info, _ = await run_job(request, lambda engine, _: engine.skill_info(skill_id, tenant))
        return _skill_object(info)

    @v1.delete("/skills/{skill_id}", response_model=SkillDeleted)
    async def delete_skill(request: Request, skill_id: str, tenant: str = Depends(tenant_of)) -> SkillDeleted:
        """Drop the skill and its cached KV."""
        await run_job(request, lambda engine, _: engine.remove_skill(skill_id, tenant))
        return SkillDeleted(id=skill_id)

    # ------------------------------------------------------------ chat

    def generate_kwargs(body: ChatCompletionRequest, tenant: str) -> dict[str, Any]:
        return dict(
            max_new_tokens=body.max_completion_tokens or body.max_tokens or settings.default_max_tokens,
            temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=body.stop_list(),
            reuse=body.mmkv.reuse, seam_tokens=body.mmkv.seam_tokens, rope_policy=body.mmkv.rope_policy,
            edit_policy=body.mmkv.edit_policy, fidelity=body.mmkv.fidelity, tenant=tenant,
        )

    def report(request: Request, job: Job, result) -> tuple[MMKVReport, Usage]:
        """The response's mmkv report and usage; records the request's metrics."""
        arrived = request.scope[_ARRIVED]
        ttft_s = job.started_at - arrived + result.ttft_s
        u = result.usage
        metrics.observe_completion(ttft_s=ttft_s, e2e_s=time.perf_counter() - arrived,
                                   prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
                                   completion_tokens=u.completion_tokens,
                                   image_tokens_reused=result.image_tokens_reused)
        usage = Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                      total_tokens=u.prompt_tokens + u.completion_tokens,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens))
        mmkv_report = MMKVReport(ttft_ms=round(ttft_s * 1000, 3), image_tokens_reused=result.image_tokens_reused,
                                 vision_tower_runs=result.vision_tower_runs,
                                 prefix_tokens_reused=result.prefix_tokens_reused,
                                 skill_tokens_reused=result.skill_tokens_reused,
                                 lm_tokens_computed=result.lm_tokens_computed,
                                 edit=dataclasses.asdict(result.edit) if result.edit else None,
                                 fidelity=dataclasses.asdict(result.fidelity) if result.fidelity else None)
        log.info("chat completion", extra={
            "ttft_ms": mmkv_report.ttft_ms, "queue_ms": round((job.started_at - arrived) * 1000, 3),
            "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
            "completion_tokens": u.completion_tokens, "finish_reason": result.finish_reason,
            "image_tokens_reused": result.image_tokens_reused, "vision_tower_runs": result.vision_tower_runs})
        return mmkv_report, usage

    @v1.post("/chat/completions", response_model=ChatCompletion,
             responses={200: {"content": {"text/event-stream": {}},
                              "description": "A chat.completion, or with stream=true an SSE stream of chunks."}})
    async def chat_completions(body: ChatCompletionRequest, request: Request, tenant: str = Depends(tenant_of)):
        if body.n != 1:
            raise InvalidRequestError("only n=1 is supported", param="n")
        messages = await engine_messages(body, tenant, files, settings)
        kwargs = generate_kwargs(body, tenant)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return await stream_chat(request, body, messages, kwargs, completion_id)
        result, job = await run_job(
            request, lambda engine, should_stop: engine.generate(messages, should_stop=should_stop, **kwargs))
        if result.finish_reason == "cancelled":  # the client left as the job finished
            return Response(status_code=499)
        mmkv_report, usage = report(request, job, result)
        return ChatCompletion(id=completion_id, created=int(time.time()), model=model_id, usage=usage, mmkv=mmkv_report,
                              choices=[Choice(message=AssistantMessage(content=result.text),
                                              finish_reason=result.finish_reason)])

    async def stream_chat(request: Request, body: ChatCompletionRequest, messages, kwargs, completion_id: str):
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()

        def on_text(delta: str) -> None:  # runs on the worker thread
            loop.call_soon_threadsafe(deltas.put_nowait, delta)

        job = worker.submit(
            lambda engine, should_stop: engine.generate(messages, on_text=on_text, should_stop=should_stop, **kwargs))
        # Scheduled after every on_text of the job, so _END arrives after the last delta.
        job.future.add_done_callback(lambda _: loop.call_soon_threadsafe(deltas.put_nowait, _END))
        # Hold the headers until the first delta or the end: a prompt the engine rejects is still
        # an HTTP error status, not a 200 with an error inside the stream.
        first_delta = asyncio.ensure_future(deltas.get())
        try:
            first = await _until_done(request, job, first_delta)
        finally:
            first_delta.cancel()
        if first is _END and job.future.exception() is not None:
            raise job.future.exception()
        created = int(time.time())

        def chunk(delta: Delta, finish_reason=None, **extra) -> str:
            data = ChatCompletionChunk(id=completion_id, created=created, model=model_id,
                                       choices=[ChunkChoice(delta=delta, finish_reason=finish_reason)], **extra)
            return f"data: {data.model_dump_json(exclude_none=True)}\n\n"

        async def events() -> AsyncIterator[str]:
            # Starlette cancels this generator when the client goes away; the watcher also covers
            # servers that only report it on the next send.
            watcher = asyncio.ensure_future(_disconnected(request))
            watcher.add_done_callback(lambda w: w.cancelled() or _cancel(job))
            try:
                yield chunk(Delta(role="assistant", content=""))
                item = first
                while item is not _END:
                    if item:
                        yield chunk(Delta(content=item))
                    item = await deltas.get()
                if (exc := job.future.exception()) is not None:
                    error = exc if isinstance(exc, MMKVError) else MMKVError("internal error during generation")
                    if not isinstance(exc, MMKVError):
                        log.error("generation failed mid-stream", exc_info=exc)
                    yield f"data: {json.dumps({'error': _error_body(error)})}\n\n"
                    return
                result = job.future.result()
                if result.finish_reason == "cancelled":  # the client has gone; nobody to tell
                    return
                mmkv_report, usage = report(request, job, result)
                yield chunk(Delta(), finish_reason=result.finish_reason, mmkv=mmkv_report)
                if body.stream_options and body.stream_options.include_usage:
                    data = ChatCompletionChunk(id=completion_id, created=created, model=model_id, choices=[],
                                               usage=usage)
                    yield f"data: {data.model_dump_json(exclude_none=True)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                watcher.cancel()
                _cancel(job)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------ models, health, metrics

    @v1.get("/models", response_model=ModelList)
    async def list_models(_tenant: str = Depends(tenant_of)) -> ModelList:
        return ModelList(data=[Model(id=model_id, created=started)])

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = worker.alive
        return JSONResponse({"status": "ok" if ok else "engine worker stopped", "model": model_id,
                             "queue_depth": worker.queue_depth, "busy": worker.busy},
                            status_code=200 if ok else 503)

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(v1)
    return app


async def engine_messages(body: ChatCompletionRequest, tenant: str, files: FileStore,
                          settings: ServerSettings) -> list[dict[str, Any]]:
    """The request's messages in the engine's shape, every part checked: image_file ids must be
    the tenant's files (404), image URLs must be data: URLs or allowed (fetched here, 400)."""
    out, images = [], 0
    for i, message in enumerate(body.messages):
        role = "system" if message.role == "developer" else message.role
        if message.content is None and message.role != "assistant":
            raise InvalidRequestError(f"messages[{i}].content is required for role {message.role!r}",
                                      param=f"messages[{i}].content")
        if message.content is None or isinstance(message.content, str):
            out.append({"role": role, "content": message.content or ""})
            continue
        parts = []
        for j, raw in enumerate(message.content):
            param = f"messages[{i}].content[{j}]"
            part = parse_content_part(raw, param)
            if isinstance(part, (TextPart, SkillPart, StateUpdatePart)):
                parts.append(part.model_dump())  # the engine checks skill ids per tenant (404)
                continue
            images += 1
            if images > settings.max_images_per_request:
                raise InvalidRequestError(f"at most {settings.max_images_per_request} images per request", param=param)
            parts.append(await _engine_image_part(part, param, tenant, files, settings))
        out.append({"role": role, "content": parts})
    return out


async def _engine_image_part(part: ImageURLPart | ImageFilePart, param: str, tenant: str, files: FileStore,
                             settings: ServerSettings) -> dict[str, Any]:
    if isinstance(part, ImageURLPart) and part.image_url.url.startswith("mmkv://"):
        # An uploaded id written as a URL: the same as an image_file part.
        part = ImageFilePart(type="image_file", image_file={"file_id": part.image_url.url.removeprefix("mmkv://")})
    if isinstance(part, ImageFilePart):
        file_id = files.get(tenant, part.image_file.file_id, param=f"{param}.image_file.file_id").id
        return {"type": "image_file", "image_file": {"file_id": file_id}}
    url = await resolve_image_url(part.image_url.url, settings.allowed_image_url_prefixes, settings.max_body_bytes,
                                  f"{param}.image_url.url")
    return {"type": "image_url", "image_url": {"url": url}}


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body must already have been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _skill_object(info) -> SkillObject:
    return SkillObject(id=info.skill_id, name=info.name, tokens=info.tokens, created_at=info.created_at)


def _file_object(f: StoredFile) -> FileObject:
    return FileObject(id=f.id, bytes=len(f.data), created_at=f.created_at, filename=f.filename, purpose="vision",
                      width=f.width, height=f.height, image_tokens=f.image_tokens)


def _error_body(exc: MMKVError) -> dict[str, Any]:
    return {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's {"error": {message, type, param, code}}."""

    @app.exception_handler(MMKVError)
    async def mmkv_error(_request: Request, exc: MMKVError) -> JSONResponse:
        if exc.http_status >= 500:
            log.error("%s: %s", type(exc).__name__, exc.message)
        return _mmkv_error_response(exc)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_request: Request, _exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(RequestValidationError)
    async def schema_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {err['msg']}" if param else err["msg"]
        return error_json(422, message, "invalid_request_error", "invalid_schema", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_json(exc.status_code, str(exc.detail), "invalid_request_error", code,
                          headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=exc)
        return error_json(500, "internal server error", "server_error", "internal_error")
