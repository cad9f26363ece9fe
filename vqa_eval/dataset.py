"""A deterministic synthetic VQA set, and its loader.

Every item is an image plus one question with a one-word answer. Three categories, three
question types each:

* perception: ``color`` / ``shape`` (one object), ``count`` (1-4 objects);
* reasoning (2-3 objects of distinct colors and shapes): ``color_of_shape``,
  ``shape_of_color``, ``left_of``;
* agentic (a status panel whose coloured status light gates a refund): ``gate_plain``,
  ``gate_logo`` (a coloured square logo of another colour on the panel), ``gate_scene``
  (the panel sits among other coloured shapes). The question is the same template for all
  three; only the drawing differs.

Scenes are drawn with Pillow from a seeded ``random.Random``, so the same seed gives the same
bytes. ``level`` picks between the *easy* layout used early in training (a square canvas, a
2 x 2 grid of cells aligned with the vision tokens, fixed object size) and the *varied* layout
of the evaluation set (sizes and aspect ratios from about 96 to 448 px a side, a grid of 2-4
cells per axis, object size 50-90% of a cell, jittered position).

CLI::

    python -m mmkv.vqa_eval.dataset --out samples/vqa --seed 1234 --per-type 40
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from PIL import Image, ImageDraw

# ----------------------------------------------------------------------------- vocabulary

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 205, 30),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
NUMBERS: tuple[str, ...] = ("one", "two", "three", "four")
BACKGROUNDS: tuple[tuple[int, int, int], ...] = (
    (250, 250, 250),
    (236, 236, 236),
    (245, 240, 228),
    (228, 234, 240),
)
GREYS = ((150, 150, 150), (175, 175, 175), (120, 120, 120))

CATEGORIES: dict[str, tuple[str, ...]] = {
    "perception": ("color", "shape", "count"),
    "reasoning": ("color_of_shape", "shape_of_color", "left_of"),
    "agentic": ("gate_plain", "gate_logo", "gate_scene"),
}
TYPES: tuple[str, ...] = tuple(t for ts in CATEGORIES.values() for t in ts)
CATEGORY_OF: dict[str, str] = {t: c for c, ts in CATEGORIES.items() for t in ts}

Q_COLOR = "what color is the shape ?"
Q_SHAPE = "what shape is it ?"
Q_COUNT = "how many shapes are there ?"
Q_COLOR_OF_SHAPE = "what color is the {shape} ?"
Q_SHAPE_OF_COLOR = "what shape is {color} ?"
Q_LEFT_OF = "is the {a} shape left of the {b} shape ?"
Q_GATE = (
    "policy : refund only if the status light is {color} . otherwise escalate . "
    "the customer asks for a refund . answer refund or escalate ."
)

Q_DESCRIBE = "describe the shapes from left to right ."
#: Question types outside the committed split's nine (drawn by :func:`make_item` all the same).
EXTRA_TYPES: tuple[str, ...] = ("describe",)


def describe_answer(objs: Sequence["Obj"]) -> str:
    """``describe``'s multi-token answer: colour and shape of each object, left to right."""
    return " , ".join(f"{o.color} {o.shape}" for o in sorted(objs, key=lambda o: o.cx))


#: Every answer any question can have, by type (the tokenizer needs them all).
ANSWERS: dict[str, tuple[str, ...]] = {
    "color": tuple(COLORS),
    "shape": SHAPES,
    "count": NUMBERS,
    "color_of_shape": tuple(COLORS),
    "shape_of_color": SHAPES,
    "left_of": ("yes", "no"),
    "gate_plain": ("refund", "escalate"),
    "gate_logo": ("refund", "escalate"),
    "gate_scene": ("refund", "escalate"),
}


def all_questions() -> list[str]:
    """Every question string the generator can produce (a tokenizer corpus)."""
    qs = [Q_COLOR, Q_SHAPE, Q_COUNT]
    qs += [Q_COLOR_OF_SHAPE.format(shape=s) for s in SHAPES]
    qs += [Q_SHAPE_OF_COLOR.format(color=c) for c in COLORS]
    qs += [Q_LEFT_OF.format(a=a, b=b) for a in COLORS for b in COLORS if a != b]
    qs += [Q_GATE.format(color=c) for c in COLORS]
    return qs


def corpus() -> list[str]:
    """Questions and answers: the words a tokenizer for this set must know."""
    words = sorted({a for ans in ANSWERS.values() for a in ans})
    return all_questions() + words


