"""Composed history (`history_policy: "compose"`, mmkv/request/compose.py): finished turns kept as
text chunks and spliced, re-rotated, where a window dropped something before them.

The oracle: a composed turn equals one masked forward in which its block sees what it saw when it
was computed (the request that computed it, laid out by the same rules: mmkv.request.oracle.Seen),
its seam tokens the request's own context; tolerance 1e-4 in float32, on both rope layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from conftest import make_png
from mmkv.engine import Engine
from mmkv.errors import InvalidRequestError
from mmkv.kv.chunks import SOURCE_BYTES, tensor_bytes
from mmkv.request.compose import turn_pieces
from mmkv.request.oracle import Seen, block_masked_logits
from mmkv.request.splice import Placement

TOL = 1e-4
SYSTEM = "you are a careful agent . each step , look at the screen and say what changed since the last one ."


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def engine(request, tiny_dirs):
    return Engine.from_pretrained(tiny_dirs[request.param], dtype=torch.float32, device="cpu")


def _conversation(shots: list[str | None], replies: int) -> list[dict]:
    """A system turn, then per step a user turn (its screenshot, None when the window dropped it,
    then its text) and, for the first `replies` steps, the agent's reply."""
    msgs = [{"role": "system", "content": SYSTEM}]
    for step, shot in enumerate(shots):
        parts = [{"type": "image_file", "image_file": {"file_id": shot}}] if shot else []
        msgs.append({"role": "user", "content": parts + [{"type": "text", "text": f"step {step} : what changed ?"}]})
        if step < replies:
            msgs.append({"role": "assistant", "content": f"clicked the button of step {step} , then waited ."})
    return msgs


@dataclass
class Done:
    """A request the test served under compose, as the oracle lays it out."""

    plan: object
    placements: list[Placement]
    seen: dict[int, Seen]
    computed: set[str] = field(default_factory=set)  # turn keys this request computed (and stored)


def _salt(engine, tenant=""):
    return engine._salt(tenant, engine.settings.seam_tokens, engine.settings.rope_policy)


def _expected(engine, msgs, done: list[Done], tenant="") -> Done:
    """The request's layout by the rule: every turn piece computed by an earlier request is a
    composed chunk that sees that request's prompt up to it; the others are computed here."""
    plan = engine.splice_plan(msgs, tenant=tenant)
    turn_start = engine.adapter.tokenizer.convert_tokens_to_ids("<|im_start|>")
    placements, seen, computed = list(plan.placements), {}, set()
    for piece in turn_pieces(plan.input_ids, plan.chunk_keys, turn_start, _salt(engine, tenant)):
        source = next((d for d in done if piece.key in d.computed), None)
        if source is None:
            computed.add(piece.key)
            continue
        there = next(p for p in turn_pieces(source.plan.input_ids, source.plan.chunk_keys, turn_start,
                                            _salt(engine, tenant)) if p.key == piece.key)
        entry = engine.cache.get(piece.key, "turn")
        assert entry is not None, "a piece an earlier request computed is stored"
        placements.append(Placement(piece.start, entry, plan.positions[:, piece.start:piece.end]))
        seen[piece.start] = Seen(source.plan.input_ids, source.plan.positions, source.placements, there.start,
                                 source.seen)
    return Done(plan, sorted(placements, key=lambda p: p.start), seen, computed)


def _oracle(engine, d: Done) -> torch.Tensor:
    return block_masked_logits(engine.adapter, d.plan.input_ids, d.plan.positions, d.placements,
                               engine.settings.seam_tokens, engine.anchor_ids, seen=d.seen)[0]


def test_composed_turns_equal_their_block_masked_oracle(engine):
    """Three requests of a windowed agent: A computes everything; B drops A's first screenshot, so
    A's later turns are composed at moved positions; C drops the next one, composing turns B
    computed (whose context held turns B composed from A): each equals its oracle."""
    shots = [engine.add_image(make_png(56, 56, seed=s)) for s in range(4)]
    done = []
    for msgs in (_conversation(shots[:2], 1), _conversation([None, shots[1], shots[2]], 2),
                 _conversation([None, None, shots[2], shots[3]], 3)):
        want = _expected(engine, msgs, done)
        r = engine.generate(msgs, max_new_tokens=1, history_policy="compose")
        gap = (r.first_logits - _oracle(engine, want)).abs().max().item()
        composed = [p for p in want.placements if p.entry.kind == "turn"]
        print(f"{engine.adapter.family}: {len(composed)} composed pieces, vs oracle max |diff| {gap:.2e}")
        assert gap <= TOL
        assert r.history.policy == "compose" and r.history.stored_turns == len(want.computed)
        assert (r.history.applied == "compose") == bool(done)
        done.append(want)
    assert r.history.composed_turns >= 2 and r.history.composed_tokens > 0
    exact = block_masked_logits(engine.adapter, want.plan.input_ids, want.plan.positions, want.plan.placements,
                                engine.settings.seam_tokens, engine.anchor_ids)[0]
    assert (r.first_logits - exact).abs().max().item() > 100 * TOL, "composed KV is not the exact path's"


