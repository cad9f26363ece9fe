"""Issue 5: the prefix cache, text skills spliced like images, errata and the edit policies."""

from __future__ import annotations

import base64

import pytest
import torch

from mmkv import Engine, UnknownSkillError
from mmkv.request.messages import erratum_line
from mmkv.request.oracle import block_masked_logits
from mmkv.store.prefix_cache import BLOCK_TOKENS, block_keys
from mmkv.request.splice import prefill_spliced

from conftest import INIT, _rope, forget_slot_records, make_png, prefix_hit

TOL = 1e-4  # float32 logits

POLICY = (
    "refund policy . a refund is allowed only when the order status is delivered and the customer "
    "reports damage within thirty days . otherwise escalate to a human agent . "
)


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu")


def _ref(image_id):
    return {"type": "image_file", "image_file": {"file_id": image_id}}


# ---- prefix cache ---------------------------------------------------------------------------------
def test_turn_two_reuses_turn_one(engine):
    turn1 = [{"role": "system", "content": POLICY * 3}, {"role": "user", "content": "is a refund allowed ?"}]
    first = engine.generate(turn1, max_new_tokens=2, tenant="prefix")
    turn2 = turn1 + [{"role": "assistant", "content": "no"}, {"role": "user", "content": "and now ?"}]
    second = engine.generate(turn2, max_new_tokens=2, tenant="prefix")
    l1 = first.usage.prompt_tokens
    assert second.usage.cached_tokens == second.prefix_tokens_reused == prefix_hit(l1, l1, second.usage.prompt_tokens)
    assert second.lm_tokens_computed == second.usage.prompt_tokens - second.usage.cached_tokens
    full = engine.generate(turn2, max_new_tokens=2, reuse=False, tenant="prefix")
    assert (second.first_logits - full.first_logits).abs().max().item() <= TOL
    again = engine.generate(turn2, max_new_tokens=2, tenant="prefix")  # identical prompt: capped at len-1
    assert again.usage.cached_tokens == again.usage.prompt_tokens - 1  # its buffer held the last block's rest
    forget_slot_records(engine)
    loaded = engine.generate(turn2, max_new_tokens=2, tenant="prefix")  # from the prefix cache's blocks only
    assert loaded.usage.cached_tokens == ((loaded.usage.prompt_tokens - 1) // BLOCK_TOKENS) * BLOCK_TOKENS
    engine.check_integrity()


def test_prefix_key_carries_the_image_hash(engine):
    """Same tokens, different image: the prefix hit stops before the image."""
    a, b = make_png(84, 84, seed=61), make_png(84, 84, seed=62)

    def prompt(png):
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        return [{"role": "system", "content": POLICY * 2},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": POLICY}]}]

    engine.generate(prompt(a), max_new_tokens=1, tenant="img-prefix")
    hit = engine.generate(prompt(b), max_new_tokens=1, tenant="img-prefix")
    plan = engine.splice_plan(prompt(b), tenant="img-prefix")
    image_start = plan.placements[0].start
    assert hit.prefix_tokens_reused == (image_start // BLOCK_TOKENS) * BLOCK_TOKENS
    same = engine.generate(prompt(b), max_new_tokens=1, tenant="img-prefix")
    assert same.prefix_tokens_reused > image_start
    other_tenant = engine.generate(prompt(b), max_new_tokens=1, tenant="someone-else")
    assert other_tenant.prefix_tokens_reused == 0


def _block_keys_reference(token_ids, chunk_keys, salt, block=BLOCK_TOKENS):
    """block_keys as first written (one hasher and one tensor per block): the stored meaning of a key."""
    import xxhash

    keys, parent, ids = [], xxhash.xxh3_128(salt.encode()).hexdigest(), token_ids.tolist()
    for start in range(0, len(ids) - block + 1, block):
        h = xxhash.xxh3_128(parent.encode())
        h.update(torch.tensor(ids[start:start + block], dtype=torch.int64).numpy().tobytes())
        h.update("\x1f".join(k or "" for k in chunk_keys[start:start + block]).encode())
        parent = h.hexdigest()
        keys.append((parent, frozenset(k for k in chunk_keys[start:start + block] if k)))
    return keys


@pytest.mark.parametrize("seed", range(6))
def test_block_keys_equal_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(0, 300, (1,), generator=g))
    ids = torch.randint(0, 150_000, (n,), generator=g, dtype=torch.int32 if seed % 2 else torch.int64)
    chunk_keys, i = [], 0
    while len(chunk_keys) < n:  # runs of text (None) and chunks, some ending inside a block, some on its edge
        size = int(torch.randint(1, 40, (1,), generator=g)) if seed % 3 else 16 * int(torch.randint(1, 3, (1,), generator=g))
        chunk_keys += [None if i % 2 == 0 else f"chunk-{i % 5}"] * size
        i += 1
    chunk_keys = chunk_keys[:n]
    got = block_keys(ids, chunk_keys, f"salt-{seed}")
    assert [(str(k), k.sources) for k in got] == _block_keys_reference(ids, chunk_keys, f"salt-{seed}")
    assert len(got) == n // BLOCK_TOKENS


def test_prefix_blocks_share_the_budget_and_evict_leaves_first(tiny_dirs):
    eng = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu", cache_bytes=60_000)
    for i in range(6):
        eng.generate([{"role": "user", "content": f"{i} " + POLICY * 2}], max_new_tokens=1)
        eng.check_integrity()
    st = eng.stats()
    assert st["evictions"] > 0 and st["cache_bytes"] <= 60_000 and st["prefix_blocks"] > 0


# ---- skills -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("seam", [0, 1, 2])
def test_two_skills_and_an_image_equal_the_block_masked_forward(engine, seam):
    s1 = engine.add_skill("refunds", POLICY)
    s2 = engine.add_skill("tools", "tool search ( query ) returns the top three documents .")
    image_id = engine.add_image(make_png(98, 70, seed=63))
    msgs = [{"role": "system", "content": [{"type": "skill", "skill_id": s1}, {"type": "text", "text": "\n"},
                                           {"type": "skill", "skill_id": s2}]},
            {"role": "user", "content": [_ref(image_id), {"type": "text", "text": "may i have a refund ?"}]}]
    plan = engine.splice_plan(msgs)
    assert [p.entry.kind for p in plan.placements] == ["skill", "skill", "image"]
    got = prefill_spliced(engine.adapter, plan.input_ids, plan.positions, plan.placements, seam).logits
    want = block_masked_logits(engine.adapter, plan.input_ids, plan.positions, plan.placements, seam,
                               engine.anchor_ids)
    diff = (got - want).abs().max().item()
    print(f"two skills + image, seam {seam}: spliced vs oracle max |diff| {diff:.2e}")
    assert diff <= TOL
    r = engine.generate(msgs, max_new_tokens=1, seam_tokens=seam)
    n_skill = engine.skill_info(s1).tokens + engine.skill_info(s2).tokens
    assert r.skill_tokens_reused == n_skill - 2 * seam


def test_skill_usage_and_reference(engine):
    text = "memory . the user prefers short answers and lives in lisbon ."
    sid = engine.add_skill("memory", text)
    assert engine.add_skill("memory again", text) == sid  # same text, same id, precompiled once
    msgs = [{"role": "system", "content": [{"type": "skill", "skill_id": sid}]},
            {"role": "user", "content": "where do i live ?"}]
    fast = engine.generate(msgs, max_new_tokens=1, seam_tokens=1, tenant="")
    n = engine.skill_info(sid).tokens
    assert fast.skill_tokens_reused == n - 1
    assert engine.adapter.tokenizer.decode(engine.prompt_ids(msgs)).count(text) == 1
    full = engine.generate(msgs, max_new_tokens=1, reuse=False)
    assert full.usage.cached_tokens == 0
    assert torch.nn.functional.cosine_similarity(fast.first_logits, full.first_logits, dim=0) > 0.9
    assert fast.fidelity is None


def test_skills_are_per_tenant(engine):
    sid = engine.add_skill("secret", "the vault code is four two .", tenant="alice")
    with pytest.raises(UnknownSkillError):
        engine.generate([{"role": "user", "content": [{"type": "skill", "skill_id": sid}]}], tenant="bob")
    assert [s.skill_id for s in engine.list_skills("alice")] == [sid]
    engine.remove_skill(sid, tenant="alice")
    with pytest.raises(UnknownSkillError):
        engine.skill_info(sid, tenant="alice")
    engine.check_integrity()


# ---- errata ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_engine(tmp_path_factory):
    from mmkv.testing.tiny import save_tiny_checkpoint

    d = save_tiny_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("long") / "m", seed=5, initializer_range=INIT,
                             text={"rope_parameters": _rope("qwen2_5_vl"), "initializer_range": INIT,
                                   "max_position_embeddings": 16384})
    return Engine.from_pretrained(d, dtype=torch.float32, device="cpu")


def _agent_turns(n_turns: int, erratum: bool):
    """A long policy with a status field, then turns in which the field toggles every turn:
    as an appended state_update part (erratum) or by editing the system prompt (in-prefix).
    Each value carries its turn number, so no earlier prompt ever matches again."""
    values = [f"{('pending', 'shipped')[t % 2]}-{t}" for t in range(n_turns)]
    for t in range(n_turns):
        value = values[t]
        system = f"order_status: {values[0] if erratum else value}\n" + POLICY * 30
        msgs = [{"role": "system", "content": system}]
        for u in range(t + 1):
            parts = []
            if erratum and u > 0:
                parts.append({"type": "state_update", "field": "order_status", "value": values[u]})
            parts.append({"type": "text", "text": "refund ?"})
            msgs.append({"role": "user", "content": parts})
            if u < t:
                msgs.append({"role": "assistant", "content": "escalate"})
        yield t, msgs


def test_28_turn_errata_keep_the_prefix_hot_and_exact(long_engine):
    rates = []
    for t, msgs in _agent_turns(28, erratum=True):
        fast = long_engine.generate(msgs, max_new_tokens=1, tenant="errata")
        full = long_engine.generate(msgs, max_new_tokens=1, reuse=False, tenant="errata")
        assert fast.usage.prompt_tokens == full.usage.prompt_tokens
        assert (fast.first_logits - full.first_logits).abs().max().item() <= TOL, t
        rate = fast.usage.cached_tokens / fast.usage.prompt_tokens
        rates.append(rate)
        if t > 0:
            assert rate >= 0.95, (t, rate)
    control = []
    for t, msgs in _agent_turns(28, erratum=False):
        r = long_engine.generate(msgs, max_new_tokens=1, tenant="in-prefix", edit_policy="recompute")
        control.append(r.usage.cached_tokens / r.usage.prompt_tokens)
    print(f"prefix hit-rate over turns 2-28: erratum {sum(rates[1:]) / 27:.3f} (min {min(rates[1:]):.3f}), "
          f"in-prefix edit {sum(control[1:]) / 27:.3f}; prompt {full.usage.prompt_tokens} tokens at turn 28")
    assert sum(control[1:]) / 27 < 0.2
    long_engine.check_integrity()


def test_state_update_renders_the_paper_line_verbatim(engine):
    msgs = [{"role": "user", "content": [{"type": "state_update", "field": "order_status", "value": "shipped"},
                                         {"type": "text", "text": "refund ?"}]}]
    text = engine.adapter.tokenizer.decode(engine.prompt_ids(msgs))
    assert ("[STATE UPDATE] order_status has just changed to shipped; this overrides any earlier value. "
            "Apply the current value.\n") in text


# ---- edit policies -------------------------------------------------------------------------------------
def _edit_pair(value):
    return [{"role": "system", "content": POLICY * 6 + f"\norder_status: {value}\n" + POLICY * 4},
            {"role": "user", "content": "refund ?"}]


@pytest.mark.parametrize("policy", ["recompute", "in_place", "selective@5", "erratum"])
def test_edit_policies_recompute_what_they_say(engine, policy):
    tenant = f"edit-{policy}"
    first = engine.generate(_edit_pair("pending"), max_new_tokens=1, tenant=tenant)
    r = engine.generate(_edit_pair("shipped"), max_new_tokens=1, tenant=tenant, edit_policy=policy)
    e = r.edit
    assert e.detected and e.policy == e.applied == policy and e.field == "order_status"
    assert (e.old_value, e.new_value) == ("pending", "shipped")
    l1, l2 = first.usage.prompt_tokens, r.usage.prompt_tokens
    assert e.recomputed_tokens == r.lm_tokens_computed and e.reused_tokens == r.usage.cached_tokens
    assert r.lm_tokens_computed + r.usage.cached_tokens == l2
    ids = engine.prompt_ids(_edit_pair("shipped")).tolist()
    old = engine.prompt_ids(_edit_pair("pending")).tolist()
    a = next(i for i, (p, q) in enumerate(zip(ids, old)) if p != q)
    covered = (l1 // BLOCK_TOKENS) * BLOCK_TOKENS
    if policy == "recompute":
        assert r.usage.cached_tokens == (a // BLOCK_TOKENS) * BLOCK_TOKENS
    elif policy == "erratum":
        assert e.erratum == erratum_line("order_status", "shipped")
        kept = l1 - len(engine.adapter.tokenizer("<|im_start|>assistant\n")["input_ids"])
        assert r.usage.cached_tokens == prefix_hit(l1, kept + 1, l2) and l2 == l1 + len(engine.adapter.tokenizer(
            "<|im_start|>user\n" + e.erratum + "\n<|im_end|>\n")["input_ids"])
    else:
        k = 5 if policy.startswith("selective") else 0
        changed = e.changed_tokens
        tail = l2 - (covered + (len(ids) - len(old)))  # tokens after the stale span, prefilled
        assert r.lm_tokens_computed == changed + k + tail
        assert r.usage.cached_tokens == l2 - changed - k - tail
    engine.check_integrity()


def test_erratum_rewrite_sticks_across_later_turns(engine):
    """Auto-detected change -> erratum; the next turn (same new value, one more turn) extends the
    rewritten prompt, so its prefix hit covers the old prompt, the erratum and turn two."""
    def chat(value, turns):
        msgs = _edit_pair(value)
        for t in range(turns):
            msgs += [{"role": "assistant", "content": "escalate"}, {"role": "user", "content": f"and now {t} ?"}]
        return engine.generate(msgs, max_new_tokens=1, tenant="sticky", edit_policy="erratum")

    chat("pending", 0)
    second = chat("shipped", 1)
    assert second.edit.detected and second.edit.erratum and second.edit.applied == "erratum"
    third = chat("shipped", 2)
    assert third.edit is not None and not third.edit.detected
    assert third.usage.prompt_tokens == second.usage.prompt_tokens + len(engine.adapter.tokenizer(
        "<|im_start|>assistant\nescalate<|im_end|>\n<|im_start|>user\nand now 1 ?<|im_end|>\n")["input_ids"])
    assert third.usage.cached_tokens >= (second.usage.prompt_tokens // BLOCK_TOKENS) * BLOCK_TOKENS
    full = engine.generate(_edit_pair("pending") + [{"role": "assistant", "content": "escalate"}], max_new_tokens=1,
                           reuse=False)
    assert full.usage.prompt_tokens < third.usage.prompt_tokens


def test_selective_with_every_token_equals_recompute_and_zero_equals_in_place(engine):
    def run(policy, tenant):
        engine.generate(_edit_pair("pending"), max_new_tokens=1, tenant=tenant)
        return engine.generate(_edit_pair("shipped"), max_new_tokens=1, tenant=tenant, edit_policy=policy)

    exact = engine.generate(_edit_pair("shipped"), max_new_tokens=1, reuse=False).first_logits
    everything = run("selective@100000", "sel-all").first_logits
    in_place = run("in_place", "sel-ip").first_logits
    zero = run("selective@0", "sel-0").first_logits
    assert (everything - exact).abs().max().item() <= TOL
    assert torch.equal(zero, in_place)
    assert (in_place - exact).abs().max().item() > 10 * TOL  # stale notes: in_place is not exact


# ---- prefix blocks inside a spliced chunk reference it ----------------------------------------------
def _ref_blocks(engine, chunk_key: str) -> list:
    from mmkv.store.prefix_cache import ChunkRefBlock

    return [e for e in engine.cache._entries.values() if isinstance(e, ChunkRefBlock) and e.chunk.key == chunk_key]


def _own_kv(block) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A block's KV on its own: a copy's tensors, or a reference's slice of its chunk with the keys
    turned from the chunk's positions to the block's (`reposition_keys`)."""
    from mmkv.kv.rerotate import reposition_keys
    from mmkv.store.prefix_cache import PrefixBlock

    if isinstance(block, PrefixBlock):
        return list(block.keys), list(block.values)
    rows = slice(block.offset, block.offset + block.size)
    cached = block.chunk.position_ids[:, rows]
    return ([reposition_keys(k[:, rows], cached, block.positions, block.rope) for k in block.chunk.keys],
            [v[:, rows] for v in block.chunk.values])


def _skill_chat(skill_id: str, lead: str, turns: int = 0) -> list[dict]:
    msgs = [{"role": "system", "content": [{"type": "text", "text": lead + "\n"}, {"type": "skill", "skill_id": skill_id}]},
            {"role": "user", "content": "is a refund allowed ?"}]
    for t in range(turns):
        msgs += [{"role": "assistant", "content": "no"}, {"role": "user", "content": f"and now {t} ?"}]
    return msgs


def _oracle_gap(engine, msgs, tenant: str, result) -> float:
    plan = engine.splice_plan(msgs, tenant=tenant)
    want = block_masked_logits(engine.adapter, plan.input_ids, plan.positions, plan.placements, 1, engine.anchor_ids)
    return (result.first_logits - want[0]).abs().max().item()


def test_blocks_inside_a_spliced_skill_reference_it_and_are_exact(engine):
    from mmkv.kv.chunks import TENSOR_HEAP_BYTES
    from mmkv.store.prefix_cache import BLOCK_ENTRY_BYTES

    tenant = "refs"
    sid = engine.add_skill("long policy", POLICY * 4, tenant=tenant)
    before = engine.cache.nbytes
    turn1 = _skill_chat(sid, "user 1 prefers short answers .")
    first = engine.generate(turn1, max_new_tokens=1, tenant=tenant)
    plan = engine.splice_plan(turn1, tenant=tenant)
    p = plan.placements[0]
    n, chunk = plan.input_ids.numel(), p.entry
    inside = [i for i in range(n // BLOCK_TOKENS) if p.start + 1 <= i * BLOCK_TOKENS and (i + 1) * BLOCK_TOKENS <= p.end]
    refs = _ref_blocks(engine, chunk.key)
    assert len(inside) >= 5 and sorted(r.offset for r in refs) == [i * BLOCK_TOKENS - p.start for i in inside]
    kv_per_token = sum(t.numel() * t.element_size() for t in (*chunk.keys, *chunk.values)) // chunk.num_tokens
    copies = n // BLOCK_TOKENS - len(inside)
    # a copied block: its KV and positions, each tensor's own heap, its entry
    tensors = 2 * len(chunk.keys) + 1
    copy = BLOCK_TOKENS * kv_per_token + 3 * BLOCK_TOKENS * 8 + tensors * TENSOR_HEAP_BYTES + BLOCK_ENTRY_BYTES
    # the chunk's KV is counted once: references cost their entry's heap only
    assert engine.cache.nbytes - before == copies * copy + len(inside) * BLOCK_ENTRY_BYTES
    assert _oracle_gap(engine, turn1, tenant, first) <= TOL
    turn2 = _skill_chat(sid, "user 1 prefers short answers .", turns=1)
    second = engine.generate(turn2, max_new_tokens=1, tenant=tenant)
    assert second.prefix_tokens_reused == (n // BLOCK_TOKENS) * BLOCK_TOKENS > p.end  # the hit runs through the refs
    gap = _oracle_gap(engine, turn2, tenant, second)
    print(f"turn hitting {len(inside)} referenced blocks: vs oracle max |diff| {gap:.2e}")
    assert gap <= TOL
    spliced = prefill_spliced(engine.adapter, plan.input_ids, plan.positions, plan.placements, 1).cache
    for r in refs:  # a reference reads back the KV the splice placed at its tokens
        a = p.start + r.offset
        assert r.positions.equal(plan.positions[:, a:a + BLOCK_TOKENS])
        for layer, k, v in zip(spliced.layers, *_own_kv(r)):
            torch.testing.assert_close(k, layer.keys[0, :, a:a + BLOCK_TOKENS], atol=1e-6, rtol=0)
            assert v.equal(layer.values[0, :, a:a + BLOCK_TOKENS])
    engine.check_integrity()

    # the chunk moved: other text before it, so other shifts; the new blocks reference the same chunk
    lead = "user 2 has a much longer preference note : short answers , no lists , plain words ."
    third = engine.generate(_skill_chat(sid, lead), max_new_tokens=1, tenant=tenant)
    assert len({r.shift for r in _ref_blocks(engine, chunk.key)}) == 2
    fourth = engine.generate(_skill_chat(sid, lead, turns=1), max_new_tokens=1, tenant=tenant)
    assert fourth.prefix_tokens_reused > engine.splice_plan(_skill_chat(sid, lead), tenant=tenant).placements[0].end
    for msgs, r in ((_skill_chat(sid, lead), third), (_skill_chat(sid, lead, turns=1), fourth)):
        assert _oracle_gap(engine, msgs, tenant, r) <= TOL
    engine.check_integrity()

    # the chunk purged: every referencing block goes, and lookups stop before the chunk
    plan4 = engine.splice_plan(_skill_chat(sid, lead, turns=1), tenant=tenant)
    keys4 = block_keys(plan4.input_ids, plan4.chunk_keys, engine._salt(tenant, 1, "native"))
    assert len(engine.prefix.lookup(keys4, plan4.input_ids.numel())) * BLOCK_TOKENS > plan4.placements[0].end
    engine.remove_skill(sid, tenant=tenant)
    assert _ref_blocks(engine, chunk.key) == [] and chunk.key not in engine.cache
    assert len(engine.prefix.lookup(keys4, plan4.input_ids.numel())) == plan4.placements[0].start // BLOCK_TOKENS
    engine.check_integrity()


def test_evicting_a_chunk_takes_its_referencing_blocks(tiny_dirs, engine):
    probe = engine.splice_plan(_skill_chat(engine.add_skill("p", POLICY * 4, tenant="size"), "x"), tenant="size")
    budget = int(1.6 * probe.placements[0].entry.nbytes)
    eng = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu", cache_bytes=budget)
    sid = eng.add_skill("long policy", POLICY * 4)
    key = eng.splice_plan(_skill_chat(sid, "lead")).placements[0].entry.key
    eng.generate(_skill_chat(sid, "lead"), max_new_tokens=1)
    refs, blocks = len(_ref_blocks(eng, key)), eng.stats()["prefix_blocks"]
    assert refs and eng.stats()["evictions"] == 0
    eng.add_skill("other", POLICY[::-1] * 4)  # needs room: the first skill is the least recently used leaf
    st = eng.stats()
    assert key not in eng.cache and _ref_blocks(eng, key) == []
    # the chunk, its references and the blocks after them went, each counted as an eviction
    assert st["evictions"] == 1 + blocks - st["prefix_blocks"] and st["prefix_blocks"] <= blocks - refs
    eng.check_integrity()
    again = eng.generate(_skill_chat(sid, "lead", turns=1), max_new_tokens=1)  # precompiled again, exact
    assert again.skill_tokens_reused == 0 and _oracle_gap(eng, _skill_chat(sid, "lead", turns=1), "", again) <= TOL
    eng.check_integrity()


def _reused_by_kind_reference(engine, plan, prefill, fresh) -> dict[str, int]:
    """The engine's reused-token counts as first written: token by token."""
    kinds = {p.entry.key: p.entry.kind for p in plan.placements}
    out = {"image": 0, "skill": 0, "video": 0, "prefix": prefill.prefix_tokens, "all": 0}
    pads = {"image": engine.adapter.image_token_id, "video": engine.adapter.video_token_id}
    for a, b in prefill.reused_ranges:
        for i in range(a, b):
            key = plan.chunk_keys[i]
            if i >= prefill.prefix_tokens and key in fresh:
                continue
            out["all"] += 1
            kind = kinds.get(key)
            if kind == "skill" or (kind in pads and int(plan.input_ids[i]) == pads[kind]):
                out[kind] += 1
    return out


def test_reused_counts_equal_the_per_token_count(engine, monkeypatch):
    """usage.cached_tokens and the per-kind counts, for turns with a skill, an image spliced twice,
    a prefix hit over both, an inline image precompiled by the request itself (first sight off;
    fresh: computed, not reused), an in_place edit's scattered ranges and an inline image computed
    in context on first sight after a prefix hit: equal to the token-by-token count."""
    cls = type(engine)
    real, seen = cls._reused_by_kind, []

    def checked(self, plan, prefill, fresh):
        got = real(self, plan, prefill, fresh)
        assert got == _reused_by_kind_reference(self, plan, prefill, fresh)
        seen.append((got, bool(fresh)))
        return got

    monkeypatch.setattr(cls, "_reused_by_kind", checked)
    tenant = "reused-counts"
    image = _ref(engine.add_image(make_png(84, 56, seed=21), tenant=tenant))
    skill = engine.add_skill("counts", POLICY * 2, tenant=tenant)
    inline = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        make_png(70, 42, seed=22)).decode()}}
    chat = [{"role": "system", "content": [{"type": "text", "text": "lead .\n"}, {"type": "skill", "skill_id": skill}]},
            {"role": "user", "content": [image, {"type": "text", "text": "what is it ?"}]}]
    engine.generate(chat, max_new_tokens=1, tenant=tenant)
    chat += [{"role": "assistant", "content": "a shape"},
             {"role": "user", "content": [{"type": "text", "text": "and these ?"}, image, inline]}]
    monkeypatch.setattr(engine.first_sight, "enabled", False)
    engine.generate(chat, max_new_tokens=1, tenant=tenant)
    monkeypatch.setattr(engine.first_sight, "enabled", True)
    engine.generate(_edit_pair("pending"), max_new_tokens=1, tenant=tenant)
    engine.generate(_edit_pair("shipped"), max_new_tokens=1, tenant=tenant, edit_policy="in_place")
    chat += [{"role": "assistant", "content": "two shapes"},
             {"role": "user", "content": [{"type": "text", "text": "and this ?"}, {"type": "image_url", "image_url": {
                 "url": "data:image/png;base64," + base64.b64encode(make_png(56, 84, seed=23)).decode()}}]}]
    assert engine.generate(chat, max_new_tokens=1, tenant=tenant).images_in_context == 1
    assert len(seen) == 5 and any(fresh for _, fresh in seen)
    assert all(seen[1][0][k] > 0 for k in ("image", "skill", "prefix", "all"))
    assert seen[4][0]["prefix"] > 0 and seen[4][0]["image"] > 0  # the earlier turns' images, in the prefix hit


def test_read_blocks_equals_each_blocks_own_kv_across_references_and_copies(engine):
    """The edit policies read an older prompt's KV with `read_blocks` / `write_blocks`, which turn
    each run of references to one chunk once; the reference is every block's own KV (`_own_kv`: a
    ChunkRefBlock's slice of the chunk turned alone), concatenated and sliced."""
    from mmkv.store.prefix_cache import ChunkRefBlock, PrefixBlock, read_blocks, write_blocks

    tenant = "read-blocks"
    sid = engine.add_skill("long policy", POLICY * 4, tenant=tenant)
    engine.generate(_skill_chat(sid, "user 3 likes detail ."), max_new_tokens=1, tenant=tenant)
    msgs = _skill_chat(sid, "user 3 likes detail .", turns=1)
    plan = engine.splice_plan(msgs, tenant=tenant)
    keys = block_keys(plan.input_ids, plan.chunk_keys, engine._salt(tenant, 1, "native"))
    blocks = engine.prefix.lookup(keys, plan.input_ids.numel())
    kinds = [type(b) for b in blocks]
    assert ChunkRefBlock in kinds and PrefixBlock in kinds and kinds.count(ChunkRefBlock) >= 3
    n = len(blocks) * BLOCK_TOKENS
    own = [_own_kv(b) for b in blocks]
    want_k = [torch.cat([k[i] for k, _ in own], dim=-2) for i in range(engine.adapter.num_layers)]
    want_v = [torch.cat([v[i] for _, v in own], dim=-2) for i in range(engine.adapter.num_layers)]
    want_pos = torch.cat([b.positions for b in blocks], dim=1)
    for start, stop in ((0, n), (3, n - 5), (BLOCK_TOKENS + 1, 3 * BLOCK_TOKENS + 2), (n - 2, n), (7, 8)):
        got_k, got_v, got_pos = read_blocks(blocks, start, stop)
        assert got_pos.equal(want_pos[:, start:stop])
        for gk, gv, wk, wv in zip(got_k, got_v, want_k, want_v):
            torch.testing.assert_close(gk, wk[:, start:stop], atol=1e-6, rtol=0)
            assert gv.equal(wv[:, start:stop])
    # into rows [at, ...) of prompt-length buffers: those rows only
    at, (start, stop) = 5, (2 * BLOCK_TOKENS - 3, n - 1)
    dst_k = [torch.full((1, *k.shape[:-2], n + 9, k.shape[-1]), 7.0) for k in want_k]
    dst_v = [torch.full((1, *v.shape[:-2], n + 9, v.shape[-1]), 7.0) for v in want_v]
    write_blocks(blocks, start, stop, dst_k, dst_v, at)
    for dk, dv, wk, wv in zip(dst_k, dst_v, want_k, want_v):
        torch.testing.assert_close(dk[0, :, at:at + stop - start], wk[:, start:stop], atol=1e-6, rtol=0)
        assert dv[0, :, at:at + stop - start].equal(wv[:, start:stop])
        rest = torch.cat((dk[0, :, :at], dk[0, :, at + stop - start:], dv[0, :, :at], dv[0, :, at + stop - start:]), 1)
        assert (rest == 7.0).all()


@pytest.mark.parametrize("policy, probes", [("in_place", 0), ("selective@3", 1)])
def test_an_edit_policy_runs_one_lm_forward(engine, monkeypatch, policy, probes):
    """The changed tokens, the chosen stale tokens and the rest of the prompt run in one forward
    (into the prompt-length slots, causal by prompt index); selective@K adds its partial probe.
    On a small model a forward's fixed cost is most of a short turn's time."""
    tenant = f"one-forward-{policy}"
    engine.generate(_edit_pair("pending"), max_new_tokens=1, tenant=tenant)
    calls = {"forward": 0, "forward_layers": 0}
    for name in calls:
        original = getattr(engine.adapter, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(engine.adapter, name, counted)
    r = engine.generate(_edit_pair("shipped"), max_new_tokens=1, tenant=tenant, edit_policy=policy)
    assert r.edit.applied == policy and r.edit.changed_tokens > 0
    assert calls == {"forward": 1, "forward_layers": probes}


def _status(turn: int) -> str:
    return f"{('pending', 'shipped')[turn % 2]}-{turn}"


def _edit_loop(turn: int) -> list[dict]:
    """An agent loop that edits the status field in the system turn every turn."""
    msgs = [{"role": "system", "content": POLICY * 4 + f"\norder_status: {_status(turn)}\n" + POLICY * 2}]
    for u in range(turn + 1):
        msgs.append({"role": "user", "content": f"refund or escalate ? case {u}"})
        if u < turn:
            msgs.append({"role": "assistant", "content": "escalate"})
    return msgs


def test_an_edit_loop_edits_the_previous_turn_not_the_last_exact_one(engine):
    """in_place / selective@K keep their turn's (approximate) KV under the policy's own salt: the
    next edited turn starts from it, so each turn computes its changed field and its new turn only
    (before, everything since the last exact prompt: a tail that grew every turn)."""
    tenant = "edit-loop"
    first = engine.generate(_edit_loop(0), max_new_tokens=1, tenant=tenant, edit_policy="in_place")
    assert first.edit.applied == "recompute" and first.edit.reason == "no field change"
    computed = []
    for t in range(1, 5):
        r = engine.generate(_edit_loop(t), max_new_tokens=1, tenant=tenant, edit_policy="in_place")
        assert r.edit.applied == "in_place", r.edit.reason
        assert r.edit.old_value == _status(t - 1)  # the previous turn, not the last exact one (turn 0)
        new_turn = r.usage.prompt_tokens - engine.prompt_ids(_edit_loop(t - 1)).numel()  # the turn it adds
        # the old prompt's KV is kept in whole blocks: at most a block's worth of it is recomputed
        assert r.lm_tokens_computed <= r.edit.changed_tokens + new_turn + BLOCK_TOKENS
        computed.append(r.lm_tokens_computed)
    assert max(computed) <= min(computed) + BLOCK_TOKENS + 4, computed  # bounded, not growing with the turns
    engine.check_integrity()


def test_an_edit_loop_of_selective_recomputing_everything_stays_exact(engine):
    """selective@K with K past the prompt recomputes every token after the change, so a loop of
    it chained through the policy's own blocks must equal a full recompute at every turn: the
    chain reads the previous turn's KV at the right tokens and positions."""
    tenant = "edit-loop-exact"
    engine.generate(_edit_loop(0), max_new_tokens=1, tenant=tenant, edit_policy="selective@100000")
    for t in range(1, 4):
        r = engine.generate(_edit_loop(t), max_new_tokens=1, tenant=tenant, edit_policy="selective@100000")
        assert r.edit.applied == "selective@100000" and r.usage.cached_tokens > 0
        assert r.edit.old_value == _status(t - 1)  # edited from the previous turn, read from its own blocks
        exact = engine.generate(_edit_loop(t), max_new_tokens=1, reuse=False).first_logits
        assert (r.first_logits - exact).abs().max().item() <= TOL, t


def test_an_exact_request_never_reads_an_edit_loops_approximate_kv(engine):
    tenant = "edit-loop-apart"
    for t in range(3):
        engine.generate(_edit_loop(t), max_new_tokens=1, tenant=tenant, edit_policy="in_place")
    again = engine.generate(_edit_loop(2), max_new_tokens=1, tenant=tenant)  # recompute: exact reuse only
    exact = engine.generate(_edit_loop(2), max_new_tokens=1, reuse=False).first_logits
    assert (again.first_logits - exact).abs().max().item() <= TOL
    ids, first = engine.prompt_ids(_edit_loop(2)).tolist(), engine.prompt_ids(_edit_loop(0)).tolist()
    field = next(i for i, (a, b) in enumerate(zip(ids, first)) if a != b)
    assert 0 < again.usage.cached_tokens <= field  # the exact blocks before the field, none of the loop's


def test_a_later_turn_of_an_edited_conversation_stays_on_its_kv(engine):
    """Under in_place, a turn that only continues an in_place turn (no new edit) reuses that turn's
    approximate KV (reported: `continued`), instead of recomputing from the field on; under
    recompute the same turn reads exact KV only."""
    tenant = "edit-continue"
    for t in range(2):
        engine.generate(_edit_loop(t), max_new_tokens=1, tenant=tenant, edit_policy="in_place")
    later = _edit_loop(1) + [{"role": "assistant", "content": "escalate"}, {"role": "user", "content": "and now ?"}]
    r = engine.generate(later, max_new_tokens=1, tenant=tenant, edit_policy="in_place")
    assert not r.edit.detected and r.edit.applied == "in_place" and r.edit.continued and r.edit.reason == ""
    n_prev = engine.prompt_ids(_edit_loop(1)).numel()
    assert r.usage.cached_tokens == (n_prev // BLOCK_TOKENS) * BLOCK_TOKENS  # the in_place turn's own blocks
    exact = engine.generate(later, max_new_tokens=1, tenant=tenant)  # recompute: exact blocks only
    assert exact.usage.cached_tokens < r.usage.cached_tokens
    assert exact.edit is None or exact.edit.applied == "recompute"
