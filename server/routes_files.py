"""/v1/files: upload an image once (decoded off the engine worker, precompiled on it), list its
files page by page, serve the bytes back safely, delete it and everything derived from it. The
file store's disk and shared-tier I/O runs on the thread pool, never on the event loop."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from mmkv.errors import InvalidImageError, InvalidRequestError, UnknownImageError, UnknownVideoError

from .context import ServerContext
from .files import FileQuotaError, FileStoreFullError, StoredFile, new_stored_file
from .pagination import PageQuery, page_query, paginate
from .schemas import FileDeleted, FileList, FileObject, UnsupportedParameterError, id_links
from .video_prep import looks_like_video, upload_video


def files_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    files = ctx.files

    @router.post("/v1/files", response_model=FileObject, openapi_extra=_UPLOAD_BODY,
                 responses={200: {"links": id_links("file_id", "get_file", "get_file_content", "delete_file")}})
    async def upload_file(request: Request, tenant: str = Depends(ctx.tenant_of)) -> FileObject:
        """Store an image or a video, decode and check it, and precompile its KV (a video's per
        temporal group; `image_tokens` then counts its video pads). Same bytes, same id."""
        file = await _uploaded_file(request)
        data = await file.read()
        if not data:
            raise InvalidImageError("the uploaded file is empty", param="file")
        files.check_room(tenant, len(data))
        if looks_like_video(data):  # MP4 / MOV / WebM / MKV: mmkv.video, every temporal group precompiled
            return _file_object(await upload_video(ctx, request, tenant, file.filename, data))
        upload = await ctx.images.prepare_upload(data, "file")

        def add(engine, _should_stop):
            image_id = engine.add_image(upload.image, tenant=tenant)
            return image_id, engine.image_info(image_id, tenant=tenant)

        (image_id, info), _ = await ctx.run_job(request, add)
        stored = new_stored_file(tenant, image_id, file.filename or "image", upload.media_type, data,
                                 info.width, info.height, info.image_tokens)
        try:
            stored = await run_in_threadpool(files.add, stored)  # the one kept, if this key has it already
        except (FileStoreFullError, FileQuotaError):  # a concurrent upload took the room: undo
            await ctx.run_job(request, lambda engine, _: engine.remove_image(image_id, tenant=tenant))
            raise
        return _file_object(stored)

    @router.get("/v1/files", response_model=FileList)
    async def list_files(page: PageQuery = Depends(page_query), purpose: str | None = None,
                         tenant: str = Depends(ctx.tenant_of)) -> FileList:
        """This key's files, newest first by default; OpenAI's cursor pagination."""
        listed = await run_in_threadpool(files.list, tenant) if purpose in (None, "vision") else []
        p = paginate(listed, lambda f: f.id, page, UnknownImageError)
        return FileList(data=[_file_object(f) for f in p.items], first_id=p.first_id, last_id=p.last_id,
                        has_more=p.has_more)

    @router.get("/v1/files/{file_id}", response_model=FileObject)
    async def get_file(file_id: str, tenant: str = Depends(ctx.tenant_of)) -> FileObject:
        return _file_object(await run_in_threadpool(files.get, tenant, file_id))

    @router.get("/v1/files/{file_id}/content", response_class=Response)
    async def get_file_content(file_id: str, tenant: str = Depends(ctx.tenant_of)) -> Response:
        """The uploaded bytes, as the image type they decoded as, as a download: never rendered
        as a page of the API's origin, whatever the client claimed at upload."""
        stored = await run_in_threadpool(files.get, tenant, file_id)
        return Response(stored.data, media_type=stored.content_type, headers={
            "Content-Disposition": f"attachment; filename*=UTF-8''{quote(stored.filename, safe='')}",
            "X-Content-Type-Options": "nosniff"})

    @router.delete("/v1/files/{file_id}", response_model=FileDeleted)
    async def delete_file(request: Request, file_id: str, tenant: str = Depends(ctx.tenant_of)) -> FileDeleted:
        """Drop the bytes, the image and every cached entry derived from it, on every tier: a shared
        tier that does not answer makes it a 503 (retry it; docs/server.md, Delete)."""
        await run_in_threadpool(files.get, tenant, file_id)
        try:
            await ctx.run_job(request, lambda engine, _: (engine.remove_video if file_id.startswith("vid-")
                                                          else engine.remove_image)(file_id, tenant=tenant))
        except (UnknownImageError, UnknownVideoError):
            pass  # the engine no longer has it; the bytes still go
        await run_in_threadpool(files.remove, tenant, file_id)
        return FileDeleted(id=file_id)

    return router


# The upload form as `_uploaded_file` reads it: one image in `file`, `purpose` "vision", nothing else.
_UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": {"type": "object", "required": ["file"], "additionalProperties": False, "properties": {
        "file": {"type": "string", "format": "binary", "minLength": 1,
                 "description": "One image (PNG, JPEG, GIF, WebP or another format Pillow decodes) or one "
                                "video (MP4, MOV, WebM, MKV)."},
        "purpose": {"type": "string", "enum": ["vision"], "default": "vision"}}},
    "encoding": {"file": {"contentType": "image/png, image/jpeg, image/gif, image/webp, video/mp4, "
                                         "video/quicktime, video/webm, video/x-matroska"}}}}}}


async def _uploaded_file(request: Request) -> UploadFile:
    """The form's one file, once its other fields passed the checks `_UPLOAD_BODY` publishes."""
    form = await request.form()
    purpose = form.get("purpose", "vision")
    if purpose != "vision":
        raise InvalidRequestError(f"purpose must be 'vision', got {purpose!r}", param="purpose")
    _only_file_and_purpose(form)
    file = form.get("file")
    if not isinstance(file, UploadFile):  # as FastAPI words a missing field
        raise RequestValidationError([{"type": "missing", "loc": ("body", "file"), "msg": "Field required"}])
    return file


def _only_file_and_purpose(form) -> None:
    """Refuse, before anything is stored, a form field this endpoint would otherwise drop: OpenAI's
    ``expires_after[...]`` (uploads here stay until deleted), any other field, a second file."""
    extra = sorted({k for k in form.keys() if k not in ("file", "purpose")})
    if extra:
        name = extra[0].split("[", 1)[0]
        why = "; uploads stay until DELETE /v1/files/{id}" if name == "expires_after" else ""
        raise UnsupportedParameterError(f"{name} is not supported by this server{why}; remove it", param=name)
    if len(form.getlist("file")) > 1:
        raise InvalidRequestError("one file per upload: send each image in its own request", param="file")


def _file_object(f: StoredFile) -> FileObject:
    return FileObject(id=f.id, bytes=f.nbytes, created_at=f.created_at, filename=f.filename, purpose="vision",
                      width=f.width, height=f.height, image_tokens=f.image_tokens)
