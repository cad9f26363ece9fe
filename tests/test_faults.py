"""Fault injection: an exception at any stage of one request (parse, plan, place, a prefill chunk,
joining the batch, a decode step, leaving the batch, a tier write, the stream's write) settles
every future within a bound, leaves no prefix block from KV that was never computed, keeps the
scheduler serving, and `/health` says what is true (review finding 3: one failure at join time
killed the scheduler's loop and every request hung).

Oracles: each bystander's greedy tokens alone (`Engine.generate`), the same request on a tenant
with nothing cached (its image spliced, no prefix block) for what a later request reads, and the
store's own integrity check.
"""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import pytest
import torch

from mmkv import Engine
from mmkv.request.scheduler import DecodeBatch, Scheduler
from mmkv.request.splice import PrefillResult

from conftest import make_png

POLICY = "refund policy . a refund is allowed only when the order status is delivered . " * 2
TOL = 1e-4  # float32 next-token logits: a later request against the same one with nothing cached
SETTLE_S = 60  # every future answers within this
BEFORE_FIRST_TOKEN = {"parse", "plan", "place", "prefill_chunk"}
WHOLE_BATCH = {"decode_step", "batch_remove"}  # such a failure may fail the batch's other rows too
STAGES = ["parse", "plan", "place", "prefill_chunk", "batch_add", "decode_step", "batch_remove", "stream_write",
          "tier_write"]


class InjectedFault(RuntimeError):
    """Stands in for an out-of-memory error or a bug at one stage."""


@pytest.fixture(scope="module")
def engine(tiny_dirs, tmp_path_factory):
    store = tmp_path_factory.mktemp("fault-store")  # a disk tier, so chunk writes happen
    return Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu", store_dir=store)


def _victim(stage: str) -> list[dict]:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}
    import base64
    image["image_url"]["url"] += base64.b64encode(make_png(40, 32, seed=len(stage))).decode()
    return [{"role": "system", "content": POLICY + " VICTIM ."},
            {"role": "user", "content": [image, {"type": "text", "text": f"what about {stage} ?"}]}]


def _bystander(i: int) -> list[dict]:
    return [{"role": "user", "content": f"bystander {i} asks about the order ."}]


class Faults:
    """Installs one stage's fault; it fires for the victim's request (or, for a whole-batch stage,
    once while the victim is in the batch)."""

    def __init__(self, engine, scheduler, monkeypatch, stage: str):
        self.engine, self.scheduler, self.stage = engine, scheduler, stage
        self.victim_runs: list = []
        self.in_victim = threading.local()
        self.fired = 0
        start = engine.start

        def tracked_start(messages, **kwargs):
            self.in_victim.flag = "VICTIM" in str(messages)
            try:
                run = start(messages, **kwargs)
            finally:
                self.in_victim.flag = False
            if "VICTIM" in str(messages):
                self.victim_runs.append(run)
            return run
        monkeypatch.setattr(engine, "start", tracked_start)
        getattr(self, f"_{stage}")(monkeypatch)

    def fire(self) -> None:
        self.fired += 1
        raise InjectedFault(self.stage)

    def _victim_now(self) -> bool:
        return getattr(self.in_victim, "flag", False)

    def _victim_running(self) -> bool:
        return any(r.run in self.victim_runs for r in self.scheduler._running)

    def _wrap(self, monkeypatch, owner, name: str, when) -> None:
        real = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if when(*args) and not self.fired:
                self.fire()
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapped)

    def _parse(self, monkeypatch):
        import mmkv.engine
        self._wrap(monkeypatch, mmkv.engine, "parse_messages", lambda messages, *_: "VICTIM" in str(messages))

    def _plan(self, monkeypatch):
        self._wrap(monkeypatch, self.engine.planner, "plan", lambda *_: self._victim_now())

    def _place(self, monkeypatch):
        self._wrap(monkeypatch, self.engine.placer, "prefill", lambda *_: self._victim_now())

    def _prefill_chunk(self, monkeypatch):
        calls = []

        def second_chunk(result, *_):
            if any(result is r.prefilled for r in self.victim_runs):
                calls.append(1)
                return len(calls) == 2
            return False
        self._wrap(monkeypatch, PrefillResult, "advance", second_chunk)

    def _batch_add(self, monkeypatch):
        self._wrap(monkeypatch, DecodeBatch, "add",
                   lambda batch, cache, *_: any(cache is r.prefilled.cache for r in self.victim_runs))

    def _decode_step(self, monkeypatch):
        self._wrap(monkeypatch, DecodeBatch, "step", lambda *_: self._victim_running())

    def _batch_remove(self, monkeypatch):
        self._wrap(monkeypatch, DecodeBatch, "remove", lambda *_: self._victim_running())

    def _stream_write(self, monkeypatch):
        pass  # the victim's on_text raises (submit)

    def _tier_write(self, monkeypatch):
        import mmkv.store.tiers
        self._wrap(monkeypatch, mmkv.store.tiers, "encode_chunk", lambda *_: True)

    def on_text(self):
        if self.stage != "stream_write":
            return None
        seen = []

        def write(delta):
            seen.append(delta)
            if len(seen) == 2 and not self.fired:
                self.fire()
        return write


