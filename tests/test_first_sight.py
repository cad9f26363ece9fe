"""First sight of an image (mmkv/request/first_sight.py): an image whose KV is in no tier is computed
in its request's context, as exact-prefix caching would (one forward, the vision tower once), and
its reusable chunk is built afterwards off the request path, by a bounded background queue.

Issue finding: a turn that added a new screenshot paid an isolated precompile of it and then the
turn (two LM passes over the image), so it cost more than with exact-prefix caching."""

from __future__ import annotations

import io
import time

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmkv import Engine
from mmkv.request import first_sight
from mmkv.request.registry import RegisteredImage
from mmkv.request.scheduler import Scheduler
from mmkv.request.splice import precompile_image

from conftest import make_png

LOGIT_TOL = 1e-4  # float32 tiny models: the in-context turn against a full forward (observed <= 1e-5)
CHUNK_TOL = 1e-5  # a build run in pieces against the precompile's one forward


def _picture(seed: int, size=(112, 84)) -> Image.Image:
    return Image.open(io.BytesIO(make_png(*size, seed=seed))).convert("RGB")


def _ask(image, text: str = "what color ?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"}, image, {"type": "text", "text": text}]}]


def _later_turn(image) -> list[dict]:
    """The image again, at another position: spliced once its chunk exists."""
    return [{"role": "system", "content": "you answer in one word ."},
            {"role": "user", "content": "a much longer opening turn that moves the image further along"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "now this"}, image, {"type": "text", "text": "?"}]}]


def _engine(tiny_dirs, family: str = "qwen2_5_vl", **settings) -> Engine:
    return Engine.from_pretrained(tiny_dirs[family], dtype=torch.float32, device="cpu", **settings)


def _key(eng: Engine, image: Image.Image, tenant: str = "") -> tuple[str, object]:
    prepared = eng.prepare_image(image)
    return eng.registry.image_key(RegisteredImage.of(prepared, uploaded=False), tenant), prepared


def _old_precompile(eng: Engine, prepared, key: str):
    """What a miss ran before first sight: the vision tower, then the isolated prefill."""
    features = eng.adapter.encode_image(prepared.pixel_values, prepared.grid_thw)
    return precompile_image(eng.adapter, features, prepared.grid_thw, key, eng.anchor_ids)


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_first_sight_turn_is_a_full_forward(tiny_dirs, family):
    """Its logits are transformers' own forward of the prompt (no prefix hit), and the engine's full
    recompute when a prefix-cache hit comes first; the image runs through the tower once and
    nothing counts as reused that did not exist before."""
    eng = _engine(tiny_dirs, family)
    image = _picture(21)
    got = eng.generate(_ask(image), max_new_tokens=1)
    processor = AutoProcessor.from_pretrained(tiny_dirs[family])
    model = AutoModelForImageTextToText.from_pretrained(tiny_dirs[family], dtype=torch.float32)
    template = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"},
                                             {"type": "text", "text": "what color ?"}]}]
    inputs = processor(text=[processor.apply_chat_template(template, tokenize=False, add_generation_prompt=True)],
                       images=[image], return_tensors="pt")
    with torch.no_grad():
        want = model(**inputs).logits[0, -1].float()
    assert torch.equal(eng.prompt_ids(_ask(image)), inputs["input_ids"][0])
    assert (got.first_logits - want).abs().max().item() <= LOGIT_TOL
    assert got.images_in_context == 1 and got.vision_tower_runs == 1
    assert got.usage.cached_tokens == got.image_tokens_reused == 0
    assert got.lm_tokens_computed == got.usage.prompt_tokens  # one forward over the prompt, no precompile

    # a later turn of the conversation with a second new image: the first turn's blocks, then the rest
    follow = _ask(image) + [{"role": "assistant", "content": "red"},
                            {"role": "user", "content": [_picture(22), {"type": "text", "text": "and this ?"}]}]
    eng.run_background()
    turn = eng.generate(follow, max_new_tokens=1)
    full = eng.generate(follow, max_new_tokens=1, reuse=False)
    assert (turn.first_logits - full.first_logits).abs().max().item() <= LOGIT_TOL
    assert turn.images_in_context == 1 and turn.vision_tower_runs == 1
    assert turn.prefix_tokens_reused > 0 and turn.usage.cached_tokens == turn.prefix_tokens_reused
    n_pad = eng.image_info(eng.add_image(image)).image_tokens
    assert turn.image_tokens_reused == n_pad  # the first image, inside the prefix hit: its KV existed
    eng.check_integrity()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_background_build_is_the_old_precompile(tiny_dirs, family):
    """Run whole, the build is bit for bit the precompile a miss ran before (the same features, the
    same isolated forward); the vision tower ran once, in the request."""
    eng = _engine(tiny_dirs, family)
    image = _picture(23)
    key, prepared = _key(eng, image)
    eng.generate(_ask(image), max_new_tokens=1)
    assert key not in eng.cache and eng.stats()["background_pending"] == 1
    runs = eng.stats()["vision_tower_runs"]
    done = eng.run_background()
    assert (done.built, done.pending) == (1, 0)
    assert done.tokens == eng.anchor_ids.numel() + eng.cache.get(key, "image").num_tokens
    assert eng.stats()["vision_tower_runs"] == runs  # the request's features, not a second tower run
    built, old = eng.cache.get(key, "image"), _old_precompile(eng, prepared, key)
    assert all(torch.equal(a, b) for a, b in zip((*built.keys, *built.values), (*old.keys, *old.values)))
    assert torch.equal(built.position_ids, old.position_ids) and torch.equal(built.token_ids, old.token_ids)
    assert torch.equal(built.features.embeds, old.features.embeds)
    assert eng.stats()["background_bytes"] == 0


