"""The synthetic VQA set: deterministic, answers consistent with the drawing, loader round-trip."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmkv.vqa_eval import dataset as D

ROOT = Path(__file__).resolve().parents[1]
SET = ROOT / "samples" / "vqa"

TEMPLATES = [
    (r"what color is the shape \?", "color"),
    (r"what shape is it \?", "shape"),
    (r"how many shapes are there \?", "count"),
    (r"what color is the (circle|square|triangle) \?", "color_of_shape"),
    (r"what shape is (red|green|blue|yellow) \?", "shape_of_color"),
    (r"is the (red|green|blue|yellow) shape left of the (red|green|blue|yellow) shape \?", "left_of"),
    (r"policy : refund only if the status light is (red|green|blue|yellow) \. otherwise escalate \. "
     r"the customer asks for a refund \. answer refund or escalate \.", "gate"),
]


def solve(question: str, qtype: str, objects: list[dict]) -> str:
    """Re-derive the answer from the scene description, independently of the generator."""
    main = [o for o in objects if o["role"] == "object"]
    if qtype == "color":
        (o,) = main
        return o["color"]
    if qtype == "shape":
        (o,) = main
        return o["shape"]
    if qtype == "count":
        return ["one", "two", "three", "four"][len(main) - 1]
    if qtype == "color_of_shape":
        shape = re.match(TEMPLATES[3][0], question).group(1)
        (o,) = [o for o in main if o["shape"] == shape]
        return o["color"]
    if qtype == "shape_of_color":
        color = re.match(TEMPLATES[4][0], question).group(1)
        (o,) = [o for o in main if o["color"] == color]
        return o["shape"]
    if qtype == "left_of":
        a, b = re.match(TEMPLATES[5][0], question).groups()
        (oa,) = [o for o in main if o["color"] == a]
        (ob,) = [o for o in main if o["color"] == b]
        return "yes" if oa["cx"] < ob["cx"] else "no"
    if qtype.startswith("gate_"):
        color = re.match(TEMPLATES[6][0], question).group(1)
        (light,) = [o for o in objects if o["role"] == "light"]
        return "refund" if light["color"] == color else "escalate"
    raise AssertionError(qtype)


def test_same_seed_same_bytes():
    for qtype in D.TYPES:
        blobs = []
        for _ in range(2):
            rng = random.Random(D.item_seed(99, qtype, 3))
            scene, q, a = D.make_item(rng, qtype)
            blobs.append((D.to_palette_png(D.render(scene, rng)), q, a))
        assert blobs[0] == blobs[1]
    # a different seed gives a different set
    a = [D.to_palette_png(img) for *_, img, _q, _a in D.generate_items(5, 2)]
    b = [D.to_palette_png(img) for *_, img, _q, _a in D.generate_items(6, 2)]
    assert a != b


def test_write_set_twice_is_identical(tmp_path):
    D.write_set(tmp_path / "a", seed=77, per_type=3)
    D.write_set(tmp_path / "b", seed=77, per_type=3)
    fa = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    fb = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert fa == fb and len(fa) == 9 * 3 + 2
    for rel in fa:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def _committed_rows():
    with open(SET / "items.jsonl") as f:
        return [json.loads(line) for line in f]


def test_committed_set_shape_and_schema():
    rows = _committed_rows()
    assert len(rows) >= 360
    by_cat: dict[str, int] = {}
    for r in rows:
        assert {"id", "image", "question", "answer", "category", "type"} <= set(r)
        assert r["category"] == D.CATEGORY_OF[r["type"]]
        assert r["answer"] in D.ANSWERS[r["type"]]
        by_cat[r["category"]] = by_cat.get(r["category"], 0) + 1
        kind = "gate" if r["type"].startswith("gate_") else r["type"]
        assert any(re.fullmatch(p, r["question"]) and k == kind for p, k in TEMPLATES), r["question"]
    assert set(by_cat) == {"perception", "reasoning", "agentic"}
    assert min(by_cat.values()) >= 120
    assert len({r["id"] for r in rows}) == len(rows)
    sizes = [Image.open(SET / r["image"]).size for r in rows]
    sides = [s for wh in sizes for s in wh]
    assert min(sides) >= 90 and max(sides) <= 460
    aspects = [w / h for w, h in sizes]
    assert min(aspects) < 0.6 and max(aspects) > 1.6  # tall and wide images both occur


def test_committed_set_regenerates_exactly():
    meta = json.loads((SET / "meta.json").read_text())
    rows = _committed_rows()
    regenerated = list(D.generate_items(meta["seed"], meta["per_type"]))
    assert len(regenerated) == len(rows)
    for r, (iid, qtype, scene, img, q, a) in zip(rows, regenerated):
        assert (r["id"], r["type"], r["question"], r["answer"]) == (iid, qtype, q, a)
        stored = np.asarray(Image.open(SET / r["image"]).convert("RGB"))
        assert np.array_equal(stored, np.asarray(img)), iid


def test_answers_consistent_with_drawing():
    for r in _committed_rows():
        scene = r["scene"]
        assert solve(r["question"], r["type"], scene["objects"]) == r["answer"], r["id"]
        img = Image.open(SET / r["image"]).convert("RGB")
        assert img.size == (scene["width"], scene["height"])
        for o in scene["objects"]:
            x, y = D.Obj(**o).probe()
            assert D.nearest_color(img.getpixel((x, y))) == o["color"], (r["id"], o)
            assert img.getpixel((x, y)) == D.COLORS[o["color"]]


def test_reasoning_objects_distinct_and_left_of_unambiguous():
    for r in _committed_rows():
        objs = [o for o in r["scene"]["objects"] if o["role"] == "object"]
        if r["category"] == "reasoning":
            assert 2 <= len(objs) <= 3
            assert len({o["color"] for o in objs}) == len(objs)
            assert len({o["shape"] for o in objs}) == len(objs)
        if r["type"] == "count":
            assert 1 <= len(objs) <= 4
        if r["type"].startswith("gate_"):
            assert sum(o["shape"] == "circle" for o in r["scene"]["objects"]) == 1  # the light only


def test_answer_balance():
    rows = _committed_rows()
    for t in ("left_of", "gate_plain", "gate_logo", "gate_scene"):
        ans = [r["answer"] for r in rows if r["type"] == t]
        for a in set(ans):
            assert 0.25 <= ans.count(a) / len(ans) <= 0.75, (t, a)


def test_loader_round_trip(tmp_path):
    rows = D.write_set(tmp_path, seed=3, per_type=2)
    items = D.load_vqa_set(tmp_path)
    assert [i.id for i in items] == [r["id"] for r in rows]
    for it, r in zip(items, rows):
        assert isinstance(it, D.VQAItem)
        assert Path(it.image).is_absolute() and Path(it.image).exists()
        assert (it.question, it.answer, it.category, it.type) == (r["question"], r["answer"], r["category"], r["type"])
        assert it.load_image().size == (r["scene"]["width"], r["scene"]["height"])
    with pytest.raises(Exception):
        items[0].answer = "x"  # frozen
    assert D.load_vqa_set(tmp_path / "items.jsonl") == items


def test_committed_set_loads():
    items = D.load_vqa_set(SET)
    assert len(items) >= 360 and all(Path(i.image).exists() for i in items)


def test_photos():
    p = SET / "photos" / "photos.jsonl"
    if not p.exists():
        pytest.skip("no photographs committed")
    items = D.load_vqa_set(p)
    assert len(items) >= 4
    for it in items:
        assert Path(it.image).exists() and it.question and it.answer


def test_set_is_small():
    total = sum(p.stat().st_size for p in SET.rglob("*") if p.is_file())
    assert total < 5 * 1024 * 1024
