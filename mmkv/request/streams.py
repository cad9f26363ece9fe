"""Live video streams: a video id that grows as frames arrive, sampled on a fixed clock and kept
within a window of temporal groups.

Sampling. A stream samples at `fps` (2 by default) on its own clock: tick k is at k / fps seconds
of stream time (the client's frame times, from 0), ticks 2j and 2j + 1 making group j. The clock
starts at the group holding the first frame's time; from there tick k takes the first frame
appended at or after its time (a frame covering several ticks, after a gap, fills each of them).
A group is stamped with the tick times, so a group's content, hash and timestamps never
change once it is complete, whatever arrives later. Every frame is resized once to the size the
stream's first frame fixes (qwen-vl-utils' per-frame bounds, `max_pixels` if set); a frame of
another source size is refused.

Window. Only the last `window_groups` complete groups are kept: the oldest are dropped, their
frames freed and their KV purged (with every prefix block holding it). A prompt sees the window
as a clip of its groups: the first kept group at the video block's start, exactly as a clip cut
with `video_start` at that group (Qwen2/2.5-VL: temporal positions from the block's start;
Qwen3-VL: each group after its own `<t seconds>`, t the stream time). Each group's KV is cached
at canonical positions, so a group seen at another offset after the window slid is rotated, not
recomputed.

Cost. Appending decodes and resizes (lock-free) and stores frames; the vision tower and the LM
run on a group the first time a prompt holds it, so a question after k new groups computes only
those k groups and its new text. A stream reserves, on its first frame, the bytes of a full
window (2 x window_groups + 1 frames) inside the engine's `video_store_bytes`.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from mmkv.errors import InvalidVideoError, StreamConflictError, VideoStoreFullError, VideoTooLargeError
from mmkv.images import MAX_ASPECT, MIN_SIDE, to_rgb
from mmkv.video import (
    FPS,
    FRAME_FACTOR,
    MAX_FPS,
    DecodedVideo,
    PixelBudget,
    VideoLimits,
    VideoSampling,
    frame_pixels,
    group_hash,
    smart_resize,
)

MAX_STREAM_TIME_S = 1e8  # a frame's time, seconds of stream time
MAX_FRAMES_PER_APPEND = 1024


@dataclass(frozen=True)
class StreamSettings:
    fps: float = FPS
    window_groups: int = 64
    max_pixels: int | None = None

    @classmethod
    def parse(cls, values: dict, param: str = "stream") -> StreamSettings:
        """From the create call's fields; a bad value is a 400 naming it."""
        fps, window, max_pixels = values.get("fps", FPS), values.get("window_groups", 64), values.get("max_pixels")
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) \
                or not 0.01 <= fps <= MAX_FPS:
            raise InvalidVideoError(f"{param}.fps must be a number from 0.01 to {MAX_FPS:g}", param=f"{param}.fps")
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= 384:
            raise InvalidVideoError(f"{param}.window_groups must be an integer from 1 to 384",
                                    param=f"{param}.window_groups")
        if max_pixels is not None and (isinstance(max_pixels, bool) or not isinstance(max_pixels, int)
                                       or not 1 <= max_pixels <= 1 << 30):
            raise InvalidVideoError(f"{param}.max_pixels must be an integer from 1 to {1 << 30}",
                                    param=f"{param}.max_pixels")
        return cls(float(fps), window, max_pixels)


@dataclass(frozen=True)
class StreamInfo:
    video_id: str
    fps: float
    window_groups: int
    groups: int  # complete groups in the window now
    first_group: int  # stream index of the window's first group
    groups_total: int  # complete groups since the stream began (dropped ones included)
    pending_frames: int  # sampled frames waiting for the partner that completes their group
    width: int  # of a source frame (0 before the first frame)
    height: int
    last_time_s: float  # the latest frame's stream time (-1 before the first frame)
    reserved_bytes: int  # of video_store_bytes


