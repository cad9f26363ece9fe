"""The fidelity dial (`blend`, mmkv/request/blend.py): r = 1 equals a full recompute, r = 0 is the
plain splice, the probe's choice equals the ranking a full recompute gives, accounting counts only
KV really reused, blended KV never reaches a request of another setting, bad values are 400s."""

from __future__ import annotations

import httpx
import time

import pytest
import torch

from mmkv import Engine
from mmkv.errors import InvalidRequestError
from mmkv.request.blend import CHUNK_KINDS, SELECTORS, count_for, parse_blend, strided
from mmkv.request.splice import prefill_full, prefill_spliced, splice_layout
from mmkv.server.app import ServerSettings, create_app
from mmkv.testing.tiny import FAMILIES

from conftest import forget_slot_records, make_png
from test_server import LiveServer

TOL = 1e-4  # float32 logits


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, tiny_dirs):
    return Engine.from_pretrained(tiny_dirs[request.param], dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def qwen25(tiny_dirs):
    return Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu")


def _chat(engine, seed: int = 1) -> list[dict]:
    """A skill as the system body, then text, an image and a question: both chunk kinds spliced."""
    skill = engine.add_skill("rules", "answer with one word . look at the shapes and their colours carefully .")
    img = {"type": "image_file", "image_file": {"file_id": engine.add_image(make_png(84, 70, seed=seed))}}
    return [{"role": "system", "content": [{"type": "skill", "skill_id": skill}]},
            {"role": "user", "content": [{"type": "text", "text": "look at this"}, img,
                                         {"type": "text", "text": "what shape is the red one ?"}]}]


def _first(engine, messages, **kw) -> torch.Tensor:
    return engine.generate(messages, max_new_tokens=1, **kw).first_logits


@pytest.mark.parametrize("select", SELECTORS)
def test_blend_one_equals_a_full_recompute_with_a_video(engine, select):
    """The dial on a video's temporal groups: r = 1 recomputes every group token in context (the
    logits of a full recompute); a ratio per kind reaches the groups as kind "video"."""
    from mmkv.testing.clips import encode_clip

    f = engine.registry.videos.budget.factor
    vid = engine.add_video(encode_clip(16, 4, 64, 48, seed=5), max_pixels=4 * f * f)
    messages = [{"role": "user", "content": [{"type": "text", "text": "watch this"},
                                             {"type": "video_file", "video_file": {"file_id": vid}},
                                             {"type": "text", "text": "which way did it move ?"}]}]
    full = _first(engine, messages, reuse=False)
    splice = _first(engine, messages)
    first = engine.generate(messages, max_new_tokens=1, blend={"video": 1.0}, blend_select=select)
    assert (splice - full).abs().max().item() > 10 * TOL
    assert (first.first_logits - full).abs().max().item() <= TOL
    assert first.video_tokens_reused == 0 and {c.kind for c in first.blend.chunks} == {"video"}
    assert all(c.recomputed == c.tokens for c in first.blend.chunks)
    half = engine.generate(messages, max_new_tokens=1, blend={"video": 0.5}, blend_select=select)
    assert 0 < sum(c.recomputed for c in half.blend.chunks) < sum(c.tokens for c in half.blend.chunks)
    assert half.prefix_tokens_reused == 0  # its own setting's blocks: none yet
    assert half.usage.cached_tokens == sum(c.tokens - c.recomputed for c in half.blend.chunks)


@pytest.mark.parametrize("select", SELECTORS)
def test_blend_one_equals_a_full_recompute(engine, select):
    """r = 1 recomputes every spliced token in context: the logits of a full recompute (deepstack
    features included on Qwen3-VL), also when a prefix-cache hit of an earlier r = 1 turn is reused."""
    messages = _chat(engine)
    full = _first(engine, messages, reuse=False)
    splice = _first(engine, messages)
    first = engine.generate(messages, max_new_tokens=1, blend=1.0, blend_select=select)
    again = engine.generate(messages, max_new_tokens=1, blend=1.0, blend_select=select)
    gap = (splice - full).abs().max().item()
    print(f"{engine.adapter.family}: splice vs full {gap:.2e}, r=1 {(first.first_logits - full).abs().max():.2e}")
    assert gap > 10 * TOL, "the splice must differ from a full recompute for this test to mean anything"
    assert (first.first_logits - full).abs().max().item() <= TOL
    assert (again.first_logits - full).abs().max().item() <= TOL
    assert first.usage.cached_tokens == 0 and first.image_tokens_reused == 0 and first.skill_tokens_reused == 0
    assert again.usage.cached_tokens == again.prefix_tokens_reused > 0  # only the exact prefix of the r = 1 turn
    assert {c.kind for c in first.blend.chunks} == {"image", "skill"}
    assert all(c.recomputed == c.tokens for c in first.blend.chunks) and first.blend.probe_tokens == 0


def test_blend_zero_is_the_plain_splice(qwen25):
    """r = 0 (explicit, or per kind) is today's splice: the same logits bit for bit, the same
    prefix-cache blocks (no blend salt), no blend report."""
    messages = _chat(qwen25, seed=2)
    plain = qwen25.generate(messages, max_new_tokens=1)
    forget_slot_records(qwen25)  # each loads the blocks the first stored, not its whole prompt from its buffer
    zero = qwen25.generate(messages, max_new_tokens=1, blend=0.0)
    forget_slot_records(qwen25)
    kinds = qwen25.generate(messages, max_new_tokens=1, blend={"image": 0, "skill": 0.0}, blend_select="stride")
    for r in (zero, kinds):
        assert torch.equal(r.first_logits, plain.first_logits)
        assert r.blend is None
        assert r.prefix_tokens_reused > plain.prefix_tokens_reused  # the plain splice's blocks: the same salt


@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.6])
def test_deviation_probe_picks_the_tokens_a_full_recompute_moves_most(qwen25, ratio):
    """The probe's choice is an oracle's: run the full recompute, read each chunk token's K/V at
    the probe layer, compare with the splice's placed K/V there and take the top ceil(r x n) per
    chunk. The blended prefill computes exactly those, counts them computed, and its logits move
    toward the full recompute's."""
    engine, layer = qwen25, qwen25.settings.blend_layer
    plan = engine.splice_plan(_chat(engine, seed=3))
    ad = engine.adapter
    from mmkv.request.blend import Blend, BlendChooser

    blend = parse_blend(ratio, "deviation")
    chooser = BlendChooser(ad, plan.input_ids, plan.positions, plan.placements, blend, layer)
    blended = prefill_spliced(ad, plan.input_ids, plan.positions, plan.placements, 1, blend=chooser)
    plain = prefill_spliced(ad, plan.input_ids, plan.positions, plan.placements, 1)
    full = prefill_full(ad, plan.input_ids, plan.native_positions, plan.chunk_features())
    expected = []
    for p, first, stop in splice_layout(plan.placements, plan.input_ids.numel(), 0, 1).reused:
        a, b = p.start + first, p.start + stop
        dk = full.cache.layers[layer].keys[0, :, a:b] - plain.cache.layers[layer].keys[0, :, a:b]
        dv = full.cache.layers[layer].values[0, :, a:b] - plain.cache.layers[layer].values[0, :, a:b]
        score = dk.pow(2).sum(dim=(0, 2)) + dv.pow(2).sum(dim=(0, 2))
        k = count_for(ratio, b - a)
        expected += sorted(a + int(i) for i in torch.topk(score, k).indices)
    assert chooser.chosen == sorted(expected)
    assert blended.computed_tokens == plain.computed_tokens + len(expected)
    assert blended.reused_tokens == plain.reused_tokens - len(expected)
    assert not any(a <= i < b for i in expected for a, b in blended.reused_ranges)
    gap = lambda r: (r.logits - full.logits).abs().max().item()  # noqa: E731
    assert gap(blended) < gap(plain)
    assert chooser.report.probe_layers == layer + 1 and chooser.report.probe_tokens > 0
    assert Blend().active is False


