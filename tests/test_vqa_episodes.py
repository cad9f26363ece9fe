"""The conversation tasks (vqa_eval/episodes.py), the drawing styles, and the committed splits:
every answer re-derived independently of the generator, the splits regenerate byte for byte."""

from __future__ import annotations

import functools

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmkv.vqa_eval import dataset as D
from mmkv.vqa_eval import episodes as E

ROOT = Path(__file__).resolve().parents[1]
EPISODES = ROOT / "samples" / "vqa" / "episodes"
HELDOUT = ROOT / "samples" / "vqa" / "heldout_style"
HELDOUT_DARK = ROOT / "samples" / "vqa" / "heldout_dark"

POLICY = re.compile(r"refund only if (?:the )?([a-z_ ]+?) is ([a-z]+) \. otherwise")
FIELD_IMAGE = re.compile(r"status light is ([a-z]+) and the ([a-z ]+?) is ([a-z]+) \.")
FIELD_LINE = re.compile(r'^\{?"?([a-z_]+)"?\s*[:=]\s*"?([a-z]+)"?\}?$')
ERRATUM = re.compile(r"^\[STATE UPDATE\] ([a-z_]+) has just changed to ([a-z]+); this overrides")


def _texts(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], p["text"]) for m in messages for p in m["content"] if p["type"] == "text"]


def _gate_answer(messages: list[dict]) -> str:
    """Refund iff the current value (the last field line or erratum of that field) is the policy's.

    Independent of the generator: parses the rendered texts only."""
    texts = [t for role, t in _texts(messages) if role != "assistant"]
    joined = "\n".join(texts)
    m = FIELD_IMAGE.search(texts[-1])
    if m:
        phrase, required = m.group(2), m.group(3)
    else:
        phrase, required = POLICY.search(joined).groups()
    current = _current_value(joined, phrase.replace(" ", "_"))
    assert current is not None, joined
    return "refund" if current == required else "escalate"


def _current_value(joined: str, field: str) -> str | None:
    """The field's value after the last field line or erratum that names it."""
    current = None
    for line in joined.splitlines():
        for pat in (FIELD_LINE, ERRATUM):
            hit = pat.match(line.strip())
            if hit and hit.group(1) == field:
                current = hit.group(2)
    return current


def _lookup_answer(messages: list[dict]) -> str:
    """The retrieval types: the asked field's current value, or the value its policy needs."""
    texts = [t for role, t in _texts(messages) if role != "assistant"]
    joined = "\n".join(texts)
    asked = re.search(r"(?:what is the|which) ([a-z ]+?) (?:now|does the policy need) \?", texts[-1])
    field = asked.group(1).replace(" ", "_")
    if "policy need" in texts[-1]:
        phrase, required = POLICY.search(joined).groups()
        assert phrase.replace(" ", "_") == field
        return required
    return _current_value(joined, field)


def _solve(qtype: str, messages: list[dict], scenes: list[dict]) -> str:
    objs = [[o for o in s["objects"] if o["role"] == "object"] for s in scenes]
    if qtype == "describe":
        return " , ".join(f"{o['color']} {o['shape']}" for o in sorted(objs[-1], key=lambda o: o["cx"]))
    if qtype == "same_color":
        return "yes" if objs[-2][0]["color"] == objs[-1][0]["color"] else "no"
    if qtype == "more_shapes":
        return "this" if len(objs[-1]) > len(objs[-2]) else "previous"
    answer = _gate_answer(messages)
    if qtype == "field_image_gate":
        asked = FIELD_IMAGE.search([t for role, t in _texts(messages) if role != "assistant"][-1]).group(1)
        (light,) = [o for o in scenes[-1]["objects"] if o["role"] == "light"]
        return answer if light["color"] == asked else "escalate"
    return answer


@pytest.mark.parametrize("qtype", E.ALL_TYPES)
def test_every_answer_of_every_type_rederives(qtype):
    for i in range(40):
        ep = E.build(random.Random(f"t-{qtype}-{i}"), qtype)
        assert ep.type == qtype and ep.messages[-1]["role"] == "assistant"
        assert len(ep.answers) == sum(m["role"] == "assistant" for m in ep.messages)
        assert len(ep.images) == sum(p["type"] == "image" for m in ep.messages for p in m["content"])
        if qtype in E.SPLIT_TYPES:
            assert _solve(qtype, ep.prompt_messages(), [s.to_json() for s in ep.scenes]) == ep.answer
        if qtype in E.LOOKUP_TYPES:  # every retrieval answer, the earlier ones (after each erratum) too
            asked = [k for k, m in enumerate(ep.messages) if m["role"] == "assistant"][-len(ep.answers):]
            for k in asked:
                if "policy need" in ep.messages[k - 1]["content"][-1]["text"] or "now ?" in ep.messages[k - 1]["content"][-1]["text"]:
                    assert _lookup_answer(ep.messages[:k]) == ep.messages[k]["content"][0]["text"]
        # every earlier answer is right too (they are supervised in training)
        if qtype == "erratum_gate":
            for k, msg in enumerate(ep.messages):
                if msg["role"] == "assistant" and msg["content"][0]["text"] in ("refund", "escalate"):
                    prev = ep.messages[k - 1]["content"]
                    if any(p["type"] == "image" for p in prev):
                        continue  # an image gate filler turn (its own policy)
                    assert _gate_answer(ep.messages[:k]) == msg["content"][0]["text"]


