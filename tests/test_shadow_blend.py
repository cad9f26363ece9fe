"""The fidelity monitor's dial replays (`--shadow-blend`, `--shadow-target`, mmkv/request/shadow.py):
each shadowed splice is spliced again at every listed blend r and compared with the exact
recompute the shadow already runs. Oracles: r = 1 is a full recompute (always agrees, logits within
TOL); r = 0 is the request's own splice (agrees exactly as the plain shadow, the same gaps); the
recommendation's bounds against closed forms of the Clopper-Pearson bound; nothing stored."""

from __future__ import annotations

import math
import threading
import time

import httpx
import pytest
import torch
from typer.testing import CliRunner

from mmkv import Engine
from mmkv.cli import app
from mmkv.request.shadow import ShadowMonitor, agreeing_needed, lower_bound, parse_shadow_blend
from mmkv.server.app import ServerSettings, create_app

from conftest import make_png
from test_server import LiveServer

TOL = 1e-4  # float32 logits
ALPHA = 0.05  # one minus the bounds' confidence


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu")


def _moved(engine, tenant: str, i: int) -> list[dict]:
    """A skill, then the image after a different amount of text each time."""
    skill = engine.add_skill("rules", "answer with one word . look at the shapes .", tenant=tenant)
    image = engine.add_image(make_png(56, 56, seed=11), tenant=tenant)
    return [{"role": "system", "content": [{"type": "skill", "skill_id": skill}]},
            {"role": "user", "content": [{"type": "text", "text": "some words before the picture . " * (1 + 3 * i)},
                                         {"type": "image_file", "image_file": {"file_id": image}},
                                         {"type": "text", "text": "what colour is the square ?"}]}]


def _served(engine, tenant: str, n: int, rope_policy: str) -> list:
    """`n` requests run as the scheduler runs them, first token out (prefix blocks stored)."""
    runs = []
    for i in range(n):
        run = engine.start(_moved(engine, tenant, i), max_new_tokens=1, tenant=tenant, rope_policy=rope_policy)
        with engine._lock:
            assert run.prefill()
        run.first_token_out()
        runs.append(run)
    return runs


def _shadow_all(monitor: ShadowMonitor, runs: list, lock) -> dict:
    for run in runs:
        assert monitor.offer(run.report, run.first_logits, run.exact, run.replay)
        while monitor.pending:
            monitor.step(lock)
    return monitor.snapshot()


@pytest.mark.parametrize("rope_policy", ["native", "none"])
def test_r1_always_agrees_and_r0_agrees_as_the_plain_shadow(engine, rope_policy):
    """r = 1 recomputes every chunk token in context: the full recompute's first token on every
    shadow (logits within TOL). r = 0 is the plain splice the request got: the same agreement and
    the same logit gaps as the plain shadow. With rotation off (`none`, a deliberately broken
    splice) the plain shadow and r = 0 disagree alike, and r = 1 still agrees."""
    n = 4
    runs = _served(engine, f"replay-{rope_policy}", n, rope_policy)
    monitor = ShadowMonitor(rate=1.0, max_pending=1, blend=(1.0, 0.0), seed=0)
    snap = _shadow_all(monitor, runs, engine._lock)
    plain, ratios = snap["kinds"]["image"], snap["blend"]["kinds"]["image"]["ratios"]
    assert plain["shadowed"] == n and snap["blend"]["replays_failed"] == 0
    assert snap["blend"]["ratios"] == [0.0, 1.0]  # ascending
    exact, splice = ratios["1.0"], ratios["0.0"]
    assert exact["shadowed"] == exact["agreed"] == n and exact["gap_sum"] <= n * TOL
    assert splice["shadowed"] == n and splice["agreed"] == plain["agreed"]
    assert abs(splice["gap_sum"] - plain["gap_sum"]) <= n * TOL
    assert plain["gap_sum"] > 10 * n * TOL, "the splice must differ from the recompute for this to mean anything"
    if rope_policy == "none":
        assert plain["agreed"] < n, "rotation off must flip a first token here"


