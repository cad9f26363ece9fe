"""`mmkv bench --modes video`: a clip uploaded once, asked about again after new text (the text
before it changed, so no prefix cache covers it), at 8 / 32 / 64 temporal groups. The arms are the
image mode's (`chunk_arms`): full recompute (the vision tower over the whole clip + one forward),
exact-prefix caching, encoder cache + prefix caching, mmkv splice k=0 / k=1 (every group's cached
KV rotated into place, k tokens a group recomputed), the engine end to end, a text-only turn of
the same new tokens and the limit (one forward of exactly the splice's new tokens)."""

from __future__ import annotations

from mmkv.bench.run import HISTORY, Table, TextContext, chunk_arms, finish, interleave, same_as_full
from mmkv.testing.clips import encode_clip

FRAMES_PER_GROUP = 2


def clip_settings(engine, group_tokens: int) -> tuple[int, dict]:
    """The square frame side giving `group_tokens` pads per group (a square number) and the
    sampling settings that keep it (max_pixels the frame's area)."""
    factor = engine.registry.videos.budget.factor
    side = int(round(group_tokens ** 0.5)) * factor
    return side, {"max_pixels": side * side}


def add_clip(engine, groups: int, group_tokens: int, tenant: str, seed: int = 0) -> str:
    """Upload a synthetic clip of `groups` temporal groups (two frames each, 2 fps), every group
    precompiled; its id."""
    side, sampling = clip_settings(engine, group_tokens)
    clip = encode_clip(FRAMES_PER_GROUP * groups, 2, side, side, seed=seed)
    return engine.add_video(clip, tenant=tenant, nframes=FRAMES_PER_GROUP * groups, **sampling)


def bench_video(engine, groups: int, repeats: int, text: TextContext, group_tokens: int = 16) -> Table:
    ad = engine.adapter
    tenant = f"video-{groups}x{group_tokens}"
    video_id = add_clip(engine, groups, group_tokens, tenant)
    frames = engine.registry.videos.lookup(video_id, tenant).video.frames
    vision = ad.preprocess_video(frames)  # the whole clip, as a full recompute encodes it

    def messages(k: int):
        return HISTORY + [{"role": "user", "content": [
            {"type": "text", "text": f"turn {k} : look again at"},
            {"type": "video_file", "video_file": {"file_id": video_id}},
            {"type": "text", "text": "what happened in it ?"}]}]

    arms, notes = chunk_arms(engine, messages, text, vision, tenant)
    info = engine.video_info(video_id, tenant=tenant)
    placements = engine.splice_plan(messages(0), tenant=tenant).placements
    notes.update(groups=info.groups, video_tokens=info.video_tokens,
                 chunk_tokens=sum(p.entry.num_tokens for p in placements))
    n = engine.prompt_ids(messages(0), tenant=tenant).numel()
    table = Table("video", f"video, {info.groups} groups of {info.video_tokens // info.groups} tokens", n,
                  same_as_full(interleave(arms, repeats)), notes)
    return finish(table, "full recompute", "limit")
