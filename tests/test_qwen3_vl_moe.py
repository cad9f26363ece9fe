"""Qwen3-VL MoE (`qwen3_vl_moe`) on the tiny checkpoint built from transformers' own Qwen3VLMoeConfig:
the adapter it loads with, transformers' own generate as the oracle of the full recompute, the
block-masked oracle for the cached turns, and one round trip through the HTTP server. The splice
and rotation suites (tests/test_splice.py, tests/test_rerotate.py) and the real-shape checks
(tests/test_real_checkpoints.py) cover the family with the others."""

from __future__ import annotations

import pytest
import torch

from mmkv import Engine
from mmkv.adapters import load_adapter
from mmkv.request.oracle import block_masked_logits

from conftest import make_png, transformers_greedy

TOL = 1e-4  # float32 logits


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Engine.from_pretrained(tiny_dirs["qwen3_vl_moe"], dtype=torch.float32, device="cpu")


def test_the_moe_loads_with_its_adapter_and_the_dense_models_rope(engine, tiny_dirs):
    """Its own adapter, every LM layer a sparse expert block (experts that change the answer), and
    the rope layout of the dense Qwen3-VL built with the same rope settings."""
    ad = engine.adapter
    assert type(ad).__name__ == "Qwen3VLMoeAdapter" and ad.family == "qwen3_vl_moe"
    blocks = [layer.mlp for layer in ad.language_model.layers]
    assert all(type(b).__name__ == "Qwen3VLMoeTextSparseMoeBlock" for b in blocks)
    dense = load_adapter(tiny_dirs["qwen3_vl"], dtype=torch.float32, device="cpu")
    assert torch.equal(ad.rope.inv_freq, dense.rope.inv_freq) and torch.equal(ad.rope.axis_of_freq,
                                                                                dense.rope.axis_of_freq)
    ids = engine.prompt_ids([{"role": "user", "content": "what color is the shape ?"}])
    pos = ad.native_positions(ids, [])
    before = ad.forward(ids, pos)
    experts = blocks[0].experts
    saved = experts.down_proj.data.clone()
    experts.down_proj.data.zero_()
    try:
        assert (ad.forward(ids, pos) - before).abs().max().item() > 100 * TOL
    finally:
        experts.down_proj.data.copy_(saved)


def test_reuse_false_equals_transformers_generate(engine, tiny_dirs):
    ours, prompt_ids, want = transformers_greedy(tiny_dirs["qwen3_vl_moe"], 10)
    assert torch.equal(engine.prompt_ids(ours), prompt_ids)
    stop_ids, engine.stop_ids = engine.stop_ids, set()  # all 10 tokens, as generate does with eos disabled
    try:
        got = engine.generate(ours, max_new_tokens=10, reuse=False)
    finally:
        engine.stop_ids = stop_ids
    assert got.token_ids == want


def test_an_image_and_a_skill_asked_twice_reuse_their_kv_and_equal_the_oracle(engine):
    """Add an image and a skill, ask twice: the first ask splices their cached KV, the second also
    takes the prompt's prefix from the cache; both first logits equal the block-masked forward."""
    image = engine.add_image(make_png(96, 64, seed=2))
    skill = engine.add_skill("brief", "be brief . answer with one word .")
    msgs = [{"role": "system", "content": [{"type": "skill", "skill_id": skill}]},
            {"role": "user", "content": [{"type": "image_file", "image_file": {"file_id": image}},
                                         {"type": "text", "text": "what shape is it ?"}]}]
    plan = engine.splice_plan(msgs)
    oracle = block_masked_logits(engine.adapter, plan.input_ids, plan.positions, plan.placements,
                                 engine.settings.seam_tokens, engine.anchor_ids)[0]
    first, second = (engine.generate(msgs, max_new_tokens=3) for _ in range(2))
    assert first.image_tokens_reused > 0 and first.skill_tokens_reused > 0 and first.vision_tower_runs == 0
    assert second.prefix_tokens_reused > first.prefix_tokens_reused and second.usage.cached_tokens > 0
    for ask in (first, second):
        assert (ask.first_logits - oracle).abs().max().item() <= TOL
    assert second.token_ids == first.token_ids


def test_server_round_trip(engine):
    """Upload, ask twice through /v1/chat/completions (the second from the cache), stream once."""
    from fastapi.testclient import TestClient

    from mmkv.server.app import ServerSettings, create_app

    with TestClient(create_app(engine, ServerSettings())) as client:
        upload = client.post("/v1/files", files={"file": ("a.png", make_png(80, 72, seed=6), "image/png")})
        assert upload.status_code == 200
        body = {"model": engine.model_id, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_file", "image_file": {"file_id": upload.json()["id"]}},
            {"type": "text", "text": "how many shapes are there ?"}]}]}
        replies = [client.post("/v1/chat/completions", json=body) for _ in range(2)]
        assert [r.status_code for r in replies] == [200, 200]
        first, second = (r.json() for r in replies)
        assert first["mmkv"]["image_tokens_reused"] > 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        stream = client.post("/v1/chat/completions", json={**body, "stream": True})
        assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
