"""Video decoding that mmkv does itself: bytes or a file object (MP4, MOV, WebM, MKV, decoded by
PyAV), or a list of PIL frames with their times; never a URL fetch, a path open or a subprocess.

Sampling and sizing follow qwen-vl-utils' readers, the reference of the Qwen-VL models: 2 frames
a second by default, 4 to 768 frames, an even count (two frames make one temporal patch),
frames picked evenly over the clip (`linspace(first, last, n).round()`); each frame resized to
a multiple of patch x merge within [min_pixels, max_pixels], max_pixels shrunk so that all
frames together stay within `total_pixels`. `fps`, `nframes`, `max_pixels`, `video_start` and
`video_end` may be set per video (`VideoSampling`).

Every limit is checked before the work it bounds (`VideoLimits`): encoded size, frame size,
duration, frames decoded (in RGB bytes), frames sampled, LM tokens, and decode time; each refusal
is a VideoTooLargeError naming the limit. Anything PyAV cannot read is an InvalidVideoError.

The content hash is xxh3-128 per temporal group (its two resized frames and their timestamps)
and, for the whole video, over the group hashes and the sampling rate: what the model sees.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import xxhash
from PIL import Image

from mmkv.errors import InvalidVideoError, VideoTooLargeError, VideoURLNotAllowedError
from mmkv.images import MAX_ASPECT, MIN_SIDE, to_rgb
from mmkv.images import bytes_from_data_url as image_bytes_from_data_url

if TYPE_CHECKING:  # torch, torchvision and PyAV load when a video is decoded: `mmkv --help` stays light
    import torch

FPS = 2.0
FRAME_FACTOR = 2  # frames per temporal patch
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768
VIDEO_MIN_TOKEN_NUM = 128  # per-frame pixel bounds in tokens of patch x merge squares (qwen-vl-utils)
VIDEO_MAX_TOKEN_NUM = 768
MAX_FPS = 60.0
# PyAV's demuxer names of the containers accepted; anything else it recognises is refused.
CONTAINERS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm")


@dataclass(frozen=True)
class VideoLimits:
    """What one video may cost. Checked before decoding where the header tells (size, frame count,
    duration), and while decoding where it does not."""

    max_bytes: int = 512 << 20  # encoded
    max_frame_pixels: int = 4096 * 4096  # of a source frame
    max_duration_s: float = 900.0
    max_decoded_bytes: int = 8 << 30  # RGB bytes of every frame decoded (all of them, not only the sampled)
    max_frames: int = FPS_MAX_FRAMES  # sampled
    max_tokens: int = 16384  # LM tokens of the whole video
    timeout_s: float = 60.0  # wall time of one decode


@dataclass
class RequestVideoTokens:
    """The video tokens one request's videos hold together, in the order the request references
    them (a video referenced twice counts twice: the prompt holds it twice); the part that takes
    the total past `limit` is refused, naming it."""

    limit: int
    factor: int  # patch x merge: one token per factor x factor pixels of a temporal group
    used: int = 0

    def add(self, video: DecodedVideo, param: str) -> None:
        _, _, h, w = video.frames.shape
        self.used += video_tokens(video.frames.shape[0], (h, w), self.factor)
        if self.used > self.limit:
            raise VideoTooLargeError(f"{param}: the request's videos reach {self.used} video tokens here, over the "
                                     f"limit of {self.limit} a request (max_video_tokens_per_request); send fewer "
                                     f"or shorter videos, or lower fps, nframes or max_pixels", param=param)


@dataclass(frozen=True)
class PixelBudget:
    """A checkpoint's per-frame bounds: `factor` = patch x merge, pixels per frame and in all."""

    factor: int
    min_pixels: int
    max_pixels: int
    total_pixels: int

    @classmethod
    def for_patch(cls, patch_size: int, merge_size: int, max_tokens: int) -> PixelBudget:
        f = patch_size * merge_size
        return cls(f, VIDEO_MIN_TOKEN_NUM * f * f, VIDEO_MAX_TOKEN_NUM * f * f, max_tokens * f * f)


