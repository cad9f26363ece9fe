"""Issue 11: field-change detection never mistakes a new question for an edit, and every edit
policy either applies or falls back to the exact path, saying why.

Oracles: the rule in mmkv/request/edits.py (ground truth by construction of each case), and the exact
reuse path (`edit_policy="recompute"`, itself held to the block-masked forward elsewhere) or
`reuse=False` for text-only prompts, within the splice tolerance.
"""

from __future__ import annotations

import base64
import gc
import json
import random
import signal
import weakref
from contextlib import contextmanager

import pytest
import torch

from mmkv import Engine
from mmkv.request.messages import erratum_line
from mmkv.store.prefix_cache import BLOCK_TOKENS

from conftest import make_png, prefix_hit

TOL = 1e-4  # float32 next-token logits
POLICIES = ("erratum", "in_place", "selective@2")
POLICY = ("refund policy . a refund is allowed only when the order status is delivered and the customer "
          "reports damage within thirty days . otherwise escalate to a human agent . ")


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu")


@contextmanager
def deadline(seconds: int):
    """Fail instead of hanging: a policy must never leave a request without an answer."""
    def fail(*_):
        raise TimeoutError(f"no answer within {seconds} s")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _image(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


def _close(a, b) -> bool:
    return (a.first_logits - b.first_logits).abs().max().item() <= TOL and a.token_ids == b.token_ids


# ---- what IS a field edit: the shapes of the rule --------------------------------------------------------
JSON_DOC = {"policy": POLICY.strip(), "order_status": "{v}", "tier": "gold"}
SHAPES = {
    "colon": ("order_status: {v}", "order_status", "pending", "shipped"),
    "equals": ("tier = {v}", "tier", "gold", "silver"),
    "json": (json.dumps(JSON_DOC, separators=(",", ":")), "order_status", "pending", "shipped"),
    "json-spaced": (json.dumps(JSON_DOC), "order_status", "pending", "shipped"),
    "yaml": ("customer:\n  name: ana\n  order_status: {v}\n  tier: gold", "order_status", "pending", "delivered"),
    "shared-stem": ("ticket: A-{v}", "ticket", "A-1041", "A-1042"),
}


def _with_field(line: str, value: str, before: int = 3, after: int = 3, question: str = "refund ?") -> list[dict]:
    return [{"role": "system", "content": POLICY * before + "\n" + line.replace("{v}", value) + "\n" + POLICY * after},
            {"role": "user", "content": question}]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_field_shapes_are_detected_with_label_and_values(engine, shape):
    line, label, old, new = SHAPES[shape]
    old_v, new_v = old.removeprefix("A-") if shape == "shared-stem" else old, \
        new.removeprefix("A-") if shape == "shared-stem" else new
    tenant = f"shape-{shape}"
    first = engine.generate(_with_field(line, old_v), max_new_tokens=1, tenant=tenant)
    r = engine.generate(_with_field(line, new_v), max_new_tokens=1, tenant=tenant, edit_policy="erratum")
    e = r.edit
    assert (e.detected, e.field, e.old_value, e.new_value, e.applied) == (True, label, old, new, "erratum"), e
    assert e.erratum == erratum_line(label, new) and len(e.erratum) <= 200
    # the rewritten prompt is the old prompt plus one erratum turn
    turn = engine.adapter.tokenizer("<|im_start|>user\n" + e.erratum + "\n<|im_end|>\n")["input_ids"]
    assert r.usage.prompt_tokens == first.usage.prompt_tokens + len(turn)
    kept = first.usage.prompt_tokens - len(engine.adapter.tokenizer("<|im_start|>assistant\n")["input_ids"])
    # the old prompt's full blocks, and the rest of it with the erratum turn's <|im_start|> when its buffer holds them
    assert r.usage.cached_tokens == prefix_hit(first.usage.prompt_tokens, kept + 1, r.usage.prompt_tokens)
    engine.check_integrity()


def test_json_field_erratum_keeps_a_2k_token_policy_hot(engine):
    """The issue's one-line JSON system prompt: the field is the key, the erratum line is short,
    and the cache hit covers the whole old prompt."""
    doc = {"policy": (POLICY * 17).strip(), "order_status": "{v}", "tier": "gold"}
    line = json.dumps(doc, separators=(",", ":"))
    tenant = "json-2k"
    first = engine.generate(_with_field(line, "pending", 0, 0), max_new_tokens=1, tenant=tenant)
    r = engine.generate(_with_field(line, "shipped", 0, 0), max_new_tokens=1, tenant=tenant, edit_policy="erratum")
    rate = r.usage.cached_tokens / r.usage.prompt_tokens
    print(f"JSON field erratum on a {first.usage.prompt_tokens}-token prompt: {r.usage.cached_tokens} of "
          f"{r.usage.prompt_tokens} tokens reused ({rate:.3f}); erratum {len(r.edit.erratum)} chars")
    assert first.usage.prompt_tokens >= 2000
    assert (r.edit.field, r.edit.old_value, r.edit.new_value) == ("order_status", "pending", "shipped")
    assert rate >= 0.95 and len(r.edit.erratum) < 120


def test_field_edit_in_an_earlier_turn_of_a_longer_chat(engine):
    """The client edits the field in place and asks one more turn: detected, and the erratum
    goes at the start of the final user turn."""
    tenant = "later-turn"
    line = "order_status: {v}"
    engine.generate(_with_field(line, "pending"), max_new_tokens=1, tenant=tenant)
    msgs = _with_field(line, "shipped") + [{"role": "assistant", "content": "escalate"},
                                           {"role": "user", "content": "and now ?"}]
    r = engine.generate(msgs, max_new_tokens=1, tenant=tenant, edit_policy="erratum")
    assert r.edit.detected and r.edit.applied == "erratum"
    text = engine.adapter.tokenizer.decode(engine.splice_plan(msgs).input_ids)
    assert text.count("order_status: shipped") == 1


# ---- what is NOT a field edit ------------------------------------------------------------------------------
def _cases(engine, tenant):
    """(name, first request, second request): none of the second requests is a field edit."""
    sky, red = make_png(84, 56, seed=11), make_png(84, 56, seed=12)
    img = engine.add_image(sky, tenant=tenant)
    ref = {"type": "image_file", "image_file": {"file_id": img}}
    system = {"role": "system", "content": "you answer questions about shapes .\norder_status: pending"}
    s1 = engine.add_skill("a", POLICY, tenant=tenant)
    s2 = engine.add_skill("b", POLICY.replace("thirty", "sixty"), tenant=tenant)

    def skill(sid):
        return [{"role": "system", "content": [{"type": "skill", "skill_id": sid},
                                                {"type": "text", "text": "\nmode: strict"}]},
                {"role": "user", "content": "refund ?"}]

    return [
        ("new question", [system, {"role": "user", "content": "what color is the sky ?"}],
         [system, {"role": "user", "content": "is the red shape left of the blue shape ?"}]),
        ("same image, new question", [{"role": "user", "content": [ref, {"type": "text", "text": "what color ?"}]}],
         [{"role": "user", "content": [ref, {"type": "text", "text": "what shape ?"}]}]),
        ("labelled value in the final turn", [system, {"role": "user", "content": "colour: red . yes or no ?"}],
         [system, {"role": "user", "content": "colour: blue . yes or no ?"}]),
        ("earlier turn without a label", [system, {"role": "user", "content": "what color is the sky ?"},
                                          {"role": "assistant", "content": "blue"},
                                          {"role": "user", "content": "are you sure ?"}],
         [system, {"role": "user", "content": "what shape is the sky ?"}, {"role": "assistant", "content": "blue"},
          {"role": "user", "content": "are you sure ?"}]),
        ("other image", [{"role": "user", "content": [_image(sky), {"type": "text", "text": "what color ?"}]}],
         [{"role": "user", "content": [_image(red), {"type": "text", "text": "what color ?"}]}]),
        ("other skill", skill(s1), skill(s2)),
        ("new system prompt", [system, {"role": "user", "content": "refund ?"}],
         [{"role": "system", "content": "you are terse ."}, {"role": "user", "content": "refund ?"}]),
        ("continuation", [system, {"role": "user", "content": "refund ?"}],
         [system, {"role": "user", "content": "refund ?"}, {"role": "assistant", "content": "no"},
          {"role": "user", "content": "why ?"}]),
    ]


def test_not_an_edit_is_never_detected_and_every_policy_equals_recompute(engine):
    per_policy = {policy: _cases(engine, f"neg-{policy}") for policy in ("recompute",) + POLICIES}
    for i, (name, _, _) in enumerate(per_policy["recompute"]):
        exact = None
        for policy in ("recompute",) + POLICIES:
            tenant = f"neg-{policy}"
            _, first, second = per_policy[policy][i]
            engine.generate(first, max_new_tokens=1, tenant=tenant)
            with deadline(60):
                r = engine.generate(second, max_new_tokens=2, tenant=tenant, edit_policy=policy)
            exact = exact or r
            if policy == "recompute":
                assert r.edit is None, name
                continue
            assert not r.edit.detected and r.edit.applied == "recompute", (name, policy, r.edit)
            assert r.edit.reason == "no field change", (name, policy)
            assert r.usage.prompt_tokens == exact.usage.prompt_tokens and _close(r, exact), (name, policy)
    engine.check_integrity()


def test_property_random_chats_are_never_taken_for_edits(engine):
    """Seeded random conversations from a vocabulary of system prompts, questions, images and
    skills; every request moves in a way that is not a field edit by the rule (a new question,
    another image or skill, a new chat, a continuation, an unlabelled change in an earlier turn).
    None is detected, and every policy answers exactly as recompute (and, without chunks, as
    reuse=False)."""
    rng = random.Random(11)
    systems = ["you answer questions about shapes .", POLICY, "order_status: pending\n" + POLICY,
               json.dumps({"tier": "gold", "policy": POLICY.strip()}), "be brief ."]
    questions = ["what color is the shape ?", "what shape is it ?", "how many shapes are there ?",
                 "is the red shape left of the blue shape ?", "refund ?", "describe the image .",
                 "color: red ?", "answer yes or no : is it a circle ?"]
    answers = ["red", "circle", "two", "yes", "no", "escalate"]
    pngs = [make_png(56 + 14 * i, 56, seed=20 + i) for i in range(3)]
    images = [engine.add_image(p, tenant=f"prop-{pol}") for pol in ("recompute",) + POLICIES for p in pngs]
    assert len(set(images)) == 3
    skills = {pol: [engine.add_skill(f"s{i}", text, tenant=f"prop-{pol}")
                    for i, text in enumerate([POLICY, "tool search ( query ) returns three documents ."])]
              for pol in ("recompute",) + POLICIES}
    assert len({tuple(v) for v in skills.values()}) == 1

    def user_turn():
        parts = []
        if rng.random() < 0.4:
            parts.append({"type": "image_file", "image_file": {"file_id": rng.choice(images)}})
        if rng.random() < 0.15:
            parts.append({"type": "skill", "skill_id": rng.choice(skills["recompute"])})
        parts.append({"type": "text", "text": rng.choice(questions)})
        return {"role": "user", "content": parts}

    def new_chat():
        return [{"role": "system", "content": rng.choice(systems)}, user_turn()]

    def move(chat):
        kind = rng.choice(["new question", "new chat", "continue", "unlabelled earlier", "new image", "same"])
        if kind == "new chat" or len(chat) < 2:
            return new_chat()
        if kind == "new question":
            return chat[:-1] + [user_turn()]
        if kind == "continue":
            return chat + [{"role": "assistant", "content": rng.choice(answers)}, user_turn()]
        if kind == "new image":
            return chat[:-1] + [{"role": "user", "content": [
                {"type": "image_file", "image_file": {"file_id": rng.choice(images)}},
                {"type": "text", "text": rng.choice(questions)}]}]
        if kind == "unlabelled earlier" and len(chat) >= 4:
            i = rng.randrange(1, len(chat) - 2)
            if chat[i]["role"] == "user":
                edited = dict(chat[i], content=[{"type": "text", "text": rng.choice(questions).replace(":", "")
                                                 + " please"}])
                return chat[:i] + [edited] + chat[i + 1:]
        return chat

    requests, chat = [], new_chat()
    for _ in range(200):
        chat = move(chat)
        requests.append(chat)
    cases = 0
    exact = [engine.generate(msgs, max_new_tokens=1, tenant="prop-recompute") for msgs in requests]
    for policy in POLICIES:
        for msgs, want in zip(requests, exact):
            with deadline(60):
                r = engine.generate(msgs, max_new_tokens=1, tenant=f"prop-{policy}", edit_policy=policy)
            cases += 1
            assert not r.edit.detected and r.edit.applied == "recompute", (policy, msgs, r.edit)
            assert _close(r, want), (policy, msgs)
    text_only = [(m, w) for m, w in zip(requests, exact)
                 if all(isinstance(x["content"], str) or all(p["type"] == "text" for p in x["content"]) for x in m)]
    for msgs, want in text_only[:40]:
        assert _close(engine.generate(msgs, max_new_tokens=1, reuse=False), want)
    print(f"property test: {cases} policy requests over {len(requests)} chats, 0 detected; "
          f"{len(text_only[:40])} text-only ones equal reuse=False")
    engine.check_integrity()


# ---- policies that cannot apply fall back, say why, and never fail ------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_every_policy_with_images_new_questions_and_real_edits(tiny_dirs, family):
    eng = Engine.from_pretrained(tiny_dirs[family], dtype=torch.float32, device="cpu")
    png = make_png(70, 56, seed=31)

    def chat(value, question, image_first=True):
        parts = [_image(png), {"type": "text", "text": question}]
        return [{"role": "system", "content": POLICY * 2 + f"\norder_status: {value}\n" + POLICY},
                {"role": "user", "content": parts if image_first else parts[::-1]}]

    stream = [chat("pending", "what color ?"), chat("shipped", "what color ?"), chat("shipped", "what shape ?"),
              chat("pending", "what shape ?", image_first=False), chat("delivered", "what shape ?", False)]
    expect_detected = [False, True, False, False, True]
    for policy in POLICIES:
        for msgs, detected in zip(stream, expect_detected):
            with deadline(60):
                r = eng.generate(msgs, max_new_tokens=2, tenant=policy, edit_policy=policy)
            assert r.edit.applied in (policy, "recompute") and r.edit.detected == detected, (family, policy, r.edit)
            assert r.edit.applied == policy or r.edit.reason, r.edit
            assert torch.isfinite(r.first_logits).all()
    eng.check_integrity()


def test_in_place_when_the_old_prompt_fills_whole_blocks(engine):
    """Every old token comes from stale blocks: the prompt's last token must still be computed."""
    tok = engine.adapter.tokenizer
    filler = ""
    while True:
        msgs = _with_field("order_status: {v}", "pending", 2, 1, question="refund ?" + filler)
        n = engine.prompt_ids(msgs).numel()
        if n % BLOCK_TOKENS == 0:
            break
        filler += " ."
    assert len(tok(filler)["input_ids"]) < BLOCK_TOKENS
    for policy in ("in_place", "selective@3"):
        tenant = f"blocks-{policy}"
        engine.generate(msgs, max_new_tokens=1, tenant=tenant)
        edited = _with_field("order_status: {v}", "shipped", 2, 1, question="refund ?" + filler)
        r = engine.generate(edited, max_new_tokens=1, tenant=tenant, edit_policy=policy)
        assert r.edit.detected and r.edit.applied == policy, r.edit
        assert r.lm_tokens_computed >= 1 and torch.isfinite(r.first_logits).all()


def test_a_failing_policy_recomputes_and_says_why(engine, monkeypatch):
    def broken(*args, **kwargs):
        raise StopIteration("injected")

    monkeypatch.setattr("mmkv.request.place.prefill_edited", broken)
    engine.generate(_with_field("order_status: {v}", "pending"), max_new_tokens=1, tenant="broken")
    msgs = _with_field("order_status: {v}", "shipped")
    r = engine.generate(msgs, max_new_tokens=1, tenant="broken", edit_policy="in_place")
    assert r.edit.detected and r.edit.applied == "recompute" and "failed" in r.edit.reason
    assert _close(r, engine.generate(msgs, max_new_tokens=1, tenant="broken-ref"))


def test_erratum_that_would_not_fit_falls_back_to_recompute(tiny_dirs):
    eng = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu")
    first = _with_field("order_status: {v}", "pending", 2, 2)
    n = eng.prompt_ids(first).numel()
    eng = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu", max_context=n + 8)
    eng.generate(first, max_new_tokens=1, tenant="tight")
    msgs = _with_field("order_status: {v}", "shipped", 2, 2)
    r = eng.generate(msgs, max_new_tokens=4, tenant="tight", edit_policy="erratum")
    assert r.edit.detected and r.edit.applied == "recompute" and "exceed the context" in r.edit.reason
    assert r.usage.prompt_tokens == eng.prompt_ids(msgs).numel()


def test_recent_prompts_keep_no_chunk_alive_and_are_counted(tiny_dirs):
    eng = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu")
    ids = [eng.add_image(make_png(56, 56, seed=40 + i)) for i in range(4)]
    refs = []
    for image_id in ids:
        msgs = [{"role": "user", "content": [{"type": "image_file", "image_file": {"file_id": image_id}},
                                             {"type": "text", "text": "what color ?"}]}]
        eng.generate(msgs, max_new_tokens=1)
        refs.append(weakref.ref(eng.splice_plan(msgs).placements[0].entry))
        eng.remove_image(image_id)
    gc.collect()
    assert all(r() is None for r in refs), "a removed image's KV is still referenced"
    recent = eng.placer.recent
    assert len(recent) == 4 and 0 < recent.nbytes <= 4 * 4 * 200 + 4 * 2 * 64


def _substitution_reference(new, old, max_tokens):
    """mmkv.request.edits._substitution as first written (every (x, y) in turn): the rule's stored meaning."""
    start = new.common_prefix(old)
    if start >= len(old):
        return None
    best = None
    for y in range(max_tokens + 1):
        rest = len(old) - start - y
        if rest <= 0:
            break
        for x in range(max_tokens + 1):
            end = start + x + rest
            if not (x or y) or end > len(new) or new.ids[start + x] != old.ids[start + y] \
                    or new.ids[end - 1] != old.ids[-1]:
                continue
            if new.same(start + x, old, start + y, rest):
                if best is None or x + y < best[1] + best[2]:
                    best = (start, x, y)
                break
    return best


def test_substitution_equals_the_reference_on_repetitive_prompts():
    """Repetitive ids (a skill's repeated sentence) and spans make many candidate (x, y) pass the
    cheap checks: the pruned search must pick the very substitution the exhaustive one does."""
    import numpy as np

    from mmkv.request.edits import TokenView, _substitution

    rng = random.Random(13)
    found = 0
    for case in range(300):
        period = rng.choice((1, 2, 3, 5, 7))
        old_ids = [rng.randrange(4) for _ in range(period)] * rng.randint(4, 30)
        old_ids = old_ids[:rng.randint(2, len(old_ids))]
        at = rng.randrange(len(old_ids))
        y, x = rng.randint(0, 4), rng.randint(0, 4)
        new_ids = old_ids[:at] + [rng.randrange(5) for _ in range(x)] + old_ids[at + y:] + \
            [rng.randrange(5) for _ in range(rng.randint(0, 3))]
        spans = ((0, 2, "img", "image"),) if case % 4 == 0 and len(old_ids) > 3 and len(new_ids) > 3 else ()
        old = TokenView(np.array(old_ids, dtype=np.int32), spans)
        new = TokenView(np.array(new_ids, dtype=np.int32), spans if case % 8 else ())
        for max_tokens in (2, 4, 16):
            want = _substitution_reference(new, old, max_tokens)
            assert _substitution(new, old, max_tokens) == want, (old_ids, new_ids, max_tokens)
            found += want is not None
    assert found > 200  # the cases exercise the search, not only its early exits


def test_values_that_are_added_word_tokens_are_still_fields(tmp_path):
    """A tokenizer may carry added tokens that are ordinary words (a fine-tune's vocabulary, the
    bundled models' field values): a value spelled by one is a field like any other. Added markup
    (`<tool_call>`-like, special or not) stays off limits: a change touching it is no edit."""
    from tokenizers import AddedToken

    from mmkv.request.place import template_tokens_of
    from mmkv.testing.tiny import build_tokenizer, save_tiny_checkpoint

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in ("pending", "shipped", "order_status")]
                   + [AddedToken("<tool_call>", normalized=False)])
    d = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "words", seed=3, tokenizer=tok)
    eng = Engine.from_pretrained(d, dtype=torch.float32, device="cpu")
    assert len(eng.adapter.tokenizer.encode("\norder_status: shipped", add_special_tokens=False)) <= 5
    tt = template_tokens_of(eng.adapter.tokenizer)
    words = eng.adapter.tokenizer.convert_tokens_to_ids(["pending", "shipped", "order_status"])
    assert not set(words) & tt.special and eng.adapter.tokenizer.convert_tokens_to_ids("<tool_call>") in tt.special
    for line, (old, new) in (("order_status: {v}", ("pending", "shipped")), ("status = {v}", ("shipped", "pending")),
                             ('{"order_status": "{v}"}', ("pending", "shipped"))):
        tenant = f"words-{line}"
        eng.generate(_with_field(line, old, 2, 2), max_new_tokens=1, tenant=tenant)
        r = eng.generate(_with_field(line, new, 2, 2), max_new_tokens=1, tenant=tenant, edit_policy="in_place")
        assert (r.edit.detected, r.edit.applied, r.edit.old_value, r.edit.new_value) == (True, "in_place", old, new), r.edit
    eng.generate(_with_field("note: {v}", "<tool_call>", 2, 2), max_new_tokens=1, tenant="markup")
    r = eng.generate(_with_field("note: {v}", "shipped", 2, 2), max_new_tokens=1, tenant="markup", edit_policy="in_place")
    assert not r.edit.detected and r.edit.applied == "recompute"
    eng.check_integrity()