def test_every_drill_answer_rederives_and_the_verdicts_are_no_majority_answer():
    """episodes.drill (training only): each of its 4-8 answers is what the rendered context says (the
    field's latest line or erratum, the policy's value, the verdict), re-derived by the parsers above."""
    kinds, verdicts = {"value": 0, "policy": 0, "verdict": 0}, []
    for i in range(80):
        ep = E.drill(random.Random(f"d-{i}"))
        assert ep.type == "drill" and not ep.images and E.DRILL_TURNS[0] <= len(ep.answers) <= E.DRILL_TURNS[1]
        for k, msg in enumerate(ep.messages):
            if msg["role"] != "assistant":
                continue
            q, a = ep.messages[k - 1]["content"][-1]["text"], msg["content"][0]["text"]
            if "answer refund or escalate" in q:
                kinds["verdict"] += 1
                verdicts.append(a)
                assert _gate_answer(ep.messages[:k]) == a
            else:
                kinds["policy" if "policy need" in q else "value"] += 1
                assert _lookup_answer(ep.messages[:k]) == a
        assert ep.answer == ep.answers[-1] and ep.gate["value"] == _current_value(
            "\n".join(t for role, t in _texts(ep.messages) if role != "assistant"), ep.gate["field"])
    assert min(kinds.values()) > 30 and 0.35 < verdicts.count("refund") / len(verdicts) < 0.65
    assert E.drill(random.Random(1), n_questions=5).answers == E.drill(random.Random(1), n_questions=5).answers


def _train_module():
    """samples/train.py as a module (it is a script, not a package member)."""
    from conftest import sample_module

    return sample_module("train")


def test_lookup_types_keep_the_committed_seeds_and_stay_out_of_the_split():
    """The retrieval types come after every earlier type in ALL_TYPES (episode_seed indexes it), and
    the committed split does not ask them; errata change the looked-up value."""
    assert E.ALL_TYPES[-len(E.LOOKUP_TYPES):] == E.LOOKUP_TYPES
    assert not set(E.LOOKUP_TYPES) & set(E.SPLIT_TYPES)
    changed = 0
    for i in range(200):
        ep = E.build(random.Random(f"lk-{i}"), "field_value")
        assert ep.answer == ep.gate["value"]
        values = [a for a in ep.answers if a in E.FIELDS[ep.gate["field"]]]
        changed += len(set(values)) > 1
    assert changed > 50


def test_answers_are_balanced_and_errata_change_the_answer():
    n = 400
    for qtype, yes in (("same_color", "yes"), ("more_shapes", "this"), ("field_gate", "refund"),
                       ("erratum_gate", "refund"), ("field_image_gate", "refund")):
        share = sum(E.build(random.Random(f"b-{qtype}-{i}"), qtype).answer == yes for i in range(n)) / n
        assert 0.4 <= share <= 0.6, (qtype, share)
    # the latest erratum decides: with the errata dropped, the answer changes in a good share of episodes
    flips = 0
    for i in range(200):
        ep = E.build(random.Random(f"f-{i}"), "erratum_gate")
        stripped = [{"role": m["role"], "content": [p for p in m["content"] if not (
            p["type"] == "text" and p["text"].startswith("[STATE UPDATE]"))]} for m in ep.messages]
        for m in stripped:
            for p in m["content"]:
                if p["type"] == "text":
                    p["text"] = "\n".join(x for x in p["text"].splitlines() if not x.startswith("[STATE UPDATE]"))
        flips += _gate_answer(stripped[:-1]) != ep.answer
    assert flips >= 60


def test_describe_names_objects_left_to_right_in_distinct_columns():
    for i in range(60):
        scene, q, a = D.make_item(random.Random(f"d-{i}"), "describe")
        assert q == D.Q_DESCRIBE
        xs = sorted(o.cx for o in scene.objects)
        assert all(b - a_ > 1 for a_, b in zip(xs, xs[1:]))
        assert len(a.split(" , ")) == len(scene.objects) <= 3


@pytest.mark.parametrize("style", [s for s in D.STYLES if s != "hollow"])
def test_styles_draw_the_same_objects(style):
    """The centre of every filled object keeps its colour in every filled style (hollow: its rim;
    dark, varied: the canvas rescaled, so the probe is too)."""
    bad = 0
    for i in range(30):
        rng = random.Random(f"s-{style}-{i}")
        scene, _, _ = D.make_item(rng, rng.choice(D.TYPES))
        img = np.asarray(D.render_styled(scene, rng, style)).astype(int)
        scale = img.shape[1] / scene.width
        assert abs(img.shape[0] / scene.height - scale) < 0.05 and (style in ("dark", "varied") or scale == 1)
        for o in scene.objects:
            x, y = o.probe()
            if o.size * scale < 12:
                continue
            bad += D.nearest_color(img[int(y * scale), int(x * scale)]) != o.color
    assert bad == 0


def test_dark_style_inverts_the_panel_and_rescales_the_canvas():
    """The second held-out renderer: a dark canvas, the panel's card dark and its header light,
    the status light a ring around a dot, and a canvas 0.6-1.6x the scene's."""
    scales = []
    for i in range(20):
        rng = random.Random(f"dark-{i}")
        scene, _, _ = D.make_item(rng, "gate_plain")
        img = np.asarray(D.render_styled(scene, rng, "dark")).astype(int)
        scale = img.shape[1] / scene.width
        scales.append(scale)
        assert img[1, 1].sum() < 200  # a dark canvas corner
        card = next(ex for ex in scene.extras if ex.get("outline") is not None)
        header = next(ex for ex in scene.extras if tuple(ex["fill"]) == (70, 70, 80))
        (x0, y0, x1, y1), (hx0, hy0, hx1, hy1) = card["box"], header["box"]
        assert img[int((hy0 + hy1) / 2 * scale), int((hx0 + hx1) / 2 * scale)].mean() > 150  # light header
        light = next(o for o in scene.objects if o.role == "light")
        r = light.size / 2 * scale
        between = img[int(light.cy * scale), int((light.cx * scale) + 0.58 * r)]  # between the dot (0.45 r) and the ring (0.72-1 r)
        assert D.nearest_color(img[int(light.cy * scale), int(light.cx * scale)]) == light.color
        assert between.mean() < 60, between  # the dark card shows between dot and ring
    assert min(scales) < 0.9 and max(scales) > 1.3