@dataclass(frozen=True)
class VideoSampling:
    """One video's sampling settings (None: the default). `fps` and `nframes` exclude each other."""

    fps: float | None = None
    nframes: int | None = None
    max_pixels: int | None = None
    video_start: float | None = None
    video_end: float | None = None

    FIELDS = ("fps", "nframes", "max_pixels", "video_start", "video_end")

    @classmethod
    def parse(cls, values: dict, param: str = "video") -> VideoSampling:
        """From a content part's or an upload's fields; a bad value is a 400 naming it."""
        def number(name, lo, hi, integer=False):
            v = values.get(name)
            if v is None:
                return None
            ok = isinstance(v, int) if integer else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok or not math.isfinite(v) or not lo <= v <= hi:
                kind = "an integer" if integer else "a number"
                raise InvalidVideoError(f"{param}.{name} must be {kind} from {lo} to {hi}", param=f"{param}.{name}")
            return v

        s = cls(fps=number("fps", 0.01, MAX_FPS), nframes=number("nframes", FRAME_FACTOR, FPS_MAX_FRAMES, True),
                max_pixels=number("max_pixels", 1, 1 << 30, True), video_start=number("video_start", 0, 1e7),
                video_end=number("video_end", 0, 1e7))
        if s.fps is not None and s.nframes is not None:
            raise InvalidVideoError(f"{param}: set fps or nframes, not both", param=f"{param}.nframes")
        if s.video_start is not None and s.video_end is not None and s.video_end <= s.video_start:
            raise InvalidVideoError(f"{param}.video_end must be after video_start", param=f"{param}.video_end")
        return s

    @property
    def is_default(self) -> bool:
        return self == VideoSampling()

    def describe(self) -> str:
        return ",".join(f"{k}={getattr(self, k)!r}" for k in self.FIELDS)


@dataclass(frozen=True)
class DecodedVideo:
    """The sampled, resized frames of a video and what the model needs to place them."""

    frames: torch.Tensor  # [N, 3, H, W] uint8, N even, H and W multiples of the budget's factor
    timestamps: tuple[float, ...]  # seconds of each sampled frame
    sample_fps: float  # sampled frames per second: second_per_grid_t = temporal_patch_size / sample_fps
    width: int  # of a source frame
    height: int
    duration_s: float
    source_bytes: int  # of the encoded upload (0 for frames)
    group_hashes: tuple[str, ...] = field(default=())
    content_hash: str = ""

    @property
    def num_groups(self) -> int:
        return self.frames.shape[0] // FRAME_FACTOR

    def group_time(self, g: int) -> float:
        """The mean time of group g's frames: Qwen3-VL's timestamp of the temporal patch."""
        return (self.timestamps[FRAME_FACTOR * g] + self.timestamps[FRAME_FACTOR * g + FRAME_FACTOR - 1]) / 2


# ---- qwen-vl-utils' arithmetic --------------------------------------------------------------------
def round_by_factor(n: float, f: int) -> int:
    return round(n / f) * f


def ceil_by_factor(n: float, f: int) -> int:
    return math.ceil(n / f) * f


