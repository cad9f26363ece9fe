"""Continuous batching (issue 13): a batch of mixed requests gives each exactly what it gets alone.

Oracle: `Engine.generate` of the same request on the same engine (greedy token ids identical,
first-token logits equal; seeded sampling identical, since each request keeps its own generator)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mmkv import Engine
from mmkv.errors import InvalidRequestError
from mmkv.request.scheduler import DecodeBatch, Scheduler

from conftest import make_png

TOL = 1e-4


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def engine(request, tiny_dirs):
    return Engine.from_pretrained(tiny_dirs[request.param], dtype=torch.float32, device="cpu")


def _requests(engine):
    image = engine.add_image(make_png(84, 56, seed=3))
    ref = {"type": "image_file", "image_file": {"file_id": image}}
    return [
        ([{"role": "user", "content": "what color is the shape ?"}], {"max_new_tokens": 7}),
        ([{"role": "system", "content": "be brief . " * 20}, {"role": "user", "content": "count ."}],
         {"max_new_tokens": 12}),
        ([{"role": "user", "content": [ref, {"type": "text", "text": "what shape is it ?"}]}],
         {"max_new_tokens": 9, "logprobs": True, "top_logprobs": 2}),
        ([{"role": "user", "content": "one two three"}],
         {"max_new_tokens": 10, "temperature": 1.3, "top_p": 0.9, "seed": 7}),
        ([{"role": "user", "content": [ref, {"type": "text", "text": "describe the image ."}]}],
         {"max_new_tokens": 5, "frequency_penalty": 1.0, "stop": ["e"]}),
    ]


def test_decode_batch_rows_equal_single_decoding(engine):
    """Three prompts of different lengths decoded side by side: every row's logits at every step
    equal the single-request decode of that prompt."""
    msgs = [m for m, _ in _requests(engine)[:3]]
    runs = [engine.start(m, max_new_tokens=6) for m in msgs]
    alone = [engine.generate(m, max_new_tokens=6) for m in msgs]
    batch = DecodeBatch(engine.adapter)
    tokens = []
    for run in runs:
        assert run.first_logits is None and run.pending_tokens > 0  # start places the KV; the forward waits
        run.prefill()
        batch.add(run.cache)
        tokens.append(run.stream.step(run.first_logits))
    assert batch.pad.count(0) >= 1 and len(set(batch.pad)) > 1  # rows really are padded
    for _ in range(4):
        logits = batch.step(tokens, [r.stream.position for r in runs])
        tokens = [r.stream.step(logits[i]) for i, r in enumerate(runs)]
    for run, want in zip(runs, alone):
        assert run.stream.ids == want.token_ids[:len(run.stream.ids)]


def test_mixed_requests_in_one_batch_answer_as_alone(engine):
    reqs = _requests(engine)
    alone = [engine.generate(m, **kw) for m, kw in reqs]
    sched = Scheduler(engine, max_batch=4).start()
    try:
        streamed = [[] for _ in reqs]
        futures = [sched.submit(m, on_text=streamed[i].append, **kw) for i, (m, kw) in enumerate(reqs)]
        got = [f.result(timeout=120) for f in futures]
    finally:
        sched.stop()
    for g, want, deltas in zip(got, alone, streamed):
        assert g.token_ids == want.token_ids and g.text == want.text and g.finish_reason == want.finish_reason
        assert "".join(deltas) == g.text
        assert (g.first_logits - want.first_logits).abs().max().item() <= TOL
        if want.logprobs:
            assert [round(x.logprob, 3) for x in g.logprobs] == [round(x.logprob, 3) for x in want.logprobs]
    assert sched.decode_steps < sum(len(g.token_ids) for g in got)  # decode steps really were shared
    print(f"{len(reqs)} requests, {sum(len(g.token_ids) for g in got)} tokens in {sched.decode_steps} "
          f"batched steps (mean batch {sched.decoded_tokens / max(sched.decode_steps, 1):.2f})")


def test_cancel_and_bad_request_touch_only_their_own(engine):
    reqs = _requests(engine)
    stop_now = threading.Event()
    sched = Scheduler(engine, max_batch=8).start()
    try:
        ok = sched.submit(reqs[1][0], **reqs[1][1])
        cancelled = sched.submit(reqs[0][0], max_new_tokens=40, should_stop=stop_now.is_set)
        bad = sched.submit([{"role": "wizard", "content": "hi"}], max_new_tokens=3)
        stop_now.set()
        assert cancelled.result(timeout=120).finish_reason == "cancelled"
        with pytest.raises(InvalidRequestError):
            bad.result(timeout=120)
        assert ok.result(timeout=120).token_ids == engine.generate(reqs[1][0], **reqs[1][1]).token_ids
    finally:
        sched.stop()


def test_waiting_requests_can_be_cancelled_and_drained(engine):
    from mmkv.request.scheduler import SchedulerStoppedError

    sched = Scheduler(engine)  # not started: everything stays waiting
    first = sched.submit([{"role": "user", "content": "hi"}], max_new_tokens=2)
    second = sched.submit([{"role": "user", "content": "hi"}], max_new_tokens=2)
    assert sched.cancel(first) and first.cancelled() and sched.waiting == 1
    sched.drain()
    with pytest.raises(SchedulerStoppedError):
        second.result(timeout=1)
    with pytest.raises(SchedulerStoppedError):
        sched.submit([{"role": "user", "content": "hi"}])
    assert SchedulerStoppedError.http_status == 503


def test_a_short_request_is_not_held_behind_a_long_prefill(engine):
    """Prefill fairness: with a long prompt prefilling a chunk a turn, a short request that arrives
    after it is admitted at once and prefilled first (fewest tokens left), so its first token comes
    before the long prompt's; both answer as they do alone."""
    long_msgs = [{"role": "user", "content": "a long policy . " * 150 + "what now ?"}]
    short_msgs = [{"role": "user", "content": "hi ?"}]
    alone = {name: engine.generate(m, max_new_tokens=3, reuse=False).token_ids
             for name, m in (("long", long_msgs), ("short", short_msgs))}
    firsts: list[str] = []
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=32).start()
    try:
        def first(name):
            return lambda _delta: firsts.append(name) if name not in firsts else None
        futures = {name: scheduler.submit(m, max_new_tokens=3, reuse=False, on_text=first(name))
                   for name, m in (("long", long_msgs), ("short", short_msgs))}
        results = {name: f.result(60) for name, f in futures.items()}
    finally:
        scheduler.stop()
    assert firsts[0] == "short", firsts
    assert {name: r.token_ids for name, r in results.items()} == alone