# ----------------------------------------------------------------------------- scenes


@dataclass(frozen=True)
class Obj:
    """One drawn object: its colour and shape names, centre and size in pixels."""

    color: str
    shape: str
    cx: float
    cy: float
    size: float
    role: str = "object"  # "object", "light", "logo", "panel"

    def probe(self) -> tuple[int, int]:
        """A pixel well inside the object (for checking the drawing)."""
        if self.shape == "triangle":  # centroid of an upward triangle is below the bbox centre
            return int(round(self.cx)), int(round(self.cy + self.size / 6))
        return int(round(self.cx)), int(round(self.cy))


@dataclass
class Scene:
    width: int
    height: int
    background: tuple[int, int, int]
    objects: list[Obj] = field(default_factory=list)
    extras: list[dict] = field(default_factory=list)  # grey bars, panels: drawn, never asked

    def to_json(self) -> dict:
        return {
            "width": self.width,
            "height": self.height,
            "background": list(self.background),
            "objects": [asdict(o) for o in self.objects],
        }


def _jitter(rgb: tuple[int, int, int], rng: random.Random, amount: int) -> tuple[int, int, int]:
    if amount <= 0:
        return rgb
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in rgb)  # type: ignore[return-value]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, size: float, fill,
                outline=None, width: int = 1) -> None:
    h = size / 2
    if shape == "circle":
        draw.ellipse([cx - h, cy - h, cx + h, cy + h], fill=fill, outline=outline, width=width)
    elif shape == "square":
        s = h * 0.9  # a square of the same box looks bigger than a circle; keep areas close
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill, outline=outline, width=width)
    elif shape == "triangle":
        draw.polygon([(cx, cy - h), (cx - h, cy + h), (cx + h, cy + h)], fill=fill, outline=outline, width=width)
    else:  # pragma: no cover - guarded by SHAPES
        raise ValueError(shape)


def render(scene: Scene, rng: random.Random, color_jitter: int = 0) -> Image.Image:
    """Draw a scene. ``rng`` only drives the colour jitter (0: exact palette colours)."""
    img = Image.new("RGB", (scene.width, scene.height), scene.background)
    draw = ImageDraw.Draw(img)
    for ex in scene.extras:
        if ex["kind"] == "rect":
            draw.rectangle(ex["box"], fill=tuple(ex["fill"]), outline=ex.get("outline"), width=ex.get("line", 1))
    for o in scene.objects:
        _draw_shape(draw, o.shape, o.cx, o.cy, o.size, _jitter(COLORS[o.color], rng, color_jitter))
    return img


# ----------------------------------------------------------------------------- drawing styles

#: Renderers seen in training (``flat`` is :func:`render`'s exact palette drawing).
TRAIN_STYLES: tuple[str, ...] = ("flat", "outline", "hollow", "soft", "noisy", "varied")
#: The renderers kept out of training. ``shadow``: anti-aliased shapes with a drop shadow and a
#: dark rim on a gradient background, panels recoloured (the ``heldout_style`` split). ``dark``: a
#: further shift, of the kind issue 16 measured on: a dark canvas, every panel drawn inverted (dark
#: card, light header and bars), the status light as a ring around a dot, shapes with a light rim,
#: and the whole canvas drawn at another size, 0.6-1.6x (the ``heldout_dark`` split).
HELDOUT_STYLES: tuple[str, ...] = ("shadow", "dark")
HELDOUT_STYLE = HELDOUT_STYLES[0]
STYLES: tuple[str, ...] = TRAIN_STYLES + HELDOUT_STYLES
DARK_BACKGROUNDS = ((28, 30, 36), (40, 36, 44), (22, 34, 40))


def _shade(rgb: Sequence[int], f: float) -> tuple[int, int, int]:
    return tuple(max(0, min(255, int(round(c * f)))) for c in rgb)  # type: ignore[return-value]


def _gradient(w: int, h: int, a: Sequence[int], b: Sequence[int], vertical: bool) -> Image.Image:
    import numpy as np

    t = np.linspace(0.0, 1.0, h if vertical else w, dtype=np.float32)
    t = t[:, None] if vertical else t[None, :]
    arr = np.asarray(a, np.float32)[None, None] * (1 - t[..., None]) + np.asarray(b, np.float32)[None, None] * t[..., None]
    arr = np.broadcast_to(arr, (h, w, 3))
    return Image.fromarray(np.ascontiguousarray(arr.round().astype(np.uint8)), "RGB")


