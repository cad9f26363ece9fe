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


def test_stream_questions_compute_the_new_groups_not_the_stream(tiny_dirs):
    """bench_stream's rows: each question after k new groups runs the tower k times and computes
    the same tokens (within a prefix block) at every length while the window grows (the earlier groups reused); a full
    recompute computes the whole prompt."""
    import torch

    from mmkv import Engine
    from mmkv.bench.video import bench_stream, format_stream

    engine = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu")
    s = bench_stream(engine, 1, group_tokens=4, ks=(1, 2), points=(4, 6, 10), window=6)
    assert [(r["k"], r["stream_groups"], r["window_groups"]) for r in s["rows"]] == [
        (1, 4, 4), (1, 6, 6), (1, 10, 6), (2, 4, 4), (2, 6, 6), (2, 10, 6)]
    for k in (1, 2):
        rows = [r for r in s["rows"] if r["k"] == k]
        assert all(r["mmkv_vision_runs"] == k for r in rows)
        # the stream grew, the work did not (up to the prefix cache's block alignment, 16 tokens)
        assert abs(rows[0]["mmkv_computed_tokens"] - rows[1]["mmkv_computed_tokens"]) < 16
        assert all(r["full_computed_tokens"] == r["prompt_tokens"] for r in rows)
        assert rows[1]["full_computed_tokens"] > rows[0]["full_computed_tokens"]
    assert "| 2 | 10 | 6 |" in format_stream(s)
