"""Videos over HTTP: chat parts (`video_url` with a data: URL, `video_file` with an uploaded id)
resolved for the engine, and uploads to /v1/files. Decoding runs on the image threads with the
engine's lock-free `prepare_video` (bounded in time and size by its limits), never on the engine
worker or the event loop."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from mmkv.errors import VideoURLNotAllowedError

from .context import ServerContext
from .schemas import VideoFilePart, VideoURLPart

VIDEO_PART_TYPES = ("video_url", "video_file")  # a chat message's video parts
STREAM_PREFIX = "vstream-"  # live streams' ids (/v1/video_streams); not in the file store
# Leading bytes of the accepted containers: ISO BMFF (MP4, MOV) boxes and the EBML header (MKV, WebM).
_BMFF_BOXES = (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip")
_EBML = b"\x1a\x45\xdf\xa3"


def looks_like_video(data: bytes) -> bool:
    """An upload to decode as a video (else as an image): the container's own signature."""
    return data[4:8] in _BMFF_BOXES or data[:4] == _EBML


async def prepare_video(ctx: ServerContext, data: Any, sampling: dict[str, Any], param: str):
    engine = ctx.worker.engine
    return await ctx.images.run(lambda d: engine.prepare_video(d, **sampling), data, param)


async def engine_video_part(ctx: ServerContext, part: VideoURLPart | VideoFilePart, param: str,
                            tenant: str) -> dict[str, Any]:
    """The engine's part for a video: an uploaded id checked against the tenant's files (404), or a
    data: URL decoded here (an http(s) URL is refused, as for images)."""
    if isinstance(part, VideoURLPart) and part.video_url.url.startswith("mmkv://"):
        part = VideoFilePart(type="video_file", video_file={"file_id": part.video_url.url.removeprefix("mmkv://")})
    if isinstance(part, VideoFilePart) and part.video_file.file_id.startswith(STREAM_PREFIX):
        return {"type": "video_file", "video_file": {"file_id": part.video_file.file_id}}  # the engine checks it (404)
    if isinstance(part, VideoFilePart):
        stored = await run_in_threadpool(ctx.files.get, tenant, part.video_file.file_id,
                                         f"{param}.video_file.file_id")
        return {"type": "video_file", "video_file": {"file_id": stored.id}}
    url = part.video_url.url
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "(none)"
        raise VideoURLNotAllowedError(f"video URLs with scheme {scheme!r} are not fetched; send a data: URL or upload "
                                      f"the video to /v1/files and reference it as a video_file part",
                                      param=f"{param}.video_url.url")
    sampling = part.model_dump(include={"fps", "nframes", "max_pixels", "video_start", "video_end"}, exclude_none=True)
    video = await prepare_video(ctx, url, sampling, param)
    return {"type": "video", "video": video}


async def upload_video(ctx: ServerContext, request, tenant: str, filename: str, data: bytes):
    """POST /v1/files with a video: decoded on the image threads, every group precompiled on the
    engine worker, the bytes kept in the file store (undone if the store has no room after all)."""
    from mmkv.video import container_media_type

    from .files import FileQuotaError, FileStoreFullError, new_stored_file

    video = await prepare_video(ctx, data, {}, "file")

    def add(engine, _should_stop):
        video_id = engine.add_video(video, tenant=tenant)
        return video_id, engine.video_info(video_id, tenant=tenant)

    (video_id, info), _ = await ctx.run_job(request, add)
    stored = new_stored_file(tenant, video_id, filename or "video", container_media_type(data), data,
                             info.width, info.height, info.video_tokens)
    try:
        return await run_in_threadpool(ctx.files.add, stored)
    except (FileStoreFullError, FileQuotaError):
        await ctx.run_job(request, lambda engine, _: engine.remove_video(video_id, tenant=tenant))
        raise
