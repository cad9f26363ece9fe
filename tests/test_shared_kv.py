"""Rows of the decode batch that hold the same prefix KV keep it once.

Oracle: the same rows in a batch that shares nothing (each row whole, left-padded: the layout
`tests/test_scheduler.py` checks against single decoding), fed the same tokens; logits within
TOL (only the order of the masked slots differs), greedy ids identical; and the bytes held."""

from __future__ import annotations

import pytest
import torch

from mmkv import Engine
from mmkv.request.scheduler import DecodeBatch
from mmkv.request.shared_kv import common_prefix_length

TOL = 1e-4
POLICY = "rule : answer in one word , never guess , cite the page . " * 24


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def engine(request, tiny_dirs):
    return Engine.from_pretrained(tiny_dirs[request.param], dtype=torch.float32, device="cpu")


def _ask(question: str) -> list[dict]:
    return [{"role": "system", "content": POLICY}, {"role": "user", "content": question}]


def _started(engine, messages: list[list[dict]], steps: int):
    """Each request started, prefilled and its first token sampled (its prefix blocks stored)."""
    runs = []
    for m in messages:
        run = engine.start(m, max_new_tokens=steps + 1)
        run.prefill()
        run.stream.step(run.first_logits)
        run.first_token_out()
        runs.append(run)
    return runs


def _decode_side_by_side(runs, shared: DecodeBatch, whole: DecodeBatch, steps: int) -> float:
    """Feed both batches the same (greedy, from the whole batch) tokens; the largest logit gap."""
    tokens = [run.stream.ids[-1] for run in runs]
    worst = 0.0
    for step in range(steps):
        positions = [run.stream.first_position + step for run in runs]
        a, b = shared.step(tokens, positions), whole.step(tokens, positions)
        worst = max(worst, float((a - b).abs().max()))
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        tokens = b.argmax(-1).tolist()
    return worst


def _batches(engine, runs):
    shared, whole = DecodeBatch(engine.adapter), DecodeBatch(engine.adapter, share=False)
    for run in runs:
        shared.add(run.cache)
        whole.add(run.cache)
    return shared, whole


def test_eight_rows_on_one_policy_hold_its_kv_once(engine):
    """8 requests about one long policy (its KV from the prefix cache): the batch holds the
    policy once, at most 1.5x one request's bytes, and decodes as the unshared batch."""
    engine.generate(_ask("warm up ."), max_new_tokens=1)  # the policy's blocks are stored
    runs = _started(engine, [_ask(f"question {i} : what is rule {i} ?") for i in range(8)], steps=4)
    shared, whole = _batches(engine, runs)
    one_row = whole.nbytes / len(runs)
    assert shared.prefix_length >= 0.8 * runs[0].cache.layers[0].keys.shape[-2]
    assert shared.nbytes <= 1.5 * one_row, (shared.nbytes, one_row)
    assert whole.nbytes >= 7 * one_row
    assert _decode_side_by_side(runs, shared, whole, steps=4) < TOL


def test_a_row_that_shares_less_gives_back_the_slots(engine):
    """Two rows share the policy; a third with another system prompt joins (the prefix shrinks
    to what all three share, the first two get their slots back); one leaves; a fourth on the
    policy joins. Every step equals the unshared batch."""
    engine.generate(_ask("warm up ."), max_new_tokens=1)
    a, b = _started(engine, [_ask("first ?"), _ask("second ?")], steps=6)
    other = _started(engine, [[{"role": "system", "content": "be brief ."},
                               {"role": "user", "content": "third ?"}]], steps=6)[0]
    shared, whole = _batches(engine, [a, b])
    before = shared.prefix_length
    shared.add(other.cache)
    whole.add(other.cache)
    assert 0 <= shared.prefix_length < before
    assert _decode_side_by_side([a, b, other], shared, whole, steps=2) < TOL
    shared.remove({0})
    whole.remove({0})
    fourth = _started(engine, [_ask("fourth ?")], steps=4)[0]
    shared.add(fourth.cache)
    whole.add(fourth.cache)
    assert _decode_side_by_side([b, other, fourth], shared, whole, steps=2) < TOL


def test_a_lone_row_shares_its_leading_slots_with_the_next(engine):
    """A batch of one row gives its leading slots to the prefix when a second row holds them
    too; the second row keeps only what follows."""
    engine.generate(_ask("warm up ."), max_new_tokens=1)
    runs = _started(engine, [_ask("alpha ?"), _ask("beta ?")], steps=3)
    shared, whole = _batches(engine, runs)
    assert shared.prefix_length > 0 and len(shared) == 2
    own = shared.cache.layers[0].keys.shape[-2]
    assert shared.prefix_length + own <= runs[0].cache.layers[0].keys.shape[-2] + max(shared.pad)
    assert _decode_side_by_side(runs, shared, whole, steps=3) < TOL


def test_kv_equal_only_to_rounding_is_not_shared():
    """Sharing is bit-exact: one element different in one layer's values ends the shared run."""
    torch.manual_seed(0)
    layers = [(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)) for _ in range(3)]
    other = [(k.clone(), v.clone()) for k, v in layers]
    assert common_prefix_length(layers, other) == 10
    other[2][1][0, 1, 6, 3] += 1e-7
    assert common_prefix_length(layers, other) == 6
    assert common_prefix_length(layers, [(k[:, :, :4], v[:, :, :4]) for k, v in other]) == 4


def test_the_scheduler_shares_and_reports_it(engine):
    """Through the scheduler: requests on one policy decode together holding it once (the
    batch's gauges say so while they run), answer as alone, and the gauges return to 0."""
    import time

    from mmkv.request.scheduler import Scheduler

    engine.generate(_ask("warm up ."), max_new_tokens=1)
    asks = [_ask(f"item {i} ?") for i in range(4)]
    alone = [engine.generate(m, max_new_tokens=10).token_ids for m in asks]
    scheduler = Scheduler(engine, max_batch=4).start()
    try:
        futures = [scheduler.submit(m, max_new_tokens=10) for m in asks]
        seen = []
        while not all(f.done() for f in futures):
            seen.append(dict(scheduler.batch_stats))
            time.sleep(0.001)
        assert [f.result().token_ids for f in futures] == alone
    finally:
        scheduler.stop()
    busiest = max(seen, key=lambda s: s["decode_batch_rows"])
    assert busiest["decode_batch_rows"] >= 2 and busiest["decode_batch_shared_tokens"] > 0
    assert scheduler.batch_stats == {"decode_batch_rows": 0, "decode_batch_kv_bytes": 0,
                                     "decode_batch_shared_tokens": 0}