def test_accounting_counts_only_reused_kv(engine):
    """A composed request's cached tokens are its prefix hit, its spliced images and the turn
    tokens placed from turn chunks (seams computed); composed + computed = the prompt."""
    tenant = "acct"
    shots = [engine.add_image(make_png(56, 56, seed=10 + s), tenant=tenant) for s in range(3)]
    engine.generate(_conversation(shots[:2], 1), max_new_tokens=1, history_policy="compose", tenant=tenant)
    r = engine.generate(_conversation([None, shots[1], shots[2]], 2), max_new_tokens=1, history_policy="compose",
                        tenant=tenant)
    h = r.history
    assert h.applied == "compose" and h.composed_tokens > 0
    assert r.usage.cached_tokens + r.lm_tokens_computed == r.usage.prompt_tokens
    plan = engine.splice_plan(_conversation([None, shots[1], shots[2]], 2), tenant=tenant)
    images = sum(int((plan.input_ids[p.start:p.end] == engine.adapter.image_token_id).sum()) - 0
                 for p in plan.placements)
    assert r.image_tokens_reused == images


def test_exact_requests_never_read_composed_kv(engine):
    """After composed requests stored their turns and blocks, the same prompts asked exactly (the
    default) equal the exact path's oracle: no turn chunk placed, no composed block loaded."""
    tenant = "exact-after"
    shots = [engine.add_image(make_png(56, 56, seed=20 + s), tenant=tenant) for s in range(3)]
    first, second = _conversation(shots[:2], 1), _conversation([None, shots[1], shots[2]], 2)
    for msgs in (first, second, second):
        engine.generate(msgs, max_new_tokens=1, history_policy="compose", tenant=tenant)
    assert engine.cache.count("turn") > 0
    for msgs in (second, second + [{"role": "assistant", "content": "done ."}, {"role": "user", "content": "next ?"}]):
        r = engine.generate(msgs, max_new_tokens=1, tenant=tenant)
        plan = engine.splice_plan(msgs, tenant=tenant)
        want = block_masked_logits(engine.adapter, plan.input_ids, plan.positions, plan.placements,
                                   engine.settings.seam_tokens, engine.anchor_ids)[0]
        assert r.history is None and (r.first_logits - want).abs().max().item() <= TOL


def test_deleting_an_image_purges_every_turn_that_saw_it(engine):
    """Turn chunks name every chunk their KV attended to: deleting a screenshot purges the turn
    holding it and every later turn (and their blocks); the turns before it stay."""
    tenant = "delete"
    shots = [engine.add_image(make_png(56, 56, seed=30 + s), tenant=tenant) for s in range(3)]
    msgs = _conversation(shots[:2], 1)
    engine.generate(msgs, max_new_tokens=1, history_policy="compose", tenant=tenant)
    plan = engine.splice_plan(msgs, tenant=tenant)
    turn_start = engine.adapter.tokenizer.convert_tokens_to_ids("<|im_start|>")
    pieces = turn_pieces(plan.input_ids, plan.chunk_keys, turn_start, _salt(engine, tenant))
    shot1 = [p for p in plan.placements if p.entry.kind == "image"][1]
    assert all(p.key in engine.cache for p in pieces)
    engine.remove_image(shots[1], tenant=tenant)
    engine.check_integrity()
    assert [p.key in engine.cache for p in pieces] == [p.end <= shot1.start for p in pieces]
    assert any(p.end <= shot1.start for p in pieces) and any(p.start > shot1.start for p in pieces)
    again = engine.generate(_conversation([None, shots[0]], 1), max_new_tokens=1, history_policy="compose",
                            tenant=tenant)
    assert again.history is not None  # a conversation without the deleted screenshot still composes


def test_turn_chunks_sit_inside_the_cache_budget(tiny_dirs):
    """Turn chunks share the KV store's budget, each charged its tensors and its sources; a long
    composed session in a small budget evicts, stays within it and keeps its books."""
    eng = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu", cache_bytes=400_000)
    shots = [eng.add_image(make_png(56, 56, seed=40 + s)) for s in range(6)]
    for step in range(2, 7):
        window = [s if i >= step - 2 else None for i, s in enumerate(shots[:step])]
        r = eng.generate(_conversation(window, step - 1), max_new_tokens=1, history_policy="compose")
        eng.check_integrity()
        assert eng.stats()["cache_bytes"] <= 400_000
    assert eng.stats()["evictions"] > 0 and r.history is not None
    turns = [e for e in eng.cache._entries.values() if e.kind == "turn"]
    assert turns and all(e.nbytes == tensor_bytes((*e.keys, *e.values, e.token_ids, e.position_ids))
                         + SOURCE_BYTES * len(e.sources) for e in turns)


@pytest.mark.parametrize("kwargs", [{"history_policy": "bogus"}, {"history_policy": 3},
                                    {"history_policy": "compose", "edit_policy": "erratum"},
                                    {"history_policy": "compose", "reuse": False}])
