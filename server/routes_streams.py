"""/v1/video_streams: live video streams. Create one, append frames (images with their times, up
to MAX_FRAMES_PER_POST a request) or an encoded segment as they arrive, ask about it in chat with a
`video_file` part naming its id, read its state, delete it. Frames decode on the image threads;
the append itself runs on the engine worker (mmkv.request.streams has the sampling clock and the
window)."""

from __future__ import annotations

import math

from fastapi import APIRouter, Depends, Request
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from mmkv.errors import InvalidRequestError, InvalidVideoError

from .context import ServerContext
from .schemas import ErrorResponse, JSONInt, UnsupportedParameterError, _integral

# Frames the stream cannot take in its present state (mmkv.errors.StreamConflictError).
_CONFLICT = {409: {"model": ErrorResponse, "description": "stream_conflict: a time not after the stream's latest "
                   "frame, a frame size other than its frames', or a window over the token limit"}}

MAX_FRAMES_PER_POST = 32  # images one /frames request may append (each within max_frame_pixels)


class StreamCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    fps: float = Field(2.0, ge=0.01, le=60.0, description="The sampling clock: frames a second the model sees.")
    window_groups: JSONInt = Field(64, ge=1, le=384, description="Temporal groups (two sampled frames each) kept; "
                                                             "older ones are dropped.")
    max_pixels: Annotated[int, Field(ge=1, le=1 << 30), BeforeValidator(_integral)] | None = Field(
        None, description="Pixels of a sampled frame at most.")


class StreamObject(BaseModel):
    id: str
    object: str = "video_stream"
    fps: float
    window_groups: int
    groups: int = Field(description="Complete temporal groups in the window now.")
    first_group: int = Field(description="Index since the stream began of the window's first group.")
    groups_total: int = Field(description="Complete groups since the stream began, dropped ones included.")
    pending_frames: int = Field(description="Sampled frames waiting for the frame that completes their group.")
    width: int
    height: int
    last_time_s: float = Field(description="Stream time of the latest frame (-1 before the first).")
    reserved_bytes: int = Field(description="Bytes of the video store the window reserves.")


class StreamDeleted(BaseModel):
    id: str
    object: str = "video_stream.deleted"
    deleted: bool = True


def _stream_object(info) -> StreamObject:
    return StreamObject(id=info.video_id, fps=info.fps, window_groups=info.window_groups, groups=info.groups,
                        first_group=info.first_group, groups_total=info.groups_total,
                        pending_frames=info.pending_frames, width=info.width, height=info.height,
                        last_time_s=info.last_time_s, reserved_bytes=info.reserved_bytes)


def streams_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/video_streams", response_model=StreamObject)
    async def create_stream(request: Request, body: StreamCreate, tenant: str = Depends(ctx.tenant_of)):
        """A live stream: its id is referenced in chat as a `video_file` part's `file_id`."""
        settings = body.model_dump(exclude_none=True)

        def create(engine, _should_stop):
            return engine.stream_info(engine.create_stream(tenant=tenant, **settings), tenant=tenant)

        info, _ = await ctx.run_job(request, create)
        return _stream_object(info)

    async def append(request: Request, stream_id: str, tenant: str, field: str, when: str, most: int):
        """Images (`frame`, at most `most`) at their `time`s, or one segment (`file`) at `start`;
        every one decoded and checked before any is appended: all or nothing."""
        engine = ctx.worker.engine
        await run_in_threadpool(engine.stream_info, stream_id, tenant)  # 404 before reading the form
        files, times = await _append_form(request, field, when, most)
        max_pixels = engine.settings.video_limits.max_frame_pixels

        def prepare(named: list[tuple[str, bytes]]):
            if field == "file":
                return engine.prepare_frames(stream_id, named[0][1], tenant, times[0] if times else None)
            images = [_decoded(data, max_pixels, name) for name, data in named]
            frames = list(zip(images, times)) if times else engine.frames_at(stream_id, images, tenant)
            return engine.prepare_frames(stream_id, frames, tenant, param="frame")

        prepared = await ctx.images.run(prepare, files, field)
        info, _ = await ctx.run_job(request, lambda e, _: e.append_frames(stream_id, prepared, tenant=tenant))
        return _stream_object(info)

    @router.post("/v1/video_streams/{stream_id}/frames", response_model=StreamObject, openapi_extra=_FRAME_BODY,
                 responses=_CONFLICT)
    async def append_frame(request: Request, stream_id: str, tenant: str = Depends(ctx.tenant_of)):
        """Append images (`frame`, repeated for several, at most MAX_FRAMES_PER_POST) at their
        `time`s in seconds of stream time (one `time` per frame, in order, strictly increasing), by
        default one tick of the stream's clock apart after its latest frame. All or nothing: a bad
        frame or time is a 400 naming it (`frame[i]`, `time[i]` in a batch); a time not after the
        latest frame's, or a frame of another size than the stream's, a 409."""
        return await append(request, stream_id, tenant, "frame", "time", MAX_FRAMES_PER_POST)

    @router.post("/v1/video_streams/{stream_id}/segments", response_model=StreamObject,
                 openapi_extra=_SEGMENT_BODY, responses=_CONFLICT)
    async def append_segment(request: Request, stream_id: str, tenant: str = Depends(ctx.tenant_of)):
        """Append an encoded segment (`file`: MP4, MOV, WebM, MKV), its frames at `start` + their
        own times (`start` by default one tick after the latest frame); all or nothing, 409 as for
        a frame."""
        return await append(request, stream_id, tenant, "file", "start", 1)

    @router.get("/v1/video_streams/{stream_id}", response_model=StreamObject)
    async def get_stream(request: Request, stream_id: str, tenant: str = Depends(ctx.tenant_of)):
        info, _ = await ctx.run_job(request, lambda e, _: e.stream_info(stream_id, tenant=tenant))
        return _stream_object(info)

    @router.delete("/v1/video_streams/{stream_id}", response_model=StreamDeleted)
    async def delete_stream(request: Request, stream_id: str, tenant: str = Depends(ctx.tenant_of)):
        """Drop the stream's frames and every group's cached KV, with every prefix block holding it."""
        def remove(engine, _should_stop):
            engine.stream_info(stream_id, tenant=tenant)  # 404 for an id that is not a stream
            engine.remove_video(stream_id, tenant=tenant)

        await ctx.run_job(request, remove)
        return StreamDeleted(id=stream_id)

    return router