def floor_by_factor(n: float, f: int) -> int:
    return math.floor(n / f) * f


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """qwen-vl-utils' smart_resize: sides multiples of `factor`, area within the bounds, aspect kept."""
    h_bar, w_bar = max(factor, round_by_factor(height, factor)), max(factor, round_by_factor(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, floor_by_factor(height / beta, factor))
        w_bar = max(factor, floor_by_factor(width / beta, factor))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = ceil_by_factor(height * beta, factor), ceil_by_factor(width * beta, factor)
    return h_bar, w_bar


def smart_nframes(sampling: VideoSampling, total_frames: int, video_fps: float) -> int:
    """qwen-vl-utils' smart_nframes: `nframes` rounded to even, or `fps` over the clip clamped to
    [4, min(768, total)] and floored to even; a clip too short for two frames is refused."""
    if sampling.nframes is not None:
        nframes = round_by_factor(sampling.nframes, FRAME_FACTOR)
    else:
        fps = sampling.fps if sampling.fps is not None else FPS
        min_frames = ceil_by_factor(FPS_MIN_FRAMES, FRAME_FACTOR)
        max_frames = floor_by_factor(min(FPS_MAX_FRAMES, total_frames), FRAME_FACTOR)
        nframes = min(max(total_frames / video_fps * fps, min_frames), max_frames, total_frames)
        nframes = floor_by_factor(nframes, FRAME_FACTOR)
    if not FRAME_FACTOR <= nframes <= total_frames:
        raise InvalidVideoError(f"the clip has {total_frames} frames; sampling needs between {FRAME_FACTOR} and "
                                f"{total_frames} (asked for {nframes})", param="nframes")
    return nframes


def frame_pixels(budget: PixelBudget, nframes: int, sampling: VideoSampling) -> tuple[int, int]:
    """(min, max) pixels of one frame: the budget's, max shrunk to total_pixels / nframes x 2 (not
    below 1.05 x min) and to the request's max_pixels."""
    max_pixels = max(min(budget.max_pixels, budget.total_pixels / nframes * FRAME_FACTOR),
                     int(budget.min_pixels * 1.05))
    if sampling.max_pixels is not None:
        max_pixels = min(max_pixels, sampling.max_pixels)
    min_pixels = min(budget.min_pixels, max_pixels)
    return min_pixels, int(max_pixels)


def frame_range(sampling: VideoSampling, total_frames: int, video_fps: float) -> tuple[int, int]:
    """qwen-vl-utils' calculate_video_frame_range: the first and last frame of video_start..video_end."""
    if sampling.video_start is None and sampling.video_end is None:
        return 0, total_frames - 1
    duration = total_frames / video_fps
    start = math.ceil(min(sampling.video_start or 0.0, duration) * video_fps)
    end = total_frames - 1 if sampling.video_end is None else \
        min(math.floor(min(sampling.video_end, duration) * video_fps), total_frames - 1)
    if start >= end:
        raise InvalidVideoError(f"video_start..video_end selects no frames of a {duration:.2f} s clip",
                                param="video_start")
    return start, end


# ---- decoding -------------------------------------------------------------------------------------
def check_frame_size(w: int, h: int, limits: VideoLimits) -> None:
    """A frame's size against `max_frame_pixels` and the sides and aspect ratio images allow."""
    if w * h > limits.max_frame_pixels:
        raise VideoTooLargeError(f"frames are {w}x{h} = {w * h} pixels, over the limit of {limits.max_frame_pixels} "
                                 f"(max_frame_pixels)")
    if min(w, h) < MIN_SIDE or max(w, h) / min(w, h) > MAX_ASPECT:
        raise InvalidVideoError(f"frames are {w}x{h}; each side must be at least {MIN_SIDE} px and the aspect ratio at "
                                f"most {MAX_ASPECT}:1")


def bytes_from_data_url(url: str) -> bytes:
    """The payload of a base64 data: URL; any other scheme is refused (never fetched)."""
    return image_bytes_from_data_url(url, "video", VideoURLNotAllowedError, InvalidVideoError)


def read_source(data) -> bytes:
    """bytes / bytearray / memoryview / a binary file object / a data: URL -> bytes."""
    if isinstance(data, str):
        return bytes_from_data_url(data)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if hasattr(data, "read"):
        out = data.read()
        if isinstance(out, (bytes, bytearray)):
            return bytes(out)
    raise InvalidVideoError(f"cannot read a video from a {type(data).__name__}")


class _Deadline:
    def __init__(self, seconds: float):
        self.seconds, self.end = seconds, time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise VideoTooLargeError(f"decoding took longer than the limit of {self.seconds:g} s (timeout_s)")


def _open(data: bytes):
    import av
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError, UnicodeDecodeError) as exc:
        raise InvalidVideoError(f"cannot decode video: not an MP4, MOV, WebM or MKV file PyAV reads ({exc})") from exc
    if container.format.name not in CONTAINERS:
        container.close()
        raise InvalidVideoError(f"the file is {container.format.long_name or container.format.name}; send an MP4, "
                                f"MOV, WebM or MKV video")
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams})
        container.close()
        raise InvalidVideoError(f"the file holds no video stream (streams: {', '.join(kinds) or 'none'})")
    return container


