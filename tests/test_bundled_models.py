"""The two bundled tiny checkpoints load offline through the Auto classes and answer as stored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "samples" / "models"
EXPECTATIONS = MODELS / "expected_answers.json"
FAMILIES = {"qwen2_5_vl-tiny": "qwen2_5_vl", "qwen3_vl-tiny": "qwen3_vl", "qwen2_5_vl-proxy": "qwen2_5_vl"}
#: issue 16's size limits: 20 MB a tiny checkpoint, 60 MB the proxy
MAX_MB = {"qwen2_5_vl-proxy": 60}

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _checkpoint_dir(name: str) -> Path:
    d = MODELS / name
    assert (d / "model.safetensors").exists(), f"bundled checkpoint {d.relative_to(ROOT)} is missing"
    return d


def _load(d: Path):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(d, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(d, local_files_only=True, dtype=torch.float32)
    return model.eval(), processor


def _answer(model, processor, image_path: Path, question: str) -> str:
    import torch
    from PIL import Image

    with Image.open(image_path) as im:
        image = im.convert("RGB")
    msgs = [{"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    enc = processor(text=[text], images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    return processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_checkpoint_loads_offline(name):
    d = _checkpoint_dir(name)
    size = sum(p.stat().st_size for p in d.iterdir() if p.is_file())
    assert size <= MAX_MB.get(name, 20) * 1024 * 1024, f"{name} is {size / 1e6:.1f} MB"
    model, processor = _load(d)
    assert model.config.model_type == FAMILIES[name]
    assert processor.chat_template and "<|vision_start|>" in processor.chat_template
    text_cfg = model.config.text_config
    assert text_cfg.eos_token_id is not None and text_cfg.pad_token_id is not None
    assert text_cfg.bos_token_id is not None


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_checkpoint_answers_as_stored(name):
    d = _checkpoint_dir(name)
    expected = json.loads(EXPECTATIONS.read_text()).get(name)
    assert expected and len(expected) == 20, f"no stored answers for {name}"
    model, processor = _load(d)
    got = {k: _answer(model, processor, ROOT / v["image"], v["question"]) for k, v in expected.items()}
    assert got == {k: v["answer"] for k, v in expected.items()}


def test_training_command_smoke(tmp_path):
    """A few steps of the training command produce a checkpoint the Auto classes load."""
    out = tmp_path / "ckpt"
    cmd = [sys.executable, str(ROOT / "samples" / "train.py"), "--family", "qwen2_5_vl", "--out", str(out),
           "--steps", "3", "--batch", "4", "--eval-every", "1000", "--rope-theta", "1000"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    state = json.loads((out / "train_state.json").read_text())
    assert state["steps"] == 3 and state["final"]
    model, processor = _load(out)
    assert model.config.model_type == "qwen2_5_vl"
    assert model.config.get_text_config().rope_parameters["rope_theta"] == 1000.0
    again = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert again.returncode == 2 and "--rope-theta" in again.stderr  # a resumed model keeps its own
    fresh = cmd[:-2]  # without --rope-theta 1000
    refused = subprocess.run(fresh + ["--rebase-theta", "50"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert refused.returncode == 2 and "--rebase-theta" in refused.stderr  # only a resumed model is rebased
    rebased = subprocess.run(fresh + ["--resume", "--steps", "1", "--rebase-theta", "50"], capture_output=True,
                             text=True, timeout=600, cwd=ROOT)
    assert rebased.returncode == 0, rebased.stderr[-3000:]
    state = json.loads((out / "train_state.json").read_text())
    assert state["rope_theta"] == 50.0 and state["rope_theta_from"] == 1000.0
    assert state["earlier_runs"][-1]["steps"] == 3
    model, processor = _load(out)
    text = model.config.get_text_config()
    assert text.rope_parameters["rope_theta"] == 50.0
    inv = model.model.language_model.rotary_emb.inv_freq  # the rotary table follows the rebased config
    d = text.head_dim
    assert torch.allclose(inv, 1.0 / 50.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    assert _answer(model, processor, ROOT / "samples" / "vqa" / "images" / "color-000.png", "what color is the shape ?") is not None


def test_batch_workers_train_exactly_as_the_loop(tmp_path):
    """`train.py --workers 2` builds each batch in a forked process ahead of its step; on a --steps run
    (whose curriculum depends on the step alone) the weights after 5 steps equal, bit for bit, those of
    the run that builds every batch in its loop. --drill 0.5 draws both kinds of batch; --count-pairs 0.5
    draws count twins (an image drawn again from a recorded rng state)."""
    from safetensors.torch import load_file

    weights = []
    for workers in (0, 2):
        out = tmp_path / f"w{workers}"
        cmd = [sys.executable, str(ROOT / "samples" / "train.py"), "--family", "qwen2_5_vl", "--out", str(out),
               "--steps", "5", "--batch", "3", "--eval-every", "1000", "--warmup", "2", "--drill", "0.5",
               "--warm-until", "0", "--weight", "field_gate=1", "--count-pairs", "0.5", "--workers", str(workers)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-3000:]
        assert json.loads((out / "train_state.json").read_text())["workers"] == workers
        weights.append(load_file(out / "model.safetensors"))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def _assert_real_position_scheme(model, processor) -> None:
    """rope_theta 1e6, head_dim >= 64, mrope sections in Qwen2.5-VL's proportions (16:24:24), >= 8 LM
    layers, 64 image tokens at 224 x 224 and 256 at 448 x 448 (64-256 for any size), finite logits."""
    import torch
    from PIL import Image

    text = model.config.get_text_config()
    rope = text.rope_parameters
    assert rope["rope_theta"] == 1e6 and text.head_dim >= 64 and text.num_hidden_layers >= 8
    t, h, w = rope["mrope_section"]
    assert 2 * sum(rope["mrope_section"]) == text.head_dim and 3 * t == 2 * h and h == w
    image_id = model.config.image_token_id
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color ?"}]}]
    prompt = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    counts = []
    for wh in [(224, 224), (448, 448), (300, 500), (40, 40), (2000, 1200)]:
        enc = processor(text=[prompt], images=[Image.new("RGB", wh, (200, 30, 30))], return_tensors="pt")
        counts.append(int((enc["input_ids"] == image_id).sum()))
    assert counts[:2] == [64, 256] and all(64 <= c <= 256 for c in counts), counts
    with torch.no_grad():
        assert torch.isfinite(model(**enc).logits).all()


def test_bundled_proxy_has_a_real_position_scheme():
    """The bundled proxy (issue 16's point 4) is the `--size proxy` architecture, not a retitled tiny model."""
    model, processor = _load(_checkpoint_dir("qwen2_5_vl-proxy"))
    _assert_real_position_scheme(model, processor)
    assert json.loads((MODELS / "qwen2_5_vl-proxy" / "train_state.json").read_text())["size"] == "proxy"


def test_proxy_training_command_builds_a_real_position_scheme(tmp_path):
    """`train.py --size proxy` (issue 16's third checkpoint): Qwen2.5-VL with rope_theta 1e6, head_dim
    64, mrope sections in Qwen2.5-VL's proportions (16:24:24), >= 8 LM layers, 64-256 tokens per image,
    a checkpoint of at most 60 MB; Qwen3-VL is refused."""
    out = tmp_path / "proxy"
    cmd = [sys.executable, str(ROOT / "samples" / "train.py"), "--family", "qwen2_5_vl", "--size", "proxy",
           "--out", str(out), "--steps", "2", "--batch", "2", "--eval-every", "1000", "--word-tokens"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    model, processor = _load(out)
    _assert_real_position_scheme(model, processor)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    assert size <= 60 * 1024 * 1024, f"proxy checkpoint is {size / 1e6:.1f} MB"
    bad = subprocess.run(cmd[:3] + ["qwen3_vl"] + cmd[4:], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "--size proxy" in bad.stderr


def test_monitor_scores_only_the_types_the_run_trains(tmp_path):
    """A perception-only run (`--warm-until 1`: color, shape and count throughout) is monitored, and its
    `--best` save chosen, on those three types and their held-out style only, not on types it never asks."""
    out = tmp_path / "warm"
    cmd = [sys.executable, str(ROOT / "samples" / "train.py"), "--family", "qwen2_5_vl", "--out", str(out),
           "--best", str(tmp_path / "best"), "--steps", "2", "--batch", "2", "--eval-every", "1", "--warm-until", "1",
           "--val-per-type", "1", "--val-style", "1", "--weight", "count=0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    history = json.loads((out / "train_state.json").read_text())["history"]
    scored = {k for h in history for k in h} - {"step", "t", "loss_ema", "val_mean"}
    assert scored == {"color", "shape", "style:color", "style:shape"}, scored
    assert json.loads((tmp_path / "best" / "train_state.json").read_text())["best"]["step"] is not None


def test_save_tiny_checkpoint_keeps_a_given_tokenizer(tmp_path):
    """A trained tokenizer passed to save_tiny_checkpoint is the one the checkpoint loads with."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmkv.testing.tiny import DEFAULT_CORPUS, build_tokenizer, save_tiny_checkpoint

    tok = build_tokenizer(list(DEFAULT_CORPUS) + ["<|im_start|>assistant\nzebra zebra<|im_end|>"] * 20, vocab_size=420)
    default = build_tokenizer()
    assert tok.get_vocab() != default.get_vocab()
    d = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "m", tokenizer=tok)
    processor = AutoProcessor.from_pretrained(d, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(d, local_files_only=True)
    assert processor.tokenizer.get_vocab() == tok.get_vocab()
    assert model.config.text_config.vocab_size == len(tok)
    assert processor.tokenizer.encode("zebra zebra") == tok.encode("zebra zebra")


def _evaluate_tiny():
    from conftest import sample_module

    return sample_module("evaluate_tiny")


def test_shuffled_control_chance_is_expected_agreement():
    """chance = sum_c P(truth = c) * P(answer = c): even yes/no guessing on an unbalanced set is at chance."""
    ev = _evaluate_tiny()
    truth = ["yes"] * 27 + ["no"] * 13  # 0.675 majority, like left_of
    assert ev.independent_chance(truth, ["yes", "no"] * 20) == pytest.approx(0.5)
    assert ev.independent_chance(truth, ["yes"] * 40) == pytest.approx(0.675)
    assert ev.independent_chance(truth, ["maybe"] * 40) == 0.0
    assert ev.independent_chance(["red", "green", "blue"], ["red", "red", "blue"]) == pytest.approx(1 / 3)


def test_shuffled_control_images_are_independent_of_the_set():
    """The shuffled control's pictures are foreign: an independent draw of each item's type, not
    another item of the same set. On the committed set, a perfect reader asked `what shape is the
    <colour> one ?` about *another item's* image answers this item's shape 0.41 of the time where
    that colour is there (the set pairs colours with shapes unevenly), so within-set shuffling put
    an image-reading model above chance. About foreign images the same reader is at chance."""
    ev = _evaluate_tiny()
    items = ev.load_vqa_set(ev.SET)
    rows = {json.loads(line)["id"]: json.loads(line) for line in (ev.SET / "items.jsonl").open()}
    group = [it for it in items if it.type == "shape_of_color"]

    def read(question: str, objects) -> str | None:  # the shape of the asked colour in this picture, if any
        found = [o["shape"] for o in objects if o["color"] in question.split()]
        return found[0] if found else None

    pairs = [(a, read(a.question, rows[b.id]["scene"]["objects"])) for a in group for b in group if a is not b]
    present = [(a, s) for a, s in pairs if s is not None]
    assert sum(s == a.answer for a, s in present) / len(present) > 0.38  # within the set: far above 1/3

    truth, said = [], []
    for r in range(6):
        foreign = ev.foreign_round(items, ev.foreign_seed(4321, r))
        assert set(foreign) == {it.id for it in items}
        for it in items:  # same type (the scene draws that type's objects), never the item's own picture
            scene, img = foreign[it.id]
            assert scene.to_json() != rows[it.id]["scene"]
            assert img.size == (scene.width, scene.height)
        for it in group:
            truth.append(it.answer)
            said.append(read(it.question, foreign[it.id][0].to_json()["objects"]) or "absent")
    rate = sum(a == b for a, b in zip(truth, said)) / len(truth)
    assert abs(rate - ev.independent_chance(truth, said)) < 0.03
    assert ev.foreign_round(items[:3], ev.foreign_seed(4321, 0))[items[0].id][0] == ev.foreign_round(
        items, ev.foreign_seed(4321, 0))[items[0].id][0]  # seeded: the same draw each time


def test_paired_table_counts_flips_and_pools_the_text_gates():
    """Old against new on the same items: now right / now wrong and the exact McNemar p (two-sided
    binomial on the flips: 1 up, 5 down is p = 0.22); the three text gates pooled in one row."""
    ev = _evaluate_tiny()
    old = {"count": [True] * 6 + [False], "field_gate": [True, True, False], "erratum_gate": [True] * 5,
           "field_image_gate": [True, False]}
    new = {"count": [False] * 5 + [True, True], "field_gate": [True, True, True], "erratum_gate": [True] * 4 + [False],
           "field_image_gate": [True, True]}
    rows = {r.split(" | ")[0].lstrip("| "): r for r in ev.paired(["old", "new"], [old, new]).splitlines()[2:]}
    assert rows["count"] == "| count | 7 | 6 | new | 2 | 1 | 5 | 0.22 |"
    assert rows["text gates"] == "| text gates | 10 | 8 | new | 9 | 2 | 1 | 1.00 |"
    assert rows["erratum_gate"] == "| erratum_gate | 5 | 5 | new | 4 | 0 | 1 | 1.00 |"


def _conversation_key(messages, scenes) -> str:
    """A conversation's texts and drawn scenes (JSON rows), to tell two conversations apart."""
    return json.dumps([[p.get("text") for m in messages for p in m["content"]], scenes], sort_keys=True)


def test_expectations_are_written_only_for_bundled_checkpoints(tmp_path):
    """A copy of the previous bundle scored beside the new one (for the paired table) must not get an
    entry in expected_answers.json: only samples/models/<name> dirs are kept, in order."""
    ev = _evaluate_tiny()
    prev = tmp_path / "qwen2_5_vl-tiny"  # same name as a bundle, another place
    dirs = [prev, ROOT / "samples" / "models" / "qwen3_vl-tiny", ROOT / "samples" / "models" / ".." / "models" / "qwen2_5_vl-tiny"]
    keep, skipped = ev.bundled_only(dirs)
    assert keep == [1, 2]
    assert skipped == [prev]
    assert ev.bundled_only([]) == ([], [])


def test_validation_check_draws_fresh_conversations_and_scores_them(tmp_path):
    """`evaluate_tiny.py --validation N` (the check before bundling): N conversations per type with
    0-2 earlier image turns, N // 2 per image type in each held-out style (`shadow`, `dark`), none a
    committed episode; the table counts exact-match hits per checkpoint."""
    ev = _evaluate_tiny()
    eps = ev.validation_episodes(6)
    assert {t for t in eps if ":" not in t} == set(ev.TYPES) | set(ev.E.SPLIT_TYPES)
    assert all(len(g) == 6 for t, g in eps.items() if ":" not in t)
    assert all(len(eps[f"{style}:{t}"]) == 3 for t in ev.TYPES for style in ("shadow", "dark"))
    shadow = ev.E.build(ev.random.Random("sel-shadow-count-0"), "count", before=0, draw=ev.D.render_heldout)
    assert eps["shadow:count"][0].images[0].tobytes() == shadow.images[0].tobytes()  # the rows earlier sets drew
    assert eps["dark:count"][0].images[0].size != shadow.images[0].size or (
        eps["dark:count"][0].images[0].tobytes() != shadow.images[0].tobytes())
    earlier = {len(ep.images) - 1 for ep in eps["color"]} | {len(ep.images) - 1 for ep in eps["shape"]}
    assert earlier == {0, 1, 2}
    rows = [json.loads(line) for line in (ROOT / "samples" / "vqa" / "episodes" / "episodes.jsonl").open()]
    committed = {_conversation_key(r["messages"], r["scenes"]) for r in rows}
    for group in eps.values():
        for ep in group:
            assert _conversation_key(ep.prompt_messages(), [sc.to_json() for sc in ep.scenes]) not in committed
    table = ev.validate([_checkpoint_dir("qwen2_5_vl-tiny")], 1)
    rows = [r.split(" | ") for r in table.splitlines()[2:]]
    assert len(rows) == len(ev.validation_episodes(1)) + 1 and all(0 <= int(r[2].rstrip(" |")) <= int(r[1]) for r in rows)
    assert rows[-1][0] == "| describe: objects in any order" and int(rows[-1][2].rstrip(" |")) >= int(
        next(r for r in rows if r[0] == "| describe")[2].rstrip(" |"))  # an exact match is also an any-order match
    record = {}
    two = ev.validate([_checkpoint_dir("qwen2_5_vl-tiny")] * 2, 1, types=["field_gate"], record=record).split("\n\n")[1]
    assert "| field_gate | 1 |" in two and two.rstrip().endswith("| 0 | 0 | 1.00 |")  # (a checkpoint against itself)
    assert "| text gates | 1 |" in two and "shadow: all" not in two  # held-out pools only where their rows are
    held = ev.paired(["a", "b"], [{"shadow:count": [True, False], "dark:count": [True], "dark:shape": [False, True]},
                                  {"shadow:count": [False, True], "dark:count": [True], "dark:shape": [True, True]}])
    assert "| shadow: all | 2 | 1 | b | 1 | 1 | 1 | 1.00 |" in held and "| dark: all | 3 | 2 | b | 3 | 1 | 0 | 1.00 |" in held
    item = record["items"]["field_gate"][0]  # --json: each item's label and every checkpoint's answer
    assert record["prefix"] == "sel" and item["label"] in ("refund", "escalate") and len(item["answers"]) == 2
    assert item["answers"][0] == item["answers"][1] and (f"| 1 | {_checkpoint_dir('qwen2_5_vl-tiny')} | {int(item['answers'][1] == item['label'])} |" in two)
    res = subprocess.run([sys.executable, str(ROOT / "samples" / "evaluate_tiny.py"), "--validation", "-1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2 and "--validation" in res.stderr
    res = subprocess.run([sys.executable, str(ROOT / "samples" / "evaluate_tiny.py"), "--threads", "0"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2 and "--threads" in res.stderr
    out = tmp_path / "v.json"  # --json is written, not ignored, under --validation; --threads 1 beside a training run
    res = subprocess.run([sys.executable, str(ROOT / "samples" / "evaluate_tiny.py"), "--validation", "1",
                          "--validation-types", "field_gate", "--model", str(_checkpoint_dir("qwen2_5_vl-tiny")),
                          "--json", str(out), "--threads", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert set(json.loads(out.read_text())["items"]) == {"field_gate"}


def test_same_objects_ignores_order_but_not_repeats_or_extras():
    """The `describe: objects in any order` row of `--validation`: a model's `describe` misses can be
    the right objects out of order, a repeated object, an extra one; only the first is an any-order match."""
    ev = _evaluate_tiny()
    label = "red circle , blue square , green triangle"
    assert ev.same_objects("blue square , red circle , green triangle", label)
    assert ev.same_objects(label, label)
    assert not ev.same_objects("red circle , red circle , green triangle", label)
    assert not ev.same_objects("red circle , blue square", label)
    assert not ev.same_objects(label + " , red square", label)
    assert not ev.same_objects("red square , blue circle , green triangle", label)


def test_by_block_splits_the_block_read_types_by_field_lines():
    """`--validation N --by-block`: each block-read episode counted once, under its number of field
    lines, with the hits of each checkpoint; other types are not split."""
    ev = _evaluate_tiny()
    eps = ev.validation_episodes(30, "sel", ["field_gate", "field_image_gate", "count"])
    hits = [{t: [i % 2 == 0 for i in range(len(g))] for t, g in eps.items()},
            {t: [True] * len(g) for t, g in eps.items()}]
    rows = [r.strip("| ").split(" | ") for r in ev.by_block(eps, hits, ["a", "b"]).splitlines()[2:]]
    assert {r[0] for r in rows} == {"field_gate", "field_image_gate"}
    for t in ("field_gate", "field_image_gate"):
        mine = [r for r in rows if r[0] == t]
        assert sum(int(r[2]) for r in mine) == 30 and sum(int(r[4]) for r in mine) == 30
        assert sum(int(r[3]) for r in mine) == sum(hits[0][t])
        sizes = [len(ev.E.field_lines(ep)) for ep in eps[t]]
        assert {int(r[1]): int(r[2]) for r in mine} == {k: sizes.count(k) for k in set(sizes)}
    assert {int(r[1]) for r in rows if r[0] == "field_gate"} == {1, 2, 3}
    res = subprocess.run([sys.executable, str(ROOT / "samples" / "evaluate_tiny.py"), "--by-block"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2 and "--by-block" in res.stderr
    errata = ev.validation_episodes(12, "sel", ["erratum_gate", "field_value"])
    rows = [r.strip("| ").split(" | ") for r in ev.by_block(errata, [{t: [True] * 12 for t in errata}], ["a"]).splitlines()[2:]]
    assert {r[0] for r in rows} == {"erratum_gate", "field_value"}
    assert all(sum(int(r[2]) for r in rows if r[0] == t) == 12 for t in errata)


def test_image_free_validation_set_has_no_image_turns_and_the_same_seeds():
    """`--validation N --image-free` (the probe of a text-only checkpoint): the same seeds as the
    default set, drawn without image turns before the task's own, so `field_gate` and the
    lookups hold no image; the training-only lookups are asked only when named; refused without
    --validation."""
    ev = _evaluate_tiny()
    types = ["field_gate", "field_value", "count"]
    free, usual = ev.validation_episodes(8, "sel", types, image_free=True), ev.validation_episodes(8, "sel", types)
    assert free.keys() == usual.keys() == {*types, "shadow:count", "dark:count"}
    assert "field_value" not in ev.validation_episodes(1) and "policy_value" not in ev.validation_episodes(1)
    assert all(not ep.images for t in ("field_gate", "field_value") for ep in free[t])
    assert all(len(ep.images) == 1 for ep in free["count"])
    assert any(ep.images for t in ("field_gate", "field_value") for ep in usual[t])
    redraw = [ev.E.build(ev.random.Random(f"sel-field_gate-{i}"), "field_gate", before=0) for i in range(8)]
    assert [ep.prompt_messages() for ep in redraw] == [ep.prompt_messages() for ep in free["field_gate"]]
    res = subprocess.run([sys.executable, str(ROOT / "samples" / "evaluate_tiny.py"), "--image-free"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2 and "--image-free" in res.stderr


def test_validation_set_takes_a_new_seed_prefix_and_a_type_subset():
    """A selection set is confirmed on a new prefix: other seeds give other conversations of the same
    types; `types` keeps those types and their held-out rows; a reserved or odd prefix and an unknown
    type are refused, on the command line with exit 2 before any model loads."""
    ev = _evaluate_tiny()
    def key(ep) -> str:
        return _conversation_key(ep.prompt_messages(), [sc.to_json() for sc in ep.scenes])

    sel, new = ev.validation_episodes(4), ev.validation_episodes(4, "confirm1")
    assert sel.keys() == new.keys()
    assert not {key(ep) for g in sel.values() for ep in g} & {key(ep) for g in new.values() for ep in g}
    assert [key(ep) for ep in ev.validation_episodes(4)["field_gate"]] == [key(ep) for ep in sel["field_gate"]]
    sub = ev.validation_episodes(4, "confirm1", ["count", "field_gate"])
    assert set(sub) == {"count", "field_gate", "shadow:count", "dark:count"}
    assert [key(ep) for ep in sub["count"]] == [key(ep) for ep in new["count"]]
    for bad in ("val", "valh", "train", "vqa", "sel-2", ""):
        with pytest.raises(ValueError, match="prefix"):
            ev.validation_episodes(1, bad)
    with pytest.raises(ValueError, match="nosuch"):
        ev.validation_episodes(1, "sel", ["nosuch"])
    for flags in (["--validation-seed", "val"], ["--validation-types", "count,nosuch"]):
        res = subprocess.run([sys.executable, str(ROOT / "samples" / "evaluate_tiny.py"), "--validation", "1", *flags],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert res.returncode == 2 and ("prefix" in res.stderr or "nosuch" in res.stderr), res.stderr[-500:]


def test_accuracy_command_reports_control_per_type(tmp_path):
    """The command that makes docs/models.md's accuracy tables runs end to end on a slice of the set."""
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "samples" / "evaluate_tiny.py"), "--model", str(_checkpoint_dir("qwen3_vl-tiny")),
           "--limit", "2", "--shuffle-rounds", "2", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| color | perception | 2 |" in res.stdout
    (r,) = json.loads(out.read_text())
    for split in ("heldout_style", "heldout_dark"):  # both held-out renderers are scored by default
        assert set(r[split]) == set(r["types"]) and all(v["n"] == 2 for v in r[split].values())
        assert f"| {split} | count |" in res.stdout
    assert r["shuffle_rounds"] == 2 and len(r["shuffled_predictions"]) == 2
    ev = _evaluate_tiny()
    fig = r["episodes"]["field_image_gate"]  # split by which halves of the conjunction hold
    eps = {ep.id: ep for ep in ev.E.load_split(ev.EPISODES) if ep.id in fig["predictions"]}
    for case, v in fig["cases"].items():
        ids = [k for k, ep in eps.items() if ev.E.case_name(ep) == case]
        assert v["n"] == len(ids) and v["accuracy"] == pytest.approx(
            sum(fig["predictions"][k] == eps[k].answer for k in ids) / len(ids))
        assert f"| episodes | field_image_gate: {case} | text_field | {len(ids)} |" in res.stdout
    assert sum(v["n"] for v in fig["cases"].values()) == fig["n"] == 2
    truth = {json.loads(line)["id"]: json.loads(line) for line in (ROOT / "samples" / "vqa" / "items.jsonl").open()}
    for t, v in r["types"].items():
        # the table's numbers follow from the answers it reports
        ids = [k for k in r["predictions"] if truth[k]["type"] == t]
        got = [rnd[k] for k in ids for rnd in r["shuffled_predictions"]]
        want = [truth[k]["answer"] for k in ids for _ in r["shuffled_predictions"]]
        assert v["n"] == len(ids) == 2
        assert v["shuffled"] == pytest.approx(sum(a == b for a, b in zip(got, want)) / len(got))
        assert v["chance"] == pytest.approx(ev.independent_chance(want, got))
        assert v["control_ok"] == (abs(v["shuffled"] - v["chance"]) <= 0.10)


@pytest.mark.parametrize("bad", ["colour=2", "count=many", "count=-1"])
def test_training_command_rejects_a_bad_type_weight(tmp_path, bad):
    cmd = [sys.executable, str(ROOT / "samples" / "train.py"), "--family", "qwen2_5_vl", "--out", str(tmp_path / "x"),
           "--steps", "1", "--weight", bad]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2 and "--weight" in res.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("bad", ["5=1", "two=1", "1=-0.5", "1=0,2=0"])
def test_training_command_rejects_a_bad_turn_weight(tmp_path, bad):
    cmd = [sys.executable, str(ROOT / "samples" / "train.py"), "--family", "qwen2_5_vl", "--out", str(tmp_path / "x"),
           "--steps", "1"]
    for item in bad.split(","):
        cmd += ["--turn-weight", item]
    if bad == "1=0,2=0":
        cmd += ["--turn-weight", "3=0", "--turn-weight", "4=0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2 and "--turn-weight" in res.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("bad", ["status=2", "tier=x", "tier=0", "tier=inf"])
def test_training_command_rejects_a_bad_field_weight(tmp_path, bad):
    cmd = [sys.executable, str(ROOT / "samples" / "train.py"), "--family", "qwen2_5_vl", "--out", str(tmp_path / "x"),
           "--steps", "1", "--field-weight", bad]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    err = res.stderr.split("error:")[-1]  # the reason, not an "unrecognized arguments" line
    assert res.returncode == 2 and (f"--field-weight {bad!r}: FIELD is one of" in err or "FIELD=NUMBER" in err)
    assert not (tmp_path / "x").exists()


def _readme_erratum_example() -> dict:
    """The skill text, the field line, the questions, the erratum and the printed answers of README's
    "Skills and errata" example, read from README itself (the test follows README, not a copy)."""
    import re

    text = (ROOT / "README.md").read_text()
    block = text.split("### Skills and errata", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    got = {
        "skill": re.search(r'"text": "([^"]+)"', block).group(1),
        "field": re.search(r'"text": "\\n(\w+): (\w+)"', block).groups(),
        "questions": re.findall(r'"(the customer asks[^"]+)"', block),
        "update": re.search(r'"field": "(\w+)", "value": "(\w+)"', block).groups(),
        "model": re.search(r'model="([^"]+)"', block).group(1),
        "printed": re.search(r'\)\s+# (\w+) -> (\w+)\s*$', block, re.M).groups(),
    }
    assert len(got["questions"]) == 2
    return got


def test_readme_skill_and_erratum_example_answers_as_printed():
    """README's flagship errata example, over HTTP with the official client on the bundled model it
    names: the first answer and the one after the erratum are what README prints, through the
    splice (skill spliced, earlier turns from the prefix cache) and through a full recompute."""
    import httpx

    import mmkv
    from mmkv.server.app import ServerSettings, create_app
    from test_server import LiveServer

    ex = _readme_erratum_example()
    engine = mmkv.Engine.from_pretrained(_checkpoint_dir(ex["model"]))
    server = LiveServer(create_app(engine, ServerSettings()))
    try:
        skill = httpx.post(f"{server.base_url}/v1/skills", json={"name": "refunds", "text": ex["skill"]}).json()
        client = server.client()
        field, value = ex["field"]
        history = [{"role": "system", "content": [{"type": "skill", "skill_id": skill["id"]},
                                                  {"type": "text", "text": f"\n{field}: {value}"}]},
                   {"role": "user", "content": ex["questions"][0]}]

        def ask(reuse: bool = True) -> tuple[str, dict]:
            r = client.chat.completions.create(model=ex["model"], messages=history, max_tokens=4, temperature=0,
                                               extra_body={} if reuse else {"mmkv": {"reuse": False}})
            return r.choices[0].message.content.strip(), r.model_extra["mmkv"]

        first, info = ask()
        assert info["skill_tokens_reused"] > 0
        assert first == ask(reuse=False)[0] == ex["printed"][0]
        history += [{"role": "assistant", "content": first},
                    {"role": "user", "content": [{"type": "state_update", "field": ex["update"][0], "value": ex["update"][1]},
                                                 {"type": "text", "text": ex["questions"][1]}]}]
        second, info = ask()
        assert info["prefix_tokens_reused"] > 0
        assert second == ask(reuse=False)[0] == ex["printed"][1]
    finally:
        server.close()
