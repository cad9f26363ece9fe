"""Chunked prefill (issue 13): the turn's forward run a chunk at a time equals the one forward,
and the scheduler runs a decode step of the running batch between the chunks.

Oracles: the unchunked forward of the same placed KV (first-token logits and every layer's KV
within TOL, float32), `Engine.generate` alone (greedy tokens identical), the recorded order of
model calls, and the KV store's `check_integrity` with its contents unchanged by a cancelled
request."""

from __future__ import annotations

import math
import time

import pytest
import torch

from mmkv import Engine
from mmkv.request.scheduler import Scheduler

from conftest import forget_slot_records, make_png

TOL = 1e-5  # float32: a chunk changes only the matmul shapes
TEXT = "a refund is allowed only when the order status is delivered . otherwise escalate . "


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def engine(request, tiny_dirs):
    return Engine.from_pretrained(tiny_dirs[request.param], dtype=torch.float32, device="cpu")


def _image(engine, tenant: str, seed: int = 5):
    return {"type": "image_file", "image_file": {"file_id": engine.add_image(make_png(84, 56, seed=seed), tenant)}}


def _prompts(engine) -> dict[str, tuple[list, dict]]:
    skill = engine.add_skill("policy", TEXT * 3, tenant="chunks")
    image = _image(engine, "chunks")
    return {
        "text": ([{"role": "system", "content": TEXT * 4}, {"role": "user", "content": "refund ?"}], {}),
        "image": ([{"role": "system", "content": TEXT}, {"role": "user", "content": [
            {"type": "text", "text": "look at"}, image, {"type": "text", "text": "what shape is it ?"}]}], {}),
        "image-seam3": ([{"role": "system", "content": TEXT}, {"role": "user", "content": [  # image pads computed
            {"type": "text", "text": "look at"}, image, {"type": "text", "text": "what shape is it ?"}]}],
            {"seam_tokens": 3}),
        "skill": ([{"role": "system", "content": [{"type": "text", "text": "rules :"},
                                                  {"type": "skill", "skill_id": skill}]},
                   {"role": "user", "content": "refund ?"}], {}),
        "full": ([{"role": "user", "content": [image, {"type": "text", "text": TEXT}]}], {"reuse": False}),
    }


def _prefilled(engine, msgs, kwargs, chunk: int | None):
    run = engine.start(msgs, max_new_tokens=1, tenant="chunks", **kwargs)
    pieces = 0
    with engine._lock:
        while not run.prefill(chunk):
            pieces += 1
    return run, pieces + 1


def _assert_same(a, b):
    assert (a.first_logits - b.first_logits).abs().max().item() <= TOL
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert la.keys.shape == lb.keys.shape
        assert (la.keys - lb.keys).abs().max().item() <= TOL and (la.values - lb.values).abs().max().item() <= TOL