def test_bad_history_policy_is_refused_naming_it(engine, kwargs):
    before = engine.stats()["requests"]
    with pytest.raises(InvalidRequestError) as err:
        engine.generate([{"role": "user", "content": "hi"}], max_new_tokens=1, **kwargs)
    assert err.value.param == "history_policy" and engine.stats()["requests"] == before


def test_nothing_to_compose_falls_back_to_exact_and_says_why(engine):
    r = engine.generate([{"role": "user", "content": "a first question ?"}], max_new_tokens=1,
                        history_policy="compose", tenant="fresh")
    assert r.history.applied == "exact" and r.history.reason and r.history.composed_tokens == 0


def test_server_reports_the_history_policy_and_refuses_a_bad_one(tiny_dirs):
    import httpx

    from mmkv.server.app import ServerSettings, create_app
    from test_server import LiveServer

    eng = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu")
    server = LiveServer(create_app(eng, ServerSettings(served_model_names=("tiny",))))
    try:
        url = f"{server.base_url}/v1/chat/completions"
        history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "step 0 : what changed ?"},
                   {"role": "assistant", "content": "clicked the button of step 0 , then waited ."}]
        bad = httpx.post(url, json={"model": "tiny", "messages": history[:2], "mmkv": {"history_policy": "nope"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "history_policy"
        for msgs in (history + [{"role": "user", "content": "step 1 ?"}],
                     [history[0], {"role": "user", "content": "step 0 ?"}] + history[2:]
                     + [{"role": "user", "content": "step 1 ?"}]):
            r = httpx.post(url, json={"model": "tiny", "messages": msgs, "max_tokens": 1,
                                      "mmkv": {"history_policy": "compose"}}, timeout=30)
            assert r.status_code == 200, r.text
        report = r.json()["mmkv"]["history"]
        assert report["applied"] == "compose" and report["composed_turns"] >= 1 and report["composed_tokens"] > 0
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= report["composed_tokens"]
    finally:
        server.close()


@pytest.mark.parametrize("kind", ["screenshots", "tool outputs"])
def test_agent_window_conversations_drop_what_they_say(kind):
    """`mmkv eval --task agent-window`: a screenshot conversation's request keeps the last 3
    screenshots and every step's text; a tool-output one keeps the last 2 tool outputs and only the
    current screenshot; every earlier step keeps its question and its reply, in order."""
    from mmkv.vqa_eval.agent_window import SCREENSHOT_WINDOW, TOOL_WINDOW, build_conversation
    from mmkv.vqa_eval.dataset import load_vqa_set
    from mmkv.vqa_eval.run import DEFAULT_SET

    conv = build_conversation(kind, load_vqa_set(DEFAULT_SET), seed=0, turns=9)
    ids = {s.item.image: f"img-{i}" for i, s in enumerate(conv.steps)}
    for t in range(len(conv.steps)):
        msgs = conv.messages(t, ids)
        users = [m["content"] for m in msgs if m["role"] == "user"]
        shown = [p["image_file"]["file_id"] for c in users for p in c if p["type"] == "image_file"]
        tools = [p["text"] for c in users for p in c if p["type"] == "text" and p["text"].startswith("tool output")]
        keep = SCREENSHOT_WINDOW if kind == "screenshots" else 1
        assert shown == [f"img-{i}" for i in range(max(0, t + 1 - keep), t + 1)]
        want_tools = [s.tool for s in conv.steps[max(0, t + 1 - TOOL_WINDOW):t + 1]] if kind == "tool outputs" else []
        assert tools == want_tools
        assert [c[-1]["text"] for c in users] == [s.item.question for s in conv.steps[:t + 1]]
        assert [m["content"] for m in msgs if m["role"] == "assistant"] == [s.item.answer for s in conv.steps[:t]]


def test_the_dial_recomputes_composed_turns_in_context(engine):
    """The fidelity dial on composed history: at r = 1 every composed turn's tokens (kind "turn")
    and every image's are recomputed in context, so the turn equals a full recompute; at r = 0.5
    about half of each composed turn is recomputed and the report counts it."""
    tenant = "dial"
    shots = [engine.add_image(make_png(56, 56, seed=40 + s), tenant=tenant) for s in range(3)]
    first, second = _conversation(shots[:2], 1), _conversation([None, shots[1], shots[2]], 2)
    for r in (1.0, 0.5):
        engine.generate(first, max_new_tokens=1, history_policy="compose", tenant=tenant, blend=r)
        got = engine.generate(second, max_new_tokens=1, history_policy="compose", tenant=tenant, blend=r)
        assert got.history.composed_turns >= 1
        turns = [c for c in got.blend.chunks if c.kind == "turn"]
        assert turns and all(c.recomputed == (c.tokens if r == 1 else -(-c.tokens // 2)) for c in turns)
        if r == 1.0:
            full = engine.generate(second, max_new_tokens=1, reuse=False, tenant=tenant).first_logits
            assert (got.first_logits - full).abs().max().item() <= TOL
