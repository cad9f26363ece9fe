"""`mmkv bench` on the tiny config, one round: the JSON holds every table, and each arm computes
the tokens it claims (timings are measured by the bench, never asserted here)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mmkv.cli import app


AGENT_TURNS = 6


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--config", "tiny", "--threads", "1", "--repeats", "1",
                                      "--image-tokens", "16", "--skill-tokens", "64", "--policy-tokens", "64",
                                      "--turns", "2", "--agent-turns", str(AGENT_TURNS), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "torch threads 1" in result.output and "### image" in result.output
    return json.loads(out.read_text())


def _rows(table):
    return {r["arm"]: r for r in table["rows"]}


def test_report_shape(report):
    assert report["threads"] == 1 and report["repeats"] == 1
    assert {"python", "torch", "transformers"} <= set(report["versions"])
    assert report["model"]["family"] == "qwen2_5_vl" and report["model"]["dtype"] == "float32"
    assert [t["mode"] for t in report["tables"]] == ["image", "skill", "errata"]
    for table in report["tables"]:
        rows = _rows(table)
        assert rows["limit"]["pct_of_limit"] == pytest.approx(100.0)
        full = next(r for name, r in rows.items() if name.startswith("full recompute"))
        assert full["speedup_vs_full"] == pytest.approx(1.0)
        for r in table["rows"]:
            assert len(r["runs_ms"]) in (1, 5) and r["ms"] > 0 and r["cpu_ms"] > 0


@pytest.mark.parametrize("mode", ["image", "skill"])
def test_chunk_arms_compute_what_they_claim(report, mode):
    table = next(t for t in report["tables"] if t["mode"] == mode)
    rows, n, hit, new = _rows(table), table["prompt_tokens"], table["notes"]["prefix_hit_tokens"], table["notes"]["new_tokens"]
    image = int(mode == "image")
    assert rows["full recompute"]["computed_tokens"] == n
    prefix = next(r for name, r in rows.items() if name.startswith("exact-prefix caching"))
    assert prefix["computed_tokens"] == n - hit and (hit > 0) == (prefix["arm"] == "exact-prefix caching")
    assert (rows["full recompute"]["vision_runs"], prefix["vision_runs"]) == (image, image)
    if image:
        assert rows["encoder cache + prefix caching"] == {**rows["encoder cache + prefix caching"], "computed_tokens": n - hit,
                                                          "vision_runs": 0}
    else:
        assert "encoder cache + prefix caching" not in rows
    # the chunk (all but its seam token) is the only difference between the splice and exact-prefix caching
    assert rows["mmkv splice k=1"]["computed_tokens"] == n - hit - table["notes"]["chunk_tokens"] + 1 == new
    assert rows["mmkv splice k=0"]["computed_tokens"] == new - 1
    for arm in ("engine (reuse)", "text-only turn", "limit"):
        assert rows[arm]["computed_tokens"] == new, arm
    assert all(r["vision_runs"] == 0 for name, r in rows.items() if "splice" in name or "limit" in name)


def test_errata_arms(report):
    rows = _rows(next(t for t in report["tables"] if t["mode"] == "errata"))
    erratum = rows["mmkv erratum (appended)"]["computed_tokens"]
    assert rows["limit"]["computed_tokens"] == rows["text-only turn"]["computed_tokens"] == erratum
    assert rows["full recompute"]["computed_tokens"] > rows["exact-prefix caching (field edited in place)"]["computed_tokens"] > erratum
    table = next(t for t in report["tables"] if t["mode"] == "errata")
    assert table["notes"]["in_place_applied"] == "1/1 turns"  # the in_place arm ran in_place, not a fallback
    in_place = rows["mmkv in_place (field edited, old KV reused)"]["computed_tokens"]
    assert in_place < rows["exact-prefix caching (field edited in place)"]["computed_tokens"]


def test_copy_and_bytes(report):
    kv_per_token = 2 * 3 * 2 * 16 * 4  # layers x KV heads x head_dim x float32, keys and values (tiny config)
    assert [r["chunk"] for r in report["copy"]] == ["image, 18 tokens", "skill, 91 tokens"]
    for r in report["copy"]:
        assert r["bytes"] == kv_per_token * int(r["chunk"].split(", ")[1].split()[0])
        assert r["ratio"] == pytest.approx(r["splice_gb_s"] / r["clone_gb_s"])
    for r in report["bytes"]:
        assert r["kv_bytes_per_token"] == r["ideal_bytes_per_token"] == kv_per_token
    image = report["bytes"][0]
    assert image["stored_bytes_per_token"] > kv_per_token  # the image's visual features are kept too
    copied, spliced = report["bytes"][-2:]  # most blocks of a turn splicing the skill reference it
    assert "text turn" in copied["what"] and copied["stored_bytes_per_token"] > kv_per_token  # tensors' own heap
    assert "reference it" in spliced["what"] and spliced["stored_bytes_per_token"] < copied["stored_bytes_per_token"] / 2
    for r in report["copy"]:
        assert r["before_ratio"] == pytest.approx(r["before_gb_s"] / r["clone_gb_s"])


def test_agent_session_adds_up_and_matches_its_plan(report):
    """Each arm's cumulative figures are the sums of its turns; mmkv reuses exactly what the plan
    says (block prefix of an earlier prompt + the spliced chunks after it); the full recompute
    computes every token and encodes every screenshot attached; exact-prefix caching reuses whole
    blocks only; mmkv runs the vision tower once per new screenshot, never for one shown again."""
    from dataclasses import asdict

    from mmkv.bench.run import agent_script

    a = report["agent"]
    script = agent_script(AGENT_TURNS, 0)  # seeded: the same session every run
    assert a["script"] == [asdict(t) for t in script] and (a["turns"], a["seed"], a["window"]) == (AGENT_TURNS, 0, 0)
    assert script[0].new_screenshot == 0 and script[1].shown_again and script[2].erratum  # every kind of turn
    rows = a["sessions"][-1]
    summary = {r["arm"]: r for r in a["summary"]}
    for arm, r in summary.items():
        for key in ("ms", "cpu_ms", "computed_tokens", "vision_runs", "reused_tokens"):
            assert r[key] == pytest.approx(sum(t["arms"][arm][key] for t in rows)), (arm, key)
    attached = 0
    for t, turn in zip(rows, script):
        attached += (turn.new_screenshot is not None) + len(turn.shown_again)
        full, prefix, mmkv = (t["arms"][arm] for arm in ("full recompute", "exact-prefix caching", "mmkv exact"))
        assert (full["computed_tokens"], full["vision_runs"], full["reused_tokens"]) == (t["prompt_tokens"], attached, 0)
        assert prefix["reused_tokens"] % 16 == 0 and prefix["computed_tokens"] == t["prompt_tokens"] - prefix["reused_tokens"]
        assert prefix["reused_tokens"] > 0 and prefix["vision_runs"] <= full["vision_runs"]
        assert mmkv["reused_tokens"] == t["mmkv_expected_reused"] >= prefix["reused_tokens"]
        assert mmkv["vision_runs"] == int(turn.new_screenshot is not None)
        # first sight: a new screenshot is computed in its turn, its chunk built after it (untimed)
        assert (mmkv["background_tokens"] > 0) == (turn.new_screenshot is not None)
    assert [p["turn"] for p in a["per_turn"]] == [t["turn"] for t in rows]
    assert summary["mmkv exact"]["reused_tokens"] > summary["exact-prefix caching"]["reused_tokens"]
    # a turn that continues the last one reuses its prompt's end too, past its last full block
    assert any(0 < t["mmkv_kept_tail"] < 16 for t in rows)
    assert summary["full recompute"]["speedup_vs_full"] == pytest.approx(1.0)
    assert summary["exact-prefix caching"]["speedup_vs_prefix"] == pytest.approx(1.0)  # ratios of a sum to itself
    assert summary["limit"]["pct_of_limit"] == pytest.approx(100.0)


def test_full_size_config_refused_when_memory_is_short(monkeypatch):
    import mmkv.bench.run as bench_run

    monkeypatch.setattr(bench_run, "_available_bytes", lambda device: 1 << 30)
    with pytest.raises(bench_run.BenchError, match=r"qwen2.5-vl-7b needs 1[0-9]\.\d GiB of cpu memory"):
        bench_run.build_engine("qwen2.5-vl-7b", None, "cpu", None, 256)
    result = CliRunner().invoke(app, ["bench", "--config", "qwen3-vl-8b", "--modes", "nope"])
    assert result.exit_code == 2 and "unknown nope" in result.output


@pytest.mark.parametrize("mode", ["image", "skill"])
def test_decode_after_splice_and_full_prefill(report, mode):
    table = next(t for t in report["tables"] if t["mode"] == mode)
    d = table["decode"]
    assert d["steps"] == 16 and d["full_tokens_s"] > 0 and d["splice_tokens_s"] > 0
    assert d["splice_over_full"] == pytest.approx(d["splice_tokens_s"] / d["full_tokens_s"])
    for arm, runs in d["runs_cpu_ms"].items():
        assert len(runs) == 1, arm


def test_engine_arm_stops_its_cpu_time_at_the_first_token(report):
    """The prefix-cache insert runs after the first token (Run.first_token_out): the engine arm's
    CPU time excludes it and reports it on its own; the mechanism arms have nothing after."""
    skill = _rows(next(t for t in report["tables"] if t["mode"] == "skill"))
    assert skill["engine (reuse)"]["after_first_token_cpu_ms"] > 0
    assert skill["limit"]["after_first_token_cpu_ms"] == skill["mmkv splice k=1"]["after_first_token_cpu_ms"] == 0


# ---- windowed agent trajectories ------------------------------------------------------------------
def _sent(msgs):
    """The file ids of a request's image parts, in order, and its text parts."""
    parts = [p for m in msgs if isinstance(m["content"], list) for p in m["content"]]
    return [p["image_file"]["file_id"] for p in parts if p["type"] == "image_file"], \
        [p for p in parts if p["type"] != "image_file"]