def test_a_build_in_pieces_matches_within_rounding(tiny_dirs):
    eng = _engine(tiny_dirs)
    image = _picture(24)
    key, prepared = _key(eng, image)
    eng.generate(_ask(image), max_new_tokens=1)
    pieces = 0
    while eng.run_background(budget=8).pending:
        pieces += 1
        assert key not in eng.cache  # stored only once whole
    assert pieces >= 3
    assert _max_diff(eng.cache.get(key, "image"), _old_precompile(eng, prepared, key)) <= CHUNK_TOL
    with pytest.raises(ValueError):
        eng.run_background(budget=0)


def test_a_later_turn_splices_the_built_chunk_and_reuses_pending_features(tiny_dirs):
    eng = _engine(tiny_dirs)
    image = _picture(25)
    first = eng.generate(_ask(image), max_new_tokens=1)
    assert first.vision_tower_runs == 1
    pending = eng.generate(_later_turn(image), max_new_tokens=1)  # before the build: in context again
    assert pending.images_in_context == 1 and pending.vision_tower_runs == 0  # the pending build's features
    assert pending.image_tokens_reused == 0
    assert eng.stats()["background_pending"] == 1  # offered once
    eng.run_background()
    later = [{"role": "user", "content": "another opening , longer than before , to move it again"},
             {"role": "assistant", "content": "ok"}, *_ask(image, "shape ?")]
    spliced = eng.generate(later, max_new_tokens=1)
    n_pad = eng.image_info(eng.add_image(image)).image_tokens
    assert spliced.images_in_context == 0 and spliced.vision_tower_runs == 0
    assert spliced.image_tokens_reused == n_pad  # seam 1: vision_start computed, the pads spliced
    eng.check_integrity()


def test_the_same_new_image_twice_in_one_request_is_encoded_once(tiny_dirs):
    eng = _engine(tiny_dirs)
    image = _picture(26)
    msgs = [{"role": "user", "content": [image, {"type": "text", "text": "and again"}, image,
                                         {"type": "text", "text": "same ?"}]}]
    got = eng.generate(msgs, max_new_tokens=1)
    full = eng.generate(msgs, max_new_tokens=1, reuse=False)
    assert got.vision_tower_runs == 1 and got.images_in_context == 1 and got.image_tokens_reused == 0
    assert (got.first_logits - full.first_logits).abs().max().item() <= LOGIT_TOL
    assert eng.run_background().built == 1