def test_stride_and_counts():
    """ceil(r x n) tokens, evenly spread, none twice; r = 0 none, r = 1 all."""
    assert [count_for(r, 100) for r in (0, 0.001, 0.05, 0.2, 0.999, 1)] == [0, 1, 5, 20, 100, 100]
    for n, k in ((100, 5), (7, 3), (10, 10), (3, 1)):
        picked = strided(4, 4 + n, k)
        assert len(set(picked)) == k and all(4 <= i < 4 + n for i in picked)
        gaps = [b - a for a, b in zip(picked, picked[1:])]
        assert not gaps or max(gaps) - min(gaps) <= 1


def test_accounting_counts_only_what_was_reused(qwen25):
    """cached_tokens, image_tokens_reused and skill_tokens_reused drop by exactly the tokens the
    dial recomputed; lm_tokens_computed grows by them; the report names each chunk's count."""
    messages = _chat(qwen25, seed=4)
    qwen25.generate(messages, max_new_tokens=1)  # chunks precompiled: they are reused below
    plain = qwen25.generate(messages, max_new_tokens=1, blend={"image": 0.5, "skill": 0.25},
                            blend_select="stride")  # no prefix hit yet under this setting
    base = qwen25.splice_plan(messages)
    chunks = {c.kind: c for c in plain.blend.chunks}
    assert chunks["image"].recomputed == count_for(0.5, chunks["image"].tokens) > 0
    assert chunks["skill"].recomputed == count_for(0.25, chunks["skill"].tokens) > 0
    assert plain.blend.recomputed_tokens == chunks["image"].recomputed + chunks["skill"].recomputed
    assert plain.usage.cached_tokens + plain.lm_tokens_computed == base.input_ids.numel()
    assert plain.usage.cached_tokens == sum(c.tokens - c.recomputed for c in chunks.values())
    # the image chunk is vision_start, pads, vision_end; seam 1: tokens 1.. are the splice's, the last is vision_end
    n_pads = base.input_ids.eq(qwen25.adapter.image_token_id).sum().item()
    picked = strided(1, 1 + chunks["image"].tokens, chunks["image"].recomputed)
    assert plain.image_tokens_reused == n_pads - sum(i <= n_pads for i in picked)
    assert plain.skill_tokens_reused == chunks["skill"].tokens - chunks["skill"].recomputed


