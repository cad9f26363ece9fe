"""`mmkv eval --grid`: agreement outside the training layout.

Conditions (vqa_eval/protocol.py `Shape`): 1-9 filler turns before the asked image, long
text-only turns in between, the image in the first user turn after system prompts of several
lengths (small and negative offsets: the image sits earlier than where it was precompiled), the
later request continuing the earlier chat (exact-prefix reuse gets its fair share), the same image
twice in one chat, and a two-image turn. The bundled models were trained on none of these, so the
figures are agreement with `full`, not accuracy. Agreement is tabulated against the asked image's
offset, the number of images in the prompt and the seam size.
"""

from __future__ import annotations

import time
from pathlib import Path

from mmkv.engine import Engine
from mmkv.vqa_eval.dataset import load_vqa_set
from mmkv.vqa_eval.protocol import SYSTEM_PROMPTS, Shape, balanced_subset, build_conversation
from mmkv.vqa_eval.run import (DEFAULT_SET, REFERENCE, _rate, choose_arms, header, make_context, run_requests,
                               summarize)

GRID_ARMS = ("full", "prefix", "splice-k0", "splice-k1", "splice-k2", "no-rotate")
CONDITIONS: dict[str, Shape] = {
    "fillers-1": Shape(later=(1, 1)),
    "fillers-3": Shape(later=(3, 3)),
    "fillers-5": Shape(later=(5, 5)),
    "fillers-7": Shape(later=(7, 7)),
    "fillers-9": Shape(later=(9, 9)),
    "text-gaps-4": Shape(later=(1, 1), text_gaps=4),
    "first-turn": Shape(earlier=(1, 2), later=(0, 0), systems=SYSTEM_PROMPTS + (".", "")),
    "continue": Shape(layout="continue"),
    "image-twice": Shape(later=(1, 2), image_twice=True),
    "two-images": Shape(later=(1, 2), two_images=True),
}
OFFSET_BINS = ((-10**6, 0), (0, 1), (1, 50), (50, 150), (150, 300), (300, 10**6))
IMAGE_BINS = ((1, 2), (2, 3), (3, 4), (4, 6), (6, 8), (8, 10**6))


def binned(rows: list[dict], arm: str, key: str, bins) -> list[dict]:
    out = []
    for lo, hi in bins:
        rs = [r for r in rows if lo <= r[key] < hi]
        out.append({"range": [lo, hi], **_rate(sum(r["arms"][arm]["agree"] for r in rs), len(rs))})
    return out


def run_grid(model_dir: str | Path | None = None, set_dir: str | Path | None = None, arms: list[str] | None = None,
             limit: int | None = None, seed: int = 0, out: str | Path = "eval-grid", max_new_tokens: int = 6,
             engine: Engine | None = None, progress: bool = True, seeds: int = 1,
             conditions: list[str] | None = None, extra_arms: list = ()) -> dict:
    """Every condition on `limit` items (default 90: 10 per type) x `seeds` conversation seeds.
    `extra_arms`: the fidelity dial's (run.blend_arms); then only those and the reference unless `arms`."""
    from mmkv.vqa_eval.report import write_grid_reports

    chosen = choose_arms(arms or ([] if extra_arms else list(GRID_ARMS)), extra_arms)
    names = conditions or list(CONDITIONS)
    unknown = [c for c in names if c not in CONDITIONS]
    if unknown:
        raise ValueError(f"unknown grid condition(s) {unknown}; choose from {', '.join(CONDITIONS)}")
    engine = engine or Engine.from_pretrained(model_dir)
    pool = load_vqa_set(set_dir or DEFAULT_SET)
    items = balanced_subset(pool, limit or 90)
    convs = {c: [build_conversation(it, pool, s, CONDITIONS[c]) for s in range(seed, seed + seeds) for it in items]
             for c in names}
    ctx = make_context(engine, [c for cs in convs.values() for c in cs], chosen, max_new_tokens, True, seed)
    t0, rows = time.perf_counter(), []
    for c in names:
        for row in run_requests(ctx, convs[c], CONDITIONS[c].layout, progress, f"grid {c}"):
            rows.append({**row, "condition": c})
    arm_names = [a.name for a in chosen]
    fast = [n for n in arm_names if n != REFERENCE]
    report = {
        "task": "grid", **header(engine, model_dir, set_dir, seed, limit, max_new_tokens),
        "seeds": list(range(seed, seed + seeds)), "items": len(items), "n": len(rows),
        "arms": {a.name: a.meaning for a in chosen}, "controls": [a.name for a in chosen if a.control],
        "conditions": {c: repr(CONDITIONS[c]) for c in names},
        "wall_s": round(time.perf_counter() - t0, 2),
        "by_condition": {c: {"summary": summarize([r for r in rows if r["condition"] == c], arm_names, seed),
                             "offset_range": [min(r["offset"] for r in rows if r["condition"] == c),
                                              max(r["offset"] for r in rows if r["condition"] == c)],
                             "images_mean": sum(r["images"] for r in rows if r["condition"] == c)
                             / sum(r["condition"] == c for r in rows)}
                         for c in names},
        "by_offset": {a: binned(rows, a, "offset", OFFSET_BINS) for a in fast},
        "by_images": {a: binned(rows, a, "images", IMAGE_BINS) for a in fast},
        "requests": rows,
    }
    write_grid_reports(report, Path(out))
    return report

