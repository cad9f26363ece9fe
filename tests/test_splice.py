"""Splice exactness: the spliced prefill equals one masked forward of the model (mmkv.request.oracle),
and its gap to a plain full recompute is measured, not hidden."""

from __future__ import annotations

import pytest
import torch

from mmkv import Engine
from mmkv.adapters import ImageFeatures
from mmkv.request.oracle import block_masked_logits
from mmkv.kv.rerotate import reposition_keys
from mmkv.request.splice import Placement, pad_features, prefill_full, prefill_spliced
from mmkv.testing.tiny import FAMILIES

from conftest import make_png

TOL = 1e-4  # float32 logits


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, tiny_dirs):
    return Engine.from_pretrained(tiny_dirs[request.param], dtype=torch.float32, device="cpu")


def _img(engine, seed):
    return {"type": "image_file", "image_file": {"file_id": engine.add_image(make_png(70 + 14 * seed, 56, seed=seed))}}


def _layouts(engine):
    a, b = _img(engine, 1), _img(engine, 2)
    return {
        "first": [{"role": "user", "content": [a, {"type": "text", "text": "what color is the shape ?"}]}],
        "middle": [{"role": "system", "content": "be brief ."},
                   {"role": "user", "content": [{"type": "text", "text": "look at this one"}, b,
                                                {"type": "text", "text": "and tell me its shape"}]}],
        "repeated": [{"role": "user", "content": [a, {"type": "text", "text": "first"}]},
                     {"role": "assistant", "content": "red"},
                     {"role": "user", "content": [{"type": "text", "text": "again the same"}, a, b,
                                                  {"type": "text", "text": "how many shapes are there ?"}]}],
    }


@pytest.mark.parametrize("seam", [0, 1, 2])
@pytest.mark.parametrize("layout", ["first", "middle", "repeated"])
@pytest.mark.parametrize("policy", ["native", "temporal"])
def test_splice_equals_block_masked_forward(engine, seam, layout, policy):
    plan = engine.splice_plan(_layouts(engine)[layout], rope_policy=policy)
    spliced = prefill_spliced(engine.adapter, plan.input_ids, plan.positions, plan.placements, seam)
    oracle = block_masked_logits(engine.adapter, plan.input_ids, plan.positions, plan.placements, seam,
                                 engine.anchor_ids)
    diff = (spliced.logits - oracle).abs().max().item()
    print(f"{engine.adapter.family} {layout} {policy} seam={seam}: spliced vs oracle max |diff| {diff:.2e}")
    assert diff <= TOL
    n_chunk = sum(p.entry.num_tokens for p in plan.placements)
    assert spliced.reused_tokens == n_chunk - seam * len(plan.placements)
    assert spliced.computed_tokens + spliced.reused_tokens == plan.input_ids.numel()


def test_image_at_sequence_start_and_end(engine):
    """A chunk at index 0 (no prefix at all) and one that ends the prompt: the last token is
    computed, never spliced, so the prompt's logits come from the model."""
    plan = engine.splice_plan(_layouts(engine)["first"])
    entry = plan.placements[0].entry
    ad = engine.adapter
    text = torch.tensor(ad.tokenizer(" what is it ?")["input_ids"])
    ids = torch.cat((entry.token_ids, text))
    pos = ad.native_positions(ids, [entry.grid_thw])
    place = [Placement(0, entry, pos[:, : entry.num_tokens])]
    for seam in (0, 1):
        got = prefill_spliced(ad, ids, pos, place, seam).logits
        want = block_masked_logits(ad, ids, pos, place, seam, engine.anchor_ids)
        assert (got - want).abs().max().item() <= TOL
    ids_end = torch.cat((text, entry.token_ids))
    pos_end = ad.native_positions(ids_end, [entry.grid_thw])
    place_end = [Placement(text.numel(), entry, pos_end[:, text.numel():])]
    result = prefill_spliced(ad, ids_end, pos_end, place_end, 1)
    assert result.reused_tokens == entry.num_tokens - 2  # seam token and final token computed


def test_no_rotation_control_is_worse(engine):
    """Splicing without re-rotation is not the masked forward: it must sit far from the exact
    splice, and further from the full recompute (random tiny models barely use position, so the
    second margin is small; the VQA evaluation measures it on trained models)."""
    plan = engine.splice_plan(_layouts(engine)["middle"])
    feats = ImageFeatures.concat([p.entry.features for p in plan.placements])
    full = prefill_full(engine.adapter, plan.input_ids, plan.native_positions, feats).logits
    rotated = prefill_spliced(engine.adapter, plan.input_ids, plan.positions, plan.placements, 0).logits
    unrotated = prefill_spliced(engine.adapter, plan.input_ids, plan.positions, plan.placements, 0,
                                rotate=False).logits
    cos = torch.nn.functional.cosine_similarity
    gap_rot, gap_norot = (rotated - full).abs().max().item(), (unrotated - full).abs().max().item()
    print(f"{engine.adapter.family}: full vs splice {gap_rot:.3e} (cos {cos(rotated, full).item():.5f}), "
          f"vs no-rotate {gap_norot:.3e} (cos {cos(unrotated, full).item():.5f})")
    assert gap_norot > gap_rot
    assert (unrotated - rotated).abs().max().item() > 10 * TOL


