"""The VQA agreement evaluation: metrics against hand-computed cases, the exact-prefix arm's
prefix rule, and a 6-item run on a tiny random model (report files, self-agreement, the control)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from mmkv.engine import Engine
from mmkv.vqa_eval.cli import app
from mmkv.vqa_eval.dataset import load_vqa_set
from mmkv.vqa_eval.metrics import Estimate, agreement_flags, bootstrap_ci, logit_cosine, p90
from mmkv.vqa_eval.protocol import balanced_subset, build_conversation
from mmkv.vqa_eval.run import DEFAULT_SET, common_prefix_length, run_eval, token_keys

# ----------------------------------------------------------------------------- metrics by hand


def test_agreement_hand_case():
    flags = agreement_flags(["red", " Blue ", "two", "circle"], ["red", "blue", "three", "square"])
    assert flags.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert Estimate.of(flags).value == 0.5


def test_logit_cosine_hand_cases():
    assert logit_cosine([1.0, 0.0], [0.0, 1.0]) == 0.0
    assert logit_cosine([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == pytest.approx(1.0, abs=1e-15)
    assert logit_cosine([1.0, 1.0], [1.0, 0.0]) == pytest.approx(1 / math.sqrt(2), abs=1e-15)
    assert logit_cosine(torch.tensor([3.0, -4.0]), torch.tensor([-3.0, 4.0])) == pytest.approx(-1.0)


def test_bootstrap_bounds_hand_cases():
    assert bootstrap_ci(np.ones(20)) == (1.0, 1.0)
    # 50 zeros, 50 ones: the mean's standard error is 0.05, so the 95% interval is about 0.5 +- 0.098.
    low, high = bootstrap_ci([0] * 50 + [1] * 50, n_boot=4000, seed=1)
    assert low == pytest.approx(0.402, abs=0.03) and high == pytest.approx(0.598, abs=0.03)
    assert bootstrap_ci([0, 1, 1, 0, 1], seed=5) == bootstrap_ci([0, 1, 1, 0, 1], seed=5)
    med = Estimate.of([1.0, 2.0, 3.0, 4.0, 100.0], np.median)
    assert med.value == 3.0 and 1.0 <= med.low <= 3.0 <= med.high <= 100.0 and med.n == 5
    assert p90(list(range(11))) == 9.0


def test_prefix_stops_at_a_different_image():
    """Image pads share one token id; the exact-prefix arm must not reuse one image's KV for another."""
    ids = torch.tensor([1, 2, 8, 9, 9, 9, 7, 3])  # 8 = vision_start, 9 = pad, 7 = vision_end
    a, b = token_keys(ids, [(2, 7)], ["img-a"]), token_keys(ids, [(2, 7)], ["img-b"])
    assert common_prefix_length(a, b) == 3  # up to and including vision_start
    assert common_prefix_length(a, a) == len(a) - 1  # capped: the last logits are computed


def test_conversations_are_seeded_and_move_the_image():
    pool = load_vqa_set(DEFAULT_SET)
    items = balanced_subset(pool, 9)
    assert len({it.type for it in items}) == 9
    c1, c2 = build_conversation(items[0], pool, 3), build_conversation(items[0], pool, 3)
    assert c1 == c2 and c1.later[-1].image == c1.earlier[-1].image == items[0].image
    assert len(c1.later) >= 2 and c1.later[:-1] != c1.earlier[:-1]  # other text before the image


# ----------------------------------------------------------------------------- a 6-item run


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Engine.from_pretrained(tiny_dirs["qwen2_5_vl"])


@pytest.fixture(scope="module")
def report(engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    run_eval(limit=6, seed=0, out=out, max_new_tokens=2, engine=engine, progress=False)
    return out


def test_report_files_exist_and_parse(report):
    data = json.loads((report / "report.json").read_text())
    assert data["n"] == 6 and len(data["items"]) == 6
    assert set(data["summary"]) == {"full", "prefix", "splice-k0", "splice-k1", "splice-k2", "splice-temporal",
                                    "no-rotate"}
    for row in data["items"]:
        assert set(row["arms"]) == set(data["summary"])
    md = (report / "report.md").read_text()
    assert "| arm | n | agreement |" in md and "| no-rotate | 6 |" in md
    assert (report / "agreement.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_exact_arms_match_full(report):
    data = json.loads((report / "report.json").read_text())
    for row in data["items"]:
        assert row["arms"]["full"]["logit_cosine"] == pytest.approx(1.0, abs=1e-12)
        prefix = row["arms"]["prefix"]
        assert prefix["logit_cosine"] > 1 - 1e-6 and prefix["answer"] == row["arms"]["full"]["answer"]
        assert prefix["lm_tokens_computed"] < row["arms"]["full"]["lm_tokens_computed"]
        assert row["arms"]["splice-k1"]["vision_tower_runs"] == 0


def test_full_agrees_with_itself_across_runs(engine, report, tmp_path):
    first = json.loads((report / "report.json").read_text())
    second = run_eval(arms=["full"], limit=6, seed=0, out=tmp_path, max_new_tokens=2, engine=engine, progress=False)
    assert [r["arms"]["full"]["answer"] for r in second["items"]] == [r["arms"]["full"]["answer"]
                                                                      for r in first["items"]]
    assert second["summary"]["full"]["overall"]["agreement"]["value"] == 1.0


def test_no_rotate_differs_where_the_image_moved(report):
    data = json.loads((report / "report.json").read_text())
    moved = [r for r in data["items"] if r["offset"] != 0]
    assert moved, "the protocol must move the image"
    for row in moved:
        arms = row["arms"]
        assert arms["no-rotate"]["logit_cosine"] < 1 - 1e-4
        assert arms["no-rotate"]["logit_cosine"] < arms["splice-k1"]["logit_cosine"]


def test_cli_runs(tiny_dirs, tmp_path):
    result = CliRunner().invoke(app, [str(tiny_dirs["qwen2_5_vl"]), "--arms", "prefix", "--limit", "3",
                                      "--max-new-tokens", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "| prefix | 3 |" in result.output
    assert json.loads((tmp_path / "report.json").read_text())["arms"].keys() == {"full", "prefix"}