class _FakeRun:
    """A prefill that never finishes: records how many tokens each turn gave it."""

    def __init__(self, pending: int):
        self.pending_tokens, self.given = pending, []
        self.stream = type("S", (), {"should_stop": None})()

    def prefill(self, n):
        self.given.append(n)
        self.pending_tokens -= n
        return False


def test_a_long_prefill_is_not_starved_by_short_ones():
    """Aging: short requests keep arriving and each would go first (fewest tokens left); a long one
    passed over for AGING_TURNS turns gets the next turn's budget all the same."""
    from mmkv.request.scheduler import AGING_TURNS, _Request

    engine = type("E", (), {"_lock": threading.RLock()})()
    scheduler = Scheduler(engine, max_batch=64, prefill_chunk=16, preempt=False)
    long_req = _Request(None, {})
    long_req.run = _FakeRun(10_000)
    scheduler._prefilling.append(long_req)
    for _turn in range(3 * (AGING_TURNS + 1)):
        short = _Request(None, {})
        short.run = _FakeRun(16)  # takes a whole turn's budget
        scheduler._prefilling.append(short)
        scheduler._prefill()
        scheduler._prefilling = [r for r in scheduler._prefilling if r.run.pending_tokens > 0]
    assert len(long_req.run.given) >= 2 and all(n == 16 for n in long_req.run.given)


