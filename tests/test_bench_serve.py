"""`mmkv bench-serve` (mmkv/bench/serve.py): the Poisson schedule, the requests each arm builds, and
a short run end to end through the real HTTP server on the bundled tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scipy.stats import chi2

from mmkv.bench import serve
from mmkv.bench.run import agent_messages, agent_script, screenshots_dropped

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "samples" / "models" / "qwen2_5_vl-tiny"


@pytest.fixture(scope="module")
def engine():
    from mmkv.engine import Engine

    return Engine.from_pretrained(TINY, dtype="float32", device="cpu")


# ---- arrivals ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [0.3, 2.0, 40.0])
def test_poisson_rate_within_its_exact_interval(rate):
    """The n-th arrival of a Poisson process of rate r is Gamma(n, r): 2 r T_n is chi-square with 2n
    degrees of freedom. For every seed the offered rate lies in the exact 99.9% interval that
    n / T_n gives (a generator with the wrong mean, e.g. gaps of mean r instead of 1 / r, fails)."""
    n, alpha = 200, 1e-3
    for seed in range(10):
        t = serve.poisson_arrivals(rate, n, seed)
        low, high = chi2.ppf(alpha / 2, 2 * n) / (2 * t[-1]), chi2.ppf(1 - alpha / 2, 2 * n) / (2 * t[-1])
        assert low <= rate <= high, (seed, low, high)


def test_poisson_schedule_is_seeded_increasing_and_refuses_bad_rates():
    a, b = serve.poisson_arrivals(1.5, 50, 7), serve.poisson_arrivals(1.5, 50, 7)
    assert a == b and serve.poisson_arrivals(1.5, 50, 8) != a
    assert all(0 < x < y for x, y in zip(a, a[1:])) and len(a) == 50
    assert serve.poisson_arrivals(3.0, 50, 7) == pytest.approx([x / 2 for x in a])  # the same draws, scaled
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="rate"):
            serve.poisson_arrivals(bad, 5, 0)


# ---- the arms' requests --------------------------------------------------------------------------------
def _workload(engine, policy_tokens=64) -> serve.Workload:
    from mmkv.bench.run import _text_of

    policy = _text_of(engine.adapter.tokenizer, policy_tokens, serve.POLICY_SENTENCE)
    return serve.Workload(engine.model_id, policy, 2, tuple(sorted(engine.stop_ids)))


def _prompt(engine, body) -> list[int]:
    return engine.prompt_ids(body["messages"]).tolist()


def _common(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_in_place_edits_the_field_and_erratum_appends_it(engine):
    """in-place: two requests differ only in the field's value, inside the system prompt, so their
    prompts part at the field (exact-prefix caching reuses only what precedes it); erratum: the
    system prompt is the first value's, byte for byte, and the new value travels in a
    state_update part after it, so the prompts share the whole policy."""
    w = _workload(engine)
    a, b = serve.arm_bodies("in-place", w, 2, "t")
    assert a["messages"][1] == b["messages"][1] == {"role": "user", "content": serve.QUESTION}
    assert a["messages"][0]["content"].replace("t-0", "t-1") == b["messages"][0]["content"]
    e0, e1 = serve.arm_bodies("erratum", w, 2, "t")
    assert e0["messages"][0] == e1["messages"][0] == w.in_place(serve.FIRST_VALUE)["messages"][0]
    assert [p for p in e1["messages"][1]["content"] if p["type"] == "state_update"] == [
        {"type": "state_update", "field": serve.FIELD, "value": "t-1"}]
    policy_end = len(engine.prompt_ids([e0["messages"][0]]).tolist()) - 3  # less the template's own tail
    policy_tokens = len(engine.adapter.tokenizer(w.policy)["input_ids"])
    assert _common(_prompt(engine, a), _prompt(engine, b)) < len(_prompt(engine, a)) - policy_tokens  # before it
    assert _common(_prompt(engine, e0), _prompt(engine, e1)) >= policy_end
    for body in (a, e0):  # streamed with usage, a fixed length: the end tokens banned
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert set(body["logit_bias"]) == {str(t) for t in engine.stop_ids}


def test_agent_arm_interleaves_sessions_and_keeps_its_window(engine):
    """Request k is turn k // S of session k % S; each turn sends the last `window` screenshots
    the session attached (inline, as data: URLs), an earlier one shown again being the very
    same URL as its first showing."""
    scripts = [agent_script(6, 0), agent_script(6, 1)]
    shots = [[f"data:image/png;base64,s{s}i{i}" for i in range(6)] for s in range(2)]
    sessions = serve.AgentSessions(scripts, shots, "skill-x", window=2, drop_chunk=1)
    bodies = serve.arm_bodies("agent", _workload(engine), 10, "t", sessions)
    for k, body in enumerate(bodies):
        s, turn = k % 2, k // 2
        parts = [p for m in body["messages"] if isinstance(m["content"], list) for p in m["content"]]
        sent = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
        assert not [p for p in parts if p["type"] == "image_file"]
        whole = agent_messages(scripts[s], turn, "skill-x", shots[s])  # no window
        attached = [p["image_file"]["file_id"] for m in whole if isinstance(m["content"], list)
                    for p in m["content"] if p["type"] == "image_file"]
        assert sent == attached[screenshots_dropped(len(attached), 2, 1):]
        assert len(sent) == min(len(attached), 2)
        assert f"step {turn} :" in json.dumps(body["messages"][-1])
    with pytest.raises(ValueError, match="unknown arm"):
        serve.arm_bodies("nope", _workload(engine), 1, "t")


def test_compare_judges_the_target_from_both_figures():
    """The target line needs the erratum ahead on p90 TTFT and on throughput at every rate past half
    of saturation; rates at or below half do not count."""
    def cell(arm, fraction, p90, req_s):
        return {"arm": arm, "fraction": fraction, "ttft_ms": {50: p90, 90: p90, 99: p90}, "req_s": req_s}

    report = {"settings": {"fractions": [0.5, 1.0]}, "cells": [
        cell("in-place", None, 900, 1.0), cell("erratum", None, 100, 3.0),
        cell("in-place", 0.5, 100, 1.0), cell("erratum", 0.5, 200, 0.9),
        cell("in-place", 1.0, 500, 1.0), cell("erratum", 1.0, 100, 1.2)]}
    assert serve.compare(report)[-1].endswith("yes (2 of 2 rates)")
    report["cells"][-1]["req_s"] = 0.95
    assert serve.compare(report)[-1].endswith("no (1 of 2 rates)")


# ---- end to end ----------------------------------------------------------------------------------------
def test_bench_serve_end_to_end_on_the_tiny_model(engine):
    """Every arm unthrottled and at one Poisson rate through the HTTP server (clients in another
    process): no request fails, the erratum's prompts are prefix-cache hits the in-place ones are
    not (hit rate from /metrics), usage agrees, and the agent's cached share counts its splices."""
    settings = serve.Settings(fractions=(1.0,), requests=2, saturation_requests=2, policy_tokens=96, tokens=2,
                              image_tokens=16, skill_tokens=32, sessions=1, window=2)
    lines = []
    report = serve.run_bench_serve(engine, settings, lines.append)
    cells = {(c["arm"], c["fraction"]): c for c in report["cells"]}
    assert len(cells) == 6 and len(lines) == 7
    for c in report["cells"]:
        assert c["errors"] == 0 and len(c["records"]) == 2, c["records"]
        assert all(r["usage"]["completion_tokens"] == 2 for r in c["records"])
    for fraction in (None, 1.0):
        in_place, erratum = cells[("in-place", fraction)], cells[("erratum", fraction)]
        assert in_place["prefix_hit"] < 0.3 < 0.6 < erratum["prefix_hit"]
        assert in_place["cached_share"] == pytest.approx(in_place["prefix_hit"], abs=0.02)
        assert cells[("agent", fraction)]["cached_share"] >= cells[("agent", fraction)]["prefix_hit"]
    assert report["saturation_req_s"] == cells[("in-place", None)]["req_s"] > 0
    assert cells[("erratum", 1.0)]["rate"] == pytest.approx(report["saturation_req_s"])
    assert len(serve.compare(report)) == 5


