"""A conversation's KV buffer from its last turn (mmkv.request.splice.SlotPool): the next turn
finds the prefix-cache blocks it hit already in place, or copies them from a buffer it outgrew,
and answers exactly as if it had loaded them; a record never outlives what it names."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from mmkv import Engine
from mmkv.request.oracle import block_masked_logits
from mmkv.request.splice import SlotPool, _slot_layers
from mmkv.testing.tiny import FAMILIES

from conftest import forget_slot_records, make_png, serve_kwargs

TOL = 1e-4  # float32 logits against one block-masked forward (mmkv.request.oracle)
F32, CPU = torch.float32, torch.device("cpu")


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, tiny_dirs):
    return Engine.from_pretrained(tiny_dirs[request.param], dtype=torch.float32, device="cpu")


class Owner:  # a stand-in for an engine's prefix cache: records are per owner, by identity
    pass


# ---- the pool ---------------------------------------------------------------------------------
def test_a_buffer_lends_its_recorded_blocks_in_place_once():
    pool, owner = SlotPool(budget=1 << 20), Owner()
    first = pool.lend(1000, F32, CPU, owner, ["a", "b", "c"])
    assert first.in_place == 0 and first.source is None
    pool.hold(first.buffer[:10], owner, ["a", "b", "c"])  # any view of it names the buffer
    ptr = first.buffer.untyped_storage().data_ptr()
    assert pool.lend(1000, F32, CPU, owner, ["a", "b", "x"]).in_place == 0, "in use: never lent twice"
    del first
    gc.collect()
    again = pool.lend(1100, F32, CPU, owner, ["a", "b", "x", "y"])
    assert again.buffer.untyped_storage().data_ptr() == ptr and again.in_place == 2
    del again
    gc.collect()
    later = pool.lend(1100, F32, CPU, owner, ["a", "b"])  # the record went with the loan: the borrower may write
    assert later.in_place == 0 and all(not e.held for e in pool._kept)


def test_a_record_is_for_its_owner_only_and_dies_with_it():
    pool, owner, other = SlotPool(budget=1 << 20), Owner(), Owner()
    lent = pool.lend(1000, F32, CPU, owner, ["a"])
    pool.hold(lent.buffer, owner, ["a", "b"])
    del lent
    gc.collect()
    got = pool.lend(1000, F32, CPU, other, ["a", "b"])
    assert got.in_place == 0  # same keys, another engine's store: its KV is not this buffer's
    pool.hold(got.buffer, owner, ["a", "b"])
    del got
    dead = weakref.ref(owner)
    del owner
    gc.collect()
    assert dead() is None and pool.lend(1000, F32, CPU, Owner(), ["a", "b"]).in_place == 0


def test_a_conversation_that_outgrew_its_buffer_copies_from_it_and_drops_it():
    pool, owner = SlotPool(budget=1 << 20), Owner()
    small = pool.lend(1000, F32, CPU, owner, ["a"])  # room 1250
    old = small.buffer.untyped_storage().data_ptr()
    pool.hold(small.buffer, owner, ["a", "b"])
    del small
    gc.collect()
    big = pool.lend(5000, F32, CPU, owner, ["a", "b", "c"])
    assert big.in_place == 0 and big.source is not None and big.source_blocks == 2
    assert big.source.untyped_storage().data_ptr() == old and big.buffer.numel() >= 5000
    pool.copied(big)
    assert big.source is None and pool.copied_blocks == 2
    assert all(e.buf.untyped_storage().data_ptr() != old for e in pool._kept)


def test_a_records_tail_counts_only_right_after_exactly_its_blocks():
    """The tokens a prompt ended with (after its last full block) are held only for a hit of
    exactly those blocks: a longer hit loads its next block from the store over them, a shorter
    one leaves them after a block it does not have."""
    pool, owner = SlotPool(budget=1 << 20), Owner()

    def lend_after(want, after, numel=1000):
        lent = pool.lend(numel, F32, CPU, owner, want, after)
        pool.hold(lent.buffer, owner, ["a", "b"], (5, 6, 7))
        return lent.in_place, lent.tail

    pool.hold(pool.lend(1000, F32, CPU).buffer, owner, ["a", "b"], (5, 6, 7))
    gc.collect()
    assert lend_after(["a", "b"], (5, 6, 7, 8)) == (2, 3)  # a later turn: the whole tail
    gc.collect()
    assert lend_after(["a", "b"], (5, 6, 9)) == (2, 2)  # up to where the prompts part
    gc.collect()
    assert lend_after(["a", "b", "c"], (1, 2)) == (2, 0)  # block c comes from the store
    gc.collect()
    assert lend_after(["a"], (5, 6, 7)) == (1, 0)  # the tail follows block b, not a
    gc.collect()
    assert pool.tail_tokens == 5
    small = pool.lend(1000, F32, CPU, owner, ["a", "b"], (5, 6, 7, 8))  # outgrown: copied with its blocks
    pool.hold(small.buffer, owner, ["a", "b"], (5, 6, 7))
    del small
    gc.collect()
    big = pool.lend(9000, F32, CPU, owner, ["a", "b"], (5, 6, 7, 8))
    assert (big.in_place, big.source_blocks, big.tail) == (0, 2, 3)
    pool.copied(big)
    assert pool.tail_tokens == 11


def test_a_plain_loan_prefers_a_buffer_without_a_record():
    pool, owner = SlotPool(budget=1 << 20), Owner()
    a, b = pool.lend(1000, F32, CPU), pool.lend(1000, F32, CPU)
    pool.hold(a.buffer, owner, ["a"])
    recorded = a.buffer.untyped_storage().data_ptr()
    del a, b
    gc.collect()
    plain = pool.lend(1000, F32, CPU)
    assert plain.buffer.untyped_storage().data_ptr() != recorded
    assert pool.lend(1000, F32, CPU, owner, ["a"]).in_place == 1


def test_a_buffers_layout_depends_on_its_room_only(engine):
    """What a request of 40 tokens wrote, one of 60 in the same buffer finds at the same slots."""
    ad = engine.adapter
    flat = torch.zeros(2 * ad.num_layers * 2 * 128 * 64 * 4)
    short, long = _slot_layers(ad, flat, 40), _slot_layers(ad, flat, 60)
    for i, (k, v) in enumerate(short):
        k.fill_(i + 1)
        v.fill_(-(i + 1))
    for i, (k, v) in enumerate(long):
        assert k.shape[-2] == 60 and (k[:, :, :40] == i + 1).all() and (v[:, :, :40] == -(i + 1)).all()
        assert (k[:, :, 40:] == 0).all()


# ---- the engine -------------------------------------------------------------------------------
def _img(engine, seed, tenant):
    return {"type": "image_file",
            "image_file": {"file_id": engine.add_image(make_png(70 + 14 * seed, 56, seed=seed), tenant=tenant)}}


def _turns(engine, tenant: str, extra: str = ""):
    image = _img(engine, 1, tenant)
    first = [{"role": "system", "content": "you are a careful agent . " * 40},
             {"role": "user", "content": [image, {"type": "text", "text": "what is on the screen ?" + extra}]}]
    second = first + [{"role": "assistant", "content": "a red shape ."},
                      {"role": "user", "content": "and what should i click next ? answer in one word ."}]
    return first, second


def _off_oracle(engine, msgs, tenant, logits) -> float:
    """How far `logits` are from one block-masked forward of the spliced prompt (mmkv.request.oracle)."""
    plan = engine.splice_plan(msgs, tenant=tenant)
    want = block_masked_logits(engine.adapter, plan.input_ids, plan.positions, plan.placements,
                               engine.settings.seam_tokens, engine.anchor_ids)
    return (logits.reshape(-1) - want.reshape(-1)).abs().max().item()


def _logits(engine, msgs, tenant):
    r = engine.generate(msgs, max_new_tokens=1, tenant=tenant)
    return r.first_logits.clone(), r.usage.cached_tokens


def _second_turn(engine, tenant, second_of=None, forget=False):
    """Turn 1, then turn 2 (`second_of(first)`, default `_turns`' second): its logits, cached
    tokens, the blocks it found in place and copied and the tokens after them (the engine's pool's
    counters), and turn 1's prompt length. `forget`: the records are dropped in between, so turn 2
    loads its hit from the prefix cache."""
    first, second = _turns(engine, tenant)
    second = second_of(first) if second_of is not None else second
    n1 = engine.generate(first, max_new_tokens=1, tenant=tenant).usage.prompt_tokens
    if forget:
        forget_slot_records(engine)
    pool = engine.slots
    in_place, copied, tail = pool.in_place_blocks, pool.copied_blocks, pool.tail_tokens
    logits, cached = _logits(engine, second, tenant)
    return (logits, cached, pool.in_place_blocks - in_place, pool.copied_blocks - copied, second,
            pool.tail_tokens - tail, n1)


def test_the_next_turn_finds_its_hit_in_place_and_answers_as_loaded(engine):
    """Turn 2 of a conversation gets turn 1's buffer with every block it hit in place and, after
    them, the tokens turn 1's prompt ended with: all of turn 1's prompt is reused. Its logits equal
    the same turn loading its blocks from the prefix cache (another tenant, the same tokens; it
    computes those last tokens again) and one block-masked forward of the model, within TOL."""
    logits, cached, in_place, copied, second, tail, n1 = _second_turn(engine, "rows-in-place")
    assert 0 < tail < 16 and cached == in_place * 16 + tail == n1 and copied == 0, "all of turn 1 was in place"
    loaded, cached_loaded, in_place_loaded, _, _, tail_loaded, _ = _second_turn(engine, "rows-loaded", forget=True)
    assert cached_loaded == cached - tail and in_place_loaded == tail_loaded == 0
    assert (logits - loaded).abs().max().item() < TOL
    assert _off_oracle(engine, second, "rows-in-place", logits) < TOL


def test_the_same_prompt_again_computes_its_last_token_only(engine):
    """A prompt sent again (a retry, another sample) reuses all of its KV but the last token, whose
    logits the turn needs: they equal the first answer's within TOL."""
    tenant = "rows-again"
    first, _ = _turns(engine, tenant, extra=" (again)")
    one = engine.generate(first, max_new_tokens=1, tenant=tenant)
    two = engine.generate(first, max_new_tokens=1, tenant=tenant)
    assert two.usage.cached_tokens == one.usage.prompt_tokens - 1 and two.lm_tokens_computed == 1
    assert (one.first_logits - two.first_logits).abs().max().item() < TOL
    assert _off_oracle(engine, first, tenant, two.first_logits) < TOL


def _longer(first):
    return first + [{"role": "assistant", "content": "a red shape ."},
                    {"role": "user", "content": "now read every label on the screen , one by one , slowly . " * 40}]


def test_a_turn_that_outgrew_its_buffer_copies_the_hit_and_answers_as_loaded(engine):
    logits, cached, in_place, copied, second, tail, n1 = _second_turn(engine, "rows-outgrown", _longer)
    assert 0 < tail < 16 and cached == copied * 16 + tail == n1 and in_place == 0
    loaded, cached_loaded, _, copied_loaded, _, tail_loaded, _ = _second_turn(engine, "rows-outgrown-loaded", _longer,
                                                                              forget=True)
    assert cached_loaded == cached - tail and copied_loaded == tail_loaded == 0
    assert (logits - loaded).abs().max().item() < TOL
    assert _off_oracle(engine, second, "rows-outgrown", logits) < TOL


def test_a_conversation_about_to_outgrow_its_buffer_moves_between_turns(engine, monkeypatch):
    """Turn 1 got a kept buffer with less room than 1.5x its prompt: once its blocks are stored it
    moves into one with twice that room (the old one stays kept, without a record), so turn 2,
    longer than the old room, finds all of turn 1 in place, copies nothing on its own path, and
    answers as the block-masked forward."""
    pool = SlotPool(budget=1 << 30)
    monkeypatch.setattr(engine.adapter, "slot_pool", pool)
    tenant = "rows-grown"
    first, _ = _turns(engine, tenant, extra=" (grown)")
    second = first + [{"role": "assistant", "content": "a red shape ."},
                      {"role": "user", "content": "now read the labels , one by one . " * 8}]
    heads, head_dim = engine.adapter.kv_shape
    per_token = 2 * engine.adapter.num_layers * heads * head_dim
    n1, n2 = (engine.splice_plan(m, tenant=tenant).input_ids.numel() for m in (first, second))
    spare = pool.lend(int(0.8 * n1) * per_token, F32, CPU)  # kept with 1.5x that room: 1.2 x n1
    room = spare.buffer.numel() // per_token
    assert n1 <= room < 1.5 * n1 and room < n2 <= 2 * n1
    del spare
    gc.collect()
    engine.generate(first, max_new_tokens=1, tenant=tenant)
    assert pool.grown == 1 and len(pool._kept) == 2 and sum(bool(e.held) for e in pool._kept) == 1
    logits, cached = _logits(engine, second, tenant)
    assert cached == n1 and pool.copied_blocks == 0 and pool.in_place_blocks * 16 + pool.tail_tokens == n1
    assert _off_oracle(engine, second, tenant, logits) < TOL
    assert pool.nbytes <= pool.budget


def test_a_buffer_grows_between_turns_only_within_the_budget():
    pool = SlotPool(budget=4000 * 4)
    lent = pool.lend(1000, F32, CPU)  # room 1500
    assert pool.room_for(lent.buffer, 1400, 2000, F32) is None  # room enough
    assert pool.room_for(lent.buffer, 1600, 3000, F32) is None  # 1500 + 3000 over the budget
    grown = pool.room_for(lent.buffer, 1600, 2500, F32)
    assert grown is not None and grown.numel() == 2500 and pool.grown == 1 and pool.nbytes == 4000 * 4
    assert pool.room_for(torch.empty(10), 1600, 2500, F32) is None  # not a kept buffer


def test_a_deleted_images_blocks_never_come_back_from_a_buffer(engine):
    """The buffer still holds a deleted image's KV, but its blocks are gone from the store: the
    next request with that prompt finds only the blocks before the image in place and answers
    as the block-masked forward."""
    tenant = "rows-deleted"
    first, second = _turns(engine, tenant, extra=" (deleted)")
    engine.generate(first, max_new_tokens=1, tenant=tenant)
    file_id = first[1]["content"][0]["image_file"]["file_id"]
    engine.remove_image(file_id, tenant=tenant)
    second = [second[0], {"role": "user", "content": [_img(engine, 1, tenant), *second[1]["content"][1:]]}, *second[2:]]
    before, tail = engine.slots.in_place_blocks, engine.slots.tail_tokens
    logits, cached = _logits(engine, second, tenant)
    image_at = engine.splice_plan(second, tenant=tenant).placements[0].start
    assert (engine.slots.in_place_blocks - before) * 16 <= image_at and engine.slots.tail_tokens == tail
    assert _off_oracle(engine, second, tenant, logits) < TOL


def test_a_turn_that_fails_leaves_no_record_of_what_it_wrote(engine, monkeypatch):
    """A turn lent the buffer in place fails in its forward (after writing past its hit): the
    record went with the loan, so the retry loads its blocks and answers as the block-masked forward."""
    tenant = "rows-failed"
    first, second = _turns(engine, tenant, extra=" (failed)")
    engine.generate(first, max_new_tokens=1, tenant=tenant)
    real = engine.adapter.forward
    calls = {"n": 0}

    def broken(ids, *args, **kwargs):
        calls["n"] += 1
        real(ids, *args, **kwargs)  # the KV is written, then the turn fails
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.adapter, "forward", broken)
    with pytest.raises(RuntimeError):
        engine.generate(second, max_new_tokens=1, tenant=tenant)
    monkeypatch.setattr(engine.adapter, "forward", real)
    assert calls["n"] == 1
    gc.collect()
    before, tail = engine.slots.in_place_blocks, engine.slots.tail_tokens
    logits, _ = _logits(engine, second, tenant)
    assert engine.slots.in_place_blocks == before and engine.slots.tail_tokens == tail
    assert _off_oracle(engine, second, tenant, logits) < TOL