def test_replays_store_nothing(engine):
    """The replays place and prefill from a cold cache: the KV store's bytes and entries, the
    prefix cache's lookups and hits are exactly as the requests left them."""
    runs = _served(engine, "replay-store", 3, "native")
    before = (engine.cache.nbytes, len(engine.cache), engine.prefix.query_tokens, engine.prefix.hit_tokens)
    monitor = ShadowMonitor(rate=1.0, max_pending=1, blend=(0.0, 0.3, 1.0), seed=0)
    snap = _shadow_all(monitor, runs, engine._lock)
    assert snap["blend"]["kinds"]["image"]["ratios"]["0.3"]["shadowed"] == 3
    assert (engine.cache.nbytes, len(engine.cache), engine.prefix.query_tokens, engine.prefix.hit_tokens) == before
    engine.cache.check_integrity()


def test_only_splices_are_replayed(engine):
    """A full recompute is not shadowed; an erratum-style kind gets its plain shadow and no replay."""
    monitor = ShadowMonitor(rate=1.0, blend=(0.0,))
    full = engine.start(_moved(engine, "replay-kinds", 0), max_new_tokens=1, tenant="replay-kinds", reuse=False)
    assert full.replay is None
    with engine._lock:
        full.prefill()
    assert not monitor.offer(full.report, full.first_logits, full.exact, full.replay)
    spliced = _served(engine, "replay-kinds", 1, "native")[0]
    report = {**spliced.report, "edit": type("Edit", (), {"applied": "erratum"})()}
    assert monitor.offer(report, spliced.first_logits, spliced.exact, spliced.replay)
    while monitor.pending:
        monitor.step(threading.Lock())
    snap = monitor.snapshot()
    assert snap["kinds"]["erratum"]["shadowed"] == 1
    assert all(row["shadowed"] == 0 for k in snap["blend"]["kinds"].values() for row in k["ratios"].values())


def test_the_recommendation_math():
    """Stored expectations, each against a closed form: all n agreeing, the one-sided bound is
    ALPHA^(1/n), so 0.99 needs ceil(ln ALPHA / ln 0.99) = 299 shadows; one disagreement, the bound
    meets t exactly when the binomial tail t^n + n t^(n-1) (1 - t) is at most ALPHA (n = 473)."""
    assert math.ceil(math.log(ALPHA) / math.log(0.99)) == 299
    assert agreeing_needed(0, 0, 0.99) == 299 and agreeing_needed(290, 290, 0.99) == 9
    assert agreeing_needed(299, 299, 0.99) == 0
    assert lower_bound(40, 40) == pytest.approx(ALPHA ** (1 / 40), rel=1e-9)
    assert lower_bound(0, 10) == 0.0
    m = agreeing_needed(99, 100, 0.99)
    assert m == 373

    def tail(n, t=0.99):  # P(at least n - 1 of n agree | agreement t)
        return t ** n + n * t ** (n - 1) * (1 - t)
    assert tail(100 + m) <= ALPHA < tail(100 + m - 1)

    monitor = ShadowMonitor(rate=1.0, blend=(0.0, 0.1, 0.2), target=0.99)
    same, other = torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])
    for ratio, agreed, n in ((0.0, 250, 300), (0.1, 290, 290), (0.2, 100, 100)):
        for i in range(n):
            monitor._record_replay("image", ratio, same if i < agreed else other, same)
    image = monitor.snapshot()["blend"]["kinds"]["image"]
    assert image["recommended"] is None and image["closest"] == 0.1 and image["agreeing_needed"] == 9
    assert image["ratios"]["0.2"]["agreeing_needed"] == 199
    for _ in range(9):
        monitor._record_replay("image", 0.1, same, same)
    image = monitor.snapshot()["blend"]["kinds"]["image"]
    assert image["recommended"] == 0.1 and image["agreeing_needed"] == 0
    assert image["ratios"]["0.1"]["lower_bound"] == pytest.approx(ALPHA ** (1 / 299), rel=1e-9)
    skill = monitor.snapshot()["blend"]["kinds"]["skill"]
    assert skill["recommended"] is None and skill["closest"] == 0.0 and skill["agreeing_needed"] == 299


@pytest.mark.parametrize("text, why", [
    ("0,x", "comma-separated"), ("0,1.5", "in [0, 1]"), ("nan", "in [0, 1]"), ("-0.1", "in [0, 1]"),
    ("0,0.1,0.1", "twice"), (",".join(str(i / 10) for i in range(9)), "at most 8")])
def test_bad_shadow_blend_lists_are_refused(text, why):
    with pytest.raises(ValueError, match="--shadow-blend") as err:
        parse_shadow_blend(text)
    assert why in str(err.value)