def _segmented_splice(ad, ids, pos, placements, seam_tokens, cache, start):
    """The splice as it ran before one-forward turns, kept as a reference: text before each chunk,
    its seam and the tail in separate forwards, chunk bodies appended (re-rotated per token)."""
    cursor = start
    for p in sorted(placements, key=lambda p: p.start):
        if p.start > cursor:
            ad.forward(ids[cursor:p.start], pos[:, cursor:p.start], cache)
        n = p.entry.num_tokens
        keep_end = n - 1 if p.end == ids.numel() else n
        seam, first = min(seam_tokens, keep_end), max(cursor - p.start, 0)
        if first < seam:
            ad.forward(p.entry.token_ids[first:seam], p.target[:, first:seam], cache, pad_features(p.entry, first, seam))
        lo = max(seam, first)
        for layer, (k, v) in enumerate(zip(p.entry.keys, p.entry.values)):
            k = reposition_keys(k[:, lo:keep_end], p.entry.position_ids[:, lo:keep_end], p.target[:, lo:keep_end],
                                ad.rope)
            cache.update(k[None], v[None, :, lo:keep_end], layer)
        cursor = max(cursor, p.start + keep_end)
    return ad.forward(ids[cursor:], pos[:, cursor:], cache), cache


@pytest.mark.parametrize("seam", [0, 1])
@pytest.mark.parametrize("layout", ["middle", "repeated"])
@pytest.mark.parametrize("prefix", [False, True])
def test_one_forward_per_turn_equals_the_segmented_splice(engine, seam, layout, prefix, monkeypatch):
    """A spliced turn runs the LM once (text, seams and tail together under a causal-by-prompt-
    index mask) and gives the segmented splice's logits and KV, also after a prefix-cache hit."""
    ad = engine.adapter
    plan = engine.splice_plan(_layouts(engine)[layout])
    start = plan.placements[0].start - 1 if prefix else 0  # a cache ending just before the first chunk

    def cache_of_prefix():
        cache = ad.new_cache()
        if start:
            ad.forward(plan.input_ids[:start], plan.positions[:, :start], cache)
        return cache

    forwards, forward, cache = [], ad.forward, cache_of_prefix()
    monkeypatch.setattr(ad, "forward", lambda *a, **k: forwards.append(a[0].numel()) or forward(*a, **k))
    got = prefill_spliced(ad, plan.input_ids, plan.positions, plan.placements, seam, cache=cache, start=start)
    assert forwards == [got.computed_tokens]
    monkeypatch.undo()
    want, want_cache = _segmented_splice(ad, plan.input_ids, plan.positions, plan.placements, seam,
                                         cache_of_prefix(), start)
    diff = (got.logits - want).abs().max().item()
    kv = max((a - b).abs().max().item() for la, lb in zip(got.cache.layers, want_cache.layers)
             for a, b in ((la.keys, lb.keys), (la.values, lb.values)))
    print(f"{ad.family} {layout} seam={seam} prefix={prefix}: one forward vs segmented logits {diff:.1e}, KV {kv:.1e}")
    assert diff <= 1e-5 and kv <= 1e-5
    assert got.cache.get_seq_length() == plan.input_ids.numel()


@pytest.mark.parametrize("recompute", [[2], [1, 3, 4], [0, 5]])
def test_recomputed_cached_tokens_are_counted_computed_and_end_the_prefix(engine, recompute):
    """issue finding (PrefillResult.prefix_tokens on the in_place path): tokens below `start` that
    the turn recomputes (an edit's changed tokens) are computed, not reused, and the prefix-cache
    hit ends at the first of them; the logits are those of the splice without a cache."""
    ad = engine.adapter
    plan = engine.splice_plan(_layouts(engine)["middle"])
    start = plan.placements[0].start - 1
    cache = ad.new_cache()
    ad.forward(plan.input_ids[:start], plan.positions[:, :start], cache)
    got = prefill_spliced(ad, plan.input_ids, plan.positions, plan.placements, 1, cache=cache, start=start,
                          recompute=recompute)
    want = prefill_spliced(ad, plan.input_ids, plan.positions, plan.placements, 1)
    assert (got.logits - want.logits).abs().max().item() <= 1e-5
    assert got.computed_tokens == want.computed_tokens - start + len(recompute)
    assert got.computed_tokens + got.reused_tokens == plan.input_ids.numel()
    reused = {i for a, b in got.reused_ranges for i in range(a, b)}
    assert len(reused) == got.reused_tokens and not reused & set(recompute)
    assert got.prefix_tokens == recompute[0]


def test_decoding_after_a_splice_appends(engine):
    """The preallocated cache behaves as an ordinary one once the turn is prefilled: a decode step
    over it equals the same step over the segmented splice's cache."""
    ad = engine.adapter
    plan = engine.splice_plan(_layouts(engine)["middle"])
    got = prefill_spliced(ad, plan.input_ids, plan.positions, plan.placements, 1)
    _, want_cache = _segmented_splice(ad, plan.input_ids, plan.positions, plan.placements, 1, ad.new_cache(), 0)
    step = torch.full((3, 1), int(plan.positions.max()) + 1)
    token = got.logits.argmax(-1)
    a, b = ad.forward(token, step, got.cache), ad.forward(token, step, want_cache)
    assert got.cache.get_seq_length() == plan.input_ids.numel() + 1
    assert (a - b).abs().max().item() <= 1e-5