def test_the_scheduler_builds_in_idle_turns(tiny_dirs):
    """The server's path: the build runs in the scheduler's idle turns, a prefill chunk at a time,
    and the next request splices it."""
    eng = _engine(tiny_dirs)
    image = _picture(27)
    key, prepared = _key(eng, image)
    scheduler = Scheduler(eng, max_batch=2, prefill_chunk=16).start()
    try:
        first = scheduler.submit(_ask(image), max_new_tokens=2).result(timeout=60)
        deadline = time.monotonic() + 30
        while eng.stats()["background_built"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        second = scheduler.submit(_later_turn(image), max_new_tokens=2).result(timeout=60)
    finally:
        scheduler.stop()
    assert first.images_in_context == 1 and first.vision_tower_runs == 1
    assert eng.stats()["background_built"] == 1 and eng.stats()["background_pending"] == 0
    assert second.images_in_context == 0 and second.vision_tower_runs == 0 and second.image_tokens_reused > 0
    assert _max_diff(eng.cache.get(key, "image"), _old_precompile(eng, prepared, key)) <= CHUNK_TOL


def _evicted_upload(eng: Engine, seed: int) -> tuple[str, str]:
    """An upload whose KV is in no tier any more (dropped from RAM, no lower tiers)."""
    image_id = eng.add_image(make_png(112, 84, seed=seed))
    key = eng.registry.image_key(eng.registry.lookup_image(image_id, ""), "")
    assert eng.cache.discard(key)
    return image_id, key


def _derived(eng: Engine, key: str) -> list[str]:
    return [k for k, e in eng.cache._entries.items() if k == key or key in getattr(e, "sources", ())]


def test_a_delete_while_the_build_is_pending_leaves_nothing(tiny_dirs):
    eng = _engine(tiny_dirs)
    image_id, key = _evicted_upload(eng, seed=28)
    ref = {"type": "image_file", "image_file": {"file_id": image_id}}
    got = eng.generate(_ask(ref), max_new_tokens=1)
    assert got.images_in_context == 1 and got.vision_tower_runs == 1  # from its source: the KV was gone
    assert eng.stats()["background_pending"] == 1 and _derived(eng, key)  # its turn's blocks name it
    eng.remove_image(image_id)
    st = eng.stats()
    assert (st["background_pending"], st["background_bytes"], st["background_cancelled"]) == (0, 0, 1)
    assert eng.run_background().built == 0
    assert _derived(eng, key) == []
    eng.check_integrity()

    # deleted between placement and the first token: the build is never queued
    image_id, key = _evicted_upload(eng, seed=29)
    run = eng.start(_ask({"type": "image_file", "image_file": {"file_id": image_id}}), max_new_tokens=1)
    with eng._lock:
        run.prefill()
        run.stream.step(run.first_logits)
    eng.remove_image(image_id)
    run.first_token_out()
    assert eng.stats()["background_pending"] == 0 and eng.run_background().built == 0
    assert _derived(eng, key) == []
    eng.check_integrity()


def test_pending_builds_stay_within_their_byte_budget(tiny_dirs):
    probe = _engine(tiny_dirs)
    a, b = _picture(30), _picture(31)
    probe.generate(_ask(a), max_new_tokens=1)
    one = probe.first_sight.builds.nbytes  # one pending build's charge: its features and its KV
    assert one > probe.first_sight.builds._jobs[0].image.features.nbytes
    eng = _engine(tiny_dirs, background_bytes=one + one // 2)
    msgs = [{"role": "user", "content": [a, {"type": "text", "text": "and"}, b, {"type": "text", "text": "?"}]}]
    got = eng.generate(msgs, max_new_tokens=1)
    st = eng.stats()
    assert got.images_in_context == 2 and got.vision_tower_runs == 2
    assert (st["background_offered"], st["background_pending"], st["background_dropped"]) == (2, 1, 1)
    assert st["background_bytes"] == one <= st["background_budget_bytes"]
    again = eng.generate(_later_turn(b), max_new_tokens=1)  # the dropped one: its features were not kept
    assert again.vision_tower_runs == 1
    tight = _engine(tiny_dirs, background_bytes=one - 1)
    tight.generate(_ask(a), max_new_tokens=1)
    assert (tight.stats()["background_pending"], tight.stats()["background_dropped"]) == (0, 1)


def test_a_failed_build_is_dropped_and_stores_nothing(tiny_dirs, monkeypatch):
    eng = _engine(tiny_dirs)
    image = _picture(32)
    key, _ = _key(eng, image)
    eng.generate(_ask(image), max_new_tokens=1)

    def broken(*args, **kwargs):
        raise RuntimeError("injected")
    monkeypatch.setattr(first_sight, "isolated_chunk", broken)
    assert eng.run_background().built == 0
    assert eng.stats()["background_failed"] == 1 and eng.stats()["background_pending"] == 0
    assert key not in eng.cache
    monkeypatch.undo()
    assert eng.generate(_ask(image), max_new_tokens=1).images_in_context == 1  # seen for the first time again


def test_first_sight_off_precompiles_as_an_upload_does(tiny_dirs):
    eng = _engine(tiny_dirs, first_sight_in_context=False)
    image = _picture(33)
    key, _ = _key(eng, image)
    got = eng.generate(_ask(image), max_new_tokens=1)
    assert got.images_in_context == 0 and got.vision_tower_runs == 1 and key in eng.cache
    assert got.lm_tokens_computed > got.usage.prompt_tokens  # the precompile's isolated prefill too
    assert eng.stats()["background_offered"] == 0


def test_an_arrival_preempts_an_idle_build_which_resumes_unchanged(tiny_dirs, monkeypatch):
    """A request that arrived while an idle turn's build ran waited for the build's whole chunk
    forward: now it stops the forward at its next layer. The build stays pending (not failed),
    keeps nothing of the cut-short piece, and once resumed stores bit for bit the precompile."""
    eng = _engine(tiny_dirs)
    image = _picture(31)
    key, prepared = _key(eng, image)
    eng.generate(_ask(image), max_new_tokens=1)
    sched = Scheduler(eng, max_batch=2)  # not started: its idle turn is driven here
    forward = eng.adapter.forward

    def arrive_during_the_build(*args, **kwargs):
        if not sched.waiting:
            sched.submit(_ask(_picture(32)), max_new_tokens=1)
        return forward(*args, **kwargs)
    monkeypatch.setattr(eng.adapter, "forward", arrive_during_the_build)
    sched._build_in_background()
    monkeypatch.undo()
    stats = eng.stats()
    assert sched.preemptions == 1 and stats["background_pending"] == 1 and stats["background_failed"] == 0
    assert key not in eng.cache
    done = eng.run_background()
    assert (done.built, done.pending) == (1, 0)
    built, old = eng.cache.get(key, "image"), _old_precompile(eng, prepared, key)
    assert all(torch.equal(a, b) for a, b in zip((*built.keys, *built.values), (*old.keys, *old.values)))