def test_bad_flag_combinations_are_refused():
    assert parse_shadow_blend("0.4, 0,0.1") == (0.0, 0.1, 0.4) and parse_shadow_blend("") == ()
    with pytest.raises(ValueError, match="needs --shadow-blend"):
        ShadowMonitor(rate=0.1, target=0.9)
    for target in (1.0, 0.0, 1.5):
        with pytest.raises(ValueError, match=r"in \(0, 1\)"):
            ShadowMonitor(rate=0.1, blend=(0.1,), target=target)
    assert ShadowMonitor(rate=0.1, blend=(0.1,)).target == 0.99
    for kw in ({"shadow_blend": (0.1,)}, {"shadow_blend": (0.1,), "shadow_target": 0.9, "shadow_rate": 0.0},
               {"shadow_rate": 0.1, "shadow_target": 0.9}, {"shadow_rate": 0.1, "shadow_blend": (0.1,),
                                                            "shadow_target": 1.0}):
        with pytest.raises(AssertionError, match="--shadow-"):
            ServerSettings(**kw)


@pytest.mark.parametrize("args, message", [
    (["--shadow-rate", "0.1", "--shadow-blend", "0,2"], "must be in [0, 1]"),
    (["--shadow-blend", "0,0.1"], "need --shadow-rate"),
    (["--shadow-rate", "0.1", "--shadow-target", "0.9"], "needs --shadow-blend"),
    (["--shadow-rate", "0.1", "--shadow-blend", "0.1", "--shadow-target", "1"], "in (0, 1)")])
def test_mmkv_serve_refuses_bad_flags_before_loading(args, message):
    result = CliRunner().invoke(app, ["serve", "--store-dir", "none", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_the_server_reports_the_recommendation(engine):
    """/v1/mmkv/fidelity and /metrics: per kind and ratio the replays and their bounds, and no
    recommendation yet after 2 shadows for a 0.9 target: the closest ratio needs
    ceil(ln ALPHA / ln 0.9) - 2 = 27 more agreeing ones (r = 1 agrees on each)."""
    live = LiveServer(create_app(engine, ServerSettings(shadow_rate=1.0, shadow_blend=(0.0, 1.0),
                                                        shadow_target=0.9)))
    try:
        model = httpx.get(f"{live.base_url}/v1/models").json()["data"][0]["id"]
        image_id = httpx.post(f"{live.base_url}/v1/files", data={"purpose": "vision"},
                              files={"file": ("a.png", make_png(56, 56, seed=5), "image/png")}).json()["id"]
        for i in range(2):
            messages = [{"role": "user", "content": [
                {"type": "text", "text": "some words . " * (1 + 3 * i)},
                {"type": "image_file", "image_file": {"file_id": image_id}}, {"type": "text", "text": "colour ?"}]}]
            r = httpx.post(f"{live.base_url}/v1/chat/completions", timeout=60, json={
                "model": model, "max_tokens": 1, "messages": messages})
            assert r.status_code == 200, r.text
            assert "shadow" not in r.text  # nothing a client sees changes
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            summary = httpx.get(f"{live.base_url}/v1/mmkv/fidelity").json()
            if summary["blend"]["kinds"]["image"]["ratios"]["1.0"]["shadowed"] == 2:
                break
            time.sleep(0.05)
        blend = summary["blend"]
        image = blend["kinds"]["image"]
        assert blend["target"] == 0.9 and blend["select"] == "deviation" and blend["confidence"] == 1 - ALPHA
        assert image["ratios"]["1.0"]["agreed"] == 2 and image["recommended"] is None
        assert image["agreeing_needed"] == math.ceil(math.log(ALPHA) / math.log(0.9)) - 2 == 27
        metrics = live.metrics()
        assert metrics['mmkv:shadow_blend_shadowed_total{kind="image",ratio="1.0"}'] == 2
        assert metrics['mmkv:shadow_blend_agreed_total{kind="image",ratio="0.0"}'] == image["ratios"]["0.0"]["agreed"]
        assert metrics['mmkv:shadow_blend_lower_bound{kind="image",ratio="1.0"}'] == pytest.approx(ALPHA ** 0.5)
        assert math.isnan(metrics['mmkv:shadow_blend_recommended_ratio{kind="image"}'])
        assert metrics['mmkv:shadow_blend_agreeing_needed{kind="image"}'] == 27
    finally:
        live.close()