def test_a_fidelity_check_does_not_hold_the_running_decodes(engine):
    """Review finding 14: `fidelity` ran two whole forwards inside the request's admission, and
    every running request waited for both. The reference forward now runs in prefill chunks like
    any other, so a decoding request keeps getting tokens while a fidelity check prefills; the
    report is the same as the single-request path's."""
    busy = [{"role": "user", "content": "keep talking ."}]
    checked = [{"role": "user", "content": "a long policy . " * 60 + "what now ?"}]
    banned = {i: -100.0 for i in engine.stop_ids}
    alone = engine.generate(checked, max_new_tokens=1, fidelity=True)
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=16).start()
    tokens, during = [], []
    try:
        running = scheduler.submit(busy, max_new_tokens=60, logit_bias=banned, on_text=tokens.append)
        while len(tokens) < 2:
            threading.Event().wait(0.01)
        result = scheduler.submit(checked, max_new_tokens=1, fidelity=True,
                                  on_start=lambda: during.append(len(tokens))).result(60)
        during.append(len(tokens))
        running.result(60)
    finally:
        scheduler.stop()
    assert during[1] - during[0] >= 5, f"the running request got {during[1] - during[0]} tokens meanwhile"
    assert result.fidelity is not None and result.fidelity.same_argmax == alone.fidelity.same_argmax
    assert abs(result.fidelity.max_abs_diff - alone.fidelity.max_abs_diff) <= 1e-4


class _TimedRun(_FakeRun):
    """A never-finishing prefill that takes `ms_per_token` per token; `on_forward(i)` runs during
    its i-th forward (0-based)."""

    def __init__(self, pending: int, ms_per_token: float, on_forward=None):
        super().__init__(pending)
        self.ms_per_token, self.on_forward = ms_per_token, on_forward

    def prefill(self, n):
        time.sleep(n * self.ms_per_token / 1e3)
        if self.on_forward is not None:
            self.on_forward(len(self.given))
        return super().prefill(n)


def test_a_turn_prefills_in_slices_and_an_arrival_ends_it():
    """Prefill fairness (a short request waited for a whole chunk's forward: 9.5x its TTFT alone
    behind a 4k prompt at chunk 512): a turn's budget runs as forwards of about `prefill_slice_ms`,
    FIRST_SLICE tokens first, then sized from the measured rate (here 40 ms at <= 1 token per ms:
    32 tokens, or 16 on a slow clock), and a request that arrives during a forward ends the turn's
    prefill after it. With `prefill_slice_ms=0` the turn's budget is one forward."""
    from mmkv.request.scheduler import FIRST_SLICE, _Request

    engine = type("E", (), {"_lock": threading.RLock()})()
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=256, prefill_slice_ms=40, preempt=False)
    long_req = _Request(None, {})
    long_req.run = _TimedRun(10_000, ms_per_token=1.0)
    scheduler._prefilling.append(long_req)
    scheduler._prefill()
    given = long_req.run.given
    assert given[0] == FIRST_SLICE and sum(given) == 256 and set(given[1:]) <= {16, 32}, given
    given.clear()  # next turn: a request arrives during the first forward
    long_req.run.on_forward = lambda i: scheduler._waiting.append(_Request(None, {})) if i == 0 else None
    scheduler._prefill()
    assert len(given) == 1 and given[0] in (16, 32), given
    whole = Scheduler(engine, max_batch=4, prefill_chunk=256, prefill_slice_ms=0, preempt=False)
    other = _Request(None, {})
    other.run = _TimedRun(10_000, ms_per_token=0.0)
    whole._prefilling.append(other)
    whole._prefill()
    assert other.run.given == [256]
    with pytest.raises(ValueError, match="prefill_slice_ms"):
        Scheduler(engine, prefill_slice_ms=-1)


def test_idle_turn_builds_run_in_slices():
    """With `prefill_slice_ms` a first-sight build in an idle turn runs one slice, FIRST_SLICE tokens,
    then sized from the last slice's rate (40 ms at 1 token per ms: 32 tokens, or 16 on a slow
    clock), not a whole chunk's forward, so an arrival waits one slice."""
    from mmkv.request.first_sight import BackgroundRun
    from mmkv.request.scheduler import FIRST_SLICE

    budgets = []

    def run_background(budget):
        budgets.append(budget)
        time.sleep(budget / 1e3)
        return BackgroundRun(built=0, tokens=budget, seconds=budget / 1e3, pending=1)
    engine = type("E", (), {"_lock": threading.RLock(), "run_background": staticmethod(run_background)})()
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=512, prefill_slice_ms=40, preempt=False)
    for _turn in range(3):
        scheduler._build_in_background()
    assert budgets[0] == FIRST_SLICE and set(budgets[1:]) <= {16, 32}, budgets