def test_blended_prefix_blocks_hold_the_recomputed_kv(qwen25):
    """A blended turn's prefix blocks hold the KV it computed, not the chunk's isolated KV (blocks
    inside a chunk reference it only where the dial reused it): the same prompt again, its prefix
    now a cache hit, gives the same logits; and a plain splice never reads blended blocks."""
    messages = _chat(qwen25, seed=5)
    plain = _first(qwen25, messages)
    first = qwen25.generate(messages, max_new_tokens=1, blend=0.5, blend_select="stride")
    again = qwen25.generate(messages, max_new_tokens=1, blend=0.5, blend_select="stride")
    assert again.prefix_tokens_reused > first.prefix_tokens_reused
    assert (again.first_logits - first.first_logits).abs().max().item() <= TOL
    forget_slot_records(qwen25)  # the plain prompt's blocks from the store, not its buffer: bit for bit
    assert torch.equal(_first(qwen25, messages), plain)


@pytest.mark.parametrize("kw, param", [
    ({"blend": -0.1}, "blend"), ({"blend": 1.5}, "blend"), ({"blend": "0.2"}, "blend"), ({"blend": True}, "blend"),
    ({"blend": float("nan")}, "blend"), ({"blend": {"audio": 0.1}}, "blend"), ({"blend": {"image": 2}}, "blend.image"),
    ({"blend_select": "best"}, "blend_select"), ({"blend": 0.2, "reuse": False}, "blend"),
])
def test_bad_values_name_their_parameter(qwen25, kw, param):
    with pytest.raises(InvalidRequestError) as err:
        qwen25.generate([{"role": "user", "content": "hi"}], max_new_tokens=1, **kw)
    assert err.value.param == param