@dataclass(frozen=True)
class _Header:
    width: int
    height: int
    frames: int  # counted by demuxing (packets carrying data)
    fps: float
    duration_s: float


def _probe(data: bytes, limits: VideoLimits, deadline: _Deadline) -> _Header:
    """Frame size, frame count (demuxed, not decoded) and rate; each checked against its limit."""
    import av
    container = _open(data)
    try:
        stream = container.streams.video[0]
        w, h = stream.codec_context.width, stream.codec_context.height
        if w <= 0 or h <= 0:
            raise InvalidVideoError("the video stream has no frame size")
        check_frame_size(w, h, limits)
        max_frames = limits.max_decoded_bytes // (w * h * 3)
        frames, last_pts = 0, None
        for packet in container.demux(stream):
            if packet.size:
                frames += 1
                last_pts = packet.pts if packet.pts is not None else last_pts
                if frames > max_frames:
                    raise VideoTooLargeError(f"decoding over {max_frames} frames of {w}x{h} exceeds the limit of "
                                             f"{limits.max_decoded_bytes} decoded bytes (max_decoded_bytes)")
                if frames % 64 == 0:
                    deadline.check()
        rate = stream.average_rate or stream.guessed_rate
        span = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else None
        if span is None and last_pts is not None and stream.time_base:
            span = float(last_pts * stream.time_base)
        fps = float(rate) if rate else (frames / span if span else 0.0)
    except av.FFmpegError as exc:
        raise InvalidVideoError(f"cannot read video: {exc}") from exc
    finally:
        container.close()
    if frames == 0 or fps <= 0 or not math.isfinite(fps):
        raise InvalidVideoError("the video stream holds no frames")
    duration = frames / fps
    if duration > limits.max_duration_s:
        raise VideoTooLargeError(f"the video is {duration:.1f} s long, over the limit of {limits.max_duration_s:g} s "
                                 f"(max_duration_s)")
    return _Header(w, h, frames, fps, duration)


def _check_plan(nframes: int, size: tuple[int, int], budget: PixelBudget, limits: VideoLimits) -> None:
    if nframes > limits.max_frames:
        raise VideoTooLargeError(f"sampling gives {nframes} frames, over the limit of {limits.max_frames} "
                                 f"(max_frames)")
    tokens = video_tokens(nframes, size, budget.factor)
    if tokens > limits.max_tokens:
        raise VideoTooLargeError(f"the video is {tokens} tokens ({nframes} frames of {size[1]}x{size[0]}), over the "
                                 f"limit of {limits.max_tokens} (max_tokens); lower fps, nframes or max_pixels")


def video_tokens(nframes: int, size: tuple[int, int], factor: int) -> int:
    return nframes // FRAME_FACTOR * (size[0] // factor) * (size[1] // factor)


