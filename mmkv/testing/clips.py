"""Synthetic video clips encoded with PyAV, for tests and benchmarks: a coloured square moving
across a plain background, one frame per step, in MP4, WebM, MKV or MOV."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np

CODECS = {"mp4": "mpeg4", "mov": "mpeg4", "mkv": "mpeg4", "webm": "libvpx"}
FORMATS = {"mp4": "mp4", "mov": "mov", "mkv": "matroska", "webm": "webm"}


def clip_frames(frames: int, width: int, height: int, seed: int = 0) -> list[np.ndarray]:
    """HWC uint8 RGB frames: a square of a seeded colour moving left to right, a seeded background."""
    rng = np.random.default_rng(seed)
    background, colour = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    side = max(4, min(width, height) // 3)
    out = []
    for i in range(frames):
        img = np.empty((height, width, 3), dtype=np.uint8)
        img[:] = background
        x = (width - side) * i // max(frames - 1, 1)
        img[(height - side) // 2:(height + side) // 2, x:x + side] = colour
        out.append(img)
    return out


def encode_clip(frames: int = 8, fps: int = 4, width: int = 64, height: int = 48, container: str = "mp4",
                seed: int = 0, audio: bool = False) -> bytes:
    """The frames of `clip_frames` encoded at a constant `fps` (with a silent audio track if asked)."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=FORMATS[container]) as out:
        stream = out.add_stream(CODECS[container], rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"qscale": "2"} if container != "webm" else {"crf": "4", "b": "0"}  # near lossless
        sound = out.add_stream("libopus" if container == "webm" else "aac", rate=48000) if audio else None
        for i, img in enumerate(clip_frames(frames, width, height, seed)):
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts, frame.time_base = i, Fraction(1, fps)
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
        if sound is not None:
            _silence(out, sound, frames / fps)
    return buf.getvalue()


def encode_audio_only(seconds: float = 1.0) -> bytes:
    """An MP4 holding one silent AAC track and no video."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        _silence(out, out.add_stream("aac", rate=48000), seconds)
    return buf.getvalue()


def _silence(out, stream, seconds: float) -> None:
    samples, pts = int(48000 * seconds), 0
    while pts < samples:
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 48000, pts
        out.mux(stream.encode(frame))
        pts += 1024
    out.mux(stream.encode())