def test_the_engine_states_its_pools_budget_and_what_it_held_in_place(engine):
    """The pool is the engine's (EngineSettings.slot_bytes), inside its budget, and `stats()`
    counts the hit tokens it held in place or copied."""
    stats = engine.stats()
    assert engine.adapter.slot_pool is engine.slots and stats["slot_budget_bytes"] == engine.settings.slot_bytes
    assert 0 < stats["slot_bytes"] <= stats["slot_budget_bytes"]
    assert stats["slot_in_place_tokens"] == engine.slots.in_place_blocks * 16 > 0
    assert stats["slot_copied_tokens"] == engine.slots.copied_blocks * 16 > 0
    assert stats["slot_tail_tokens"] == engine.slots.tail_tokens > 0


def test_no_pool_keeps_nothing_and_answers_the_same(tiny_dirs):
    from mmkv.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        Engine.from_pretrained(tiny_dirs[FAMILIES[0]], dtype=torch.float32, device="cpu", slot_bytes=-1)
    assert err.value.param == "slot_bytes"
    none = Engine.from_pretrained(tiny_dirs[FAMILIES[0]], dtype=torch.float32, device="cpu", slot_bytes=0)
    logits, cached, in_place, copied, _, tail, _ = _second_turn(none, "rows-none")
    assert cached > 0 and in_place == copied == tail == 0 and none.stats()["slot_bytes"] == 0
    kept = Engine.from_pretrained(tiny_dirs[FAMILIES[0]], dtype=torch.float32, device="cpu")
    assert (logits - _second_turn(kept, "rows-none")[0]).abs().max().item() < TOL


def test_metrics_and_the_serve_flag_carry_the_pool(engine, monkeypatch):
    from mmkv.server.app import ServerSettings, create_app
    from test_server import LiveServer

    _second_turn(engine, "rows-metrics")
    live = LiveServer(create_app(engine, ServerSettings()))
    try:
        got = live.metrics()
        assert got["mmkv:slot_pool_budget_bytes"] == engine.settings.slot_bytes
        assert got["mmkv:slot_in_place_tokens_total"] == engine.slots.in_place_blocks * 16 > 0
        assert got["mmkv:slot_tail_tokens_total"] == engine.slots.tail_tokens > 0
    finally:
        live.close()
    seen = serve_kwargs(monkeypatch, "--slot-mb", "64")
    assert seen["slot_bytes"] == 64 << 20