def _char_view(text: str):
    """A prompt in a one-token-per-character vocabulary: id 1 is <|im_start|>, 2 is <|im_end|>,
    a character c is ord(c) + 10."""
    import numpy as np

    from mmkv.request.edits import TokenView

    marks = {"<s>": 1, "<e>": 2}
    ids, i = [], 0
    while i < len(text):
        tag = text[i:i + 3]
        ids.append(marks[tag] if tag in marks else ord(text[i]) + 10)
        i += 3 if tag in marks else 1
    return TokenView(np.array(ids, dtype=np.int32), ())


def test_a_label_must_end_its_line_before_the_value_not_the_line_above():
    """issue finding (edit detection's label regex ended in `$`, which also matches before a
    trailing newline): a label alone on the line above the changed text (`notes:` then a line
    break) is not that text's label. The same value on the label's own line is a field."""
    from mmkv.request.edits import EditRules, RecentPrompt, TemplateTokens, detect_field_change

    tt = TemplateTokens(turn_start=1, generation_prompt=(), special=frozenset({1, 2}),
                        decode=lambda ids: "".join(chr(i - 10) for i in ids if i > 2))
    filler = "a refund is allowed only when delivered .\n" * 2
    rules = EditRules()

    def change(layout: str, old: str, new: str):
        prompt = lambda v: _char_view(f"<s>system\n{filler}{layout.format(v=v)}\n{filler}<e><s>user\nwhy ?<e>")  # noqa: E731
        recent = [RecentPrompt(prompt(old), prompt(old))]
        return detect_field_change(prompt(new), recent, tt, rules)

    same_line = change("notes: {v} car parked here", "blue", "red")
    assert (same_line.field, same_line.old_value, same_line.new_value) == \
        ("notes", "blue car parked here", "red car parked here")
    assert change("notes:\n{v} car parked here", "blue", "red") is None
    assert change("notes =\n{v} car parked here", "blue", "red") is None
