"""`mmkv bench --modes video` on the tiny config, one round: each arm computes the tokens it claims
(the splice: the new text and one seam token a group; the tower never runs on a reuse arm), and bad
clip settings are refused. Timings are measured by the bench, never asserted here."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mmkv.cli import app


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--config", "tiny", "--threads", "1", "--repeats", "1", "--modes",
                                      "video", "--video-groups", "3", "--group-tokens", "16", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "### video: video, 3 groups of 16 tokens" in result.output
    tables = json.loads(out.read_text())["tables"]
    assert [t["mode"] for t in tables] == ["video"]
    return tables[0]


def test_video_arms_compute_what_they_claim(table):
    rows, n, notes = {r["arm"]: r for r in table["rows"]}, table["prompt_tokens"], table["notes"]
    hit, groups, new = notes["prefix_hit_tokens"], notes["groups"], notes["new_tokens"]
    assert groups == 3 and notes["video_tokens"] == notes["chunk_tokens"] == 3 * 16  # Qwen2.5-VL: pads only
    assert rows["full recompute"]["computed_tokens"] == n and rows["full recompute"]["vision_runs"] == 1
    assert 0 < hit and rows["exact-prefix caching"]["computed_tokens"] == n - hit
    assert rows["encoder cache + prefix caching"]["computed_tokens"] == n - hit
    assert rows["encoder cache + prefix caching"]["vision_runs"] == 0
    # every group's KV comes from the cache except its seam token
    assert rows["mmkv splice k=1"]["computed_tokens"] == n - hit - notes["video_tokens"] + groups == new
    assert rows["mmkv splice k=0"]["computed_tokens"] == new - groups
    for arm in ("engine (reuse)", "text-only turn", "limit"):
        assert rows[arm]["computed_tokens"] == new, arm
        assert rows[arm]["vision_runs"] == 0, arm
    assert rows["limit"]["pct_of_limit"] == pytest.approx(100.0)


@pytest.mark.parametrize("args, message", [(["--video-groups", "1"], "2 to 384 groups"),
                                           (["--group-tokens", "15"], "square number")])
def test_bad_clip_settings_refused(args, message):
    result = CliRunner().invoke(app, ["bench", "--config", "tiny", "--threads", "1", "--modes", "video", *args])
    assert result.exit_code == 2 and message in result.output