def test_hollow_style_outlines_in_the_object_colour():
    rng = random.Random(3)
    scene, _, _ = D.make_item(rng, "color")
    (o,) = scene.objects
    img = np.asarray(D.render_styled(scene, rng, "hollow")).astype(int)
    x, y = int(o.cx), int(o.cy)
    ring = [img[y, int(x + dx)] for dx in np.linspace(-o.size / 2, o.size / 2, 40) if 0 <= int(x + dx) < img.shape[1]]
    assert any(D.nearest_color(p) == o.color and min(abs(p - np.asarray(D.COLORS[o.color]))) < 40 for p in ring)


def test_training_never_draws_the_heldout_style():
    assert not set(D.HELDOUT_STYLES) & set(D.TRAIN_STYLES) and D.HELDOUT_STYLE in D.HELDOUT_STYLES
    train = _train_module()
    seen = []
    orig = D.render_styled
    try:
        D.render_styled = lambda scene, rng, style, **kw: (seen.append(style), orig(scene, rng, style, **kw))[1]
        draw = train.Style(p=1.0, jpeg=0.5).drawer()
        for i in range(60):
            rng = random.Random(i)
            scene, _, _ = D.make_item(rng, "color")
            draw(scene, rng)
    finally:
        D.render_styled = orig
    assert set(seen) == set(D.TRAIN_STYLES[1:])


def test_dark_canvas_redraws_the_background_dark_and_keeps_the_objects():
    """`train.py --dark-canvas 1`: every training drawing but `varied` (which picks its own) sits on a
    background of brightness <= 90 (12-72, tinted by up to 18), far from every palette colour, with the
    objects still drawn in their colours; `--dark-canvas 0` draws no extra random number."""
    train = _train_module()
    orig = D.render_styled
    try:
        for style in D.TRAIN_STYLES:
            if style == "varied":
                continue
            D.render_styled = lambda scene, rng, _s, _st=style, **kw: orig(scene, rng, _st, **kw)
            draw = train.Style(p=1.0, dark=1.0, color_jitter=0).drawer()
            for i in range(8):
                rng = random.Random(i)
                scene, _, _ = D.make_item(rng, "color")
                img = np.asarray(draw(scene, rng)).astype(int)
                corner = img[:3, :3].reshape(-1, 3).mean(0)
                assert corner.max() <= 90 + (30 if style == "noisy" else 0), (style, corner)
                o = scene.objects[0]
                if style != "hollow":  # (a hollow shape's centre is background)
                    assert D.nearest_color(img[int(o.cy), int(o.cx)]) == o.color, (style, o)
    finally:
        D.render_styled = orig
    for i in range(20):
        assert min(math.dist(D.dark_canvas(random.Random(i)), c) for c in D.COLORS.values()) > 110
    a, b = random.Random(3), random.Random(3)
    scene, _, _ = D.make_item(random.Random(0), "count")
    np.testing.assert_array_equal(np.asarray(train.Style(p=0.5).drawer()(scene, a)),
                                  np.asarray(train.Style(p=0.5, dark=0.0).drawer()(scene, b)))
    assert a.random() == b.random()


def test_committed_episode_split_regenerates(tmp_path):
    meta = json.loads((EPISODES / "meta.json").read_text())
    rows = E.write_split(tmp_path, meta["seed"], 2)
    committed = {json.loads(line)["id"]: json.loads(line) for line in (EPISODES / "episodes.jsonl").open()}
    assert len(committed) == meta["n"] == meta["per_type"] * len(E.SPLIT_TYPES)
    for r in rows:
        assert r == committed[r["id"]]
        for m in r["messages"]:
            for p in m["content"]:
                if p["type"] == "image":
                    assert (tmp_path / p["image"]).read_bytes() == (EPISODES / p["image"]).read_bytes()
    for r in committed.values():  # every committed answer re-derives from its own record
        assert _solve(r["type"], r["messages"], r["scenes"]) == r["answer"], r["id"]
    eps = E.load_split(EPISODES)
    assert len(eps) == len(committed) and all(len(ep.images) == len(committed[ep.id]["scenes"]) for ep in eps)
    cases = {}
    for ep in eps:  # text gates keep their record, and it decides the answer
        assert bool(ep.gate) == (ep.type in E.TEXT_TYPES), ep.id
        if ep.gate:
            ok = E.light_case(ep) == (True, True) if ep.type == "field_image_gate" else ep.gate["value"] == ep.gate["required"]
            assert ep.answer == ("refund" if ok else "escalate"), ep.id
        if (c := E.case_name(ep)) is not None:
            cases[c] = cases.get(c, 0) + 1
    assert sum(cases.values()) == meta["per_type"] and set(cases) == {"light+field", "light only", "field only", "neither"}