def test_kind_ratios_override_the_default():
    default = parse_blend({"image": 0.2}, "stride")
    assert dict(parse_blend({"skill": 0.05}, None, default).ratios) == {"image": 0.2, "skill": 0.05, "video": 0.0, "turn": 0.0}
    assert parse_blend(None, None, default) == default
    assert dict(parse_blend(0.4, None, default).ratios) == dict.fromkeys(CHUNK_KINDS, 0.4)


@pytest.fixture(scope="module")
def live(tiny_dirs):
    engine = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu",
                                    blend={"skill": 0.5})
    return LiveServer(create_app(engine, ServerSettings(served_model_names=("tiny",)))), engine


def _post(live, mmkv: dict, content="what shape ?") -> httpx.Response:
    import base64

    url = "data:image/png;base64," + base64.b64encode(make_png(70, 56, seed=7)).decode()
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "mmkv": mmkv,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": content}]}]}
    return httpx.post(f"{live.base_url}/v1/chat/completions", json=body, timeout=60)


def test_server_reports_the_dial_and_refuses_bad_values(live):
    server, engine = live
    _post(server, {})  # first sight: the inline image computed in context, its chunk built in idle time
    deadline = time.monotonic() + 30
    while engine.stats().get("background_pending", 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    r = _post(server, {"blend": {"image": 0.4}, "blend_select": "stride"})
    assert r.status_code == 200, r.text
    report = r.json()["mmkv"]["blend"]
    assert report["ratios"] == {"image": 0.4, "skill": 0.5, "video": 0.0, "turn": 0.0} and report["select"] == "stride"
    image = [c for c in report["chunks"] if c["kind"] == "image"][0]
    assert image["recomputed"] == count_for(0.4, image["tokens"]) > 0
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the image's chunk, built before
    for mmkv, param in (({"blend": 2}, "mmkv.blend"), ({"blend": {"audio": 0.1}}, "mmkv.blend.audio"),
                        ({"blend": "x"}, "mmkv.blend"), ({"blend_select": "best"}, "mmkv.blend_select"),
                        ({"blend": 0.1, "reuse": False}, "blend")):
        bad = _post(server, mmkv)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (mmkv, bad.text)


def test_eval_dial_arms_and_certification():
    """`mmkv eval --blend`: one arm per setting (r = 0 and 1 once, whatever the selector), each
    passing its ratio and selector to the engine; the certification reads the exact one-sided
    bound: the smallest r that reaches the target, none when no arm does."""
    from mmkv.vqa_eval.blend_report import certified, dial_of
    from mmkv.vqa_eval.run import blend_arms, choose_arms

    arms = blend_arms([0, 0.1, 1], ["deviation", "stride"])
    assert [a.name for a in arms] == ["blend-0", "blend-0.1", "blend-1", "blend-0.1-stride"]
    assert arms[3].options() == {"reuse": True, "seam_tokens": 1, "rope_policy": "native", "blend": 0.1,
                                 "blend_select": "stride"}
    assert [a.name for a in choose_arms(None, arms)] == ["full", *[a.name for a in arms]]
    assert dial_of("blend-0.1-stride") == (0.1, "stride") and dial_of("splice-k1") is None
    with pytest.raises(ValueError):
        blend_arms([1.5], ["deviation"])
    summary = {name: {"verdict": {"exact_lower": low}} for name, low in (
        ("blend-0", 0.95), ("blend-0.1", 0.991), ("blend-1", 0.995), ("blend-0.1-stride", 0.98))}
    assert certified(summary, 0.99) == {"deviation": 0.1, "stride": None}


def test_an_edit_policy_that_places_the_prompt_says_the_dial_did_not_apply(qwen25):
    """in_place places the prompt from the earlier turn's KV: the dial never ran, and says why."""
    from test_edits import SHAPES, _with_field

    line, _, old, new = SHAPES["colon"]
    qwen25.generate(_with_field(line, old), max_new_tokens=1, tenant="dial-edit", blend=0.5)
    r = qwen25.generate(_with_field(line, new), max_new_tokens=1, tenant="dial-edit", edit_policy="in_place",
                        blend=0.5)
    assert r.edit.applied == "in_place"
    assert r.blend.applied is False and "in_place" in r.blend.reason and r.blend.recomputed_tokens == 0