def render_styled(scene: Scene, rng: random.Random, style: str, color_jitter: int = 0,
                  jpeg: float = 0.0) -> Image.Image:
    """Draw a scene in one of :data:`STYLES` (the same objects, so the same answers).

    ``flat`` is :func:`render`. The others: ``outline`` (filled, dark rim 1-4 px), ``hollow``
    (coloured outline only), ``soft`` (anti-aliased: drawn at 4x, downsampled), ``noisy`` (gradient
    background, pixel noise), ``varied`` (backgrounds and panels in any grey scheme, optional rims,
    the canvas rescaled), ``shadow`` (held out: anti-aliased, drop shadow, dark rim, gradient),
    ``dark`` (held out: see :data:`HELDOUT_STYLES`; it also changes the canvas size).
    Panels and bars are recoloured a little in every non-flat style. ``jpeg`` is the chance of a
    JPEG re-encode (quality 35-85) afterwards."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")
    if style == "flat":
        img = render(scene, rng, color_jitter=color_jitter)
    elif style == "dark":
        img = _render_dark(scene, rng, color_jitter)
    elif style == "varied":
        img = _render_varied(scene, rng, color_jitter)
    else:
        scale = 4 if style in ("soft", "shadow") else 1
        w, h = scene.width * scale, scene.height * scale
        if style in ("noisy", "shadow"):
            other = rng.choice(BACKGROUNDS + ((210, 215, 225), (240, 232, 214)))
            img = _gradient(w, h, scene.background, other, rng.random() < 0.5)
        else:
            img = Image.new("RGB", (w, h), scene.background)
        draw = ImageDraw.Draw(img)
        tint = rng.uniform(0.85, 1.12)
        for ex in scene.extras:
            if ex["kind"] == "rect":
                box = [v * scale for v in ex["box"]]
                outline = ex.get("outline")
                draw.rectangle(box, fill=_shade(ex["fill"], tint), outline=outline,
                               width=max(1, ex.get("line", 1) * scale))
        rim = max(1, int(round(rng.uniform(1, 4)))) * scale
        for o in scene.objects:
            fill = _jitter(COLORS[o.color], rng, color_jitter)
            cx, cy, size = o.cx * scale, o.cy * scale, o.size * scale
            if style == "hollow":
                width = max(2 * scale, int(size * rng.uniform(0.1, 0.18)))
                _draw_shape(draw, o.shape, cx, cy, size, None, outline=fill, width=width)
            elif style == "outline":
                _draw_shape(draw, o.shape, cx, cy, size, fill, outline=_shade(fill, 0.45), width=rim)
            elif style == "shadow":
                d = size * 0.08
                _draw_shape(draw, o.shape, cx + d, cy + d, size, (110, 110, 110))
                _draw_shape(draw, o.shape, cx, cy, size, fill, outline=_shade(fill, 0.55), width=scale)
            else:
                _draw_shape(draw, o.shape, cx, cy, size, fill)
        if scale > 1:
            img = img.resize((scene.width, scene.height), Image.Resampling.LANCZOS)
        if style == "noisy":
            import numpy as np

            nrng = np.random.default_rng(rng.getrandbits(32))
            arr = np.asarray(img, np.float32) + nrng.normal(0.0, rng.uniform(4, 14), (scene.height, scene.width, 3))
            img = Image.fromarray(arr.clip(0, 255).round().astype(np.uint8), "RGB")
    if jpeg > 0 and rng.random() < jpeg:
        import io

        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=rng.randint(35, 85))
        buf.seek(0)
        with Image.open(buf) as im:
            img = im.convert("RGB")
    return img


def render_heldout(scene: Scene, rng: random.Random) -> Image.Image:
    """A scene in :data:`HELDOUT_STYLE`: the ``draw`` argument validation episodes pass to the
    episode builder."""
    return render_styled(scene, rng, HELDOUT_STYLE)


def _far_from_palette(rng: random.Random, lo: int = 12, hi: int = 245) -> tuple[int, int, int]:
    """A grey of any brightness, slightly tinted, at least 110 (RGB distance) from every palette
    colour, so that no background or panel is mistaken for an object's colour."""
    while True:
        g = rng.randint(lo, hi)
        c = tuple(max(0, min(255, g + rng.randint(-18, 18))) for _ in range(3))
        if all(sum((a - b) ** 2 for a, b in zip(c, p)) ** 0.5 > 110 for p in COLORS.values()):
            return c  # type: ignore[return-value]