@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_at_any_stage_fails_that_request_alone(engine, monkeypatch, stage):
    """Review finding 3: a fault at `stage` of one request settles every future within SETTLE_S
    (the victim with the fault, unless the stage cannot fail a request: a tier write is counted,
    never a request error), bystanders answer as they do alone (a failed decode step or batch
    shrink may fail the rows it held, never hang them), nothing computed wrongly is stored, and the
    scheduler goes on serving."""
    alone = {i: engine.generate(_bystander(i), max_new_tokens=6, tenant=f"by-{stage}").token_ids for i in (0, 1)}
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=16).start()
    try:
        faults = Faults(engine, scheduler, monkeypatch, stage)
        futures = {"by0": scheduler.submit(_bystander(0), max_new_tokens=6, tenant=f"by-{stage}"),
                   "victim": scheduler.submit(_victim(stage), max_new_tokens=6, tenant=f"victim-{stage}",
                                              on_text=faults.on_text()),
                   "by1": scheduler.submit(_bystander(1), max_new_tokens=6, tenant=f"by-{stage}")}
        done, pending = concurrent.futures.wait(futures.values(), timeout=SETTLE_S)
        assert not pending, f"{stage}: futures still pending after {SETTLE_S} s"
        if stage == "tier_write":
            engine.run_background()  # the victim's inline image is written once its chunk is built (idle turns)
            engine.tiers.flush()
            assert futures["victim"].result().token_ids and engine.stats()["tier_writes_failed"] >= 1
        else:
            assert faults.fired == 1
            error = futures["victim"].exception()
            # a batch that cannot shrink fails the rows still in it; the finished victim kept its answer
            assert isinstance(error, InjectedFault) or (stage == "batch_remove" and error is None), repr(error)
        for i in (0, 1):
            error = futures[f"by{i}"].exception()
            if error is None:
                assert futures[f"by{i}"].result().token_ids == alone[i], f"{stage}: bystander {i} changed"
            else:
                assert stage in WHOLE_BATCH and isinstance(error, InjectedFault), f"{stage}: bystander {i}: {error!r}"
        monkeypatch.undo()
        assert scheduler.alive
        again = scheduler.submit(_victim(stage), max_new_tokens=1, tenant=f"victim-{stage}").result(SETTLE_S)
    finally:
        scheduler.stop()
    exact = engine.generate(_victim(stage), max_new_tokens=1, tenant=f"fresh-{stage}")
    assert (again.first_logits - exact.first_logits).abs().max().item() <= TOL
    if stage in BEFORE_FIRST_TOKEN:
        assert again.prefix_tokens_reused == 0, f"{stage}: a block of the failed request was stored"
    engine.check_integrity()


def test_a_fault_at_join_keeps_the_server_healthy(tiny_dirs, monkeypatch):
    """Review finding 3 at the HTTP edge: a request that fails as it joins the batch gets a JSON
    500 (the server's own fault, no hang), `/health` stays 200 and true (the scheduler is alive),
    the next request is answered, and once the scheduler really is gone `/health` says 503."""
    from mmkv.server.app import ServerSettings, create_app
    from test_server import LiveServer

    engine = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu")
    app = create_app(engine, ServerSettings())
    live = LiveServer(app)
    try:
        real, fired = DecodeBatch.add, []

        def failing_add(batch, cache):
            if not fired:
                fired.append(1)
                raise InjectedFault("out of memory at join")
            return real(batch, cache)
        monkeypatch.setattr(DecodeBatch, "add", failing_add)
        model = httpx.get(f"{live.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
        first = httpx.post(f"{live.base_url}/v1/chat/completions", json=body, timeout=SETTLE_S)
        assert first.status_code == 500 and first.json()["error"]["type"] == "server_error"
        health = httpx.get(f"{live.base_url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        second = httpx.post(f"{live.base_url}/v1/chat/completions", json=body, timeout=SETTLE_S)
        assert second.status_code == 200 and second.json()["choices"][0]["message"]["content"] is not None
        app.state.ctx.worker.scheduler.stop()
        assert httpx.get(f"{live.base_url}/health", timeout=10).status_code == 503
    finally:
        live.close()


def test_the_loop_survives_an_engine_without_first_sight_builds():
    """review finding: the loop's idle check read `engine.first_sight` unguarded, so a scheduler
    over an engine without first-sight builds (a test double, another engine) died in its first
    wait, outside any request's stages; now the check has no builds to run and the loop lives."""
    import time

    from mmkv.request.scheduler import Scheduler

    class Bare:
        _lock = threading.Lock()

    scheduler = Scheduler(Bare()).start()
    try:
        time.sleep(0.05)
        assert scheduler.alive
    finally:
        scheduler.stop()
