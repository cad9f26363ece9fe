"""mmkv.video: sampling and sizing as qwen-vl-utils (the Qwen-VL models' reference reader), the
accepted containers, the content hash, every limit and bad input as a clear 4xx error."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from PIL import Image
from qwen_vl_utils import vision_process as ref
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as tvf

from mmkv.errors import InvalidVideoError, VideoTooLargeError, VideoURLNotAllowedError
from mmkv.testing.clips import encode_audio_only, encode_clip
from mmkv.video import PixelBudget, VideoLimits, VideoSampling, decode_video

BUDGET = PixelBudget(28, 4 * 28 * 28, 16 * 28 * 28, 1000 * 28 * 28)


def _reference(data: bytes, ele: dict) -> tuple[torch.Tensor, float, list[int]]:
    """qwen-vl-utils' fetch_video over every frame PyAV decodes (its own readers need a path and a
    torchvision that still has read_video): frame range, smart_nframes, linspace, then one resize
    of the stacked uint8 frames."""
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        fps = float(stream.average_rate)
        video = torch.stack([torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1)
                             for f in c.decode(stream)])
    start, end, total = ref.calculate_video_frame_range(ele, video.shape[0], fps)
    nframes = ref.smart_nframes(ele, total_frames=total, video_fps=fps)
    idx = torch.linspace(start, end, nframes).round().long().tolist()
    video = video[idx]
    max_pixels = max(min(ele["max_pixels"], ele["total_pixels"] / nframes * ref.FRAME_FACTOR),
                     int(ele["min_pixels"] * 1.05))
    h, w = ref.smart_resize(video.shape[2], video.shape[3], factor=28, min_pixels=ele["min_pixels"],
                            max_pixels=min(max_pixels, ele.get("max_pixels_request", max_pixels)))
    video = tvf.resize(video, [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True)
    return video, nframes / total * fps, idx


@pytest.mark.parametrize("frames,fps,size,sampling", [
    (8, 4, (64, 48), {}),
    (41, 10, (96, 64), {}),
    (41, 10, (96, 64), {"fps": 1.0}),
    (41, 10, (96, 64), {"nframes": 6}),
    (41, 10, (200, 120), {"max_pixels": 6 * 28 * 28}),
    (60, 12, (64, 64), {"video_start": 1.0, "video_end": 4.0}),
])
def test_sampling_and_sizing_match_qwen_vl_utils(frames, fps, size, sampling):
    data = encode_clip(frames, fps, *size)
    ele = {"min_pixels": BUDGET.min_pixels, "max_pixels": BUDGET.max_pixels, "total_pixels": BUDGET.total_pixels,
           **{k: v for k, v in sampling.items() if k != "max_pixels"}}
    if "max_pixels" in sampling:
        ele["max_pixels_request"] = sampling["max_pixels"]
    want, want_fps, idx = _reference(data, ele)
    got = decode_video(data, BUDGET, VideoSampling(**sampling))
    assert got.frames.shape == want.shape and torch.equal(got.frames, want)
    assert got.sample_fps == pytest.approx(want_fps)
    assert got.timestamps == tuple(i / fps for i in idx)


def test_containers_and_content_hash():
    """The same frames in MP4, MOV and MKV (one codec) hash alike; other frames or another sampling do not."""
    hashes = {c: decode_video(encode_clip(8, 4, container=c), BUDGET).content_hash for c in ("mp4", "mov", "mkv")}
    assert len(set(hashes.values())) == 1
    webm = decode_video(encode_clip(8, 4, container="webm"), BUDGET)
    assert webm.frames.shape == (4, 3, 56, 56)
    assert decode_video(encode_clip(8, 4, seed=1), BUDGET).content_hash != hashes["mp4"]
    assert decode_video(encode_clip(8, 4), BUDGET, VideoSampling(nframes=2)).content_hash != hashes["mp4"]
    with_audio = decode_video(encode_clip(8, 4, audio=True), BUDGET)
    assert with_audio.content_hash == hashes["mp4"]


def test_file_object_and_data_url():
    import base64
    data = encode_clip(8, 4)
    want = decode_video(data, BUDGET).content_hash
    assert decode_video(io.BytesIO(data), BUDGET).content_hash == want
    assert decode_video("data:video/mp4;base64," + base64.b64encode(data).decode(), BUDGET).content_hash == want
    with pytest.raises(VideoURLNotAllowedError):
        decode_video("https://example.com/a.mp4", BUDGET)


def test_variable_frame_rate_decodes():
    """Frames at irregular times: every frame counted, an even number sampled."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as out:
        s = out.add_stream("mpeg4", rate=30)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        s.codec_context.time_base = Fraction(1, 1000)
        for i, t in enumerate([0, 30, 50, 200, 210, 600, 640, 1000, 1500, 1510]):
            f = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 20, dtype=np.uint8), format="rgb24")
            f.pts, f.time_base = t, Fraction(1, 1000)
            out.mux(s.encode(f))
        out.mux(s.encode())
    got = decode_video(buf.getvalue(), BUDGET)
    assert got.frames.shape[0] % 2 == 0 and got.frames.shape[0] >= 4