def dark_canvas(rng: random.Random) -> tuple[int, int, int]:
    """A dark background for a training drawing (brightness 12-72, tinted, far from every palette
    colour): the augmentation ``train.py --dark-canvas`` applies. An ablation of the held-out ``dark``
    renderer (:func:`_render_dark`'s switches) found the dark canvas, not its panels, rims or lights,
    was what cost accuracy."""
    return _far_from_palette(rng, 12, 72)


def _supersampled(scene: Scene, rng: random.Random, scales: tuple[float, float], factor: int,
                  background: Callable[[random.Random], tuple[int, int, int]]):
    """A canvas for an anti-aliased renderer: the scene drawn at ``factor`` times a scale drawn from
    ``scales`` (the scale first, then the background, from ``rng``: the committed held-out splits
    depend on that order). Returns (image, draw, supersampled scale, output scale)."""
    scale = rng.uniform(*scales)
    ss = factor * scale
    img = Image.new("RGB", (max(1, round(scene.width * ss)), max(1, round(scene.height * ss))), background(rng))
    return img, ImageDraw.Draw(img), ss, scale


def _downsampled(img: Image.Image, scene: Scene, scale: float) -> Image.Image:
    return img.resize((max(1, round(scene.width * scale)), max(1, round(scene.height * scale))),
                      Image.Resampling.LANCZOS)


def _render_varied(scene: Scene, rng: random.Random, color_jitter: int) -> Image.Image:
    """The ``varied`` training renderer: a background of any brightness, panels in a random grey
    scheme (card, header and bars each drawn light or dark), shapes with or without a rim of a
    random grey, the canvas drawn at 0.7-1.4x the scene's size (anti-aliased)."""
    img, draw, ss, scale = _supersampled(scene, rng, (0.7, 1.4), 3, _far_from_palette)
    card, header = _far_from_palette(rng), _far_from_palette(rng)
    for ex in scene.extras:
        if ex["kind"] == "rect":
            if ex.get("outline") is not None:
                fill, outline = card, _far_from_palette(rng)
            elif tuple(ex["fill"]) == (70, 70, 80):
                fill, outline = header, None
            else:
                fill, outline = _far_from_palette(rng), None
            draw.rectangle([v * ss for v in ex["box"]], fill=fill, outline=outline,
                           width=max(1, round(ex.get("line", 1) * ss)))
    rim = _far_from_palette(rng) if rng.random() < 0.5 else None
    rim_w = max(1, round(rng.uniform(0.5, 2.5) * ss))
    for o in scene.objects:
        fill = _jitter(COLORS[o.color], rng, color_jitter)
        _draw_shape(draw, o.shape, o.cx * ss, o.cy * ss, o.size * ss, fill, outline=rim, width=rim_w)
    return _downsampled(img, scene, scale)


def _render_dark(scene: Scene, rng: random.Random, color_jitter: int = 0, *, ring: bool = True, rim: bool = True,
                 invert: bool = True, rescale: bool = True, dark_bg: bool = True) -> Image.Image:
    """The ``dark`` held-out renderer (see :data:`HELDOUT_STYLES`): drawn at 4x the target scale,
    then downsampled (anti-aliased) to the scene's size times 0.6-1.6.

    The switches, all on for the held-out style, turn one feature off each, for an ablation that
    measures what each feature costs a model: the ring-shaped status light, the light rim, the inverted
    panels, the rescaled canvas, the dark background (off: the scene's own). Every switch draws the
    same random numbers, so an ablated drawing differs from the held-out one in that feature only."""
    img, draw, ss, scale = _supersampled(scene, rng, (0.6, 1.6), 4, lambda r: r.choice(DARK_BACKGROUNDS))
    if not (rescale and dark_bg):
        ss, scale = (ss, scale) if rescale else (4.0, 1.0)
        img = Image.new("RGB", (max(1, round(scene.width * ss)), max(1, round(scene.height * ss))),
                        img.getpixel((0, 0)) if dark_bg else scene.background)
        draw = ImageDraw.Draw(img)
    for ex in scene.extras:
        if ex["kind"] == "rect":
            # the panel inverted: dark card, light header and bars
            fill = tuple(255 - c for c in ex["fill"]) if invert else tuple(ex["fill"])
            outline = (200, 200, 210) if ex.get("outline") is not None else None
            draw.rectangle([v * ss for v in ex["box"]], fill=fill, outline=outline, width=max(1, round(ex.get("line", 1) * ss)))
    for o in scene.objects:
        fill = _jitter(COLORS[o.color], rng, color_jitter)
        cx, cy, size = o.cx * ss, o.cy * ss, o.size * ss
        if o.role == "light" and ring:  # a ring around a dot, not a filled disc
            _draw_shape(draw, "circle", cx, cy, size, None, outline=fill, width=max(1, round(size * 0.14)))
            _draw_shape(draw, "circle", cx, cy, size * 0.45, fill)
        else:
            _draw_shape(draw, o.shape, cx, cy, size, fill, outline=(235, 235, 235) if rim else None,
                        width=max(1, round(ss)))
    return _downsampled(img, scene, scale)


