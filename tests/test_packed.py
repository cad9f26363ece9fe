"""A prefill that rides in the decode step (mmkv.kv.packed): one forward runs the batch's next
tokens and a prefilling request's text piece, and each gets what its own forward gives.

Oracle: the same state run the usual way, a decode step (`DecodeBatch.step`) and then the piece's
own forward (`Run.prefill`): the rows' logits, the piece's last-token logits and every layer's KV
of both within TOL (float32: only the matrix shapes differ). Four families, with and without a
shared prefix in the batch, the piece appended after a prefix-cache hit or written into a
splice's slots, the last piece of a prompt or one in the middle."""

from __future__ import annotations

import time

import pytest
import torch

from mmkv import Engine
from mmkv.request.batch import DecodeBatch

from conftest import make_png

TOL = 1e-4
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
POLICY = "rule : answer in one word , never guess , cite the page . " * 8


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, tiny_dirs):
    return Engine.from_pretrained(tiny_dirs[request.param], dtype=torch.float32, device="cpu")


def _rows(engine, shared: bool) -> list[list[dict]]:
    image = {"type": "image_file", "image_file": {"file_id": engine.add_image(make_png(84, 56, seed=3))}}
    system = {"role": "system", "content": POLICY if shared else "be brief ."}
    return [[system, {"role": "user", "content": [image, {"type": "text", "text": "what shape is it ?"}]}],
            [system, {"role": "user", "content": [image, {"type": "text", "text": "what colour is it ?"}]}],
            [{"role": "system", "content": POLICY if shared else "look ."}, {"role": "user", "content": "count ."}]]


def _state(engine, shared: bool, rider_msgs, kwargs):
    """A decode batch of three prefilled rows and a started (not prefilled) rider."""
    batch = DecodeBatch(engine.adapter, max_rows=4)
    firsts = []
    for msgs in _rows(engine, shared):
        run = engine.start(msgs, max_new_tokens=4)
        with engine._lock:
            run.prefill(None)
        batch.add(run.cache)
        firsts.append(int(run.first_logits.argmax()))
    positions = [batch.length + 7] * len(firsts)  # any text position past every row
    rider = engine.start(rider_msgs, max_new_tokens=4, **kwargs)
    return batch, firsts, positions, rider


def _kv(cache_layers, upto: int | None = None):
    return [(layer.keys[..., :upto, :].clone(), layer.values[..., :upto, :].clone()) for layer in cache_layers]


def _close(a, b):
    return max((x - y).abs().max().item() for (ka, va), (kb, vb) in zip(a, b) for x, y in ((ka, kb), (va, vb)))


CASES = {
    "after a prefix hit": ([{"role": "system", "content": POLICY}, {"role": "user", "content": "why ?"}], {}, None),
    "into a splice's slots": ("image", {}, None),
    "a middle piece": ([{"role": "user", "content": "tell me about the policy . " * 6}], {"reuse": False}, 5),
}


