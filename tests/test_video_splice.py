"""Video reuse on every family (the Qwen3-VL MoE too): each temporal group is a chunk spliced with per-axis
re-rotation. The splice equals the block-masked oracle (float32, 1e-4); re-rotated keys equal keys
computed at the target; `reuse=False` is one full forward; an upload asked about in another
conversation at another place runs the vision tower 0 times; deletes purge every group."""

from __future__ import annotations

import pytest
import torch

from mmkv import Engine
from mmkv.errors import UnknownVideoError
from mmkv.kv.rerotate import reposition_keys
from mmkv.request.oracle import block_masked_logits
from mmkv.request.splice import prefill_full, prefill_spliced
from mmkv.request.videos import VideoGroupRef
from mmkv.testing.clips import encode_clip

TOL = 1e-4
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, tiny_dirs):
    return Engine.from_pretrained(tiny_dirs[request.param], dtype=torch.float32, device="cpu")


def _small(engine) -> dict:
    f = engine.registry.videos.budget.factor
    return {"max_pixels": 4 * f * f}


def _video_part(engine, seed=0, frames=16):
    vid = engine.add_video(encode_clip(frames, 4, 64, 48, seed=seed), **_small(engine))
    return vid, {"type": "video_file", "video_file": {"file_id": vid}}


def _layouts(engine):
    _, v = _video_part(engine)
    _, w = _video_part(engine, seed=1, frames=8)
    return {
        "video first": [{"role": "user", "content": [v, {"type": "text", "text": "what moved ?"}]}],
        "two videos": [{"role": "system", "content": "be brief ."},
                       {"role": "user", "content": [{"type": "text", "text": "first"}, v,
                                                    {"type": "text", "text": "then"}, w,
                                                    {"type": "text", "text": "which is longer ?"}]}],
        "again later": [{"role": "user", "content": [v, {"type": "text", "text": "what colour ?"}]},
                        {"role": "assistant", "content": "red"},
                        {"role": "user", "content": [{"type": "text", "text": "and here"}, w, v,
                                                     {"type": "text", "text": "how many shapes ?"}]}],
    }


@pytest.mark.parametrize("seam", [0, 1, 2])
@pytest.mark.parametrize("layout", ["video first", "two videos", "again later"])
def test_video_splice_equals_block_masked_forward(engine, seam, layout):
    plan = engine.splice_plan(_layouts(engine)[layout])
    assert any(p.entry.kind == "video" for p in plan.placements)
    spliced = prefill_spliced(engine.adapter, plan.input_ids, plan.positions, plan.placements, seam)
    oracle = block_masked_logits(engine.adapter, plan.input_ids, plan.positions, plan.placements, seam,
                                 engine.anchor_ids)
    assert (spliced.logits - oracle).abs().max().item() <= TOL


def test_rerotated_group_keys_equal_keys_computed_at_the_target(engine):
    """A group's keys rotated from their canonical positions to the prompt's equal the keys of the
    same isolated prefill run at the target positions."""
    plan = engine.splice_plan(_layouts(engine)["again later"])
    p = [p for p in plan.placements if p.entry.kind == "video"][-1]
    assert not torch.equal(p.target, p.entry.position_ids)
    anchor = engine.anchor_ids
    shift = p.target[:, :1] - p.entry.position_ids[:, :1]
    ids = torch.cat((anchor, p.entry.token_ids))
    positions = torch.cat((torch.arange(anchor.numel()).expand(3, -1) + shift, p.target), dim=1)
    cache = engine.adapter.new_cache()
    engine.adapter.forward(ids, positions, cache, p.entry.features)
    for layer, k in enumerate(p.entry.keys):
        moved = reposition_keys(k, p.entry.position_ids, p.target, engine.adapter.rope)
        direct = cache.layers[layer].keys[0, :, anchor.numel():]
        assert (moved - direct).abs().max().item() <= 1e-4