def nearest_color(rgb: Sequence[int]) -> str:
    """Name of the palette colour closest to ``rgb`` (used to check drawings)."""
    return min(COLORS, key=lambda c: sum((a - b) ** 2 for a, b in zip(COLORS[c], rgb)))


# ----------------------------------------------------------------------------- layouts


def _canvas(rng: random.Random, easy: bool, easy_size: int) -> tuple[int, int, int, int]:
    """(width, height, cols, rows)."""
    if easy:
        return easy_size, easy_size, 2, 2
    aspect = math.exp(rng.uniform(math.log(1 / 2.5), math.log(2.5)))
    long_side = rng.randint(128, 448)
    if aspect >= 1:
        w, h = long_side, max(96, int(round(long_side / aspect)))
    else:
        w, h = max(96, int(round(long_side * aspect))), long_side
    base = rng.choice((2, 2, 3)) if max(w / h, h / w) < 1.6 else 2
    if w >= h:
        rows, cols = base, min(4, max(base, int(round(base * w / h))))
    else:
        cols, rows = base, min(4, max(base, int(round(base * h / w))))
    return w, h, cols, rows


def _place(
    rng: random.Random,
    n: int,
    w: int,
    h: int,
    cols: int,
    rows: int,
    easy: bool,
    cells: Sequence[tuple[int, int]] | None = None,
) -> list[tuple[float, float, float, int]]:
    """n object boxes in distinct cells: (cx, cy, size, col)."""
    all_cells = list(cells) if cells is not None else [(c, r) for r in range(rows) for c in range(cols)]
    chosen = rng.sample(all_cells, n)
    cw, ch = w / cols, h / rows
    out = []
    for c, r in chosen:
        if easy:
            size = 0.7 * min(cw, ch)
            cx, cy = (c + 0.5) * cw, (r + 0.5) * ch
        else:
            size = rng.uniform(0.55, 0.9) * min(cw, ch)
            cx = c * cw + size / 2 + rng.uniform(0, cw - size)
            cy = r * ch + size / 2 + rng.uniform(0, ch - size)
        out.append((cx, cy, size, c))
    return out


def _gate_panel(rng: random.Random, scene: Scene, box: tuple[float, float, float, float], light_color: str,
                logo_color: str | None, easy: bool) -> None:
    """Draw a status panel into ``box`` (x0, y0, x1, y1): header, grey field bars, status light."""
    x0, y0, x1, y1 = box
    pw, ph = x1 - x0, y1 - y0
    card = (255, 255, 255) if scene.background != (250, 250, 250) else (232, 232, 232)
    scene.extras.append({"kind": "rect", "box": [x0, y0, x1, y1], "fill": card, "outline": (90, 90, 90), "line": 2})
    header_h = ph * 0.18
    scene.extras.append({"kind": "rect", "box": [x0, y0, x1, y0 + header_h], "fill": (70, 70, 80)})
    # field bars (a label and a value each), left part of the panel
    n_rows = 3 if easy else rng.randint(2, 4)
    body_top, body_bot = y0 + header_h + ph * 0.08, y1 - ph * 0.08
    row_h = (body_bot - body_top) / n_rows
    for i in range(n_rows):
        yc = body_top + (i + 0.5) * row_h
        bar_h = max(2.0, row_h * 0.3)
        lw = pw * (0.18 if easy else rng.uniform(0.12, 0.22))
        vw = pw * (0.25 if easy else rng.uniform(0.12, 0.3))
        g = GREYS[0] if easy else rng.choice(GREYS)
        scene.extras.append({"kind": "rect", "box": [x0 + pw * 0.06, yc - bar_h / 2, x0 + pw * 0.06 + lw, yc + bar_h / 2], "fill": g})
        scene.extras.append({"kind": "rect", "box": [x0 + pw * 0.30, yc - bar_h / 2, x0 + pw * 0.30 + vw, yc + bar_h / 2], "fill": g})
    # the status light: a circle on the right of the panel body
    size = min(pw * 0.3, (body_bot - body_top) * 0.6) * (1.0 if easy else rng.uniform(0.75, 1.0))
    cx = x0 + pw * 0.78 + (0 if easy else rng.uniform(-0.04, 0.04) * pw)
    cy = (body_top + body_bot) / 2 + (0 if easy else rng.uniform(-0.15, 0.15) * (body_bot - body_top))
    scene.objects.append(Obj(light_color, "circle", cx, cy, size, role="light"))
    if logo_color is not None:  # a coloured square logo in the header, left side
        ls = header_h * 0.8
        scene.objects.append(Obj(logo_color, "square", x0 + pw * 0.04 + ls / 2, y0 + header_h / 2, ls / 0.9 * 0.98, role="logo"))