@pytest.mark.parametrize("split,style", [(HELDOUT, "shadow"), (HELDOUT_DARK, "dark")])
def test_committed_heldout_style_split_regenerates(tmp_path, split, style):
    meta = json.loads((split / "meta.json").read_text())
    assert meta["style"] == style and style in D.HELDOUT_STYLES
    rows = D.write_set(tmp_path, meta["seed"], 1, style=meta["style"])
    for r in rows:
        assert (tmp_path / r["image"]).read_bytes() == (split / r["image"]).read_bytes()
    items = D.load_vqa_set(split)
    assert len(items) == meta["n"]
    # its images differ from the flat renderer's for the same scenes
    rng = random.Random(D.item_seed(meta["seed"], "color", 0))
    scene, _, _ = D.make_item(rng, "color")
    flat = D.render(scene, rng)
    with Image.open(split / "images" / "color-000.png") as im:
        styled = np.asarray(im.convert("RGB").resize(flat.size)).astype(int)
    assert np.abs(np.asarray(flat).astype(int) - styled).mean() > 2


def test_text_gates_record_what_decides_them():
    """`Episode.gate` (what the training skew keys on) names the field, the needed and the current value
    (and, for `field_image_gate`, the light and the asked colour): together they decide the answer."""
    for qtype in E.TEXT_TYPES:
        for i in range(60):
            ep = E.build(random.Random(f"g-{qtype}-{i}"), qtype)
            g = ep.gate
            assert g["required"] in E.FIELDS[g["field"]] and g["value"] in E.FIELDS[g["field"]]
            if qtype != "field_image_gate":
                assert (ep.answer == "refund") == (g["value"] == g["required"])
            else:  # the light drawn in the asked turn's image, the colour its question names
                light = next(o.color for o in ep.scenes[-1].objects if o.role == "light")
                assert g["light"] == light and f"status light is {g['asked']} " in ep.messages[-2]["content"][-1]["text"]
                assert (ep.answer == "refund") == (g["value"] == g["required"] and g["asked"] == g["light"])
    assert not E.build(random.Random(0), "color").gate


SHIPPED = sorted(str(p.parent.relative_to(ROOT / "samples")) for p in (ROOT / "samples").glob("*/*/tokenizer.json"))


@pytest.mark.parametrize("name", SHIPPED)
def test_ask_leaves_room_for_every_answer_in_each_shipped_tokenizer(name):
    """ask()'s budget (answer_budget) holds every answer of every type, as each shipped checkpoint's
    tokenizer spells it, with the closing <|im_end|>: every describe answer of 1-3 objects, every
    one-word answer, every field value. A tokenizer whose answers fit keeps the old 16; the rope_theta
    1e4 chain spells `triangle` in five pieces, so its three-object answers need more than 16."""
    import itertools

    from transformers import AutoTokenizer

    assert {"models/qwen2_5_vl-tiny", "models/qwen3_vl-tiny"} <= set(SHIPPED)
    tok = AutoTokenizer.from_pretrained(ROOT / "samples" / name, local_files_only=True)
    pieces = functools.lru_cache(maxsize=None)(lambda text: len(tok.encode(text, add_special_tokens=False)))
    pairs = list(itertools.product(D.COLORS, D.SHAPES))
    describe = max(pieces(D.describe_answer([D.Obj(c, s, x, 0, 1) for x, (c, s) in enumerate(objs)]))
                   for n in (1, 2, 3) for objs in itertools.product(pairs, repeat=n))
    assert describe + 1 <= E.answer_budget(tok, "describe"), (name, describe)
    values = {v for vs in E.FIELDS.values() for v in vs}
    for qtype in [t for t in E.ALL_TYPES if t != "describe"]:
        answers = E.ANSWERS.get(qtype) or D.ANSWERS.get(qtype) or values
        assert max(map(pieces, answers)) + 1 <= E.answer_budget(tok, qtype), (name, qtype)
    if describe + 1 <= E.DESCRIBE_TOKENS:  # never raised needlessly: such a checkpoint's reports keep 16
        assert E.answer_budget(tok, "describe") == E.DESCRIBE_TOKENS, name
    assert E._BUDGETS[tok]["describe"] == E.answer_budget(tok, "describe")  # computed once per tokenizer


