"""`mmkv eval --task video`: the synthetic clips show what their labels say (read back from the
pixels), the shuffled control reorders groups only, and a small run on the bundled model serves
every arm as claimed (the splice and no-rotate arms from the upload's KV, the tower never run)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from mmkv.cli import app
from mmkv.vqa_eval.video_eval import ANSWERS, ARMS, COLOURS, TYPES, draw_clip, shuffled


def _pixels(img) -> np.ndarray:
    return np.asarray(img).astype(int)


def _mask(img, colour: str) -> np.ndarray:
    return (np.abs(_pixels(img) - np.array(COLOURS[colour])).sum(-1) < 30)


def _centre(img, colour: str) -> np.ndarray:
    ys, xs = np.nonzero(_mask(img, colour))
    return np.array([xs.mean(), ys.mean()])


@pytest.mark.parametrize("seed", range(6))
def test_clips_show_their_labels(seed):
    d = draw_clip("direction", seed)
    dx, dy = _centre(d.frames[-1][0], "red") - _centre(d.frames[0][0], "red")
    seen = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
    assert seen == d.answer
    f = draw_clip("first_colour", seed)
    first = next(i for i, (img, _) in enumerate(f.frames) if any(_mask(img, c).any() for c in COLOURS))
    assert [c for c in COLOURS if _mask(f.frames[first][0], c).sum() > 100] == [f.answer]
    c = draw_clip("count_end", seed)
    assert sum(_mask(c.frames[-1][0], col).sum() > 100 for col in COLOURS) == ANSWERS["count_end"].index(c.answer) + 1
    light = draw_clip("light_green", seed)
    assert _mask(light.frames[-1][0], "green").any() == (light.answer == "yes")
    assert [t for _, t in d.frames] == [i / 2 for i in range(8)]


def test_shuffled_control_reorders_groups_only():
    clip = draw_clip("direction", 3)
    mixed = shuffled(clip, 7)
    assert [t for _, t in mixed] == [t for _, t in clip.frames]
    groups = [tuple(id(f) for f, _ in clip.frames[i:i + 2]) for i in range(0, 8, 2)]
    moved = [tuple(id(f) for f, _ in mixed[i:i + 2]) for i in range(0, 8, 2)]
    assert sorted(moved) == sorted(groups) and moved != groups


def test_small_run_on_the_bundled_model(tmp_path):
    result = CliRunner().invoke(app, ["eval", "--task", "video", "--limit", "1", "--seeds", "1", "--threads", "1",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["task"] == "video" and report["n"] == len(TYPES)
    for row in report["requests"]:
        arms = row["arms"]
        assert set(arms) == set(ARMS) and row["label"] in ANSWERS[row["type"]]
        for arm in ("splice", "no-rotate"):  # uploaded before the conversation: its groups' KV is reused
            assert arms[arm]["vision_tower_runs"] == 0 and arms[arm]["video_tokens_reused"] > 0
        for arm in ("full", "shuffled"):
            assert arms[arm]["vision_tower_runs"] > 0 and arms[arm]["video_tokens_reused"] == 0
        assert arms["full"]["agree"] and arms["full"]["first_agree"]
    summary = report["summary"]["all"]
    assert summary["n"] == len(TYPES) and summary["full"]["agreement"]["k"] == len(TYPES)
    assert "| light_green | 1 | 0.50 |" in (tmp_path / "report.md").read_text()


def test_set_is_refused_for_video(tmp_path):
    """The video task draws its clips: a --set would be ignored, so it is refused."""
    result = CliRunner().invoke(app, ["eval", "--task", "video", "--set", str(tmp_path), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--set applies to the VQA set" in result.output


def test_dial_arms_on_the_qwen3_video_model(tmp_path):
    """`--blend` adds a splice arm per fidelity-dial ratio (kind video). At r = 1 every group's
    tokens are recomputed in context: its answer and first token equal the full recompute's on
    every conversation (the oracle), the vision tower still does not run, and the report has the
    arm's column. `--blend-select` is the agreement task's and is refused here."""
    model = "samples/models/qwen3_vl-tiny-video"
    result = CliRunner().invoke(app, ["eval", model, "--task", "video", "--limit", "1", "--seeds", "1",
                                      "--threads", "1", "--blend", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["arms"] == [*ARMS, "blend 1"]
    for row in report["requests"]:
        dial = row["arms"]["blend 1"]
        assert dial["agree"] and dial["first_agree"] and dial["vision_tower_runs"] == 0
    assert report["summary"]["all"]["blend 1"]["agreement"]["k"] == len(TYPES)
    assert "blend 1 agreement |" in (tmp_path / "report.md").read_text()
    refused = CliRunner().invoke(app, ["eval", model, "--task", "video", "--blend", "0.1", "--blend-select",
                                       "stride", "--out", str(tmp_path)])
    assert refused.exit_code == 2 and "--blend-select" in refused.output