def make_item(rng: random.Random, qtype: str, level: float = 1.0, easy_size: int = 112
              ) -> tuple[Scene, str, str]:
    """One scene with a question of type ``qtype`` and its answer.

    ``level`` in [0, 1]: the chance that the varied layout is used (else the easy one)."""
    easy = rng.random() >= level
    w, h, cols, rows = _canvas(rng, easy, easy_size)
    scene = Scene(w, h, BACKGROUNDS[0] if easy else rng.choice(BACKGROUNDS))
    colors, shapes = list(COLORS), list(SHAPES)

    if qtype in ("color", "shape"):
        (cx, cy, s, _), = _place(rng, 1, w, h, cols, rows, easy)
        o = Obj(rng.choice(colors), rng.choice(shapes), cx, cy, s)
        scene.objects.append(o)
        return scene, (Q_COLOR if qtype == "color" else Q_SHAPE), (o.color if qtype == "color" else o.shape)

    if qtype == "count":
        n = rng.randint(1, 4)
        for cx, cy, s, _ in _place(rng, n, w, h, cols, rows, easy):
            scene.objects.append(Obj(rng.choice(colors), rng.choice(shapes), cx, cy, s))
        return scene, Q_COUNT, NUMBERS[n - 1]

    if qtype in ("color_of_shape", "shape_of_color", "left_of"):
        n = rng.choice((2, 3))
        while True:
            boxes = _place(rng, n, w, h, cols, rows, easy)
            if qtype != "left_of" or len({b[3] for b in boxes}) >= 2:
                break
        cs, ss = rng.sample(colors, n), rng.sample(shapes, n)
        objs = [Obj(c, s, cx, cy, sz) for c, s, (cx, cy, sz, _) in zip(cs, ss, boxes)]
        scene.objects.extend(objs)
        if qtype == "color_of_shape":
            o = rng.choice(objs)
            return scene, Q_COLOR_OF_SHAPE.format(shape=o.shape), o.color
        if qtype == "shape_of_color":
            o = rng.choice(objs)
            return scene, Q_SHAPE_OF_COLOR.format(color=o.color), o.shape
        # left_of: a pair in different columns; balanced yes / no
        cols_of = [b[3] for b in boxes]
        pairs = [(i, j) for i in range(n) for j in range(n) if i != j and cols_of[i] != cols_of[j]]
        want_yes = rng.random() < 0.5
        pairs = [(i, j) for i, j in pairs if (objs[i].cx < objs[j].cx) == want_yes]
        i, j = rng.choice(pairs)
        return scene, Q_LEFT_OF.format(a=objs[i].color, b=objs[j].color), "yes" if want_yes else "no"

    if qtype == "describe":  # 1-3 objects in distinct columns, named left to right
        n = rng.randint(1, min(3, cols))
        col_choice = rng.sample(range(cols), n)
        cells = [(c, rng.randrange(rows)) for c in col_choice]
        boxes = _place(rng, n, w, h, cols, rows, easy, cells=cells)
        objs = [Obj(rng.choice(colors), rng.choice(shapes), cx, cy, sz) for cx, cy, sz, _ in boxes]
        scene.objects.extend(objs)
        return scene, Q_DESCRIBE, describe_answer(objs)

    if qtype in ("gate_plain", "gate_logo", "gate_scene"):
        light = rng.choice(colors)
        asked = light if rng.random() < 0.5 else rng.choice([c for c in colors if c != light])
        logo = rng.choice([c for c in colors if c != light]) if qtype == "gate_logo" else None
        if qtype == "gate_scene":
            # the panel takes one end of the long axis; other coloured squares / triangles beside it
            frac = 0.62 if easy else rng.uniform(0.5, 0.65)
            first = rng.random() < 0.5
            m = 0.04 * min(w, h)
            if w >= h:
                px0, px1 = (m, w * frac - m) if first else (w * (1 - frac) + m, w - m)
                _gate_panel(rng, scene, (px0, m, px1, h - m), light, None, easy)
                side = (w * frac, 0.0, float(w), float(h)) if first else (0.0, 0.0, w * (1 - frac), float(h))
            else:
                py0, py1 = (m, h * frac - m) if first else (h * (1 - frac) + m, h - m)
                _gate_panel(rng, scene, (m, py0, w - m, py1), light, None, easy)
                side = (0.0, h * frac, float(w), float(h)) if first else (0.0, 0.0, float(w), h * (1 - frac))
            sw, sh = side[2] - side[0], side[3] - side[1]
            scols, srows = (1, 2) if sh >= 1.6 * sw else (2, 1) if sw >= 1.6 * sh else (1, 1)
            k = rng.randint(1, scols * srows)
            for cx, cy, s, _ in _place(rng, k, int(sw), int(sh), scols, srows, easy):
                scene.objects.append(Obj(rng.choice(colors), rng.choice(("square", "triangle")),
                                         side[0] + cx, side[1] + cy, s * 0.8, role="distractor"))
        else:
            m = (0.06 if easy else rng.uniform(0.03, 0.12)) * min(w, h)
            _gate_panel(rng, scene, (m, m, w - m, h - m), light, logo, easy)
        return scene, Q_GATE.format(color=asked), "refund" if asked == light else "escalate"

    raise ValueError(f"unknown question type {qtype!r}")


