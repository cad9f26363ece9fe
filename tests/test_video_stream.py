"""Live video streams (mmkv.request.streams) on all three families: fixed-clock sampling keeps
earlier groups as they were; a question after k new groups runs the vision tower k times and
reuses every earlier group; the spliced prompt equals the block-masked oracle and a full
recompute equals one of an inline clip of the window's frames at their times; the window bounds
memory (oldest groups dropped and purged); deletes purge; bad appends change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mmkv import Engine
from mmkv.errors import InvalidVideoError, StreamConflictError, UnknownVideoError, VideoStoreFullError
from mmkv.request.oracle import block_masked_logits
from mmkv.request.splice import prefill_spliced
from mmkv.testing.clips import clip_frames, encode_clip

TOL = 1e-4
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
SIDE = 64
CAMERA_FRAMES = 64  # the square crosses the frame once in this many camera frames


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, tiny_dirs):
    return Engine.from_pretrained(tiny_dirs[request.param], dtype=torch.float32, device="cpu")


def _stream(engine, window=4, fps=2.0):
    f = engine.registry.videos.budget.factor
    return engine.create_stream(fps=fps, window_groups=window, max_pixels=4 * f * f)


def _frames(start: int, count: int, fps: float = 4.0, seed: int = 0):
    """`count` camera frames at `fps` from frame index `start` (times start / fps ...)."""
    frames = clip_frames(CAMERA_FRAMES, SIDE, SIDE, seed)[start:start + count]
    return [(Image.fromarray(img), (start + i) / fps) for i, img in enumerate(frames)]


def _ask(stream_id, question="what moved ?"):
    return [{"role": "system", "content": "you watch a camera ."},
            {"role": "user", "content": [{"type": "video_file", "video_file": {"file_id": stream_id}},
                                         {"type": "text", "text": question}]}]


def test_fixed_clock_keeps_earlier_groups(engine):
    """4 fps camera on a 2 fps clock: tick k takes the frame at k / 2 s; a group, once complete,
    keeps its hash and times whatever arrives after (one frame at a time or in a burst)."""
    sid = _stream(engine, window=8)
    info = engine.append_frames(sid, _frames(0, 5))  # t = 0 .. 1.0: ticks 0, 1, 2
    assert (info.groups, info.pending_frames) == (1, 1)
    first = engine.registry.videos.lookup(sid, "").video
    assert first.timestamps == (0.0, 0.5)
    for i in range(5, 13):
        engine.append_frames(sid, _frames(i, 1))
    later = engine.registry.videos.lookup(sid, "").video
    assert later.group_hashes[0] == first.group_hashes[0] and torch.equal(later.frames[:2], first.frames)
    assert later.timestamps == tuple(k / 2 for k in range(later.num_groups * 2))
    burst = _stream(engine, window=8)
    engine.append_frames(burst, _frames(0, 13))
    assert engine.registry.videos.lookup(burst, "").video.group_hashes == later.group_hashes
    engine.remove_video(sid), engine.remove_video(burst)


def test_question_after_k_new_groups_computes_only_them(engine):
    sid = _stream(engine, window=16)
    engine.append_frames(sid, _frames(0, 12))  # 3 groups (ticks 0..5)
    first = engine.generate(_ask(sid), max_new_tokens=1)
    assert first.vision_tower_runs == 3
    for k in (1, 2):
        before = engine.stream_info(sid)
        engine.append_frames(sid, _frames(4 * before.groups_total, 4 * k))
        grown = engine.stream_info(sid)
        assert grown.groups == before.groups + k
        r = engine.generate(_ask(sid, f"and now {k} ?"), max_new_tokens=1)
        assert r.vision_tower_runs == k
        pads = engine.video_info(sid).video_tokens // grown.groups
        seam = 0 if engine.registry.videos.timestamps else 1  # Qwen2/2.5-VL: a group's first pad is its seam
        # the earlier groups' KV existed before the request; the new groups' was computed in it
        assert before.groups * (pads - seam) <= r.video_tokens_reused <= before.groups * pads
        group_tokens = engine.registry.videos.group_tokens(engine.registry.videos.lookup(sid, "").video, 0)[0].numel()
        assert r.usage.cached_tokens >= before.groups * (group_tokens - 1)
        # the turn runs the new groups (each precompiled after the anchor), the new text and at most
        # one prefix block of older tokens: nothing that grows with the stream
        fresh = r.usage.prompt_tokens - r.usage.cached_tokens
        assert fresh <= k * group_tokens + 32
        assert r.lm_tokens_computed <= fresh + k * (engine.anchor_ids.numel() + group_tokens)
    engine.remove_video(sid)


def test_stream_splice_equals_block_masked_forward(engine):
    sid = _stream(engine, window=3)
    engine.append_frames(sid, _frames(0, 20))  # 5 groups: the window keeps the last 3
    plan = engine.splice_plan(_ask(sid))
    assert sum(p.entry.kind == "video" for p in plan.placements) == 3
    spliced = prefill_spliced(engine.adapter, plan.input_ids, plan.positions, plan.placements, 1)
    oracle = block_masked_logits(engine.adapter, plan.input_ids, plan.positions, plan.placements, 1,
                                 engine.anchor_ids)
    assert (spliced.logits - oracle).abs().max().item() <= TOL
    engine.remove_video(sid)


def test_window_is_a_clip_of_its_groups(engine):
    """After the window slid, a full recompute about the stream equals one about an inline clip of
    the window's frames at their stream times: positions restart at the block, timestamps are the
    stream's."""
    sid = _stream(engine, window=2)
    engine.append_frames(sid, _frames(0, 24))
    window = engine.registry.videos.lookup(sid, "").video
    assert window.timestamps[0] > 0
    frames = [(Image.fromarray(x.permute(1, 2, 0).numpy()), t) for x, t in zip(window.frames, window.timestamps)]
    f = engine.registry.videos.budget.factor
    inline = [{"role": "system", "content": "you watch a camera ."},
              {"role": "user", "content": [{"type": "video", "video": frames, "max_pixels": 4 * f * f},
                                           {"type": "text", "text": "what moved ?"}]}]
    a = engine.generate(_ask(sid), max_new_tokens=1, reuse=False)
    b = engine.generate(inline, max_new_tokens=1, reuse=False)
    assert (a.first_logits - b.first_logits).abs().max().item() <= 1e-5
    engine.remove_video(sid)