@pytest.mark.parametrize("shared", [False, True], ids=["own rows", "shared prefix"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_ridden_step_equals_a_step_then_the_pieces_own_forward(engine, case, shared):
    msgs, kwargs, piece_tokens = CASES[case]
    if msgs == "image":  # the image spliced, the question after it computed
        msgs = _rows(engine, shared)[0][:1] + [{"role": "user", "content": [
            {"type": "text", "text": "and now ,"}, _rows(engine, shared)[0][1]["content"][0],
            {"type": "text", "text": "which shape ?"}]}]
    engine.generate(msgs, max_new_tokens=1, **kwargs)  # the prefix blocks / chunks it reuses exist
    results = {}
    for arm in ("separate", "ridden"):
        batch, firsts, positions, rider = _state(engine, shared, msgs, kwargs)
        assert (batch.prefix_length > 0) == shared
        n = piece_tokens or rider.pending_tokens
        with engine._lock:
            if arm == "separate":
                logits = batch.step(firsts, positions)
                done = rider.prefill(n)
            else:
                piece = rider.ride(n)
                assert piece is not None and piece.n == n
                logits, (last,) = batch.step(firsts, positions, riders=[piece])
                done = rider.rode(piece, last)
        assert done == (piece_tokens is None)
        results[arm] = (logits, rider.first_logits if done else None, _kv(batch.layers, None),
                        _kv(rider.cache.layers))
    (la, fa, ba, ra), (lb, fb, bb, rb) = results["separate"], results["ridden"]
    assert (la - lb).abs().max().item() <= TOL
    if fa is not None:
        assert (fa - fb).abs().max().item() <= TOL
    assert _close(ba, bb) <= TOL and _close(ra, rb) <= TOL


def test_a_piece_with_image_pads_does_not_ride(engine):
    """Visual features (and Qwen3-VL's deepstack) run in the piece's own forward only."""
    image = {"type": "image_file", "image_file": {"file_id": engine.add_image(make_png(56, 56, seed=11))}}
    run = engine.start([{"role": "user", "content": [image, {"type": "text", "text": "what ?"}]}],
                       max_new_tokens=2, reuse=False)
    assert run.ride(run.pending_tokens) is None
    with engine._lock:
        assert run.prefill(None)


def _traffic(engine):
    banned = {t: -100.0 for t in engine.stop_ids}
    image = {"type": "image_file", "image_file": {"file_id": engine.add_image(make_png(84, 56, seed=3))}}
    return [
        ([{"role": "user", "content": "count to ten ."}], {"max_new_tokens": 12, "logit_bias": banned}),
        ([{"role": "system", "content": POLICY}, {"role": "user", "content": "why ?"}], {"max_new_tokens": 5}),
        ([{"role": "user", "content": [image, {"type": "text", "text": "what shape ?"}]}],
         {"max_new_tokens": 6, "temperature": 1.0, "seed": 4}),
        ([{"role": "user", "content": "one two three"}], {"max_new_tokens": 4, "logprobs": True, "top_logprobs": 2}),
    ]


@pytest.mark.parametrize("ride", [True, False])
def test_requests_riding_in_decode_steps_answer_as_alone(engine, ride):
    """Through the scheduler: requests that arrive while others decode ride in the decode steps
    (counted), and each answers exactly as alone (tokens, first logits within TOL); `ride=False`
    keeps every prefill its own forward."""
    from mmkv.request.scheduler import Scheduler

    traffic = _traffic(engine)
    for msgs, kw in traffic:  # prefix blocks and the image chunk exist: later prefills are short
        engine.generate(msgs, **kw)
    alone = [engine.generate(msgs, **kw) for msgs, kw in traffic]
    sched = Scheduler(engine, max_batch=4, ride=ride).start()
    try:
        first = sched.submit(traffic[0][0], **traffic[0][1])
        while sched.decode_steps == 0:
            time.sleep(0.001)  # the first request decodes: the others arrive into a running batch
        rest = [sched.submit(msgs, **kw) for msgs, kw in traffic[1:]]
        got = [f.result(timeout=120) for f in [first] + rest]
    finally:
        sched.stop()
    assert (sched.ridden > 0) == ride
    for g, want in zip(got, alone):
        assert g.token_ids == want.token_ids and g.finish_reason == want.finish_reason
        assert (g.first_logits - want.first_logits).abs().max().item() <= TOL
        assert g.prefix_tokens_reused == want.prefix_tokens_reused and g.lm_tokens_computed == want.lm_tokens_computed


def test_a_failed_ridden_step_fails_its_requests_and_leaves_nothing(engine, monkeypatch):
    """A packed forward that raises fails the rider and the batch's rows (as any failed decode
    step), stores no prefix block of the rider, and the scheduler serves the next request."""
    from mmkv.request.scheduler import Scheduler

    traffic = _traffic(engine)
    for msgs, kw in traffic:
        engine.generate(msgs, **kw)
    rider_msgs = [{"role": "system", "content": POLICY}, {"role": "user", "content": "never stored ?"}]

    def broken(*args, **kwargs):
        raise RuntimeError("packed forward failed")
    monkeypatch.setattr(engine.adapter, "forward_packed", broken)
    sched = Scheduler(engine, max_batch=4).start()
    try:
        first = sched.submit(traffic[0][0], **traffic[0][1])
        while sched.decode_steps == 0:
            time.sleep(0.001)
        rider = sched.submit(rider_msgs, max_new_tokens=3)
        for f in (first, rider):
            with pytest.raises(RuntimeError, match="packed forward failed"):
                f.result(timeout=120)
        monkeypatch.undo()
        again = sched.submit(*traffic[1][:1], **traffic[1][1]).result(timeout=120)
    finally:
        sched.stop()
    assert again.token_ids == engine.generate(*traffic[1][:1], **traffic[1][1]).token_ids
    engine.check_integrity()
    control = engine.generate([rider_msgs[0], {"role": "user", "content": "a control ?"}], max_new_tokens=1)
    later = engine.generate(rider_msgs, max_new_tokens=1)
    assert later.prefix_tokens_reused == control.prefix_tokens_reused  # the policy's blocks only: none of its own


def test_serve_flags_reach_the_scheduler(monkeypatch):
    """`mmkv serve --no-ride-prefill --prefill-slice-ms 40` reaches the server's scheduler; a
    negative slice is refused before the server starts."""
    from typer.testing import CliRunner

    import mmkv.server.app as server_app
    import mmkv.server.serve as server_serve
    from mmkv.cli import app as cli

    captured, real_create_app = [], server_app.create_app

    def create_app(engine, settings):
        built = real_create_app(engine, settings)
        captured.append(built.state.ctx.worker.scheduler)
        return built
    monkeypatch.setattr(server_app, "create_app", create_app)
    monkeypatch.setattr(server_serve, "serve", lambda *args, **kwargs: None)
    result = CliRunner().invoke(cli, ["serve", "--store-dir", "none", "--no-ride-prefill", "--prefill-slice-ms", "40"])
    assert result.exit_code == 0, result.output
    assert (captured[0].ride, captured[0].prefill_slice_ms) == (False, 40.0)
    refused = CliRunner().invoke(cli, ["serve", "--store-dir", "none", "--prefill-slice-ms", "-1"])
    assert refused.exit_code == 2, refused.output


def test_several_riders_in_one_step_equal_their_own_forwards(engine):
    """Two prefills (one appended after a prefix hit, one into a splice's slots) ride in one step:
    each equals its own forward, and the rows equal the plain step."""
    msgs_a = CASES["after a prefix hit"][0]
    msgs_b = [{"role": "user", "content": [_rows(engine, False)[0][1]["content"][0], {"type": "text", "text": "size ?"}]}]
    for msgs in (msgs_a, msgs_b):
        engine.generate(msgs, max_new_tokens=1)
    results = {}
    for arm in ("separate", "ridden"):
        batch, firsts, positions, first = _state(engine, False, msgs_a, {})
        second = engine.start(msgs_b, max_new_tokens=4)
        with engine._lock:
            if arm == "separate":
                logits = batch.step(firsts, positions)
                assert first.prefill(None) and second.prefill(None)
            else:
                pieces = [first.ride(first.pending_tokens), second.ride(second.pending_tokens)]
                logits, lasts = batch.step(firsts, positions, riders=pieces)
                assert all(run.rode(piece, last) for run, piece, last in zip((first, second), pieces, lasts))
        results[arm] = (logits, [first.first_logits, second.first_logits], _kv(batch.layers),
                        _kv(first.cache.layers) + _kv(second.cache.layers))
    (la, fa, ba, ra), (lb, fb, bb, rb) = results["separate"], results["ridden"]
    assert (la - lb).abs().max().item() <= TOL
    assert all((x - y).abs().max().item() <= TOL for x, y in zip(fa, fb))
    assert _close(ba, bb) <= TOL and _close(ra, rb) <= TOL
