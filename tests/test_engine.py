"""The engine's promises: an image is encoded once, reused anywhere, `reuse=False` is plain
transformers, and bad input changes nothing."""

from __future__ import annotations

import base64

import pytest
import torch

from mmkv import (
    Engine,
    ImageTooLargeError,
    ImageURLNotAllowedError,
    InvalidImageError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    UnknownImageError,
)

from conftest import make_png, transformers_greedy


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu", seam_tokens=1)


def _ref(image_id):
    return {"type": "image_file", "image_file": {"file_id": image_id}}


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_second_request_reuses_the_image_anywhere(engine):
    image_id = engine.add_image(make_png(112, 84, seed=11))
    assert image_id == engine.add_image(make_png(112, 84, seed=11))  # same pixels, same id
    before = engine.stats()
    first = engine.generate([{"role": "user", "content": [_ref(image_id), {"type": "text", "text": "color ?"}]}],
                            max_new_tokens=3)
    other = [{"role": "system", "content": "you answer in one word ."},
             {"role": "user", "content": "a much longer opening turn that moves the image further along"},
             {"role": "assistant", "content": "ok"},
             {"role": "user", "content": [{"type": "text", "text": "now this"}, _ref(image_id),
                                          {"type": "text", "text": "shape ?"}]}]
    second = engine.generate(other, max_new_tokens=3)
    after = engine.stats()
    n_pad = engine.image_info(image_id).image_tokens
    assert after["vision_tower_runs"] == before["vision_tower_runs"]  # add_image ran it, once
    assert first.vision_tower_runs == second.vision_tower_runs == 0
    assert second.image_tokens_reused == n_pad  # seam 1 recomputes vision_start only
    assert second.usage.cached_tokens == n_pad + 1  # pads + vision_end
    assert second.lm_tokens_computed == second.usage.prompt_tokens - second.usage.cached_tokens
    assert after["image_cache_hits"] - before["image_cache_hits"] == 2
    engine.check_integrity()


def test_result_does_not_depend_on_cache_state(tiny_dirs):
    """A miss precompiles and splices exactly as a hit does; eviction changes speed, not answers."""
    small = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu", cache_bytes=1)
    big = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu")
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(make_png(90, 90))}},
                                         {"type": "text", "text": "what shape is it ?"}]}]
    big.generate(msgs, max_new_tokens=2)
    a = small.generate(msgs, max_new_tokens=6)
    b = big.generate(msgs, max_new_tokens=6)
    assert a.token_ids == b.token_ids
    assert small.stats()["cache_bytes"] == 0 and small.stats()["image_cache_entries"] == 0
    assert a.vision_tower_runs == 1 and b.vision_tower_runs == 0
    small.check_integrity()


def test_lru_eviction_keeps_budget(tiny_dirs):
    probe = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu")
    probe.add_image(make_png(84, 84, seed=1))
    one = probe.stats()["cache_bytes"]
    eng = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu", cache_bytes=2 * one)
    ids = [eng.add_image(make_png(84, 84, seed=s)) for s in (1, 2, 3)]
    st = eng.stats()
    assert st["image_cache_entries"] == 2 and st["evictions"] == 1 and st["cache_bytes"] == 2 * one
    runs = st["vision_tower_runs"]
    eng.generate([{"role": "user", "content": [_ref(ids[0]), {"type": "text", "text": "?"}]}], max_new_tokens=1)
    assert eng.stats()["vision_tower_runs"] == runs + 1  # evicted: recomputed from the kept pixels
    eng.check_integrity()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_reuse_false_equals_plain_transformers(tiny_dirs, family):
    d = tiny_dirs[family]
    eng = Engine.from_pretrained(d, dtype=torch.float32, device="cpu")
    ours, prompt_ids, want = transformers_greedy(d, 12)
    assert torch.equal(eng.prompt_ids(ours), prompt_ids)
    eng.stop_ids = set()  # compare all 12 tokens, as generate does with eos disabled
    got = eng.generate(ours, max_new_tokens=12, reuse=False)
    assert got.token_ids == want
    assert got.usage.cached_tokens == 0 and got.vision_tower_runs == 1


def test_fidelity_is_reported(engine):
    image_id = engine.add_image(make_png(98, 70, seed=5))
    r = engine.generate([{"role": "user", "content": [{"type": "text", "text": "look"}, _ref(image_id),
                                                      {"type": "text", "text": "?"}]}],
                        max_new_tokens=1, fidelity=True)
    assert r.fidelity is not None and 0.9 < r.fidelity.logit_cosine <= 1.0 + 1e-6
    assert r.fidelity.max_abs_diff > 0  # seam 1 on a chunk that missed its prefix is not exact