@dataclass(frozen=True)
class PreparedFrames:
    """Appended frames decoded, checked and resized (lock-free), with their times."""

    frames: list[torch.Tensor]  # [3, H, W] uint8 each
    times: list[float]
    source_size: tuple[int, int]  # (width, height)
    param: str = "frames"  # the field an error names: the list's (frames[0]), else the field itself

    def first(self) -> str:
        return f"{self.param}[0]" if self.param == "frames" else self.param


def new_stream_id() -> str:
    return f"vstream-{secrets.token_hex(12)}"


class VideoStream:
    """One stream's window: the sampled frames of its complete groups (oldest first), a pending
    frame, their ticks and group hashes. Mutated under the engine's lock only."""

    def __init__(self, video_id: str, settings: StreamSettings, budget: PixelBudget, limits: VideoLimits):
        self.video_id, self.settings, self.budget, self.limits = video_id, settings, budget, limits
        self.frames: list[torch.Tensor] = []  # window frames, then any pending one
        self.ticks: list[int] = []
        self.hashes: list[str] = []  # one per complete group in the window
        self.first_group = 0
        self.next_tick = 0
        self.last_time = -1.0
        self.source_size: tuple[int, int] | None = None
        self.size: tuple[int, int] | None = None  # (H, W) after resizing
        self.reserved = 0
        self._snapshot: DecodedVideo | None = None
        self.registered = None  # the RegisteredVideo of the snapshot prompts see (mmkv.request.videos)

    # ---- frames in ---------------------------------------------------------------------------------
    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """The resized (H, W) of a frame of this source size: qwen-vl-utils' per-frame bounds."""
        sampling = VideoSampling(max_pixels=self.settings.max_pixels)
        return smart_resize(height, width, self.budget.factor, *frame_pixels(self.budget, FRAME_FACTOR, sampling))

    def prepare(self, frames, param: str = "frames") -> PreparedFrames:
        """[(PIL image | HWC uint8 array, seconds), ...] checked, converted and resized. Reads only
        settings and the source size the first frame fixed: safe without the lock."""
        from mmkv.video import _resize

        if not isinstance(frames, (list, tuple)) or not frames:
            raise InvalidVideoError(f"{param} must be a non-empty list of (image, seconds) pairs", param=param)
        if len(frames) > MAX_FRAMES_PER_APPEND:
            raise VideoTooLargeError(f"{len(frames)} frames in one append, over the limit of {MAX_FRAMES_PER_APPEND}",
                                     param=param)
        images, times = [], []
        for i, item in enumerate(frames):
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise InvalidVideoError(f"{param}[{i}] must be an (image, seconds) pair", param=f"{param}[{i}]")
            img, t = item
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                    or not 0 <= t <= MAX_STREAM_TIME_S:
                raise InvalidVideoError(f"{param}[{i}]: the time must be seconds from 0 to {MAX_STREAM_TIME_S:g}",
                                        param=f"{param}[{i}]")
            if times and t <= times[-1]:
                raise InvalidVideoError(f"{param}[{i}]: times must increase strictly", param=f"{param}[{i}]")
            images.append(self._rgb(img, f"{param}[{i}]"))
            times.append(float(t))
        h, w = images[0].shape[:2]
        other = next((i for i, a in enumerate(images) if a.shape[:2] != (h, w)), None)
        if other is not None:
            raise InvalidVideoError(f"{param}[{other}]: every frame must have the size of the first",
                                    param=f"{param}[{other}]")
        if self.source_size is not None and (w, h) != self.source_size:
            raise StreamConflictError(f"{param}: frames are {w}x{h}; this stream's frames are "
                                      f"{self.source_size[0]}x{self.source_size[1]}", param=param)
        if w * h > self.limits.max_frame_pixels:
            raise VideoTooLargeError(f"frames are {w}x{h} = {w * h} pixels, over the limit of "
                                     f"{self.limits.max_frame_pixels} (max_frame_pixels)", param=param)
        if min(w, h) < MIN_SIDE or max(w, h) / min(w, h) > MAX_ASPECT:
            raise InvalidVideoError(f"frames are {w}x{h}; each side must be at least {MIN_SIDE} px and the aspect "
                                    f"ratio at most {MAX_ASPECT}:1", param=param)
        size = self.target_size(w, h)
        return PreparedFrames([_resize(a, size) for a in images], times, (w, h), param)

    def prepare_segment(self, data, start: float | None, param: str = "file") -> PreparedFrames:
        """An encoded segment (MP4 / MOV / WebM / MKV): every frame at `start` + its own time
        (`start` by default just after the stream's latest frame), under the engine's video
        limits (size, frame size, duration, decoded bytes, decode time)."""
        from mmkv.video import decode_all_frames

        frames = decode_all_frames(data, self.limits, MAX_FRAMES_PER_APPEND)
        return self.prepare([(f, self.start_time(start) + t) for f, t in frames], param)

    def start_time(self, start: float | None, interval: float | None = None) -> float:
        """An append's first time: `start`, by default one `interval` (one tick) after the
        stream's latest frame, 0 for the first."""
        if start is None:
            return 0.0 if self.last_time < 0 else self.last_time + (interval or 1 / self.settings.fps)
        if isinstance(start, bool) or not isinstance(start, (int, float)) or not math.isfinite(start) \
                or not 0 <= start <= MAX_STREAM_TIME_S:
            raise InvalidVideoError(f"start must be seconds from 0 to {MAX_STREAM_TIME_S:g}", param="start")
        return float(start)

    @staticmethod
    def _rgb(img, param: str) -> np.ndarray:
        if isinstance(img, Image.Image):
            return np.array(to_rgb(img))
        if isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3:
            return np.ascontiguousarray(img)
        raise InvalidVideoError(f"{param}: a frame must be a PIL image or an HxWx3 uint8 array", param=param)

    def window_bytes(self, prepared: PreparedFrames) -> int:
        """Bytes the stream reserves: a full window and a pending frame at the resized size."""
        h, w = prepared.frames[0].shape[1:]
        return (FRAME_FACTOR * self.settings.window_groups + 1) * 3 * h * w

    def check_append(self, prepared: PreparedFrames) -> None:
        """Refused, changing nothing: a first time not after the stream's latest, or a group over
        the token limit (checked by the caller against the store budget)."""
        if prepared.times[0] <= self.last_time:
            raise StreamConflictError(f"{prepared.first()}: time {prepared.times[0]:g} s is not after the stream's "
                                      f"latest frame ({self.last_time:g} s)", param=prepared.first())
        if self.source_size is not None and prepared.source_size != self.source_size:
            raise StreamConflictError(f"{prepared.param}: frames are {prepared.source_size[0]}x"
                                      f"{prepared.source_size[1]}; this stream's frames are {self.source_size[0]}x"
                                      f"{self.source_size[1]}", param=prepared.param)
        h, w = prepared.frames[0].shape[1:]
        tokens = self.settings.window_groups * (h // self.budget.factor) * (w // self.budget.factor)
        if tokens > self.limits.max_tokens:  # the stream's settings cannot take these frames: a conflict (409)
            raise StreamConflictError(f"{prepared.param}: this stream's window of {self.settings.window_groups} groups "
                                      f"of {h}x{w} frames would be {tokens} tokens, over the limit of "
                                      f"{self.limits.max_tokens} (max_tokens); create the stream with fewer "
                                      f"window_groups or a lower max_pixels", param=prepared.param)

    def append(self, prepared: PreparedFrames) -> tuple[int, list[str]]:
        """Sample the frames onto the clock; returns (groups completed, hashes of the groups the
        window dropped). Call `check_append` first."""
        if self.source_size is None:  # the clock starts at the group holding the first frame
            self.source_size, self.size = prepared.source_size, tuple(prepared.frames[0].shape[1:])
            first = math.floor(prepared.times[0] * self.settings.fps + 1e-9) // FRAME_FACTOR
            self.next_tick, self.first_group = FRAME_FACTOR * first, first
        before, dropped = self.first_group + len(self.hashes), []
        for frame, t in zip(prepared.frames, prepared.times):
            last = math.floor(t * self.settings.fps + 1e-9)  # the last tick at or before t: this frame fills up to it
            if last - self.next_tick + 1 > FRAME_FACTOR * (self.settings.window_groups + 1):
                dropped += self._skip_gap(frame, last)
            while self.next_tick <= last:
                self._fill(frame)
            self.last_time = t
            dropped += self._trim()
        self._snapshot = None
        return self.first_group + len(self.hashes) - before, dropped

    def _fill(self, frame: torch.Tensor) -> None:
        self.frames.append(frame)
        self.ticks.append(self.next_tick)
        self.next_tick += 1
        if len(self.frames) % FRAME_FACTOR == 0:
            ticks = self.ticks[-FRAME_FACTOR:]
            self.hashes.append(group_hash(torch.stack(self.frames[-FRAME_FACTOR:]), self._times(ticks)))

    def _skip_gap(self, frame: torch.Tensor, last: int) -> list[str]:
        """A gap longer than the window: every group before its last window's worth of ticks would
        be dropped as soon as it completed, so the clock jumps over them (whole groups, its phase
        kept) instead of filling them. Returns the window's hashes, all dropped."""
        if len(self.frames) % FRAME_FACTOR:  # the pending frame's group completes first
            self._fill(frame)
        keep = FRAME_FACTOR * (self.settings.window_groups + 1)
        skip = (last - self.next_tick + 1 - keep) // FRAME_FACTOR * FRAME_FACTOR
        dropped = self.hashes
        self.first_group += len(self.hashes) + skip // FRAME_FACTOR
        self.next_tick += skip
        self.frames, self.ticks, self.hashes = [], [], []
        return dropped

    def _trim(self) -> list[str]:
        """Drop the oldest groups beyond the window; their hashes."""
        extra = len(self.hashes) - self.settings.window_groups
        if extra <= 0:
            return []
        dropped = self.hashes[:extra]
        self.hashes = self.hashes[extra:]
        self.frames, self.ticks = self.frames[FRAME_FACTOR * extra:], self.ticks[FRAME_FACTOR * extra:]
        self.first_group += extra
        return dropped

    def _times(self, ticks: list[int]) -> tuple[float, ...]:
        return tuple(k / self.settings.fps for k in ticks)

    # ---- what a prompt sees ----------------------------------------------------------------------------
    def snapshot(self) -> DecodedVideo | None:
        """The window's complete groups as a clip (None before the first group completes); the
        same object until the next append."""
        if not self.hashes:
            return None
        if self._snapshot is None:
            n = FRAME_FACTOR * len(self.hashes)
            times = self._times(self.ticks[:n])
            self._snapshot = DecodedVideo(torch.stack(self.frames[:n]), times, self.settings.fps,
                                          self.source_size[0], self.source_size[1], times[-1] - times[0], 0,
                                          tuple(self.hashes), f"{self.video_id}@{self.first_group}+{len(self.hashes)}")
        return self._snapshot

    def info(self) -> StreamInfo:
        w, h = self.source_size or (0, 0)
        return StreamInfo(self.video_id, self.settings.fps, self.settings.window_groups, len(self.hashes),
                          self.first_group, self.first_group + len(self.hashes),
                          len(self.frames) - FRAME_FACTOR * len(self.hashes), w, h, self.last_time, self.reserved)

    @property
    def nbytes(self) -> int:
        return sum(f.numel() for f in self.frames)


def reserve(stream: VideoStream, prepared: PreparedFrames, store_bytes: int, budget: int) -> int:
    """The bytes a stream's first append reserves (0 after it); VideoStoreFullError when the store
    cannot hold them."""
    if stream.reserved:
        return 0
    need = stream.window_bytes(prepared)
    if store_bytes + need > budget:
        raise VideoStoreFullError(f"the video store holds {store_bytes} of {budget} bytes; a window of "
                                  f"{stream.settings.window_groups} groups at this frame size needs {need}: lower "
                                  f"window_groups or max_pixels, or delete videos first", param="frames")
    return need