# ---- what aiperf needs of the server ---------------------------------------------------------------------
def test_head_is_answered_as_get_without_a_body(engine):
    """aiperf finding: aiperf probes /metrics with HEAD before scraping it, and the server answered
    405 while that very 405's Allow header listed HEAD with GET. HEAD now answers as GET does (status,
    headers, no body) wherever GET does, and stays a 405 naming the methods where it does not."""
    from starlette.testclient import TestClient

    from mmkv.server.app import ServerSettings, create_app

    with TestClient(create_app(engine, ServerSettings())) as client:
        for path in ("/metrics", "/health", "/v1/models"):
            got, head = client.get(path), client.head(path)
            assert head.status_code == got.status_code == 200, path
            assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]
            assert head.headers["x-content-type-options"] == "nosniff"
        head = client.head("/v1/chat/completions")
        assert head.status_code == 405 and head.headers["allow"] == "POST" and head.content == b""
        assert client.head("/v1/files/img-missing").status_code == 404


def test_aiperf_dataset_repeats_its_screenshots(engine, tmp_path):
    """aiperf's single_turn lines: the policy and a step line of each request's own, and the
    screenshots in turn (3 files for 7 requests: each shown again after other text; 7 files: all
    distinct pictures)."""
    from mmkv.bench.run import _text_of

    policy = _text_of(engine.adapter.tokenizer, 32, serve.POLICY_SENTENCE)
    for count in (3, 7):
        path = serve.write_aiperf_dataset(tmp_path / f"d{count}" / "data.jsonl", engine, 7, count, 32, 16)
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(lines) == 7 and all(set(x) == {"text", "image"} for x in lines)
        assert [x["text"] for x in lines] == [f"{policy}\nstep {k} : what changed on this screen ?" for k in range(7)]
        assert [Path(x["image"]).name for x in lines] == [f"screenshot-{k % count}.png" for k in range(7)]
        assert len({Path(x["image"]).read_bytes() for x in lines}) == count