def test_sampling_is_seeded_and_stop_strings_cut(engine):
    msgs = [{"role": "user", "content": "say something"}]
    a = engine.generate(msgs, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    b = engine.generate(msgs, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids
    greedy = engine.generate(msgs, max_new_tokens=8)
    assert len(greedy.text) >= 2
    stop = greedy.text[1:2]
    cut = engine.generate(msgs, max_new_tokens=8, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == greedy.text[: greedy.text.find(stop)]
    streamed = []
    engine.generate(msgs, max_new_tokens=8, on_text=streamed.append)
    assert "".join(streamed) == greedy.text


def test_cancel_stops_generation(engine):
    r = engine.generate([{"role": "user", "content": "go"}], max_new_tokens=50, should_stop=lambda: True)
    assert r.finish_reason == "cancelled" and len(r.token_ids) <= 1


def test_large_image_is_downscaled_to_max_pixels(engine):
    image_id = engine.add_image(make_png(1600, 1200))
    info = engine.image_info(image_id)
    ip = engine.adapter.processor.image_processor
    assert info.width == 1600 and info.image_tokens * (ip.patch_size * ip.merge_size) ** 2 <= ip.size["longest_edge"]


BAD_INPUTS = [
    (b"definitely not an image", InvalidImageError, "cannot decode"),
    (make_png(1, 1), InvalidImageError, "at least"),
    (make_png(2000, 9), InvalidImageError, "aspect ratio"),
    ("data:image/png;base64,@@@", InvalidImageError, "base64"),
    ("https://example.com/cat.png", ImageURLNotAllowedError, "not fetched"),
    ("file:///etc/passwd", ImageURLNotAllowedError, "not fetched"),
]


@pytest.mark.parametrize("data,exc,match", BAD_INPUTS)
def test_bad_images_raise_and_change_nothing(engine, data, exc, match):
    engine.add_image(make_png(84, 84, seed=30))
    before = engine.stats()
    with pytest.raises(exc, match=match):
        engine.add_image(data)
    url = data if isinstance(data, str) else _data_url(data)
    msgs = [{"role": "user", "content": [_ref(engine.add_image(make_png(84, 84, seed=30))),
                                         {"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(exc):
        engine.generate(msgs, max_new_tokens=2)
    assert engine.stats() == {**before, "image_cache_hits": engine.stats()["image_cache_hits"]}
    engine.check_integrity()


def test_decompression_bomb_guard(tiny_dirs):
    eng = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu",
                                 max_image_pixels=1_000_000)
    with pytest.raises(ImageTooLargeError, match="over the limit"):
        eng.add_image(make_png(1200, 1000))
    assert eng.stats()["registered_images"] == 0 and eng.stats()["vision_tower_runs"] == 0
    eng.check_integrity()


def test_unknown_ids_bad_messages_and_long_prompts(engine):
    before = engine.stats()
    with pytest.raises(UnknownImageError):
        engine.generate([{"role": "user", "content": [_ref("img-" + "0" * 32)]}])
    with pytest.raises(UnknownImageError):
        engine.remove_image("img-nope")
    with pytest.raises(InvalidRequestError, match="type"):
        engine.generate([{"role": "user", "content": [{"type": "audio"}]}])
    with pytest.raises(InvalidRequestError, match="reserved token"):
        engine.generate([{"role": "user", "content": "<|image_pad|>"}])
    with pytest.raises(InvalidRequestError, match="role"):
        engine.generate([{"role": "wizard", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="seam_tokens"):
        engine.generate([{"role": "user", "content": "hi"}], seam_tokens=-1)
    with pytest.raises(InvalidRequestError, match="rope_policy"):
        engine.generate([{"role": "user", "content": "hi"}], rope_policy="sideways")
    with pytest.raises(PromptTooLongError):
        engine.generate([{"role": "user", "content": "hi"}], max_new_tokens=engine.max_context)
    assert engine.stats() == before
    engine.check_integrity()


def test_tenants_are_isolated(engine):
    image_id = engine.add_image(make_png(84, 84, seed=40), tenant="alice")
    with pytest.raises(UnknownImageError):
        engine.generate([{"role": "user", "content": [_ref(image_id)]}], tenant="bob")
    runs = engine.stats()["vision_tower_runs"]
    assert engine.add_image(make_png(84, 84, seed=40), tenant="bob") == image_id
    assert engine.stats()["vision_tower_runs"] == runs + 1  # no cache hit across tenants
    engine.remove_image(image_id, tenant="alice")
    with pytest.raises(UnknownImageError):
        engine.image_info(image_id, tenant="alice")
    assert engine.image_info(image_id, tenant="bob").width == 84


def test_model_dir_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="config.json"):
        Engine.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        Engine.from_pretrained(tmp_path)


def test_no_rotate_policy_is_the_worse_control(engine):
    """rope_policy="none" splices cached keys unrotated: further from full recompute than native."""
    image_id = engine.add_image(make_png(84, 112, seed=50))
    msgs = [{"role": "system", "content": "a long system prompt that pushes the image far along . " * 3},
            {"role": "user", "content": [_ref(image_id), {"type": "text", "text": "what shape is it ?"}]}]
    full = engine.generate(msgs, max_new_tokens=1, reuse=False).first_logits
    native = engine.generate(msgs, max_new_tokens=1, seam_tokens=0).first_logits
    none = engine.generate(msgs, max_new_tokens=1, seam_tokens=0, rope_policy="none").first_logits
    assert (none - native).abs().max() > 1e-3
    assert (none - full).abs().max() > (native - full).abs().max()