def test_slot_pool_never_shares_a_live_buffer_and_reuses_a_released_one(engine):
    """Two live caches never get one storage; a released cache's buffer comes back (its pages are
    mapped already), unless a view of it is still alive; the kept bytes stay within the budget.
    Spliced logits through reused buffers equal the fresh ones (no stale KV leaks in)."""
    import gc

    from mmkv.request.splice import SlotPool, preallocate

    ad = engine.adapter
    pool = SlotPool(budget=1 << 30)

    def storage(cache):
        return cache.layers[0].keys.untyped_storage().data_ptr()

    a, b = ad.new_cache(), ad.new_cache()
    preallocate(ad, a, 0, 40, pool)
    preallocate(ad, b, 0, 40, pool)
    assert storage(a) != storage(b)
    first = storage(a)
    del a
    gc.collect()
    c = ad.new_cache()
    preallocate(ad, c, 0, 36, pool)  # fits the released 40-token buffer
    assert storage(c) == first and storage(c) != storage(b)
    view = c.layers[-1].values[:, :, :2]  # a slice outlives its cache: the buffer is not free
    del c
    gc.collect()
    d = ad.new_cache()
    preallocate(ad, d, 0, 40, pool)
    assert storage(d) not in (first, storage(b))
    del view
    per_cache = pool.nbytes // 3
    small = SlotPool(budget=2 * per_cache)
    live = [ad.new_cache() for _ in range(4)]
    for cache in live:
        preallocate(ad, cache, 0, 40, small)
    assert small.nbytes <= 2 * per_cache and len({storage(x) for x in live}) == 4

    msgs = [{"role": "system", "content": "be brief ."}, {"role": "user", "content": [
        {"type": "text", "text": "look at this one"}, _img(engine, 3), {"type": "text", "text": "and its shape"}]}]
    plan = engine.splice_plan(msgs)
    runs = []
    for _ in range(3):  # the second and third turn run in the first one's released buffer
        r = prefill_spliced(ad, plan.input_ids, plan.positions, plan.placements, 1)
        runs.append((r.logits.clone(), storage(r.cache)))
        del r
        gc.collect()
    assert runs[1][1] == runs[0][1] and torch.equal(runs[1][0], runs[0][0]) and torch.equal(runs[2][0], runs[0][0])


def test_slot_pool_makes_room_by_dropping_free_buffers_of_other_sizes():
    """A full pool frees kept buffers that fit nothing to keep a new one, also when an older kept
    buffer is still in use: the bug this guards removed entries with ==, which compared tensors of
    different sizes element by element and raised."""
    from mmkv.request.splice import SlotPool

    f32, cpu = torch.float32, torch.device("cpu")
    pool = SlotPool(budget=4 * 5000)  # room for 5000 float32 elements; kept buffers get 1.5x room
    alive = pool.lend(800, f32, cpu).buffer  # kept (1200) and still in use
    for n in (2000, 400):  # kept (3000, 600), released at once
        pool.lend(n, f32, cpu)
    assert pool.nbytes == (1200 + 3000 + 600) * 4
    big = pool.lend(3500, f32, cpu).buffer  # fits no kept buffer: free ones go until it fits, the one in use stays
    assert big.numel() == 3500 and pool.nbytes == (1200 + 3500) * 4  # no room for 1.5x: exact
    assert alive.numel() == 1200  # a loan is the buffer's whole room
    ptr = big.untyped_storage().data_ptr()
    del big
    again = pool.lend(2000, f32, cpu).buffer  # the free 3500 buffer fits and is handed out again
    assert again.untyped_storage().data_ptr() == ptr and pool.nbytes == (1200 + 3500) * 4


def test_slot_pool_gives_a_growing_conversation_its_buffer_again():
    """A kept buffer has 1.5x the room asked for, so the next turn's longer prompt reuses it
    (its pages mapped already) instead of faulting in a fresh one."""
    from mmkv.request.splice import POOL_GROWTH, SlotPool

    f32, cpu = torch.float32, torch.device("cpu")
    pool = SlotPool(budget=1 << 20)
    turn = pool.lend(10_000, f32, cpu).buffer
    ptr = turn.untyped_storage().data_ptr()
    assert turn.numel() == int(10_000 * POOL_GROWTH) and pool.nbytes == int(10_000 * POOL_GROWTH) * 4
    del turn
    for n in (11_000, 15_000):  # two longer turns, one after the other
        turn = pool.lend(n, f32, cpu).buffer
        assert turn.numel() == 15_000 and turn.untyped_storage().data_ptr() == ptr
        del turn
    longer = pool.lend(15_001, f32, cpu).buffer  # past the room: a new buffer
    assert longer.untyped_storage().data_ptr() != ptr
