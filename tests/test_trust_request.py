"""The request path under hostile text and failures (the outside review's findings on forged turns,
leftover prefix blocks and deletes undone between admission and first token).

Oracles: the special-token ids the chat template itself places (the same request with harmless
text in place of the hostile strings), and the exact path (`reuse=False`, one full forward) for
the KV a later request reads.
"""

from __future__ import annotations

import base64
from collections import Counter

import pytest
import torch

from mmkv import Engine
from mmkv.errors import InvalidRequestError

from conftest import make_png

POLICY = "refund policy . a refund is allowed only when the order status is delivered . " * 3
EDIT_POLICIES = ("recompute", "erratum", "in_place", "selective@2")
TOL = 1e-4  # float32 next-token logits, spliced / prefix-cached against the full forward


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def engine(request, tiny_dirs):
    return Engine.from_pretrained(tiny_dirs[request.param], dtype=torch.float32, device="cpu")


def _specials(engine) -> list[str]:
    return sorted({t.content for t in engine.adapter.tokenizer.added_tokens_decoder.values() if t.special})


def _special_ids(engine) -> set[int]:
    return {i for i, t in engine.adapter.tokenizer.added_tokens_decoder.items() if t.special}


class PrefilledIds:
    """Records the token ids each request's forward prefilled (after any erratum rewrite)."""

    def __init__(self, engine, monkeypatch):
        self.ids: torch.Tensor | None = None
        placer_prefill, prompt = engine.placer.prefill, engine.planner.prompt

        def spy_placer(*args, **kwargs):
            placed = placer_prefill(*args, **kwargs)
            self.ids = placed.plan.input_ids.clone()
            return placed

        def spy_prompt(*args, **kwargs):
            ids, spans = prompt(*args, **kwargs)
            self.ids = ids.clone()
            return ids, spans
        monkeypatch.setattr(engine.placer, "prefill", spy_placer)
        monkeypatch.setattr(engine.planner, "prompt", spy_prompt)


def _field_turns(hostile: str) -> tuple[list[dict], list[dict]]:
    """Two turns whose field line changes value; the line (and so the erratum) carries `hostile`."""
    def turn(value: str) -> list[dict]:
        return [{"role": "system", "content": POLICY + f"\nstatus: {value} (see {hostile})\n" + POLICY},
                {"role": "user", "content": "refund ?"}]
    return turn("pending"), turn("shipped")


def _vectors(engine, hostile: str, tag: str):
    """Every place client text enters a prompt: (name, list of generate() calls as kwargs)."""
    skill = engine.add_skill(f"skill-{tag}", f"a policy that says {hostile} in the middle", tenant=tag)
    tool = {"type": "function", "function": {
        "name": "lookup", "description": f"look up {hostile}",
        "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": hostile}}}}}
    yield "user text", [dict(messages=[{"role": "user", "content": f"say {hostile} now"}])]
    yield "user text, full recompute", [dict(messages=[{"role": "user", "content": f"say {hostile}"}], reuse=False)]
    yield "system text", [dict(messages=[{"role": "system", "content": f"rules {hostile}"},
                                         {"role": "user", "content": "hi"}])]
    yield "assistant and tool history", [dict(messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": f"ok {hostile}"},
        {"role": "user", "content": "and ?"}])]
    yield "skill", [dict(messages=[{"role": "user", "content": [{"type": "skill", "skill_id": skill},
                                                                {"type": "text", "text": "ok ?"}]}], tenant=tag)]
    yield "state_update", [dict(messages=[{"role": "user", "content": [
        {"type": "state_update", "field": f"status {hostile}", "value": f"sent {hostile}"},
        {"type": "text", "text": "ok ?"}]}])]
    if "{%- if tools %}" in (engine.adapter.processor.chat_template or "") or "tools" in str(
            engine.adapter.processor.chat_template):
        yield "tool schema", [dict(messages=[{"role": "user", "content": "weather ?"}], tools=[tool])]
    for policy in EDIT_POLICIES:
        first, second = _field_turns(hostile)
        yield f"edit policy {policy}", [dict(messages=first), dict(messages=second, edit_policy=policy)]


def test_no_client_text_forges_a_special_token(engine, monkeypatch):
    """Review finding 1 (forged turns through the erratum edit policy): every special token's string,
    sent through every message field, skill, state_update, tool schema and edit policy, reaches the
    model as plain text. The prefilled ids hold exactly the special tokens the template places for
    the same request with harmless text in place of the strings (so the erratum turn mmkv adds is
    counted on both sides)."""
    hostile = " ".join(s for s in _specials(engine) if not s.startswith(("<|vision", "<|image", "<|video")))
    assert "<|im_start|>" in hostile and "<|im_end|>" in hostile
    harmless = " ".join("x" for _ in hostile.split())
    spy, specials = PrefilledIds(engine, monkeypatch), _special_ids(engine)

    def prefilled(calls, tenant) -> Counter:
        for kwargs in calls:
            engine.generate(**{"max_new_tokens": 1, "tenant": tenant, **kwargs})
        return Counter(i for i in spy.ids.tolist() if i in specials)

    checked = 0
    for (name, bad), (_, good) in zip(_vectors(engine, hostile, "bad"), _vectors(engine, harmless, "good")):
        got = prefilled(bad, f"bad-{name}")
        want = prefilled(good, f"good-{name}")
        assert got == want, f"{name}: special tokens {dict(got)} where the template placed {dict(want)}"
        checked += 1
    assert checked >= 10
    engine.check_integrity()