def _resize(rgb: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """One HWC uint8 frame -> [3, H, W] uint8 at `size`, bicubic with antialias (as qwen-vl-utils)."""
    import torch
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as tvf
    frame = torch.from_numpy(rgb).permute(2, 0, 1)
    if tuple(frame.shape[1:]) == size:
        return frame.contiguous()
    return tvf.resize(frame, list(size), interpolation=InterpolationMode.BICUBIC, antialias=True)


def _read_and_probe(data, limits: VideoLimits) -> tuple[bytes, _Deadline, _Header]:
    """An encoded video's bytes, checked against `max_bytes`, its decode deadline started, and its
    container probed (stream, size, duration, frames) within the limits."""
    raw = read_source(data)
    if not raw:
        raise InvalidVideoError("video data is empty")
    if len(raw) > limits.max_bytes:
        raise VideoTooLargeError(f"the video is {len(raw)} bytes, over the limit of {limits.max_bytes} (max_bytes)")
    deadline = _Deadline(limits.timeout_s)
    return raw, deadline, _probe(raw, limits, deadline)


def decode_video(data, budget: PixelBudget, sampling: VideoSampling = VideoSampling(),
                 limits: VideoLimits = VideoLimits()) -> DecodedVideo:
    """bytes | file object | data: URL | [(PIL image, seconds), ...] -> sampled, resized, hashed frames."""
    import torch
    if isinstance(data, (list, tuple)):
        return _from_frames(data, budget, sampling, limits)
    raw, deadline, head = _read_and_probe(data, limits)
    first, last = frame_range(sampling, head.frames, head.fps)
    nframes = smart_nframes(sampling, last - first + 1, head.fps)
    size = smart_resize(head.height, head.width, budget.factor, *frame_pixels(budget, nframes, sampling))
    _check_plan(nframes, size, budget, limits)
    indices = torch.linspace(first, last, nframes).round().long().tolist()
    frames = _decode_frames(raw, indices, size, deadline)
    return with_hashes(DecodedVideo(torch.stack(frames), tuple(i / head.fps for i in indices),
                                nframes / (last - first + 1) * head.fps, head.width, head.height, head.duration_s,
                                len(raw)))


def _decode_frames(raw: bytes, indices: list[int], size: tuple[int, int], deadline: _Deadline) -> list[torch.Tensor]:
    """Decode the stream once, keeping (resized) the frames at `indices` (ascending, repeats allowed)."""
    import av
    import torch
    wanted: dict[int, int] = {}
    for i in indices:
        wanted[i] = wanted.get(i, 0) + 1
    out: list[torch.Tensor] = []
    container = _open(raw)
    try:
        stream = container.streams.video[0]
        for n, frame in enumerate(container.decode(stream)):
            deadline.check()
            if n in wanted:
                kept = _resize(frame.to_ndarray(format="rgb24"), size)
                out += [kept] * wanted[n]
            if n >= indices[-1]:
                break
    except av.FFmpegError as exc:
        raise InvalidVideoError(f"cannot decode video: {exc}") from exc
    finally:
        container.close()
    if len(out) < len(indices):
        raise InvalidVideoError(f"the video is truncated or corrupt: {len(out)} of the {len(indices)} sampled frames "
                                f"decode")
    return out


def decode_all_frames(data, limits: VideoLimits, max_frames: int) -> list[tuple[np.ndarray, float]]:
    """Every frame of an encoded segment with its time from the segment's first frame (HWC uint8
    RGB), for a live stream's append; the limits as for a video, and at most `max_frames`."""
    import av
    raw, deadline, head = _read_and_probe(data, limits)
    if head.frames > max_frames:
        raise VideoTooLargeError(f"the segment has {head.frames} frames, over the limit of {max_frames} a segment")
    out: list[tuple[np.ndarray, float]] = []
    container = _open(raw)
    try:
        for n, frame in enumerate(container.decode(container.streams.video[0])):
            deadline.check()
            out.append((frame.to_ndarray(format="rgb24"), float(frame.time) if frame.time is not None
                        else n / head.fps))
    except av.FFmpegError as exc:
        raise InvalidVideoError(f"cannot decode video: {exc}") from exc
    finally:
        container.close()
    if not out:
        raise InvalidVideoError("the video stream holds no frames")
    t0 = out[0][1]
    return [(f, t - t0) for f, t in out]


def _from_frames(frames: Sequence, budget: PixelBudget, sampling: VideoSampling,
                 limits: VideoLimits) -> DecodedVideo:
    """[(PIL image, seconds), ...] used as they are (no resampling: `fps`, `nframes` and the time
    range are refused), padded to an even count with the last frame, as qwen-vl-utils does."""
    import torch
    set_fields = [k for k in ("fps", "nframes", "video_start", "video_end") if getattr(sampling, k) is not None]
    if set_fields:
        raise InvalidVideoError(f"{set_fields[0]} applies to encoded videos; frames with their times are used as "
                                f"they are", param=set_fields[0])
    if not frames:
        raise InvalidVideoError("a video needs at least one frame")
    images, times = [], []
    for i, item in enumerate(frames):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], Image.Image)
                and isinstance(item[1], (int, float)) and not isinstance(item[1], bool) and math.isfinite(item[1])):
            raise InvalidVideoError(f"frame {i} must be a (PIL image, seconds) pair")
        if times and item[1] <= times[-1] or item[1] < 0:
            raise InvalidVideoError(f"frame {i}: times must be >= 0 and strictly increasing")
        images.append(item[0])
        times.append(float(item[1]))
    if len(images) > limits.max_frames:
        raise VideoTooLargeError(f"{len(images)} frames, over the limit of {limits.max_frames} (max_frames)")
    w, h = images[0].size
    if any(img.size != (w, h) for img in images):
        raise InvalidVideoError("every frame must have the size of the first")
    check_frame_size(w, h, limits)
    nframes = ceil_by_factor(len(images), FRAME_FACTOR)
    size = smart_resize(h, w, budget.factor, *frame_pixels(budget, nframes, sampling))
    _check_plan(nframes, size, budget, limits)
    resized = [_resize(np.array(to_rgb(img)), size) for img in images]
    resized += [resized[-1]] * (nframes - len(resized))
    times += [times[-1]] * (nframes - len(times))
    span = times[len(images) - 1] - times[0]
    sample_fps = (len(images) - 1) / span if len(images) > 1 else FPS
    return with_hashes(DecodedVideo(torch.stack(resized), tuple(times), sample_fps, w, h, span, 0))