def test_group_encoding_equals_whole_video_encoding(engine):
    """The vision tower attends within a temporal group only, so encoding groups one by one (what
    the cache stores) equals the rows of one encoding of the whole video."""
    vid, _ = _video_part(engine)
    reg = engine.registry.videos.lookup(vid, "")
    pixel_values, grid = engine.adapter.preprocess_video(reg.video.frames)
    whole = engine.adapter.encode_image(pixel_values, grid)
    parts = [engine.registry.videos.encode(VideoGroupRef(reg, g)) for g in range(reg.video.num_groups)]
    assert (torch.cat([p.embeds for p in parts]) - whole.embeds).abs().max().item() <= 1e-5
    for d in range(len(whole.deepstack)):
        assert (torch.cat([p.deepstack[d] for p in parts]) - whole.deepstack[d]).abs().max().item() <= 1e-5


def test_reuse_false_is_one_full_forward(engine):
    """`reuse=False`: one causal forward over the prompt at the native positions with the tower's
    features, exactly (greedy tokens and first logits of an independent full prefill)."""
    msgs = _layouts(engine)["two videos"]
    result = engine.generate(msgs, max_new_tokens=3, reuse=False)
    plan = engine.splice_plan(msgs)
    full = prefill_full(engine.adapter, plan.input_ids, plan.native_positions, plan.chunk_features())
    assert (result.first_logits - full.logits[0]).abs().max().item() <= 1e-5
    assert result.video_tokens_reused == 0 and result.usage.cached_tokens == 0


def test_upload_asked_elsewhere_runs_the_tower_zero_times(engine):
    vid, part = _video_part(engine, seed=5)
    info = engine.video_info(vid)
    first = engine.generate([{"role": "user", "content": [part, {"type": "text", "text": "what moved ?"}]}],
                            max_new_tokens=2)
    other = engine.generate([{"role": "system", "content": "you watch clips ."},
                             {"role": "user", "content": [{"type": "text", "text": "a new chat about"}, part,
                                                          {"type": "text", "text": "which colour ?"}]}],
                            max_new_tokens=2)
    # the seam (one token a group) is computed: a pad on Qwen2/2.5-VL, the timestamp's first token on Qwen3-VL
    seam_pads = 0 if engine.registry.videos.timestamps else info.groups
    for r in (first, other):
        assert r.vision_tower_runs == 0
        assert r.video_tokens_reused == info.video_tokens - seam_pads
        assert r.usage.cached_tokens >= r.video_tokens_reused


def test_inline_video_counts_as_computed_then_reused(engine):
    """An inline video first precompiled for a request is computed there (not reused); the same
    clip inline again reuses every group."""
    clip = encode_clip(12, 4, 64, 48, seed=9)
    msgs = [{"role": "user", "content": [{"type": "video", "video": clip, **_small(engine)},
                                         {"type": "text", "text": "what moved ?"}]}]
    registered = engine.stats()["registered_videos"]
    first, again = engine.generate(msgs, max_new_tokens=2), engine.generate(msgs, max_new_tokens=2)
    assert first.vision_tower_runs == 3 and first.video_tokens_reused == 0
    assert again.vision_tower_runs == 0 and again.video_tokens_reused > 0
    assert engine.stats()["registered_videos"] == registered  # inline videos are released with their request
    engine.check_integrity()


def test_delete_purges_every_group(engine):
    vid, part = _video_part(engine, seed=7)
    msgs = [{"role": "user", "content": [part, {"type": "text", "text": "what moved ?"}]}]
    engine.generate(msgs, max_new_tokens=2)
    groups = engine.video_info(vid).groups
    before = engine.stats()["video_cache_entries"]
    engine.remove_video(vid)
    assert engine.stats()["video_cache_entries"] == before - groups
    with pytest.raises(UnknownVideoError):
        engine.generate(msgs, max_new_tokens=2)
    engine.check_integrity()
