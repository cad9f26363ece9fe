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


# ---- live streams -------------------------------------------------------------------------------------
STREAM_WINDOW = 32  # groups a stream keeps: the later checkpoints slide the window
STREAM_POINTS = (8, 16, 32, 48, 64)  # stream lengths, in groups, at which questions are timed
STREAM_FPS = 2.0


def _group_frames(side: int, g: int) -> list:
    """Group g's two camera frames at their ticks: a scene of its own (seeded by g)."""
    from PIL import Image

    from mmkv.testing.clips import clip_frames

    return [(Image.fromarray(img), (2 * g + j) / STREAM_FPS) for j, img in enumerate(clip_frames(2, side, side, g))]


def bench_stream(engine, repeats: int, group_tokens: int = 16, ks: tuple[int, ...] = (1, 4),
                 points: tuple[int, ...] = STREAM_POINTS, window: int = STREAM_WINDOW) -> dict:
    """A live stream grows; from each point (its length at the first of them) `repeats` questions
    are asked, each after k new groups (the stream then k groups longer), and timed end to end (`engine_sample`: TTFT and CPU time to
    the first token) beside a full recompute of the same prompt. Past `window` groups the oldest
    are dropped, so the window slides and every kept group moves."""
    from mmkv.bench.run import engine_sample

    side, sampling = clip_settings(engine, group_tokens)
    rows = []
    for k in ks:
        tenant = f"stream-k{k}"
        sid = engine.create_stream(tenant=tenant, fps=STREAM_FPS, window_groups=window, **sampling)
        grown = 0

        def grow(n: int) -> None:
            nonlocal grown
            for g in range(grown, grown + n):
                engine.append_frames(sid, _group_frames(side, g), tenant=tenant)
            grown += n

        def question(i: int) -> list:
            return [{"role": "system", "content": "you watch a camera ."},
                    {"role": "user", "content": [{"type": "video_file", "video_file": {"file_id": sid}},
                                                 {"type": "text", "text": f"question {i} : what changed ?"}]}]

        asked = 0
        for point in points:
            grow(max(0, point - k - grown))
            engine_sample(engine, question(asked), tenant=tenant)  # untimed: the stream so far is cached
            asked += 1
            mmkv, full, vision = [], [], []
            length = grown + k
            for _ in range(repeats):
                grow(k)
                runs = engine.registry.vision_tower_runs
                mmkv.append(engine_sample(engine, question(asked), tenant=tenant))
                vision.append(engine.registry.vision_tower_runs - runs)
                full.append(engine_sample(engine, question(asked), tenant=tenant, reuse=False))
                asked += 1
            rows.append(_stream_row(k, length, min(length, window), mmkv, full, vision))
        engine.remove_video(sid, tenant=tenant)
    return {"group_tokens": group_tokens, "window": window, "fps": STREAM_FPS, "repeats": repeats, "rows": rows}


def _stream_row(k: int, point: int, kept: int, mmkv: list, full: list, vision: list) -> dict:
    import statistics

    def med(samples, attr):
        return statistics.median(getattr(s, attr) * 1e3 for s in samples)

    return {"k": k, "stream_groups": point, "window_groups": kept, "prompt_tokens": mmkv[0].prompt_tokens,
            "mmkv_ms": med(mmkv, "wall_s"), "mmkv_cpu_ms": med(mmkv, "cpu_s"),
            "mmkv_computed_tokens": mmkv[0].tokens, "mmkv_vision_runs": vision[0],
            "full_ms": med(full, "wall_s"), "full_cpu_ms": med(full, "cpu_s"), "full_computed_tokens": full[0].tokens,
            "runs_cpu_ms": [s.cpu_s * 1e3 for s in mmkv]}


def format_stream(s: dict) -> str:
    lines = [f"### stream: a question after k new groups as the stream grows (groups of {s['group_tokens']} tokens, "
             f"{s['fps']:g} fps clock, window {s['window']} groups; medians of {s['repeats']} questions)",
             "| k new groups | stream groups | groups in window | prompt tokens | mmkv TTFT ms | mmkv CPU ms | "
             "LM tokens computed | vision runs | full recompute ms | full CPU ms | full / mmkv (CPU) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['k']} | {r['stream_groups']} | {r['window_groups']} | {r['prompt_tokens']} | {r['mmkv_ms']:.1f} | "
              f"{r['mmkv_cpu_ms']:.1f} | {r['mmkv_computed_tokens']} | {r['mmkv_vision_runs']} | {r['full_ms']:.1f} | "
              f"{r['full_cpu_ms']:.1f} | {r['full_cpu_ms'] / r['mmkv_cpu_ms']:.1f}x |" for r in s["rows"]]
    return "\n".join(lines) + "\n"