def test_a_rider_is_not_held_behind_another_prefill():
    """A short request that rides in the decode step got its first token only after the turn's
    other prefills ran (a long prompt's slices, up to a chunk): once one rides, the others wait for
    the next turn (passed over, so aging still serves them)."""
    from mmkv.request.scheduler import _Request

    class ShortRun(_FakeRun):
        def ride(self, n):
            return ("piece", n)

    class LongRun(_FakeRun):
        def ride(self, n):
            raise AssertionError("a long prompt's rest does not fit one slice: it is never asked to ride")

    adapter = type("A", (), {"can_pack": staticmethod(lambda: True)})()
    engine = type("E", (), {"_lock": threading.RLock(), "adapter": adapter})()
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=256, preempt=False)
    scheduler._running = [_Request(None, {})]  # a row decodes: a step runs this turn
    long_req, short_req = _Request(None, {}), _Request(None, {})
    long_req.run, short_req.run = LongRun(10_000), ShortRun(10)
    scheduler._prefilling += [long_req, short_req]
    scheduler._prefill()
    assert scheduler._riders == [(short_req, ("piece", 10))]
    assert long_req.run.given == [] and long_req.passed_over == 1


def test_arrivals_cannot_starve_a_prefill_by_preempting_it():
    """A forward cut short by an arrival runs again; after MAX_PREEMPTIONS in a row it runs to its
    end whatever arrives, and only a request that arrives during the forward cuts it short (not
    one already waiting at its start)."""
    from mmkv.request.scheduler import MAX_PREEMPTIONS, _Request

    layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(3))
    adapter = type("A", (), {"language_model": type("LM", (), {"layers": layers})()})()
    engine = type("E", (), {"_lock": threading.RLock(), "adapter": adapter})()
    scheduler = Scheduler(engine, max_batch=64, prefill_chunk=64)

    class LayeredRun(_FakeRun):
        def __init__(self, pending, arrive_in: Scheduler | None):
            super().__init__(pending)
            self.arrive_in = arrive_in

        def prefill(self, n):
            for layer in layers:
                if layer is layers[0] and self.arrive_in is not None:  # a request arrives while it runs
                    self.arrive_in.submit(None)
                layer(torch.zeros(1))
            return super().prefill(n)
    req = _Request(None, {})
    req.run = LayeredRun(10_000, scheduler)
    for _turn in range(MAX_PREEMPTIONS):
        assert scheduler._forward(req, 64) is False and req.run.given == []
    assert scheduler.preemptions == MAX_PREEMPTIONS
    scheduler._forward(req, 64)
    assert req.run.given == [64] and req.preempted == 0
    waiting_before = Scheduler(engine, max_batch=64, prefill_chunk=64)
    waiting_before._waiting.append(_Request(None, {}))
    other = _Request(None, {})
    other.run = LayeredRun(10_000, None)
    waiting_before._forward(other, 64)
    assert other.run.given == [64] and waiting_before.preemptions == 0


def test_a_waiting_request_is_admitted_before_a_long_forward_starts():
    """A short request that arrived while a long prompt was being admitted (before its forward
    started, so nothing to preempt) waited for the long prompt's whole first chunk (6.6x its TTFT
    alone behind a 4k prompt): now no prefill forward starts while a request waits with room; the
    turn ends, the next admits it and prefills it first."""
    from mmkv.request.scheduler import _Request

    engine = type("E", (), {"_lock": threading.RLock()})()
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=64, preempt=False)
    long_req = _Request(None, {})
    long_req.run = _FakeRun(10_000)
    scheduler._prefilling.append(long_req)
    scheduler._waiting.append(_Request(None, {}))
    scheduler._prefill()
    assert long_req.run.given == [] and long_req.passed_over == 1
    scheduler._waiting.clear()
    scheduler._prefill()
    assert long_req.run.given == [64]