def group_hash(frames: torch.Tensor, times: tuple[float, ...]) -> str:
    """xxh3-128 of one temporal group: its frames' size, times and pixels."""
    h, w = frames.shape[-2:]
    return xxhash.xxh3_128(f"{h}x{w}|{tuple(times)!r}|".encode() + frames.numpy().tobytes()).hexdigest()


def with_hashes(video: DecodedVideo) -> DecodedVideo:
    """Group hashes over each temporal group's frames and times; the video's over those and the rate."""
    n = video.frames.shape[0]
    groups = [group_hash(video.frames[a:a + FRAME_FACTOR], video.timestamps[a:a + FRAME_FACTOR])
              for a in range(0, n, FRAME_FACTOR)]
    whole = xxhash.xxh3_128(("|".join(groups) + f"|fps={video.sample_fps!r}").encode()).hexdigest()
    return DecodedVideo(video.frames, video.timestamps, video.sample_fps, video.width, video.height,
                        video.duration_s, video.source_bytes, tuple(groups), whole)


def container_media_type(data: bytes) -> str:
    """The media type of what PyAV recognised (for serving an upload back), never the client's claim:
    MP4 / MOV as video/mp4, Matroska with a VP8 / VP9 / AV1 stream as video/webm, else video/x-matroska."""
    container = _open(data)
    try:
        if container.format.name != "matroska,webm":
            return "video/mp4"
        codec = container.streams.video[0].codec_context.name
        return "video/webm" if codec in ("vp8", "vp9", "av1", "libvpx", "libvpx-vp9") else "video/x-matroska"
    finally:
        container.close()
