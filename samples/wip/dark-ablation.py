"""Which feature of the held-out ``dark`` renderer costs accuracy (session 51).

    python samples/wip/dark-ablation.py MODEL_DIR [N] [VARIANT,...]

Each variant redraws the ``dark`` renderer with one feature switched off; ``flat_darkbg`` is the
plain ``flat`` renderer with only its background swapped for one of ``dark``'s. N items per image
type (default 40), seeds ``abl-<type>-<i>``: never a training, validation or committed seed. One
thread; prints hits of N * 9 per variant and per type."""
from __future__ import annotations

import dataclasses
import functools
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "samples")]

import torch  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

import evaluate_tiny as ET  # noqa: E402
from vqa_eval import dataset as D, episodes as E  # noqa: E402


def dark_variant(scene, rng, ring=True, rim=True, invert=True, rescale=True, dark_bg=True):
    """dataset._render_dark with features switchable (True everywhere: the same drawing)."""
    img, draw, ss, scale = D._supersampled(scene, rng, (0.6, 1.6), 4, lambda r: r.choice(D.DARK_BACKGROUNDS))
    if not rescale or not dark_bg:
        ss, scale = (ss, scale) if rescale else (4.0, 1.0)
        bg = img.getpixel((0, 0)) if dark_bg else scene.background
        img = Image.new("RGB", (max(1, round(scene.width * ss)), max(1, round(scene.height * ss))), bg)
        draw = ImageDraw.Draw(img)
    for ex in scene.extras:
        if ex["kind"] == "rect":
            fill = tuple(255 - c for c in ex["fill"]) if invert else tuple(ex["fill"])
            outline = (200, 200, 210) if ex.get("outline") is not None else None
            draw.rectangle([v * ss for v in ex["box"]], fill=fill, outline=outline,
                           width=max(1, round(ex.get("line", 1) * ss)))
    for o in scene.objects:
        fill = D.COLORS[o.color]
        cx, cy, size = o.cx * ss, o.cy * ss, o.size * ss
        if o.role == "light" and ring:
            D._draw_shape(draw, "circle", cx, cy, size, None, outline=fill, width=max(1, round(size * 0.14)))
            D._draw_shape(draw, "circle", cx, cy, size * 0.45, fill)
        else:
            D._draw_shape(draw, o.shape, cx, cy, size, fill, outline=(235, 235, 235) if rim else None,
                          width=max(1, round(ss)))
    return D._downsampled(img, scene, scale)


def flat_darkbg(scene, rng):
    return D.render(dataclasses.replace(scene, background=rng.choice(D.DARK_BACKGROUNDS)), rng)


VARIANTS = {
    "dark": dark_variant,
    "no_ring": functools.partial(dark_variant, ring=False),
    "no_rim": functools.partial(dark_variant, rim=False),
    "no_invert": functools.partial(dark_variant, invert=False),
    "no_rescale": functools.partial(dark_variant, rescale=False),
    "light_bg": functools.partial(dark_variant, dark_bg=False),
    "flat": lambda s, r: D.render_styled(s, r, "flat"),
    "flat_darkbg": flat_darkbg,
    "varied": lambda s, r: D.render_styled(s, r, "varied"),
}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    model_dir, n = argv[0], int(argv[1]) if len(argv) > 1 else 40
    chosen = argv[2].split(",") if len(argv) > 2 else list(VARIANTS)
    model, processor = ET.load(model_dir)
    for name in chosen:
        t0, row = time.time(), {}
        for t in D.TYPES:
            eps = [E.build(random.Random(f"abl-{t}-{i}"), t, before=0, draw=VARIANTS[name]) for i in range(n)]
            row[t] = sum(E.ask(model, processor, ep) == ep.answer for ep in eps)
        print(f"{name:12s} {sum(row.values())}/{n * len(row)} {row} {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