def to_palette_png(img: Image.Image, path: Path | None = None) -> bytes:
    """Encode a flat-colour RGB image as a small, exact palette PNG (deterministic bytes)."""
    colors = img.getcolors(256)
    if colors is None:
        raise ValueError("image has more than 256 colours; cannot store it exactly as a palette PNG")
    import io

    import numpy as np

    palette = sorted(c for _, c in colors)
    arr = np.asarray(img.convert("RGB"), dtype=np.int64)
    keys = (arr[..., 0] << 16) | (arr[..., 1] << 8) | arr[..., 2]
    pal_keys = np.array([(r << 16) | (g << 8) | b for r, g, b in palette], dtype=np.int64)
    idx = np.searchsorted(pal_keys, keys).astype(np.uint8)
    pal_img = Image.new("P", img.size)
    pal_img.frombytes(np.ascontiguousarray(idx).tobytes())
    pal_img.putpalette([v for c in palette for v in c])

    buf = io.BytesIO()
    pal_img.save(buf, format="PNG", optimize=True)
    data = buf.getvalue()
    if path is not None:
        path.write_bytes(data)
    return data


# ----------------------------------------------------------------------------- the set


@dataclass(frozen=True)
class VQAItem:
    id: str
    image: str  # path of the image file (absolute once loaded)
    question: str
    answer: str
    category: str
    type: str

    def load_image(self) -> Image.Image:
        with Image.open(self.image) as im:
            return im.convert("RGB")


def item_seed(seed: int, qtype: str, index: int) -> int:
    """A per-item seed, stable across Python versions (no ``hash()``)."""
    return seed * 1_000_003 + TYPES.index(qtype) * 10_007 + index


def generate_items(seed: int, per_type: int, level: float = 1.0, style: str = "flat"):
    """Yield (id, qtype, scene, image, question, answer) for the evaluation set."""
    for qtype in TYPES:
        for i in range(per_type):
            rng = random.Random(item_seed(seed, qtype, i))
            scene, q, a = make_item(rng, qtype, level=level)
            img = render(scene, rng, color_jitter=0) if style == "flat" else render_styled(scene, rng, style)
            yield f"{qtype}-{i:03d}", qtype, scene, img, q, a


