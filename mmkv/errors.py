"""Errors are part of the interface: one exception type per kind of bad input, each with the
HTTP status and OpenAI error type the server answers with. Raising one never changes a cache.
"""

from __future__ import annotations


class MMKVError(Exception):
    """Base of every error mmkv raises on purpose."""

    http_status = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(MMKVError):
    """A request that is malformed in a way the schema cannot catch (bad content part, bad setting)."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class InvalidImageError(InvalidRequestError):
    """Bytes that are not a decodable image, or an image too small or too oddly shaped to encode."""

    code = "invalid_image"


class ImageTooLargeError(InvalidImageError):
    """An image over the hard pixel limit (the decompression-bomb guard), or one whose tokens alone
    fill the model's context. Ordinary large images are downscaled to max_pixels instead."""

    code = "image_too_large"


class ImageURLNotAllowedError(InvalidImageError):
    """An http(s) or file URL where only data: URLs and uploaded ids are accepted."""

    code = "image_url_not_allowed"


class PromptTooLongError(InvalidRequestError):
    """Prompt plus max_new_tokens exceed the model's context or the engine's limit."""

    code = "context_length_exceeded"


class ImageStoreFullError(MMKVError):
    """The engine's image store (the compact sources of uploaded images) is at its byte budget."""

    http_status = 507
    error_type = "server_error"
    code = "image_store_full"


class UnknownImageError(MMKVError):
    """An image id that this tenant never added, or that was deleted."""

    http_status = 404
    error_type = "invalid_request_error"
    code = "image_not_found"


class UnknownSkillError(MMKVError):
    """A skill id that this tenant never added, or that was deleted."""

    http_status = 404
    error_type = "invalid_request_error"
    code = "skill_not_found"


class ModelLoadError(MMKVError):
    """A checkpoint directory that is missing, unreadable or of an unsupported architecture."""

    http_status = 500
    error_type = "server_error"
    code = "model_load_error"


class RopeNotComposableError(ModelLoadError):
    """A rope type whose scaling makes rotation by a delta differ from rotation to the target
    position (dynamic NTK, YaRN attention factors, LongRoPE): cached keys cannot be moved."""

    code = "rope_not_composable"


def settleable(exc: BaseException) -> BaseException:
    """`exc`, or a RuntimeError for it when it is StopIteration: asyncio cannot raise that into a
    Future, so a request failed with it would never get its answer."""
    if isinstance(exc, StopIteration):
        error = RuntimeError(f"the engine raised {exc!r}")
        error.__cause__ = exc
        return error
    return exc


def fail_future(future, exc: BaseException) -> None:
    """Settle a request's future with `exc`, whether it was still queued or already running; a
    future already settled or cancelled is left as it is. The one way every loop fails a request."""
    if future.done() or (not future.running() and not future.set_running_or_notify_cancel()):
        return
    future.set_exception(settleable(exc))


class InvalidVideoError(InvalidRequestError):
    """Bytes that are not a decodable video in an accepted container (MP4, MOV, WebM, MKV), a file
    without a video stream, or frames that cannot be read."""

    code = "invalid_video"


class VideoTooLargeError(InvalidVideoError):
    """A video over one of the limits (duration, frames, decoded bytes, tokens, frame size, decode
    time); the message names the limit and its value."""

    code = "video_too_large"


class VideoURLNotAllowedError(InvalidVideoError):
    """An http(s) or file URL where only data: URLs and uploaded ids are accepted."""

    code = "video_url_not_allowed"


class StreamConflictError(InvalidVideoError):
    """Frames a live stream cannot take in its present state: a time not after its latest frame's,
    a frame size other than its frames', or frames whose full window under the stream's
    `window_groups` and `max_pixels` would be over the token limit."""

    http_status = 409
    code = "stream_conflict"


class UnknownVideoError(MMKVError):
    """A video id that this tenant never added, or that was deleted."""

    http_status = 404
    error_type = "invalid_request_error"
    code = "video_not_found"


class VideoStoreFullError(MMKVError):
    """The engine's video store (the sampled frames of uploaded videos) is at its byte budget."""

    http_status = 507
    error_type = "server_error"
    code = "video_store_full"