def test_a_batch_of_text_only_episodes_trains():
    """A training batch may hold no image at all (text gates, no earlier turns): labels still cover
    every answer and the model takes it."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    train = _train_module()
    d = ROOT / "samples" / "models" / "qwen2_5_vl-tiny"
    processor = AutoProcessor.from_pretrained(d, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(d, local_files_only=True)
    batch = train.Batcher(processor, "qwen2_5_vl").batch(random.Random(0), 3, 1.0, max_turns=1,
                                                        types={"field_gate": 1.0})
    assert "pixel_values" not in batch
    labelled = [processor.tokenizer.decode([t for t in row if t >= 0]) for row in batch["labels"].tolist()]
    assert all(x.replace("<|im_end|>", "") in ("refund", "escalate") for x in labelled)
    assert float(model(**batch).loss.detach()) > 0


def test_a_drill_batch_labels_every_answer_of_every_turn():
    """``--drill``'s batches: text only, and the labels are exactly each drill's answers (+ <|im_end|>)."""
    from transformers import AutoProcessor

    train = _train_module()
    processor = AutoProcessor.from_pretrained(ROOT / "samples" / "models" / "qwen2_5_vl-proxy", local_files_only=True)
    batch = train.Batcher(processor, "qwen2_5_vl").drill_batch(random.Random(5), 3)
    assert "pixel_values" not in batch
    rng = random.Random(5)
    want = [E.drill(rng).answers for _ in range(3)]
    for row, answers in zip(batch["labels"].tolist(), want):
        spans, cur = [], []
        for t in row + [-100]:
            if t >= 0:
                cur.append(t)
            elif cur:
                spans.append(processor.tokenizer.decode(cur)), cur.clear()
        assert spans == [a + "<|im_end|>" for a in answers]


def test_varied_style_draws_backgrounds_of_any_brightness_never_a_palette_colour():
    """The `varied` training renderer's backgrounds span dark and light greys, each far from every
    object colour (a background is never read as a shape's colour)."""
    corners = []
    for i in range(40):
        rng = random.Random(f"varied-{i}")
        scene, _, _ = D.make_item(rng, "color")
        img = np.asarray(D.render_styled(scene, rng, "varied")).astype(int)
        c = img[0, 0]
        corners.append(c.mean())
        assert min(np.linalg.norm(c - np.asarray(p)) for p in D.COLORS.values()) > 100
    assert min(corners) < 60 and max(corners) > 200


def test_history_validation_draws_earlier_turns_like_the_committed_split():
    """`train.py --val-history`: validation episodes carry 0-2 earlier image turns, as the committed
    conversation split does (text gates fail there far more often than on single questions), and
    none of them is a committed episode."""
    train = _train_module()
    single = train.heldout(12, 5, ["field_gate"])
    hist = train.heldout(12, 5, ["field_gate"], history=True)
    n_user = lambda ep: sum(m["role"] == "user" for m in ep.messages)  # noqa: E731
    assert {n_user(ep) for _, ep in single} <= {1, 2}  # (a field block may take its own turn)
    assert len({len(ep.images) for _, ep in hist}) == 3 and {len(ep.images) for _, ep in hist} == {0, 1, 2}
    assert all(len(ep.images) == 0 for _, ep in single)
    committed = [json.loads(line)["messages"] for line in (EPISODES / "episodes.jsonl").open()]
    texts = {json.dumps([p.get("text") for m in msgs for p in m["content"]]) for msgs in committed}
    for _, ep in hist:
        assert json.dumps([p.get("text") for m in ep.prompt_messages() for p in m["content"]]) not in texts


def test_light_focus_makes_the_light_decide_field_image_gates(monkeypatch):
    """`train.py --light-focus 1`: every field_image_gate episode has the field matching and the
    light matching about half the time (the answer hangs on the image); 0 leaves the split's mix,
    where the field matches in 4 of 6 and the light then in 3 of 4."""
    train = _train_module()
    built = []
    orig = E.build
    monkeypatch.setattr(E, "build", lambda *a, **kw: built.append(orig(*a, **kw)) or built[-1])

    def cases(focus: float) -> list[tuple[bool, bool]]:
        rng = random.Random(3)
        out = []
        for _ in range(80):
            built.clear()
            _, _, answers = train.conversation(rng, 1.0, 56, 1, types={"field_image_gate": 1.0}, light_focus=focus)
            light_ok, field_ok = E.light_case(built[-1])
            assert answers[-1] == ("refund" if light_ok and field_ok else "escalate")
            out.append((light_ok, field_ok))
        return out

    focused = cases(1.0)
    assert all(f for _, f in focused) and 24 <= sum(l for l, _ in focused) <= 56  # binomial(80, 0.5) +- 3.6 sd
    plain = cases(0.0)
    assert 0.45 < sum(f for _, f in plain) / 80 < 0.85 and sum(l and f for l, f in plain) > 24


def test_field_lines_finds_every_block_format_and_nothing_else():
    """episodes.field_lines: the block's lines in all four formats, wherever they sit (system turn or
    the asking turn), and never a policy, filler or erratum line."""
    seen_formats, sizes = set(), set()
    for i in range(120):
        ep = E.build(random.Random(f"fl-{i}"), "field_gate")
        lines = E.field_lines(ep)
        f, v = ep.gate["field"], ep.gate["value"]
        assert sum(f in line for line in lines) == 1 and any(v in line for line in lines if f in line)
        texts = [p["text"] for m in ep.prompt_messages() for p in m["content"] if p.get("type") == "text"]
        every = [line for t in texts for line in t.split("\n")]
        assert all(line in every for line in lines)
        for line in every:
            if line in lines:
                assert not line.startswith(("policy", "refund policy", "[STATE")) and line not in E.FILLERS
            else:  # what is not a field line names no field value after a ':' or '='
                assert not any(line.startswith((k + ":", k + " =", k + " :", '{"' + k)) for k in E.FIELDS)
        seen_formats |= {next(i for i, fmt in enumerate(E.FIELD_FORMATS) if fmt.format(f=f, v=v) in lines)}
        sizes.add(len(lines))
    assert seen_formats == set(range(len(E.FIELD_FORMATS))) and sizes == {1, 2, 3}
    ep = E.build(random.Random("fl-erratum"), "erratum_gate")
    assert E.has_erratum(ep) and not any("[STATE UPDATE]" in line for line in E.field_lines(ep))
    assert not E.has_erratum(E.build(random.Random("fl-0"), "field_gate"))


def test_block_focus_makes_the_block_decide(monkeypatch):
    """`train.py --block-focus 1`: every field_gate / field_image_gate episode has 2-3 field lines, and
    every field_value answer is read from such a block with no erratum after it; 0 keeps the split's
    mix (a third one-line blocks; most field_value answers in an erratum) and draws nothing extra."""
    train = _train_module()

    def draw(qtype: str, focus: float) -> list:
        rng = random.Random(f"bf-{qtype}")
        return [train.episode(rng, 1.0, 56, 1, types={qtype: 1.0}, block_focus=focus) for _ in range(60)]

    for qtype in ("field_gate", "field_image_gate", "field_value"):
        focused = draw(qtype, 1.0)
        assert all(len(E.field_lines(ep)) >= 2 for ep in focused)
        assert not (qtype == "field_value" and any(E.has_erratum(ep) for ep in focused))
        plain = draw(qtype, 0.0)
        assert sum(len(E.field_lines(ep)) == 1 for ep in plain) > 8
        assert [ep.messages for ep in plain] == [ep.messages for ep in draw(qtype, 0.0)]
    assert sum(E.has_erratum(ep) for ep in draw("field_value", 0.0)) > 30
    rng = random.Random("bf-image")  # other types: the same stream with and without the option
    a = [train.episode(rng, 1.0, 56, 1, types={"erratum_gate": 1.0}, block_focus=1.0).messages for _ in range(5)]
    rng = random.Random("bf-image")
    assert a == [train.episode(rng, 1.0, 56, 1, types={"erratum_gate": 1.0}).messages for _ in range(5)]


def test_field_weights_set_how_often_each_field_is_asked(monkeypatch):
    """`train.py --field-weight order_status=4`: text episodes ask about order_status about 4 / 7 of
    the time (the other three fields 1 / 7 each) in every text type; without it, about a quarter.
    Image episodes, and text episodes under even weights (the default), draw exactly as before."""
    train = _train_module()
    built = []
    orig = E.build
    monkeypatch.setattr(E, "build", lambda *a, **kw: built.append(orig(*a, **kw)) or built[-1])

    def share(qtype: str, fw) -> float:
        rng = random.Random(f"fw-{qtype}")
        n = 0
        for _ in range(140):
            built.clear()
            train.conversation(rng, 1.0, 56, 1, types={qtype: 1.0}, field_weights=fw)
            n += built[-1].gate["field"] == "order_status"
        return n / 140

    fw = {"order_status": 4.0, "tier": 1.0, "payment": 1.0, "account": 1.0}
    for qtype in E.TEXT_TYPES + E.LOOKUP_TYPES:
        assert 0.45 < share(qtype, fw) < 0.70, qtype  # 4/7 = 0.57, sd 0.042
    assert 0.13 < share("field_gate", None) < 0.37  # 1/4, sd 0.037
    even = {f: 1.0 for f in E.FIELDS}  # train.py's default: the data of earlier stages' commands unchanged
    for qtype, weights in (("count", fw), ("field_gate", even), ("erratum_gate", even)):
        rng_a, rng_b = random.Random(9), random.Random(9)
        assert [train.conversation(rng_a, 1.0, 56, 1, types={qtype: 1.0}, field_weights=weights)[0] for _ in range(5)] == \
            [train.conversation(rng_b, 1.0, 56, 1, types={qtype: 1.0})[0] for _ in range(5)]


def test_word_tokens_make_each_field_value_one_token_in_every_format():
    """`train.py --word-tokens`: every field name and value is one token in the plain, `=`, JSON and
    erratum forms, `paid` never matches inside `unpaid`, the text round-trips, the new embedding rows
    start as the mean of the letters' rows, and a second call adds nothing."""
    import torch
    from transformers import AutoModelForImageTextToText

    from mmkv.testing import tiny

    train = _train_module()
    tok = tiny.build_tokenizer(tiny.DEFAULT_CORPUS, vocab_size=512)  # (like the bundled ones: no field text)
    model = AutoModelForImageTextToText.from_config(
        tiny.tiny_config("qwen2_5_vl", tok, **train.model_overrides("qwen2_5_vl")))
    pieces = tok.encode("unpaid", add_special_tokens=False)
    assert len(pieces) > 1  # (the premise: the BPE spells it out)
    before = model.get_input_embeddings().weight[pieces].mean(0).clone()
    n = train.add_word_tokens(model, tok)
    assert n == len(train.WORD_TOKENS) + 1 and model.get_input_embeddings().weight.shape[0] == len(tok)
    assert model.get_output_embeddings().weight.shape[0] == len(tok)
    unpaid = tok.convert_tokens_to_ids("unpaid")
    assert torch.allclose(model.get_input_embeddings().weight[unpaid], before)
    for field, values in E.FIELDS.items():
        for v in values:
            for text in (f"{field}: {v}", f"{field} = {v}", f'{{"{field}": "{v}"}}', E.erratum_line(field, v)):
                ids = tok.encode(text, add_special_tokens=False)
                assert tok.convert_tokens_to_ids(v) in ids and tok.convert_tokens_to_ids(field) in ids, text
                assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("paid") not in tok.encode("payment: unpaid", add_special_tokens=False)
    assert tok.encode("[STATE UPDATE] x", add_special_tokens=False)[0] == tok.convert_tokens_to_ids("[STATE UPDATE]")
    assert train.add_word_tokens(model, tok) == 0
    out = model(input_ids=torch.tensor([tok.encode("tier = gold", add_special_tokens=False)]))
    assert out.logits.shape[-1] == len(tok)


def test_unify_words_gives_each_field_name_and_value_one_id_wherever_it_stands():
    """`train.py --unify-words` on the proxy's tokenizer (whose BPE has `Ġtier` beside `tier`, `Ġpending`
    beside `pending`): afterwards a field name and each value take one id in a block line of every format,
    an erratum, a question and an answer; no id is added, text round-trips, `paid` stays out of `unpaid`,
    and a second call marks nothing. Before, the question's `tier` and the block's differ (the premise)."""
    from transformers import AutoTokenizer

    train = _train_module()
    tok = AutoTokenizer.from_pretrained(ROOT / "samples" / "models" / "qwen2_5_vl-proxy", local_files_only=True)

    def ids_of(word: str) -> set[int]:
        texts = [fmt.format(f=f, v=v) for f, vs in E.FIELDS.items() for v in vs for fmt in E.FIELD_FORMATS]
        texts += [E.erratum_line(f, v) for f, vs in E.FIELDS.items() for v in vs]
        texts += [E.Q_FIELD_VALUE.format(phrase=E.PHRASE[f]) for f in E.FIELDS] + [f"\n{word}<|im_end|>"]
        out = set()
        for text in texts:
            for i in tok.encode(text, add_special_tokens=False):
                if tok.convert_ids_to_tokens(i).replace("Ġ", "").strip('"{}:') == word:
                    out.add(i)
        return out

    assert len(ids_of("tier")) == 2 and len(ids_of("pending")) == 2
    n = len(tok)
    marked = train.unify_words(tok)
    assert {"tier", "pending", "paid"} <= set(marked) and len(tok) == n
    for word in [v for vs in E.FIELDS.values() for v in vs] + ["tier", "payment", "account"]:
        assert ids_of(word) == {tok.convert_tokens_to_ids(word)}, word
    for text in ("tier = gold", 'payment: unpaid', E.erratum_line("payment", "paid"), E.Q_FIELD_VALUE.format(phrase="tier")):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.convert_tokens_to_ids("paid") not in tok.encode("payment: unpaid", add_special_tokens=False)
    assert train.unify_words(tok) == []


def _prompt_text(ep) -> str:
    return "\n".join(p["text"] for m in ep.prompt_messages() for p in m["content"] if p.get("type") == "text")


def _stated_values(ep) -> list[str]:
    """The target field's values in the order the prompt states them (field lines, then errata)."""
    target, text = ep.gate["field"], _prompt_text(ep)
    stated = [(m.start(), m.group(1)) for pat in (rf'"?{target}"?\s*[:=]\s*"?(\w+)', rf"{target} has just changed to (\w+);")
              for m in re.finditer(pat, text)]
    return [v for _, v in sorted(stated)]


def _read_gate(ep) -> str:
    """A text gate's answer read back from the episode's own text (and the light's colour from its
    scene), independently of how it was built: the policy's needed value, the field's last statement
    (field line or erratum), the asked light colour."""
    target, text = ep.gate["field"], _prompt_text(ep)
    required = re.findall(rf"(?:{E.PHRASE[target]}|{target}) is (\w+) \. otherwise", text)[-1]
    ok = _stated_values(ep)[-1] == required
    if ep.type == "field_image_gate":
        light = next(o.color for o in ep.scenes[-1].objects if o.role == "light")
        ok = ok and re.search(r"status light is (\w+) and", text).group(1) == light
    return "refund" if ok else "escalate"


def test_contrast_twins_flip_the_answer_by_one_value():
    """`train.py --contrast`: a text gate's twin differs from it in one word of one prompt message (the
    field line's value, the last erratum's value, or the asked light colour) and in the last answer,
    which flips; both answers agree with the rule read back from the text; an erratum is never changed
    to the value it overrides; earlier answers are kept. Twins exist for most episodes of each type."""
    train = _train_module()
    made = {t: 0 for t in E.TEXT_TYPES}
    for qtype in E.TEXT_TYPES:
        for i in range(120):
            rng = random.Random(f"twin-{qtype}-{i}")
            ep = train.episode(rng, 1.0, 56, 1 + i % 3, types={qtype: 1.0})
            tw = train.twin(ep, rng)
            if tw is None:
                continue
            made[qtype] += 1
            assert _read_gate(ep) == ep.answer and _read_gate(tw) == tw.answer != ep.answer
            assert tw.answers[:-1] == ep.answers[:-1] and tw.images is ep.images
            changed = [(a, b) for a, b in zip(ep.prompt_messages(), tw.prompt_messages()) if a != b]
            assert len(changed) == 1
            words = [(x, y) for x, y in zip(*(re.findall(r"\w+", m["content"][-1]["text"]) for m in changed[0])) if x != y]
            assert len(words) == 1
            if qtype == "erratum_gate":  # the last erratum changed, and still to another value than the one before it
                assert _stated_values(tw)[:-1] == _stated_values(ep)[:-1]
                assert _stated_values(tw)[-1] != _stated_values(tw)[-2]
    assert min(made.values()) >= 80, made


def test_contrast_batch_holds_each_text_gate_next_to_its_twin():
    """`--contrast 1`: a batch of text gates comes in pairs whose labelled answers differ; 0 draws no twin."""
    from transformers import AutoProcessor

    train = _train_module()
    processor = AutoProcessor.from_pretrained(ROOT / "samples" / "models" / "qwen2_5_vl-tiny", local_files_only=True)
    batcher = train.Batcher(processor, "qwen2_5_vl")

    batch = batcher.batch(random.Random(4), 6, 1.0, max_turns=1, types={"field_gate": 1.0}, contrast=1.0)
    paired = [processor.tokenizer.decode([t for t in row if t >= 0]).replace("<|im_end|>", "") for row in batch["labels"].tolist()]
    assert all(paired[k] != paired[k + 1] for k in (0, 2, 4)), paired
    plain_rng, batch_rng = random.Random(4), random.Random(4)
    batcher.batch(batch_rng, 6, 1.0, max_turns=1, types={"field_gate": 1.0})
    for _ in range(6):
        train.episode(plain_rng, 1.0, batcher.easy_size, 1, types={"field_gate": 1.0})
    assert plain_rng.random() == batch_rng.random()  # (contrast 0 leaves the data stream as before)


def test_decide_weight_reweights_the_last_answer_against_transformers_own_loss():
    """`--decide-weight W`: the loss is the weighted mean of transformers' own token losses, the last
    turn's answer tokens (not their <|im_end|>) weighing W; W = 1 is the model's own loss."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    train = _train_module()
    d = ROOT / "samples" / "models" / "qwen2_5_vl-tiny"
    processor = AutoProcessor.from_pretrained(d, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(d, local_files_only=True).eval()
    batcher = train.Batcher(processor, "qwen2_5_vl")
    batch = batcher.batch(random.Random(3), 3, 1.0, max_turns=2, types={"color": 1.0, "field_gate": 1.0},
                          turn_weights={2: 1.0})
    labels = batch["labels"]
    mask = batcher.decide_mask(labels)
    tok = processor.tokenizer
    for b in range(labels.shape[0]):  # the mask is the last answer, the labels hold more than it
        last = tok.decode(labels[b][mask[b]].tolist())
        assert last and "<|im_end|>" not in last
        assert int((labels[b] != train.IGNORE).sum()) > int(mask[b].sum()) + 1
    with torch.no_grad():
        def own(keep):
            lab = torch.where(keep, labels, torch.full_like(labels, train.IGNORE))
            n = int((lab[:, 1:] != train.IGNORE).sum())
            return float(model(**{**batch, "labels": lab}).loss), n
        l_d, n_d = own(mask)
        l_o, n_o = own(~mask & (labels != train.IGNORE))
        for w in (1.0, 1.0 + 1e-9, 4.0):
            got = float(train.weighted_loss(model, batch, batcher, w))
            want = (n_o * l_o + w * n_d * l_d) / (n_o + w * n_d)
            assert abs(got - want) < 1e-4 * max(1.0, want), (w, got, want)


@pytest.mark.parametrize("flag", [["--decide-weight", "0"], ["--decide-weight", "-1"], ["--contrast", "2"],
                                  ["--light-focus", "-0.5"], ["--dark-canvas", "1.5"], ["--drill", "1.5"],
                                  ["--drill", "-0.1"], ["--count-pairs", "1.5"]])
def test_train_refuses_a_bad_weight_or_share_before_building_anything(tmp_path, flag, capsys):
    """A loss weight <= 0 or a share outside [0, 1] is a usage error (exit 2) naming the flag; no model is written."""
    train = _train_module()
    with pytest.raises(SystemExit) as e:
        train.main(["--family", "qwen2_5_vl", "--out", str(tmp_path / "m"), "--steps", "1", *flag])
    assert e.value.code == 2 and flag[0] in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_count_pairs_twin_is_the_same_drawing_with_its_last_shape_taken_out():
    """`train.py --count-pairs`: a `count` episode's twin asks the same question of the same drawing with
    one shape fewer. With the flat renderer (colour jitter, no noise or JPEG) every pixel that changes lies
    in the taken-out shape's box, and drawing the original scene again from the recorded rng state gives the
    original image exactly; with the full training style the answers and scenes still pair. One shape: no twin."""
    train = _train_module()
    for style, exact in ((train.Style(), True), (train.Style(p=0.8, jpeg=0.15, dark=0.3), False)):
        made = 0
        for i in range(40):
            rng, draws = random.Random(f"count-twin-{i}"), []
            ep = train.episode(rng, 1.0, 56, 1 + i % 3, types={"count": 1.0}, style=style, draws=draws)
            tw = train.count_twin(ep, style.drawer(), draws)
            objs = ep.scenes[-1].objects
            assert D.NUMBERS[len(objs) - 1] == ep.answer
            if len(objs) == 1:
                assert tw is None
                continue
            made += 1
            assert tw.answer == D.NUMBERS[len(objs) - 2] and tw.scenes[-1].objects == objs[:-1]
            assert tw.prompt_messages() == ep.prompt_messages() and tw.answers[:-1] == ep.answers[:-1]
            assert all(a is b for a, b in zip(tw.images[:-1], ep.images[:-1]))
            a, b = (np.asarray(x, dtype=int) for x in (ep.images[-1], tw.images[-1]))
            assert a.shape == b.shape and (a != b).any()
            if exact:
                again = random.Random()
                again.setstate(draws[-1][1])
                assert np.array_equal(np.asarray(style.drawer()(ep.scenes[-1], again)), np.asarray(ep.images[-1]))
                o = objs[-1]
                ys, xs = np.nonzero((a != b).any(-1))
                assert (np.abs(xs - o.cx) <= o.size / 2 + 2).all() and (np.abs(ys - o.cy) <= o.size / 2 + 2).all()
        assert made >= 25, made
    assert train.count_twin(train.episode(random.Random(0), 1.0, 56, 1, types={"color": 1.0}, draws=[]), train.Style().drawer(), []) is None


def test_count_pairs_batch_holds_each_count_next_to_its_twin():
    """`--count-pairs 1`: a batch of count questions comes in pairs (n shapes, then n - 1) where n > 1;
    0 draws nothing extra (the data stream of earlier runs is kept)."""
    from transformers import AutoProcessor

    train = _train_module()
    processor = AutoProcessor.from_pretrained(ROOT / "samples" / "models" / "qwen2_5_vl-tiny", local_files_only=True)
    batcher = train.Batcher(processor, "qwen2_5_vl")
    batch = batcher.batch(random.Random(5), 12, 1.0, max_turns=1, types={"count": 1.0}, count_pairs=1.0)
    answers = [processor.tokenizer.decode([t for t in row if t >= 0]).replace("<|im_end|>", "").strip()
               for row in batch["labels"].tolist()]
    numbers = [D.NUMBERS.index(a) + 1 for a in answers]
    k, pairs = 0, 0
    while k < len(numbers):
        if numbers[k] > 1 and k + 1 < len(numbers):
            assert numbers[k + 1] == numbers[k] - 1, numbers
            k, pairs = k + 2, pairs + 1
        else:
            k += 1
    assert pairs >= 3 and len(numbers) == 12, numbers
    plain_rng, batch_rng = random.Random(5), random.Random(5)
    batcher.batch(batch_rng, 6, 1.0, max_turns=1, types={"count": 1.0})
    for _ in range(6):
        train.episode(plain_rng, 1.0, batcher.easy_size, 1, types={"count": 1.0})
    assert plain_rng.random() == batch_rng.random()