def _form_body(field: str, types: str, what: str, when: str, most: int) -> dict:
    def repeatable(schema: dict) -> dict:
        return schema if most == 1 else {"oneOf": [schema, {"type": "array", "items": schema, "minItems": 1,
                                                             "maxItems": most}]}

    return {"requestBody": {"required": True, "content": {"multipart/form-data": {
        "schema": {"type": "object", "required": [field], "additionalProperties": False, "properties": {
            field: repeatable({"type": "string", "format": "binary", "minLength": 1, "description": what}),
            when: repeatable({"type": "number", "minimum": 0, "maximum": 1e7,
                              "description": "Stream time in seconds (default: one tick after the latest "
                                             "frame)."})}},
        "encoding": {field: {"contentType": types}}}}}}


_FRAME_BODY = _form_body("frame", "image/png, image/jpeg, image/gif, image/webp",
                         f"An image of the stream's size; repeat for several (at most {MAX_FRAMES_PER_POST}), each "
                         f"with its own time.", "time", MAX_FRAMES_PER_POST)
_SEGMENT_BODY = _form_body("file", "video/mp4, video/quicktime, video/webm, video/x-matroska",
                           "One encoded segment (MP4, MOV, WebM, MKV).", "start", 1)


def _names(field: str, n: int) -> list[str]:
    """How errors name a form's repeated field: the field itself when it is alone, else field[i]."""
    return [field] if n == 1 else [f"{field}[{i}]" for i in range(n)]


async def _append_form(request: Request, field: str, when: str, most: int
                       ) -> tuple[list[tuple[str, bytes]], list[float]]:
    """The files' names and bytes (at most `most`) and their times (none: the defaults; else one
    each) from a frame or segment form, every field checked before anything is decoded."""
    form = await request.form()
    extra = sorted({k for k in form.keys() if k not in (field, when)})
    if extra:
        raise UnsupportedParameterError(f"{extra[0]} is not a field of this append; remove it", param=extra[0])
    parts = form.getlist(field)
    if len(parts) > most:
        raise InvalidRequestError(f"one {field} per append" if most == 1 else
                                  f"{len(parts)} {field}s in one append, over the limit of {most}", param=field)
    if not parts or not isinstance(parts[0], UploadFile):  # as FastAPI words a missing field
        raise RequestValidationError([{"type": "missing", "loc": ("body", field), "msg": "Field required"}])
    files = []
    for name, part in zip(_names(field, len(parts)), parts):
        data = await part.read() if isinstance(part, UploadFile) else b""
        if not data:
            raise InvalidVideoError(f"the {name} is empty or not a file", param=name)
        files.append((name, data))
    stamps = form.getlist(when)
    if stamps and len(stamps) != len(files):
        raise InvalidRequestError(f"{len(stamps)} {when} values for {len(files)} {field}s: send one {when} per "
                                  f"{field}, in order, or none", param=when)
    return files, [_seconds(v, name, 1e7) for name, v in zip(_names(when, len(stamps)), stamps)]


def _decoded(data: bytes, max_pixels: int, param: str):
    """Image bytes -> an RGB PIL image (mmkv.images: size and bomb limits), on the image threads."""
    from mmkv.images import decode_image

    try:
        return decode_image(data, max_pixels).image
    except InvalidRequestError as exc:
        raise InvalidVideoError(f"{param}: {exc.message}", param=param) from exc


def _seconds(value, param: str, most: float) -> float:
    try:
        t = float(value) if isinstance(value, str) else math.nan
    except ValueError:
        t = math.nan
    if not math.isfinite(t) or not 0 <= t <= most:
        raise InvalidRequestError(f"{param} must be a number of seconds from 0 to {most:g}, got {value!r}",
                                  param=param)
    return t
