"""The online fidelity monitor (`--shadow-rate`): sampled fast-path requests are recomputed exactly
in idle turns and their first token and logit gap compared. Oracle: a splice with rotation switched
off (`rope_policy="none"`, keys left at the positions they were computed at) is a deliberately
broken fast path that must raise the alert; the same requests spliced correctly must not."""

from __future__ import annotations

import time

import pytest
import torch

from mmkv import Engine
from mmkv.request.scheduler import Scheduler
from mmkv.request.shadow import ShadowMonitor, shadow_kind

from conftest import make_png

WINDOW = 8


ALERT = 0.7  # a correct splice of the bundled model agrees on 7 of these 8 (isolation); none agrees without rotation


@pytest.fixture(scope="module")
def engine():
    """The bundled trained model: its answers depend on the image, so a wrong splice shows."""
    return Engine.from_pretrained(None, dtype=torch.float32, device="cpu")


def _moved(image_id: str, i: int) -> list[dict]:
    """The image after a different amount of text each time: far from where it was computed."""
    return [{"role": "user", "content": [{"type": "text", "text": "some words before the picture . " * (3 + 4 * i)},
                                         {"type": "image_file", "image_file": {"file_id": image_id}},
                                         {"type": "text", "text": "what colour is the square ?"}]}]


def _run(engine, policy: str, tenant: str) -> dict:
    image_id = engine.add_image(make_png(56, 56, seed=11), tenant=tenant)
    monitor = ShadowMonitor(rate=1.0, alert=ALERT, window=WINDOW, max_pending=WINDOW, seed=0)
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=64, shadow=monitor).start()
    try:
        futures = [scheduler.submit(_moved(image_id, i), max_new_tokens=1, tenant=tenant, rope_policy=policy)
                   for i in range(WINDOW)]
        for f in futures:
            f.result(60)
        deadline = time.monotonic() + 60
        while monitor.pending and time.monotonic() < deadline:  # the shadows run once the queue is idle
            time.sleep(0.02)
    finally:
        scheduler.stop()
    return monitor.snapshot()["kinds"]["image"]


def test_the_monitor_stays_quiet_on_a_correct_splice(engine):
    image = _run(engine, "native", "shadow-native")
    assert image["shadowed"] == WINDOW and image["dropped"] == 0
    assert image["agreement"] >= ALERT and image["alerts"] == 0 and not image["alerting"]
    lo, hi = image["interval_95"]
    assert lo <= image["agreement"] <= hi
    assert image["gap_buckets"]["+Inf"] == image["shadowed"]


def test_the_monitor_catches_a_splice_without_rotation(engine):
    image = _run(engine, "none", "shadow-broken")
    assert image["shadowed"] == WINDOW, image  # the alert needs a full window
    assert image["agreement"] < ALERT and image["alerts"] == 1 and image["alerting"], image
    assert image["gap_sum"] / image["shadowed"] > 1.0


def test_only_fast_paths_are_shadowed(engine):
    """A full recompute, or a text turn that reused nothing spliced, has nothing to check."""
    text = [{"role": "user", "content": "hello there ."}]
    assert shadow_kind(engine.start(text, reuse=False).report) is None
    assert shadow_kind(engine.start(text).report) is None
    skill = engine.add_skill("s", "a short policy about refunds .", tenant="kinds")
    with_skill = [{"role": "user", "content": [{"type": "skill", "skill_id": skill}, {"type": "text", "text": "ok ?"}]}]
    assert shadow_kind(engine.start(with_skill, tenant="kinds").report) == "skill"


def test_a_busy_server_drops_and_counts(engine):
    """Sampled requests beyond the bounded queue are dropped and counted, never queued without bound."""
    monitor = ShadowMonitor(rate=1.0, max_pending=1)
    image_id = engine.add_image(make_png(40, 40, seed=3), tenant="busy")
    runs = [engine.start(_moved(image_id, i), max_new_tokens=1, tenant="busy") for i in range(3)]
    for run in runs:
        with engine._lock:
            run.prefill()
        monitor.offer(run.report, run.first_logits, run.exact)
    image = monitor.snapshot()["kinds"]["image"]
    assert monitor.pending == 1 and image["dropped"] == 2


def test_the_server_reports_the_monitor(engine):
    """`--shadow-rate` through the HTTP server: /v1/mmkv/fidelity sums the shadows per kind with an
    exact interval, /metrics shows the same counts, and with the monitor off the summary says so."""
    import httpx

    from mmkv.server.app import ServerSettings, create_app
    from test_server import LiveServer

    live = LiveServer(create_app(engine, ServerSettings(shadow_rate=1.0, shadow_window=4)))
    try:
        model = httpx.get(f"{live.base_url}/v1/models").json()["data"][0]["id"]
        image_id = httpx.post(f"{live.base_url}/v1/files", data={"purpose": "vision"},
                              files={"file": ("a.png", make_png(48, 48, seed=5), "image/png")}).json()["id"]
        for i in range(2):
            r = httpx.post(f"{live.base_url}/v1/chat/completions", timeout=60, json={
                "model": model, "max_tokens": 1, "messages": _moved(image_id, i)})
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            summary = httpx.get(f"{live.base_url}/v1/mmkv/fidelity").json()
            if summary["kinds"]["image"]["shadowed"] == 2:
                break
            time.sleep(0.05)
        image = summary["kinds"]["image"]
        assert summary["enabled"] and image["shadowed"] == 2 and image["interval_95"][0] <= image["agreement"]
        metrics = live.metrics()
        assert metrics['mmkv:shadow_shadowed_total{kind="image"}'] == 2
        assert metrics['mmkv:shadow_agreed_total{kind="image"}'] == image["agreed"]
        assert metrics['mmkv:shadow_logit_gap_count{kind="image"}'] == 2
    finally:
        live.close()
    off = LiveServer(create_app(engine, ServerSettings()))
    try:
        assert httpx.get(f"{off.base_url}/v1/mmkv/fidelity").json() == {"object": "mmkv.fidelity", "enabled": False}
    finally:
        off.close()