def _zero_frame_mp4() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        s = out.add_stream("mpeg4", rate=4)
        s.width, s.height = 64, 48
        out.mux(s.encode())
    return buf.getvalue()


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, format="PNG")
    return buf.getvalue()


CLIP = encode_clip(8, 4)
BAD = {
    "empty": (b"", InvalidVideoError),
    "random bytes": (bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8)), InvalidVideoError),
    "truncated": (CLIP[: len(CLIP) // 2], InvalidVideoError),
    "corrupt middle": (CLIP[:600] + bytes(400) + CLIP[1000:], InvalidVideoError),
    "zero frames": (_zero_frame_mp4(), InvalidVideoError),
    "audio only": (encode_audio_only(), InvalidVideoError),
    "png image": (_png(), InvalidVideoError),
    "text": (b"hello, this is not a video at all", InvalidVideoError),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_video_is_a_400(name):
    data, kind = BAD[name]
    with pytest.raises(kind) as err:
        decode_video(data, BUDGET)
    assert err.value.http_status == 400


@pytest.mark.parametrize("limits,field", [
    (VideoLimits(max_bytes=100), "max_bytes"),
    (VideoLimits(max_frame_pixels=64 * 47), "max_frame_pixels"),
    (VideoLimits(max_duration_s=1.0), "max_duration_s"),
    (VideoLimits(max_decoded_bytes=64 * 48 * 3 * 5), "max_decoded_bytes"),
    (VideoLimits(max_frames=2), "max_frames"),
    (VideoLimits(max_tokens=7), "max_tokens"),
    (VideoLimits(timeout_s=0.0), "timeout_s"),
])
def test_each_limit_is_a_400_naming_it(limits, field):
    with pytest.raises(VideoTooLargeError) as err:
        decode_video(CLIP, BUDGET, limits=limits)
    assert err.value.http_status == 400 and f"({field})" in err.value.message


def test_frames_with_times():
    """PIL frames with their times: used as they are, an odd count padded with the last frame."""
    frames = [(Image.new("RGB", (64, 48), (i * 40, 0, 0)), 0.5 * i) for i in range(3)]
    got = decode_video(frames, BUDGET)
    assert got.frames.shape == (4, 3, 56, 56)
    assert got.timestamps == (0.0, 0.5, 1.0, 1.0) and got.sample_fps == pytest.approx(2.0)
    assert torch.equal(got.frames[2], got.frames[3])
    with pytest.raises(InvalidVideoError, match="fps"):
        decode_video(frames, BUDGET, VideoSampling(fps=1.0))
    with pytest.raises(InvalidVideoError, match="increasing"):
        decode_video(frames[::-1], BUDGET)
    with pytest.raises(InvalidVideoError, match="pair"):
        decode_video([Image.new("RGB", (64, 48))], BUDGET)


@pytest.mark.parametrize("values,param", [
    ({"fps": 0}, "video.fps"), ({"fps": "2"}, "video.fps"), ({"nframes": 3.5}, "video.nframes"),
    ({"nframes": 10_000}, "video.nframes"), ({"fps": 1, "nframes": 4}, "video.nframes"),
    ({"max_pixels": True}, "video.max_pixels"), ({"video_start": 3, "video_end": 2}, "video.video_end"),
    ({"fps": float("nan")}, "video.fps"),
])
def test_sampling_settings_are_checked(values, param):
    with pytest.raises(InvalidVideoError) as err:
        VideoSampling.parse(values)
    assert err.value.param == param
