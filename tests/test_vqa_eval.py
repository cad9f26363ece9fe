"""The VQA agreement evaluation: metrics against hand-computed cases, the exact-prefix arm's
prefix rule, the conversation shapes, and small runs of each task on a tiny random model (report
files, self-agreement, the exact arms, the splice against its block-masked oracle, the control,
the continue layout's prefix share, the stress grid and the errata task)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from typer.testing import CliRunner

from mmkv.engine import Engine
from mmkv.vqa_eval.cli import app
from mmkv.vqa_eval.compare import compare_reports
from mmkv.vqa_eval.dataset import load_vqa_set
from mmkv.vqa_eval.errata import run_errata
from mmkv.vqa_eval.grid import run_grid
from mmkv.vqa_eval.metrics import logit_cosine, normalize_answer, p90
from mmkv.vqa_eval.protocol import Shape, balanced_subset, build_conversation, to_messages
from mmkv.vqa_eval.run import (DEFAULT_SET, common_prefix_length, image_offset, merge_reports, run_eval,
                               token_keys)
from mmkv.vqa_eval.stats import clopper_pearson

# ----------------------------------------------------------------------------- metrics by hand


def test_answers_match_case_and_space_insensitively():
    assert normalize_answer(" Blue ") == "blue" and normalize_answer("two  shapes") == "two shapes"
    assert normalize_answer("three") != normalize_answer("two")


def test_logit_cosine_hand_cases():
    assert logit_cosine([1.0, 0.0], [0.0, 1.0]) == 0.0
    assert logit_cosine([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == pytest.approx(1.0, abs=1e-15)
    assert logit_cosine([1.0, 1.0], [1.0, 0.0]) == pytest.approx(1 / math.sqrt(2), abs=1e-15)
    assert logit_cosine(torch.tensor([3.0, -4.0]), torch.tensor([-3.0, 4.0])) == pytest.approx(-1.0)


def test_p90():
    assert p90(list(range(11))) == 9.0


def test_prefix_stops_at_a_different_image():
    """Image pads share one token id; the exact-prefix arm must not reuse one image's KV for another."""
    ids = torch.tensor([1, 2, 8, 9, 9, 9, 7, 3])  # 8 = vision_start, 9 = pad, 7 = vision_end
    a, b = token_keys(ids, [(2, 7)], ["img-a"]), token_keys(ids, [(2, 7)], ["img-b"])
    assert common_prefix_length(a, b) == 3  # up to and including vision_start
    assert common_prefix_length(a, a) == len(a) - 1  # capped: the last logits are computed


# ----------------------------------------------------------------------------- conversation shapes


@pytest.fixture(scope="module")
def pool():
    return load_vqa_set(DEFAULT_SET)


def test_conversations_are_seeded_and_move_the_image(pool):
    items = balanced_subset(pool, 9)
    assert len({it.type for it in items}) == 9
    c1, c2 = build_conversation(items[0], pool, 3), build_conversation(items[0], pool, 3)
    assert c1 == c2 and c1.later[-1].images == c1.earlier[-1].images == (items[0].image,)
    assert len(c1.later) >= 2 and c1.later[:-1] != c1.earlier[:-1]  # other text before the image
    assert build_conversation(items[0], pool, 4) != c1  # another seed, another conversation


def test_shapes_of_the_stress_grid(pool):
    item = pool[0]
    cont = build_conversation(item, pool, 0, Shape(layout="continue"))
    n = len(cont.earlier)
    assert cont.later[:n - 1] == cont.earlier[:-1] and cont.later[n - 1].answer == item.answer  # a continuation
    twice = build_conversation(item, pool, 0, Shape(image_twice=True))
    assert sum(item.image in t.images for t in twice.later) == 2
    two = build_conversation(item, pool, 0, Shape(two_images=True))
    assert len(two.later[-1].images) == 2 and two.later[-1].images[-1] == item.image
    gaps = build_conversation(item, pool, 0, Shape(later=(1, 1), text_gaps=3))
    assert [len(t.images) for t in gaps.later] == [1, 0, 0, 0, 1]
    nine = build_conversation(item, pool, 0, Shape(later=(9, 9)))
    assert len(nine.later) == 10


# ----------------------------------------------------------------------------- a 6-item, 2-seed run


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Engine.from_pretrained(tiny_dirs["qwen2_5_vl"])