@pytest.mark.parametrize("case", ["text", "image", "image-seam3", "skill", "full"])
def test_chunked_forward_equals_the_one_forward(engine, case):
    msgs, kwargs = _prompts(engine)[case]
    whole, pieces = _prefilled(engine, msgs, kwargs, None)
    assert pieces == 1
    probe = engine.start(msgs, max_new_tokens=1, tenant="chunks", **kwargs)
    q = probe.pending_tokens
    sizes = {1, 3, 7, q // 2 or 1, q}
    if case != "text" and case != "full":
        index = probe.prefilled.pending.index
        (placed,) = engine.splice_plan(msgs, tenant="chunks").placements
        at = int((index < placed.start).sum())  # the seam's first token among the computed tokens
        assert at and int(index[at]) == placed.start
        sizes |= {at, at + 1, at + 2}  # the first boundary right before the seam, after its first / second token
    for size in sorted(sizes):
        run, pieces = _prefilled(engine, msgs, kwargs, size)
        assert pieces == math.ceil(q / size)
        _assert_same(run, whole)
    print(f"{engine.adapter.family} {case}: {q} computed tokens, chunk sizes {sorted(sizes)} equal the one forward")


def test_chunked_forward_after_a_prefix_cache_hit(engine):
    turn1 = [{"role": "system", "content": TEXT * 3}, {"role": "user", "content": [_image(engine, "prefix-chunks", 7),
                                                                                   {"type": "text", "text": "shape ?"}]}]
    engine.generate(turn1, max_new_tokens=1, tenant="prefix-chunks")  # its blocks go into the prefix cache
    forget_slot_records(engine)  # every run below loads them from there (none finds turn 1's prompt in place)
    turn2 = turn1 + [{"role": "assistant", "content": "a circle"}, {"role": "user", "content": TEXT}]
    whole = engine.start(turn2, max_new_tokens=1, tenant="prefix-chunks")
    with engine._lock:
        whole.prefill()
    assert whole.report["prefix_tokens_reused"] > 0
    for size in (1, 5, 16):
        run = engine.start(turn2, max_new_tokens=1, tenant="prefix-chunks")
        assert run.report["prefix_tokens_reused"] == whole.report["prefix_tokens_reused"]
        with engine._lock:
            while not run.prefill(size):
                pass
        _assert_same(run, whole)
    engine.check_integrity()


def test_an_edit_policy_chunks_its_last_forward(engine):
    """in_place computes the changed field and the rest of the prompt in one forward through the
    splice's slots: that forward chunks like any other."""
    def prompt(value):
        return [{"role": "system", "content": TEXT * 4 + f"\norder_status: {value}\n" + TEXT * 2},
                {"role": "user", "content": "refund ?"}]
    runs = []
    for size in (None, 1, 3):  # each its own tenant: an in_place turn becomes the next one's starting point
        engine.generate(prompt("pending"), max_new_tokens=1, tenant=f"edit-chunks-{size}")
        run = engine.start(prompt("shipped"), max_new_tokens=1, tenant=f"edit-chunks-{size}", edit_policy="in_place")
        assert run.report["edit"].applied == "in_place" and run.pending_tokens > 3
        with engine._lock:
            while not run.prefill(size):
                pass
        runs.append(run)
    for run in runs[1:]:
        _assert_same(run, runs[0])


def _record(monkeypatch, engine, events: list, fail_on=None):
    """Log every model call as ("prefill", tokens) or ("decode", rows) (a piece riding in a decode
    step: both, the piece first); `fail_on(event_number)` True makes that prefill forward raise."""
    forward, decode = engine.adapter.forward, engine.adapter.forward_decode

    def recorded_forward(input_ids, *args, **kwargs):
        events.append(("prefill", input_ids.numel()))
        if fail_on is not None and fail_on(len(events)):
            raise RuntimeError("chunk failed")
        return forward(input_ids, *args, **kwargs)

    def recorded_decode(tokens, *args, **kwargs):
        events.append(("decode", tokens.numel()))
        return decode(tokens, *args, **kwargs)

    def recorded_packed(tokens, positions, layers, mask, pieces, **kwargs):  # pieces riding in a decode step
        for piece in pieces:
            events.append(("prefill", piece.n))
            if fail_on is not None and fail_on(len(events)):
                raise RuntimeError("chunk failed")
        events.append(("decode", tokens.numel()))
        return packed(tokens, positions, layers, mask, pieces, **kwargs)
    packed = engine.adapter.forward_packed
    monkeypatch.setattr(engine.adapter, "forward", recorded_forward)
    monkeypatch.setattr(engine.adapter, "forward_decode", recorded_decode)
    monkeypatch.setattr(engine.adapter, "forward_packed", recorded_packed)


def _until_decoding(sched) -> None:
    """Wait until the scheduler ran a decode step: the next request arrives into a running batch."""
    while sched.decode_steps == 0:
        time.sleep(0.001)


def _long(engine, tenant: str):
    return [{"role": "system", "content": TEXT * 6},
            {"role": "user", "content": [_image(engine, tenant, 9), {"type": "text", "text": "what shape ?"}]}]


def _running(engine, tokens=60):
    banned = {t: -100.0 for t in engine.stop_ids}  # every answer runs to max_new_tokens
    return [{"role": "user", "content": "count to ten ."}], {"max_new_tokens": tokens, "logit_bias": banned}


@pytest.mark.parametrize("chunk", [0, 16])
def test_decode_steps_run_between_the_chunks_of_a_long_prefill(engine, monkeypatch, chunk):
    """A decodes; B (a long prompt with an image) arrives: with chunking every chunk of B's
    forward is followed by a decode step of A, and both answer exactly as alone."""
    short, kw = _running(engine)
    want_a = engine.generate(short, tenant="order", **kw)
    want_b = engine.generate(_long(engine, "alone"), max_new_tokens=8, tenant="alone")  # no prefix hit for B below
    events: list = []
    _record(monkeypatch, engine, events)
    long_msgs = _long(engine, f"order{chunk}")  # its image uploaded (precompiled) before the count starts
    events.clear()
    sched = Scheduler(engine, max_batch=4, prefill_chunk=chunk)
    a = sched.submit(short, tenant="order", **kw)
    sched.start()
    _until_decoding(sched)
    b = sched.submit(long_msgs, max_new_tokens=8, tenant=f"order{chunk}")  # A decodes
    try:
        got_a, got_b = a.result(timeout=120), b.result(timeout=120)
    finally:
        sched.stop()
    assert got_a.token_ids == want_a.token_ids and got_b.token_ids == want_b.token_ids
    assert (got_b.first_logits - want_b.first_logits).abs().max().item() <= TOL
    first_decode = events.index(("decode", 1))
    b_chunks = [i for i, (kind, _) in enumerate(events) if kind == "prefill" and i > first_decode]
    assert sum(events[i][1] for i in b_chunks) == got_b.lm_tokens_computed
    if chunk:
        assert len(b_chunks) == math.ceil(got_b.lm_tokens_computed / chunk) > 3
        assert all(events[i][1] <= chunk for i in b_chunks)
        for i, j in zip(b_chunks, b_chunks[1:]):  # one decode step of A between two chunks of B
            assert events[i + 1:j] == [("decode", 1)]
    else:
        assert len(b_chunks) == 1  # the whole prefill: A waits for all of it
    print(f"{engine.adapter.family} chunk {chunk}: {len(b_chunks)} prefill forwards for "
          f"{got_b.lm_tokens_computed} tokens, decode steps between them")


def test_cancel_mid_prefill_frees_it_and_stores_nothing(engine, monkeypatch):
    msgs = _long(engine, "cancel")
    engine.start(msgs, max_new_tokens=1, tenant="cancel")  # precompile the image outside the count
    short, kw = _running(engine, 30)
    want = engine.generate(short, tenant="cancel", **kw)  # its prefix blocks are stored now
    before = engine.stats()
    events: list = []
    _record(monkeypatch, engine, events)
    sched = Scheduler(engine, max_batch=4, prefill_chunk=8)
    running = sched.submit(short, tenant="cancel", **kw)
    cancelled = sched.submit(msgs, max_new_tokens=8, tenant="cancel",
                             should_stop=lambda: sum(kind == "prefill" for kind, _ in events) >= 5)
    sched.start()
    try:
        got = cancelled.result(timeout=120)
        other = running.result(timeout=120)
    finally:
        sched.stop()
    assert got.finish_reason == "cancelled" and got.token_ids == [] and got.first_logits is None
    assert sum(kind == "prefill" for kind, _ in events) < got.lm_tokens_computed // 8  # it stopped early
    assert other.token_ids == want.token_ids
    engine.check_integrity()
    after = engine.stats()
    assert after["prefix_blocks"] == before["prefix_blocks"] and after["cache_bytes"] == before["cache_bytes"]
    again = engine.generate(msgs, max_new_tokens=1, tenant="cancel")
    assert again.prefix_tokens_reused == 0  # no block of the cancelled prompt was stored
    engine.check_integrity()


def test_a_failing_chunk_fails_only_its_request(engine, monkeypatch):
    events: list = []
    armed = {"on": False}
    _record(monkeypatch, engine, events, fail_on=lambda n: armed["on"] and events[-1][0] == "prefill")
    engine.start(_long(engine, "fail"), max_new_tokens=1, tenant="fail")  # precompile the image: only chunks fail
    short, kw = _running(engine, 20)
    want = engine.generate(short, tenant="fail", **kw)
    sched = Scheduler(engine, max_batch=4, prefill_chunk=8)
    ok = sched.submit(short, tenant="fail", **kw)
    sched.start()
    _until_decoding(sched)
    doomed = sched.submit(_long(engine, "fail"), max_new_tokens=4, tenant="fail",
                          on_start=lambda: armed.update(on=True))  # start() places the KV, then chunks fail
    try:
        with pytest.raises(RuntimeError, match="chunk failed"):
            doomed.result(timeout=120)
        assert ok.result(timeout=120).token_ids == want.token_ids
    finally:
        sched.stop()
    engine.check_integrity()


@pytest.mark.parametrize("reuse", [False, True], ids=["appended", "into slots"])
def test_a_request_arriving_mid_forward_preempts_it(engine, monkeypatch, reuse):
    """Prefill fairness: a short request that arrived during a long prompt's 512-token forward
    waited for all of it (9.5x its TTFT alone behind a 4k prompt on the bench CPU). Now the forward
    stops before its next layer, the short request is prefilled next, and the long prompt's piece
    runs again from where it was: both answer as alone, so the cut-short forward left no trace in
    the long prompt's cache (appended after it: `reuse=False`, or into a splice's slots)."""
    short_msgs = [{"role": "user", "content": "hi ?"}]
    tenant = f"preempt-{reuse}"
    if reuse:  # an image spliced after a long system prompt: the text goes into the splice's slots
        long_msgs = _long(engine, tenant)
        engine.start(long_msgs, max_new_tokens=1, tenant=tenant)  # the image precompiled, nothing prefilled
        want_long = engine.generate(_long(engine, "alone"), max_new_tokens=3, tenant="alone")
    else:
        long_msgs = [{"role": "user", "content": TEXT * 12 + "refund ?"}]
        want_long = engine.generate(long_msgs, max_new_tokens=3, reuse=False)
    want = {"long": want_long, "short": engine.generate(short_msgs, max_new_tokens=3, reuse=False)}
    events: list = []
    _record(monkeypatch, engine, events)
    sched = Scheduler(engine, max_batch=4, prefill_chunk=512)
    submitted: dict = {}
    forward = engine.adapter.forward

    def arrive_during_the_first_forward(input_ids, *args, **kwargs):
        if "short" not in submitted:
            submitted["short"] = sched.submit(short_msgs, max_new_tokens=3, reuse=False)
        return forward(input_ids, *args, **kwargs)
    monkeypatch.setattr(engine.adapter, "forward", arrive_during_the_first_forward)
    long_future = sched.submit(long_msgs, max_new_tokens=3, reuse=reuse, tenant=tenant)
    sched.start()
    try:
        got = {"long": long_future.result(timeout=120), "short": None}
        got["short"] = submitted["short"].result(timeout=120)
    finally:
        sched.stop()
    prefills = [n for kind, n in events if kind == "prefill"]
    assert sched.preemptions == 1
    assert prefills[0] == min(512, got["long"].lm_tokens_computed)  # cut short ...
    assert prefills[1] == got["short"].lm_tokens_computed  # ... the short request's prefill next ...
    assert sum(prefills[2:]) == got["long"].lm_tokens_computed  # ... then the long prompt's, whole again
    for name in want:
        assert got[name].token_ids == want[name].token_ids
        assert (got[name].first_logits - want[name].first_logits).abs().max().item() <= TOL
    engine.check_integrity()