def write_set(out: Path, seed: int, per_type: int, style: str = "flat") -> list[dict]:
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for iid, qtype, scene, img, q, a in generate_items(seed, per_type, style=style):
        rel = f"images/{iid}.png"
        if style == "flat":
            to_palette_png(img, out / rel)
        else:  # anti-aliased styles have more than 256 colours: a plain (still lossless) PNG
            img.save(out / rel, format="PNG", optimize=True)
        rows.append({"id": iid, "image": rel, "question": q, "answer": a,
                     "category": CATEGORY_OF[qtype], "type": qtype, "scene": scene.to_json()})
    with open(out / "items.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    meta = {"seed": seed, "per_type": per_type, "n": len(rows), "types": list(TYPES),
            "generator": "python -m mmkv.vqa_eval.dataset --out samples/vqa%s --seed %d --per-type %d"
            % ("" if style == "flat" else "/" + out.name, seed, per_type) + (f" --style {style}" if style != "flat" else "")}
    if style != "flat":
        meta["style"] = style
    (out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return rows


def load_vqa_set(path: str | Path) -> list[VQAItem]:
    """Load items from a set directory (with ``items.jsonl`` or ``photos.jsonl``) or a JSONL file.

    Image paths are resolved against the JSONL file's folder."""
    p = Path(path)
    if p.is_dir():
        p = p / "items.jsonl" if (p / "items.jsonl").exists() else p / "photos.jsonl"
    items = []
    with open(p) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            img = Path(r["image"])
            if not img.is_absolute():
                img = (p.parent / img).resolve()
            items.append(VQAItem(id=r["id"], image=str(img), question=r["question"], answer=r["answer"],
                                 category=r["category"], type=r["type"]))
    return items


# ----------------------------------------------------------------------------- real photos

#: Hand-written questions for scikit-image's bundled photographs (public domain / CC0).
PHOTO_QUESTIONS: dict[str, list[tuple[str, str]]] = {
    "astronaut": [("what color is the suit ?", "orange"),
                  ("is there a flag in the picture ? answer yes or no .", "yes")],
    "coffee": [("what drink is in the cup ?", "coffee"),
               ("what color is the cup ?", "red")],
    "chelsea": [("what animal is this ?", "cat"),
                ("what color are the animal's eyes ?", "green")],
    "rocket": [("what stands on the launch pad ?", "rocket"),
               ("is it day or night ?", "night")],
}
PHOTO_LICENCES = {
    "astronaut": "NASA, public domain (scikit-image data: astronaut.png)",
    "coffee": "CC0, Rachel Michetti (scikit-image data: coffee.png)",
    "chelsea": "CC0, Stefan van der Walt (scikit-image data: chelsea.png)",
    "rocket": "SpaceX, public domain (scikit-image data: rocket.jpg)",
}


def write_photos(out: Path, skimage_data: Path, max_side: int = 448) -> list[dict]:
    """Copy a few of scikit-image's bundled photographs (downsized JPEG) with questions."""
    out = Path(out) / "photos"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, qas in PHOTO_QUESTIONS.items():
        src = next(iter(sorted(Path(skimage_data).glob(name + ".*"))))
        with Image.open(src) as im:
            im = im.convert("RGB")
            im.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
            im.save(out / f"{name}.jpg", format="JPEG", quality=85, optimize=True)
        for k, (q, a) in enumerate(qas):
            rows.append({"id": f"photo-{name}-{k}", "image": f"{name}.jpg", "question": q, "answer": a,
                         "category": "photo", "type": "photo", "licence": PHOTO_LICENCES[name]})
    with open(out / "photos.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    return rows


def main(argv: Iterable[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="samples/vqa")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--per-type", type=int, default=40)
    ap.add_argument("--style", default="flat", choices=STYLES,
                    help=f"drawing style ({', '.join(HELDOUT_STYLES)} are kept out of training)")
    ap.add_argument("--photos-from", default=None,
                    help="scikit-image's data folder (skimage/data) to copy a few photographs from")
    args = ap.parse_args(list(argv) if argv is not None else None)
    out = Path(args.out)
    if (out / "images").exists():
        shutil.rmtree(out / "images")
    rows = write_set(out, args.seed, args.per_type, style=args.style)
    print(f"wrote {len(rows)} items to {out}")
    if args.photos_from:
        prow = write_photos(out, Path(args.photos_from))
        print(f"wrote {len(prow)} photo questions to {out / 'photos'}")


if __name__ == "__main__":
    main()