@pytest.mark.parametrize("chunk, sent", [(1, [1, 2, 3, 3, 3, 3, 3, 3, 3]),  # UI-TARS: keeps the last 3, one drop a turn
                                         (3, [1, 2, 3, 4, 5, 3, 4, 5, 3])])  # Anthropic's loop: 3 at a time
def test_window_drops_the_oldest_screenshots_one_at_a_time_or_in_chunks(chunk, sent):
    """A client keeping 3 screenshots of a session that shows a new one every turn: how many each
    request carries, stored as those agents' loops send them; the ones kept are always the newest
    and every text part stays."""
    from mmkv.bench.run import AgentTurn, agent_messages

    script = [AgentTurn(i, [], None) for i in range(9)]
    ids = [f"img-{i}" for i in range(9)]
    for t in range(9):
        whole_images, whole_text = _sent(agent_messages(script, t, "skill", ids))
        images, text = _sent(agent_messages(script, t, "skill", ids, window=3, drop_chunk=chunk))
        assert len(images) == sent[t] and images == whole_images[len(whole_images) - sent[t]:]
        assert text == whole_text


@pytest.mark.parametrize("window, chunk", [(3, 1), (5, 1), (3, 3), (4, 2)])
def test_window_on_the_seeded_session(window, chunk):
    """On the seeded 24-turn session (several screenshots in some turns, earlier ones shown again):
    one at a time, a request never carries more than the window; in chunks of k, at most window +
    k - 1, and every turn drops a multiple of k; the newest image parts are the ones kept."""
    from mmkv.bench.run import agent_messages, agent_script

    script = agent_script(24, 0)
    ids = [f"img-{i}" for i in range(24)]
    dropped_before = 0
    for t in range(24):
        whole, _ = _sent(agent_messages(script, t, "skill", ids))
        images, _ = _sent(agent_messages(script, t, "skill", ids, window=window, drop_chunk=chunk))
        assert min(len(whole), window) <= len(images) <= window + chunk - 1
        assert images == whole[len(whole) - len(images):]
        dropped = len(whole) - len(images)
        assert dropped % chunk == 0 and dropped >= dropped_before
        dropped_before = dropped
    assert dropped_before > 0


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """The agent session of `report` with the client keeping only the last 2 screenshots."""
    out = tmp_path_factory.mktemp("bench") / "window.json"
    result = CliRunner().invoke(app, ["bench", "--config", "tiny", "--threads", "1", "--repeats", "1",
                                      "--modes", "agent", "--image-tokens", "16", "--skill-tokens", "64",
                                      "--agent-turns", str(AGENT_TURNS), "--window", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "keeps the last 2 screenshots, dropping them one at a time" in result.output
    assert "mmkv composed: next token as full recompute's on" in result.output
    return json.loads(out.read_text())["agent"]


def test_windowed_session_exact_prefix_loses_what_mmkv_keeps(report, windowed):
    """With a window, exact-prefix caching reuses less than with the whole history (every token
    after a dropped screenshot is recomputed); mmkv exact reuses at least as much as exact-prefix
    caching every turn, exactly what its plan says; no arm computes less than the limit; the
    encoder cache runs the vision tower once per screenshot."""
    whole, rows = report["agent"]["sessions"][-1], windowed["sessions"][-1]
    assert (windowed["window"], windowed["drop_chunk"]) == (2, 1)
    assert [t["screenshots"] for t in rows] == [min(t["screenshots"], 2) for t in whole]
    prefix = "exact-prefix caching"
    drops = 0
    for w, t in zip(whole, rows):
        assert w["prompt_tokens"] - t["prompt_tokens"] == 18 * (w["screenshots"] - t["screenshots"])  # 16 pads + 2
        assert t["arms"][prefix]["reused_tokens"] <= w["arms"][prefix]["reused_tokens"]
        if t["dropped"] > drops:  # this turn dropped one: the whole-history prompt reuses more
            assert t["arms"][prefix]["reused_tokens"] < w["arms"][prefix]["reused_tokens"]
        drops = t["dropped"]
        mmkv, limit = t["arms"]["mmkv exact"], t["arms"]["limit"]
        assert mmkv["reused_tokens"] == t["mmkv_expected_reused"] >= t["arms"][prefix]["reused_tokens"]
        assert limit["computed_tokens"] == t["new_tokens"]
        assert all(arm["computed_tokens"] >= limit["computed_tokens"] for arm in t["arms"].values())
    assert drops > 0
    composed = [t["arms"]["mmkv composed"] for t in rows]
    assert sum(c["composed_tokens"] for c in composed) > 0  # turns after a dropped screenshot were composed
    assert sum(c["computed_tokens"] for c in composed) < sum(t["arms"]["mmkv exact"]["computed_tokens"] for t in rows)
    g = windowed["agreement"]["mmkv composed"]
    assert g["n"] == len(rows) and g["low"] <= g["k"] / g["n"] <= g["high"]
    total = {r["arm"]: r for r in windowed["summary"]}
    whole_prefix = next(r for r in report["agent"]["summary"] if r["arm"] == prefix)
    assert total[prefix]["reused_tokens"] < whole_prefix["reused_tokens"]
    assert total["encoder cache + prefix caching"]["vision_runs"] == total["limit"]["vision_runs"] == \
        sum(t["new_screenshot"] is not None for t in windowed["script"])
    for arm, r in total.items():  # the JSON's per-turn rows add up to the summary
        for key in ("ms", "computed_tokens", "reused_tokens", "vision_runs"):
            assert r[key] == pytest.approx(sum(t["arms"][arm][key] for t in rows)), (arm, key)


@pytest.mark.parametrize("args, message", [
    (["--window", "-1"], "must be 0 (the whole history)"),
    (["--window", "2", "--drop-chunk", "0"], "must be 1 to --window (2), got 0"),
    (["--window", "2", "--drop-chunk", "3"], "must be 1 to --window (2), got 3"),
    (["--drop-chunk", "2"], "applies with a --window"),
    (["--window", "2", "--modes", "image"], "add agent to --modes"),
    (["--window", "9", "--agent-turns", "3"], "never drops one"),
    (["--agent-arms", "full,exact,bogus"], "unknown bogus"),
    (["--agent-arms", "full,exact,limit"], "must include prefix and exact"),
    (["--agent-arms", "prefix,exact", "--modes", "image"], "applies to the agent mode"),
])
def test_window_out_of_range_refused(args, message):
    result = CliRunner().invoke(app, ["bench", "--config", "tiny", "--threads", "1", "--modes", "agent", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_the_common_prefix_compares_keys_with_none_beside_ints():
    """The agent arms' token key is (id, screenshot index or None): a text token against an image
    pad compares None with an int, which only == may do (os.path.commonprefix orders them and raised)."""
    from mmkv.store.prefix_cache import common_prefix

    a = [(1, None), (7, 0), (7, 0), (2, None)]
    b = [(1, None), (7, 0), (7, None), (2, None)]
    assert common_prefix(a, b) == 2 and common_prefix(a, a) == 4 and common_prefix(a, []) == 0


def test_the_median_interval_is_the_order_statistics_at_95_percent():
    """The median's distribution-free interval: of n sorted values, the k-th from each end with
    1 - 2 P(Binomial(n, 1/2) < k) >= 0.95 (k = 1 at n = 6, 2 at n = 9 and 10); none below 6."""
    from mmkv.bench.run import median_interval

    assert median_interval([5.0, 1.0, 3.0, 2.0, 4.0]) == {"median": 3.0, "low": None, "high": None}
    assert median_interval([6.0, 1.0, 3.0, 2.0, 4.0, 5.0]) == {"median": 3.5, "low": 1.0, "high": 6.0}
    assert median_interval([float(x) for x in range(9, 0, -1)]) == {"median": 5.0, "low": 2.0, "high": 8.0}
    assert median_interval([float(x) for x in range(1, 11)]) == {"median": 5.5, "low": 2.0, "high": 9.0}


def test_two_agent_arms_over_six_sessions_give_each_turn_an_interval(tmp_path):
    """`--agent-arms prefix,exact`: only those two run (no full recompute: no agreement, no
    speed-up against it); each turn's ratio is the median of the sessions' paired ratios, inside
    its 95% interval."""
    out = tmp_path / "pair.json"
    result = CliRunner().invoke(app, ["bench", "--config", "tiny", "--threads", "1", "--repeats", "6", "--modes", "agent",
                                      "--image-tokens", "16", "--skill-tokens", "64", "--agent-turns", "3",
                                      "--agent-arms", "exact,prefix", "--json", str(out)])
    assert result.exit_code == 0, result.output
    a = json.loads(out.read_text())["agent"]
    assert a["arms"] == ["exact-prefix caching", "mmkv exact"] and a["agreement"] == {}
    assert [r["arm"] for r in a["summary"]] == a["arms"] and len(a["sessions"]) == 6
    assert all(r["speedup_vs_full"] is None and r["pct_of_limit"] is None for r in a["summary"])
    assert all(set(t["arms"]) == set(a["arms"]) == set(t["order"]) for rows in a["sessions"] for t in rows)
    for rows in zip(*a["sessions"]):  # on every turn each arm ran first in half the sessions
        assert sum(t["order"][0] == "mmkv exact" for t in rows) == 3
    for p, rows in zip(a["per_turn"], zip(*a["sessions"])):
        ratios = sorted(t["arms"]["mmkv exact"]["cpu_ms"] / t["arms"]["exact-prefix caching"]["cpu_ms"] for t in rows)
        assert p["interval_cpu"] == [ratios[0], ratios[-1]]  # k = 1 at n = 6
        assert ratios[0] <= p["mmkv_over_prefix_cpu"] <= ratios[-1]
    assert "| exact-prefix caching |" in result.output and "| - |" in result.output
    assert f"[{a['per_turn'][0]['interval_cpu'][0]:.2f}-" in result.output
    # each kind of turn together: per session, the ratio of the two arms' sums over those turns
    from mmkv.bench.run import agent_script, turn_kind

    kinds = [turn_kind(t) for t in agent_script(3, 0)]
    assert [k["kind"] for k in a["per_kind"]] == ["new screenshot", "screenshot again", "computed alike"]
    for k in a["per_kind"][:2]:
        assert k["turns"] == [t + 1 for t, kind in enumerate(kinds) if kind == k["kind"]]
    for rows in a["sessions"]:  # the turns computed alike: the same vision runs, at most a block fewer tokens
        alike = [t["turn"] for t in rows if t["arms"]["mmkv exact"]["vision_runs"] == t["arms"]["exact-prefix caching"]
                 ["vision_runs"] and t["arms"]["mmkv exact"]["computed_tokens"] + 16
                 >= t["arms"]["exact-prefix caching"]["computed_tokens"]]
        assert alike == a["per_kind"][2]["turns"] == [1, 3]  # first sights; turn 2 splices screenshot 0
    for k in a["per_kind"]:
        ratios = sorted(sum(rows[t - 1]["arms"]["mmkv exact"]["ms"] for t in k["turns"])
                        / sum(rows[t - 1]["arms"]["exact-prefix caching"]["ms"] for t in k["turns"]) for rows in a["sessions"])
        assert k["interval_ms"] == [ratios[0], ratios[-1]] and ratios[0] <= k["mmkv_over_prefix_ms"] <= ratios[-1]
        assert f"| {k['kind']} | {', '.join(map(str, k['turns']))} | {k['mmkv_over_prefix_ms']:.2f}x [" in result.output