def test_window_bounds_memory_and_purges_dropped_groups(engine):
    before = engine.stats()
    sid = _stream(engine, window=3)
    for i in range(0, 48, 4):  # 12 groups, asked about after each
        engine.append_frames(sid, _frames(i, 4, seed=11))
        engine.generate(_ask(sid), max_new_tokens=1)
        info, stats = engine.stream_info(sid), engine.stats()
        assert info.groups <= 3
        assert stats["video_cache_entries"] - before["video_cache_entries"] <= 3
        assert stats["video_store_bytes"] - before["video_store_bytes"] == info.reserved_bytes
        engine.check_integrity()
    assert info.groups_total == 12 and info.first_group == 9
    # a gap far longer than the window: the clock jumps, the window holds the frame after the gap
    info = engine.append_frames(sid, [(Image.fromarray(clip_frames(1, SIDE, SIDE)[0]), 1e5)])
    assert info.groups == 3 and info.groups_total == 100000 and info.pending_frames == 1
    engine.remove_video(sid)
    assert engine.stats()["video_cache_entries"] == before["video_cache_entries"]
    assert engine.stats()["video_store_bytes"] == before["video_store_bytes"]
    engine.check_integrity()


def test_delete_purges_and_forgets(engine):
    sid = _stream(engine)
    engine.append_frames(sid, _frames(0, 8))
    engine.generate(_ask(sid), max_new_tokens=1)
    engine.remove_video(sid)
    with pytest.raises(UnknownVideoError):
        engine.generate(_ask(sid), max_new_tokens=1)
    with pytest.raises(UnknownVideoError):
        engine.append_frames(sid, _frames(8, 4))
    engine.check_integrity()


def test_segment_append(engine):
    """An encoded segment's frames sit at `start` + their own times."""
    sid = _stream(engine, window=8)
    engine.append_frames(sid, encode_clip(8, 4, SIDE, SIDE, seed=0), start=0.0)
    seg = engine.registry.videos.lookup(sid, "").video
    ref = _stream(engine, window=8)
    engine.append_frames(ref, _frames(0, 8))
    assert engine.stream_info(sid).groups == engine.stream_info(ref).groups == 2
    assert seg.timestamps == engine.registry.videos.lookup(ref, "").video.timestamps
    engine.remove_video(sid), engine.remove_video(ref)


def _bad_appends(engine, sid):
    img = Image.fromarray(np.zeros((SIDE, SIDE, 3), np.uint8))
    return [
        ([], "non-empty"),
        ([(img, 0.1)], "not after"),  # the stream's latest is at 0.75 s: a conflict (409)
        ([(img, 5.0), (img, 4.0)], "increase strictly"),
        ([(Image.fromarray(np.zeros((SIDE, SIDE + 8, 3), np.uint8)), 9.0)], "this stream's frames"),
        ([(img, float("nan"))], "seconds"),
        ([("not a frame", 9.0)], "PIL image"),
        (b"not a video", "cannot decode"),
    ]


def test_bad_appends_change_nothing(engine):
    sid = _stream(engine)
    engine.append_frames(sid, _frames(0, 4))
    info = engine.stream_info(sid)
    for frames, message in _bad_appends(engine, sid):
        with pytest.raises(InvalidVideoError, match=message):
            engine.append_frames(sid, frames)
        assert engine.stream_info(sid) == info
    with pytest.raises(StreamConflictError):  # a time the stream has passed is a conflict with its state (409)
        engine.append_frames(sid, [(Image.fromarray(np.zeros((SIDE, SIDE, 3), np.uint8)), 0.5)])
    for settings, field in (({"fps": 0}, "fps"), ({"window_groups": 0}, "window_groups"),
                            ({"max_pixels": 1.5}, "max_pixels")):
        with pytest.raises(InvalidVideoError) as exc:
            engine.create_stream(**settings)
        assert exc.value.param == f"stream.{field}"
    engine.remove_video(sid)
    engine.check_integrity()


def test_empty_stream_and_store_budget(engine):
    sid = _stream(engine)
    with pytest.raises(InvalidVideoError, match="no complete temporal group"):
        engine.generate(_ask(sid), max_new_tokens=1)
    engine.remove_video(sid)
    videos = engine.registry.videos
    budget, videos.store_budget = videos.store_budget, videos.store_bytes + 100
    try:
        sid = _stream(engine)
        with pytest.raises(VideoStoreFullError):
            engine.append_frames(sid, _frames(0, 4))
        assert engine.stream_info(sid).reserved_bytes == 0 and engine.stream_info(sid).groups == 0
        engine.remove_video(sid)
    finally:
        videos.store_budget = budget
    engine.check_integrity()