@pytest.fixture(scope="module")
def report(engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    run_eval(limit=6, seeds=2, seed=0, out=out, max_new_tokens=2, engine=engine, progress=False)
    return out


@pytest.fixture(scope="module")
def data(report):
    return json.loads((report / "report.json").read_text())


def test_report_files_exist_and_parse(report, data):
    assert data["n"] == 12 and len(data["requests"]) == 12 and data["seeds"] == [0, 1]
    assert set(data["summary"]) == {"full", "prefix", "splice-k0", "splice-k1", "splice-k2", "splice-temporal",
                                    "no-rotate"}
    assert {(r["seed"], r["id"]) for r in data["requests"]} == {(s, r["id"]) for s in (0, 1)
                                                                  for r in data["requests"][:6]}
    md = (report / "report.md").read_text()
    assert "| arm | agreement k/n [exact 95%]" in md and "| no-rotate (control) | " in md
    assert "## Error decomposition" in md and "## Agreement by question type" in md
    from mmkv.vqa_eval.run import floors
    assert data["floors"] == floors(data["requests"])
    assert f"(the position controls' own floor): {data['floors']['shuffled_same_question']:.3f}." in md
    assert (report / "agreement.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_is_the_exact_interval_of_the_counts(data):
    for name, s in data["summary"].items():
        k = sum(r["arms"][name]["agree"] for r in data["requests"])
        assert s["agreement"]["k"] == k and s["agreement"]["n"] == 12
        assert (s["agreement"]["low"], s["agreement"]["high"]) == pytest.approx(clopper_pearson(k, 12))
        assert sum(t["n"] for t in s["by_type"].values()) == 12
        assert sum(t["flips"] for t in s["by_type"].values()) == 12 - k
    assert not data["summary"]["splice-k1"]["verdict"]["passed"]  # 12 requests cannot show 0.99


def test_exact_arms_match_full(data):
    for row in data["requests"]:
        assert row["arms"]["full"]["logit_cosine"] == pytest.approx(1.0, abs=1e-12)
        prefix = row["arms"]["prefix"]
        assert prefix["logit_cosine"] > 1 - 1e-6 and prefix["answer"] == row["arms"]["full"]["answer"]
        assert row["arms"]["splice-k1"]["vision_tower_runs"] == 0


def test_splice_equals_its_oracle_and_the_split_is_exact(data):
    """Rotation (splice vs block-masked oracle) is float noise for the native splice and large for
    the control; rotation + isolation is the arm's whole margin change."""
    for row in data["requests"]:
        k1, ctrl = row["arms"]["splice-k1"]["error"], row["arms"]["no-rotate"]["error"]
        assert k1["rotation_max_abs"] < 1e-3
        for e in (k1, ctrl):
            assert e["rotation"] + e["isolation"] == pytest.approx(e["margin_change"], abs=1e-9)
        if row["offset"] != 0:
            assert ctrl["rotation_max_abs"] > 1e-3
    assert "rotation" not in data["requests"][0]["arms"]["splice-k0"]["error"]  # no k=0 oracle by default


def test_full_agrees_with_itself_across_runs(engine, data, tmp_path):
    second = run_eval(arms=["full"], limit=6, seeds=2, seed=0, out=tmp_path, max_new_tokens=2, engine=engine,
                      progress=False)
    assert [r["arms"]["full"]["answer"] for r in second["requests"]] == [r["arms"]["full"]["answer"]
                                                                         for r in data["requests"]]
    assert second["summary"]["full"]["agreement"]["k"] == 12


def test_no_rotate_differs_where_the_image_moved(data):
    moved = [r for r in data["requests"] if r["offset"] != 0]
    assert moved, "the protocol must move the image"
    for row in moved:
        arms = row["arms"]
        assert arms["no-rotate"]["logit_cosine"] < 1 - 1e-4
        assert arms["no-rotate"]["logit_cosine"] < arms["splice-k1"]["logit_cosine"]


def test_continue_layout_gives_exact_prefix_its_share(engine, tmp_path, pool):
    rep = run_eval(arms=["prefix", "splice-k1"], limit=3, seeds=1, out=tmp_path, max_new_tokens=2, engine=engine,
                   progress=False, layout="continue", decomposition=False)
    convs = [build_conversation(it, pool, 0, Shape(layout="continue")) for it in balanced_subset(pool, 3)]
    for row, conv in zip(rep["requests"], convs):
        file_ids = {p: engine.add_image(open(p, "rb").read()) for p in conv.images}
        earlier_len = engine.prompt_ids(to_messages(conv.system, conv.earlier, file_ids)).numel()
        assert row["arms"]["prefix"]["cached_tokens"] >= earlier_len  # the whole earlier prompt is reused
        assert row["arms"]["prefix"]["answer"] == row["arms"]["full"]["answer"]


def test_an_image_moved_earlier_has_a_negative_offset(engine, pool):
    conv = build_conversation(pool[0], pool, 0, Shape(earlier=(1, 1), later=(0, 0), systems=(".",)))
    file_ids = {p: engine.add_image(open(p, "rb").read()) for p in conv.images}
    assert image_offset(engine, to_messages(conv.system, conv.later, file_ids)) < 0


def test_cli_runs(tiny_dirs, tmp_path):
    result = CliRunner().invoke(app, [str(tiny_dirs["qwen2_5_vl"]), "--arms", "prefix", "--limit", "3", "--seeds", "1",
                                      "--max-new-tokens", "1", "--out", str(tmp_path), "--no-decomposition"])
    assert result.exit_code == 0, result.output
    assert re.search(r"^\| prefix \| \d/3 ", result.output, re.M), result.output
    assert json.loads((tmp_path / "report.json").read_text())["arms"].keys() == {"full", "prefix"}
    bad = CliRunner().invoke(app, [str(tiny_dirs["qwen2_5_vl"]), "--task", "nope", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "--task" in bad.output


# ----------------------------------------------------------------------------- grid, errata, compare


def test_grid_small(engine, tmp_path):
    rep = run_grid(limit=2, conditions=["first-turn", "two-images", "continue"], arms=["splice-k1", "no-rotate"],
                   out=tmp_path, max_new_tokens=2, engine=engine, progress=False)
    assert list(rep["by_condition"]) == ["first-turn", "two-images", "continue"] and rep["n"] == 6
    assert all(r["images"] == 3 for r in rep["requests"] if r["condition"] == "two-images" and r["later_turns"] == 1)
    assert sum(b["n"] for b in rep["by_offset"]["splice-k1"]) == 6
    md = (tmp_path / "report.md").read_text()
    assert "| first-turn | 2 |" in md and "## Agreement by asked image's offset" in md
    assert (tmp_path / "grid.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="grid condition"):
        run_grid(conditions=["nope"], engine=engine)


def test_errata_small(engine, tmp_path):
    rep = run_errata(limit=2, ks=[1], out=tmp_path, max_new_tokens=2, engine=engine, progress=False)
    s, n = rep["summary"], rep["n"]
    assert rep["arms"] == ["recompute", "erratum", "in_place", "selective@1", "stale"] and n == 2
    for arm in ("recompute", "erratum", "in_place", "selective@1"):
        assert s[arm]["detected"] == n and s[arm]["field_named_right"] == n  # the rule calls these edits
        assert sum(s[arm]["applied"].values()) == n
    assert s["stale"]["detected"] == 0 and s["recompute"]["agreement"]["k"] == n
    assert s["in_place"]["lm_tokens_computed"] < s["recompute"]["lm_tokens_computed"]
    assert "| selective@1 |" in (tmp_path / "report.md").read_text()


def test_compare_reports_pairs_requests(tmp_path):
    def rep(model, flags):
        return {"model": model, "reference": "full", "summary": {"full": {}, "splice-k1": {}},
                "requests": [{"seed": 0, "id": f"i{i}", "layout": "new_chat",
                              "arms": {"splice-k1": {"agree": f}}} for i, f in enumerate(flags)]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(rep("m1", [True] * 10)))
    b.write_text(json.dumps(rep("m2", [False] * 4 + [True] * 6)))
    assert "| splice-k1 | 10 | 4 | 0 | 0.125 |" in compare_reports(a, b)


def test_compare_command_takes_two_reports_as_documented(tmp_path):
    """`mmkv eval --compare A B` (docs/eval.md's form): the table; one report, a file that is not a
    report, or a missing one: a clear error and exit code 2, never a traceback."""
    from mmkv.vqa_eval.cli import app

    rep = {"model": "m", "reference": "full", "summary": {"full": {}, "splice-k1": {}},
           "requests": [{"seed": 0, "id": "i0", "layout": "new_chat", "arms": {"splice-k1": {"agree": True}}}]}
    a, b, junk = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "junk.json"
    a.write_text(json.dumps(rep))
    b.write_text(json.dumps(rep | {"model": "n"}))
    junk.write_text(json.dumps({"model": "x"}))
    ok = CliRunner().invoke(app, ["--compare", str(a), str(b)])
    assert ok.exit_code == 0 and "| splice-k1 | 1 | 0 | 0 | 1 |" in ok.output
    for args in (["--compare", str(a)], ["--compare", str(a), str(junk)], ["--compare", str(a), str(tmp_path / "no.json")]):
        bad = CliRunner().invoke(app, args)
        assert bad.exit_code == 2, (args, bad.output)
        assert bad.exception is None or isinstance(bad.exception, SystemExit), (args, bad.exception)


def test_merge_of_seed_shards_equals_the_whole_run(data, tmp_path):
    paths = []
    for s in (0, 1):
        part = {**data, "seeds": [s], "requests": [r for r in data["requests"] if r["seed"] == s]}
        paths.append(tmp_path / f"s{s}.json")
        paths[-1].write_text(json.dumps(part))
    merged = merge_reports(paths, tmp_path / "merged")
    assert merged["n"] == 12 and merged["seeds"] == [0, 1]
    for name, s in data["summary"].items():
        assert merged["summary"][name]["agreement"] == s["agreement"]
        assert merged["summary"][name]["by_type"] == s["by_type"]
    with pytest.raises(ValueError, match="share conversation seeds"):
        merge_reports([paths[0], paths[0]], tmp_path / "again")


def test_errata_chain_runs_loops_of_edits_on_their_own_kv(engine, tmp_path):
    """`--chain N`: each conversation as a loop of N edits; in_place applies at every step, edits
    the previous step (few tokens where recompute's grow with the turns) and is scored against
    recompute at the same step."""
    rep = run_errata(limit=2, ks=[2], out=tmp_path, max_new_tokens=2, engine=engine, progress=False, chain=3)
    c = rep["chain"]
    assert c["steps"] == 3 and c["arms"] == ["recompute", "in_place", "selective@2"]
    ref, ip = c["summary"]["recompute"], c["summary"]["in_place"]
    assert [e["step"] for e in ip] == [1, 2, 3] and all(e["applied"] == rep["n"] for e in ip)
    assert all(e["agreement"]["k"] == e["agreement"]["n"] == rep["n"] for e in ref)  # recompute vs itself
    assert ref[2]["lm_tokens_computed"] > ref[0]["lm_tokens_computed"]  # the loop grows: recompute pays for it
    assert all(e["lm_tokens_computed"] < r["lm_tokens_computed"] for e, r in zip(ip[1:], ref[1:]))
    assert "## Chained edits: 3 per conversation" in (tmp_path / "report.md").read_text()


def _floor_rows(spec: list[tuple[str, str, str]]) -> list[dict]:
    return [{"type": t, "question": q, "arms": {"full": {"answer": a}}} for t, q, a in spec]


def test_floors_same_question_is_the_unbiased_chance_another_request_of_that_question_agrees():
    """floors(): per type, `shuffled_image` is sum P(answer)^2; `shuffled_same_question` pairs each
    request only with *other* requests of its question (a question asked once takes its type's
    unbiased figure). Worked by hand on a set where the question fixes the answer."""
    from mmkv.vqa_eval.run import floors

    rows = _floor_rows([("shape_of_color", "what shape is the red one ?", "circle")] * 3
                       + [("shape_of_color", "what shape is the blue one ?", "square")] * 3)
    f = floors(rows)
    assert f["shuffled_image"] == pytest.approx(0.5)  # (3/6)^2 + (3/6)^2
    assert f["image_blind"] == pytest.approx(0.5)
    assert f["shuffled_same_question"] == pytest.approx(1.0)  # the question gives the answer away
    # unbiased: two requests of one question that disagree never agree with each other
    rows = _floor_rows([("count", "how many ?", "two"), ("count", "how many ?", "three")])
    assert floors(rows)["shuffled_same_question"] == 0.0 and floors(rows)["shuffled_image"] == pytest.approx(0.5)
    # a question asked once falls back to its type: (a, a, b) -> pairs agree 2 of 6 ordered = 1/3
    rows = _floor_rows([("color", "q1", "red"), ("color", "q1", "red"), ("color", "q2", "blue")])
    assert floors(rows)["shuffled_same_question"] == pytest.approx((2 * 1.0 + 1 * (1 / 3)) / 3)