def test_processor_tokens_in_client_text_are_refused_or_plain(engine, monkeypatch):
    """Review finding 1, the processor-only tokens (vision markers, image pads): in client text they
    are refused with a 400 naming the field, or reach the model as plain text; never as the token."""
    spy, specials = PrefilledIds(engine, monkeypatch), _special_ids(engine)
    for s in _specials(engine):
        if not s.startswith(("<|vision", "<|image", "<|video")):
            continue
        try:
            engine.generate([{"role": "user", "content": f"look {s} here"}], max_new_tokens=1, tenant="proc")
        except InvalidRequestError as exc:
            assert exc.param
            continue
        assert engine.adapter.tokenizer.convert_tokens_to_ids(s) not in spy.ids.tolist()
        assert set(spy.ids.tolist()) & specials <= set(
            engine.adapter.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))


def _text(tag: str) -> list[dict]:
    return [{"role": "system", "content": POLICY + f" case {tag} ."}, {"role": "user", "content": f"question {tag} ?"}]


class InjectedFault(RuntimeError):
    """Stands in for an out-of-memory error at one stage of a request."""


@pytest.mark.parametrize("stage", ["sampler", "fidelity"])
def test_failed_request_leaves_no_prefix_blocks(engine, monkeypatch, stage):
    """Review finding 2 (a failed request leaves its deferred prefix insert for the next one): a
    request that fails after its KV was placed (in the sampler's construction, or in the whole
    forward `fidelity=True` forces) stores nothing; the next request (here `reuse=False`, which
    stores nothing itself) does not store the failed one's never-written slots either, and a later
    exact request about the same prompt answers as the full forward does."""
    tag = f"fail-{stage}"
    before = engine.cache.count("prefix")
    with monkeypatch.context() as m:
        if stage == "sampler":
            m.setattr("mmkv.engine.DecodeStream", lambda **_: (_ for _ in ()).throw(InjectedFault("sampler")))
        else:
            m.setattr("mmkv.engine.Fidelity.between", lambda *_: (_ for _ in ()).throw(InjectedFault("fidelity")))
        with pytest.raises(InjectedFault):
            engine.generate(_text(tag), max_new_tokens=1, tenant=tag, fidelity=stage == "fidelity")
    engine.generate(_text("other"), max_new_tokens=1, tenant=tag, reuse=False)
    assert engine.cache.count("prefix") == before
    again = engine.generate(_text(tag), max_new_tokens=1, tenant=tag)
    exact = engine.generate(_text(tag), max_new_tokens=1, tenant=tag, reuse=False)
    assert again.usage.cached_tokens == 0
    assert (again.first_logits - exact.first_logits).abs().max().item() <= TOL
    engine.check_integrity()


def test_delete_between_admission_and_first_token_is_not_undone(engine):
    """Review finding 4 (a delete between admission and first token is undone): the request's
    prefix blocks hold the deleted image's KV; once the image is deleted while the request is
    placed but before its first token, none of them is stored, and a request about the same image
    uploaded again finds no prefix block from before the delete."""
    tenant = "delete-mid-request"
    png = make_png(48, 40, seed=7)
    image_id = engine.add_image(png, tenant=tenant)
    msgs = [{"role": "user", "content": [{"type": "image_file", "image_file": {"file_id": image_id}},
                                         {"type": "text", "text": "what colour is the square ?"}]}]
    before = engine.cache.count("prefix")
    run = engine.start(msgs, max_new_tokens=2, tenant=tenant)
    engine.remove_image(image_id, tenant=tenant)  # the request is admitted, its first token not out
    with engine._lock:
        run.prefill()
        run.stream.step(run.first_logits)
        run.first_token_out()
    assert engine.cache.count("prefix") == before
    assert engine.add_image(png, tenant=tenant) == image_id
    again = engine.generate(msgs, max_new_tokens=1, tenant=tenant)
    assert again.prefix_tokens_reused == 0
    engine.check_integrity()


def test_a_running_request_holds_its_prompt_kv_once(engine):
    """Review finding 11: once a request's KV joined the decode batch, its run no longer holds the
    prompt-length cache it was prefilled into (the batch row is the one copy it decodes from), and
    it still decodes exactly as alone."""
    from mmkv.request.scheduler import Scheduler

    msgs = _text("once")
    alone = engine.generate(msgs, max_new_tokens=4, tenant="once").token_ids
    scheduler = Scheduler(engine, max_batch=2).start()
    held = []
    try:
        def on_text(_delta):
            held.extend(r.run.cache for r in scheduler._running)
        result = scheduler.submit(msgs, max_new_tokens=4, tenant="once", on_text=on_text).result(60)
    finally:
        scheduler.stop()
    assert held and all(cache is None for cache in held)
    assert result.token_ids == alone
