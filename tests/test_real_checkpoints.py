"""Real-shape checkpoints (mmkv.testing.realshape): Qwen's real tokenizer, the released chat templates and
processor settings, the released per-layer shapes, random weights, loaded from a hub cache by id.

Each conformance test is checked against transformers' own processor (apply_chat_template with
tokenize=True, which renders, loads the images and expands the pads itself) for the same messages.
The splice and rotation tests repeat tests/test_splice.py and tests/test_rerotate.py at head_dim
128 with the released rope settings, per dtype, and on Qwen2.5-VL's documented YaRN setting.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import os

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from typer.testing import CliRunner

from mmkv import Engine
from mmkv.adapters import ImageFeatures, load_adapter
from mmkv.cli import app
from mmkv.errors import ModelLoadError
from mmkv.hub import resolve_model
from mmkv.request.oracle import block_masked_logits
from mmkv.testing.realshape import (EXPERT_WEIGHTS, QWEN2_5_VL_YARN, QWEN3_FAMILIES, RELEASED, SPECIAL_IDS,
                                   save_real_checkpoint)
from mmkv.kv.rerotate import reposition_keys
from mmkv.request.splice import precompile_image, prefill_spliced

from conftest import make_png

FAMILIES = tuple(RELEASED)
YARN_REPO = "mmkv-test/Qwen2.5-VL-7B-Instruct-YaRN"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Spliced vs block-masked oracle, max |diff| of the last-token logits (max |logit| ~3.7 here).
# float32 is exact up to summation order (measured 2.8e-6 to 3.8e-6 on the three families); the
# half types differ by their rounding of the KV (the splice rotates cached keys in float32 and
# rounds once more, the oracle computes them at the target directly): measured 3.2e-2 to 4.1e-2
# in bfloat16 and 4.9e-3 to 5.1e-3 in float16, on CPU. The bounds leave 2x of headroom.
SPLICE_TOL = {torch.float32: 1e-4, torch.bfloat16: 8e-2, torch.float16: 1e-2}


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A hub cache holding the real-shape checkpoints and a YaRN variant, as HF_HUB_CACHE.
    initializer_range 0.05 (released models train from 0.02): random weights that attend by position
    enough for a wrong rotation to show (the no-rotation control below must fail)."""
    root = tmp_path_factory.mktemp("hub")
    for fam in FAMILIES:
        save_real_checkpoint(fam, root, seed=1, initializer_range=0.05)
    save_real_checkpoint("qwen2_5_vl", root, seed=1, initializer_range=0.05, repo_id=YARN_REPO,
                         rope_parameters=QWEN2_5_VL_YARN)
    before = os.environ.get("HF_HUB_CACHE")
    os.environ["HF_HUB_CACHE"] = str(root)
    yield root
    if before is None:
        os.environ.pop("HF_HUB_CACHE")
    else:
        os.environ["HF_HUB_CACHE"] = before


@pytest.fixture(scope="module")
def engines(hub):
    return {fam: Engine.from_pretrained(spec.repo_id, dtype="float32", device="cpu")
            for fam, spec in RELEASED.items()}


def _with_dtype(engine: Engine, dtype: torch.dtype, device: str) -> Engine:
    """The same checkpoint in another dtype / on another device, sharing the processor."""
    if engine.adapter.dtype == dtype and str(engine.adapter.device).startswith(device):
        return engine
    model = copy.deepcopy(engine.adapter.model).to(device=device, dtype=dtype)
    return Engine(type(engine.adapter)(model, engine.adapter.processor), engine.settings, engine.model_id)


@pytest.fixture(scope="module")
def variants(engines):
    cache = {}

    def get(family: str, dtype: torch.dtype, device: str = "cpu") -> Engine:
        key = (family, dtype, device)
        if key not in cache:
            cache[key] = _with_dtype(engines[family], dtype, device)
        return cache[key]

    return get


# ---- messages ------------------------------------------------------------------------------------
def _png(width: int, height: int, seed: int = 0) -> bytes:
    return make_png(width, height, seed=seed)


def _both(png: bytes) -> tuple[dict, dict]:
    """The same image as an OpenAI data-URL part (mmkv) and a PIL part (transformers)."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return ({"type": "image_url", "image_url": {"url": url}},
            {"type": "image", "image": Image.open(io.BytesIO(png)).convert("RGB")})


def _conversation(name: str) -> tuple[list, list]:
    """(mmkv messages, transformers messages) for one conformance case."""
    a, b, c = _both(_png(300, 200, 1)), _both(_png(120, 260, 2)), _both(_png(64, 64, 3))
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    cases = {
        "text": [[{"role": "user", "content": "Hello, what's 2+2? Answer in one word — ça va?"}]] * 2,
        "one_image": [[{"role": "user", "content": [img, text("Describe this image.")]}] for img in (a[0], a[1])],
        "several_images": [[{"role": "user", "content": [text("Compare"), x, text("with"), y, z,
                                                         text("What differs?")]}]
                           for x, y, z in ((a[0], b[0], c[0]), (a[1], b[1], c[1]))],
        "system": [[{"role": "system", "content": "You are terse. Reply in French."},
                    {"role": "user", "content": [img, text("What is it?")]}] for img in (b[0], b[1])],
        "multi_turn": [[{"role": "user", "content": [x, text("What colour is the rectangle?")]},
                        {"role": "assistant", "content": "Red."},
                        {"role": "user", "content": [text("And this one?"), y]}]
                       for x, y in ((a[0], c[0]), (a[1], c[1]))],
    }
    mmkv_msgs, hf_msgs = cases[name]
    # transformers' templates read list content; string content renders the same either way.
    return mmkv_msgs, hf_msgs


def _processor_ids(engine: Engine, hf_messages: list) -> tuple[list[int], torch.Tensor | None]:
    out = engine.adapter.processor.apply_chat_template(
        hf_messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    return out["input_ids"][0].tolist(), out.get("image_grid_thw")


# ---- the tokenizer -------------------------------------------------------------------------------
def test_vendored_tokenizer_is_qwens(engines):
    for fam, engine in engines.items():
        tok = engine.adapter.tokenizer
        assert len(tok) == 151669
        assert {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_IDS} == SPECIAL_IDS
    # Stored expectation: Qwen's ids for a chat header ("user" 872, "\n" 198).
    ids = tok("<|im_start|>user\nhi<|im_end|>")["input_ids"]
    assert ids[:3] == [151644, 872, 198] and ids[-1] == 151645
    text = "naïve café ✓ 你好 <tool_call>"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_hub_layout_and_released_settings(hub, engines):
    for fam, spec in RELEASED.items():
        repo = hub / spec.hub_dir_name
        snapshot = repo / "snapshots" / (repo / "refs" / "main").read_text()
        assert (snapshot / "model.safetensors.index.json").is_symlink()
        shards = sorted(snapshot.glob("model-*-of-*.safetensors"))
        assert len(shards) >= 2 and all(s.resolve().parent == repo / "blobs" for s in shards)
        ad = engines[fam].adapter
        assert engines[fam].model_id == spec.repo_id
        ip = ad.processor.image_processor
        assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (16 if fam in QWEN3_FAMILIES else 14, 2, 2)
        released = spec.preprocessor_config
        size = released.get("size") or {"shortest_edge": released["min_pixels"], "longest_edge": released["max_pixels"]}
        assert dict(ip.size) == size and list(ip.image_mean) == released["image_mean"]
        assert ad.processor.chat_template == spec.chat_template == ad.tokenizer.chat_template
        text = ad.text_config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        assert head_dim == 128 and ad.rope.inv_freq.numel() == 64
        assert bool(ad.config.tie_word_embeddings) == spec.tie_word_embeddings
        assert (ad.model.lm_head.weight.data_ptr() == ad.language_model.embed_tokens.weight.data_ptr()) == \
            spec.tie_word_embeddings
    assert engines["qwen2_5_vl"].adapter.config.vision_config.fullatt_block_indexes == [1, 3]
    assert engines["qwen3_vl"].adapter.config.vision_config.deepstack_visual_indexes == [1, 2, 3]
    moe = engines["qwen3_vl_moe"].adapter
    assert type(moe).__name__ == "Qwen3VLMoeAdapter" and moe.config.vision_config.deepstack_visual_indexes == [1, 2, 3]
    assert (moe.text_config.num_experts, moe.text_config.num_experts_per_tok, moe.text_config.num_key_value_heads,
            moe.text_config.num_attention_heads) == (8, 2, 1, 8)
    assert all(type(layer.mlp).__name__ == "Qwen3VLMoeTextSparseMoeBlock" for layer in moe.language_model.layers)


def _loaded_name(family: str, released: str) -> str:
    """transformers 5's name for a weight as the released checkpoint spells it."""
    if family not in QWEN3_FAMILIES and released.startswith("visual."):
        return "model." + released
    if family not in QWEN3_FAMILIES and released.startswith("model."):
        return "model.language_model." + released.removeprefix("model.")
    return released


@pytest.mark.parametrize("family", FAMILIES)
def test_released_config_and_weight_names_load_every_tensor(engines, family):
    """config.json and the weight names are spelled as released (transformers 4.x for Qwen2/2.5-VL);
    every stored tensor must arrive in the loaded model, none left to random init (the MoE's fused
    expert weights stored [experts, in, out] as released, transposed on load)."""
    snapshot = resolve_model(RELEASED[family].repo_id).path
    config = json.loads((snapshot / "config.json").read_text())
    weight_map = json.loads((snapshot / "model.safetensors.index.json").read_text())["weight_map"]
    loaded = engines[family].adapter.model.state_dict()
    if family in QWEN3_FAMILIES:
        assert "rope_scaling" in config["text_config"] and "model.language_model.embed_tokens.weight" in weight_map
    else:
        assert config["rope_scaling"]["type"] == "mrope" and "model.embed_tokens.weight" in weight_map
        assert "visual.blocks.0.attn.qkv.weight" in weight_map
    assert ("lm_head.weight" in weight_map) != RELEASED[family].tie_word_embeddings
    experts = [n for n in weight_map if n.endswith(EXPERT_WEIGHTS)]
    assert len(experts) == (2 * config["text_config"]["num_hidden_layers"] if family == "qwen3_vl_moe" else 0)
    for name, shard in weight_map.items():
        with safe_open(snapshot / shard, "pt") as f:
            stored = f.get_tensor(name)
        got = loaded[_loaded_name(family, name)].to(torch.bfloat16)
        if name in experts:  # not square, so only the transpose matches
            assert got.shape[1] != got.shape[2]
            got = got.transpose(1, 2)
        assert torch.equal(got, stored), name
    assert len({_loaded_name(family, n) for n in weight_map}) == len(weight_map)


# ---- conformance against transformers' processor ------------------------------------------------------
@pytest.mark.parametrize("case", ["text", "one_image", "several_images", "system", "multi_turn"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_ids_match_the_processor(engines, family, case):
    engine = engines[family]
    mmkv_msgs, hf_msgs = _conversation(case)
    expected, grids = _processor_ids(engine, hf_msgs)
    got = engine.prompt_ids(mmkv_msgs).tolist()
    assert got == expected
    n_pads = sum(int(g.prod()) // 4 for g in grids) if grids is not None else 0
    assert got.count(SPECIAL_IDS["<|image_pad|>"]) == n_pads
    default_system = family not in QWEN3_FAMILIES and case != "system"
    assert (engine.adapter.tokenizer.decode(got[:12]).startswith("<|im_start|>system\nYou are a helpful assistant."))\
        == default_system


# Below min_pixels (upscaled), ordinary, extreme aspect, and above max_pixels (downscaled).
SIZES = {"qwen2_vl": [(20, 20), (640, 480), (1400, 30)],
         "qwen2_5_vl": [(20, 20), (333, 517), (4000, 3300)],
         "qwen3_vl": [(20, 20), (333, 517), (1400, 30), (4200, 4100)], "qwen3_vl_moe": [(20, 20), (333, 517)]}


@pytest.mark.parametrize("family", FAMILIES)
def test_image_token_counts_across_min_and_max_pixels(engines, family):
    engine = engines[family]
    ip = engine.adapter.processor.image_processor
    for w, h in SIZES[family]:
        img = Image.new("RGB", (w, h), (90, 160, 40))
        expected, grids = _processor_ids(engine, [{"role": "user", "content": [{"type": "image", "image": img}]}])
        got = engine.prompt_ids([{"role": "user", "content": [{"type": "image", "image": img}]}]).tolist()
        assert got == expected, (w, h)
        t, gh, gw = (int(x) for x in grids[0])
        pixels = gh * gw * ip.patch_size**2
        assert ip.size["shortest_edge"] <= pixels <= ip.size["longest_edge"], (w, h, pixels)
        print(f"{family} {w}x{h}: grid {gh}x{gw} -> {got.count(SPECIAL_IDS['<|image_pad|>'])} image tokens")


class _Forced(torch.nn.Module):
    """An lm_head that makes the i-th call's argmax `tokens[i]` (the rest of the logits unchanged)."""

    def __init__(self, head: torch.nn.Module, tokens: list[int]):
        super().__init__()
        self.head, self.tokens, self.calls = head, tokens, 0

    def forward(self, hidden):
        logits = self.head(hidden)
        tok = self.tokens[min(self.calls, len(self.tokens) - 1)]
        self.calls += 1
        logits[..., tok] = logits.max() + 100.0
        return logits


@pytest.mark.parametrize("stop", ["<|im_end|>", "<|endoftext|>"])
@pytest.mark.parametrize("family", FAMILIES)
def test_generation_stops_on_qwens_end_tokens(engines, family, stop):
    engine = engines[family]
    model = engine.adapter.model
    words = engine.adapter.tokenizer("Paris is")["input_ids"]
    head = model.lm_head
    model.lm_head = _Forced(head, [*words, SPECIAL_IDS[stop], *words])
    try:
        out = engine.generate([{"role": "user", "content": "Capital of France?"}], max_new_tokens=8)
    finally:
        model.lm_head = head
    assert out.finish_reason == "stop" and out.token_ids == words and out.text == "Paris is"
    assert out.usage.completion_tokens == len(words)


@pytest.mark.parametrize("family", FAMILIES)
def test_usage_prompt_tokens_is_the_processors_count(engines, family):
    engine = engines[family]
    mmkv_msgs, hf_msgs = _conversation("multi_turn")
    expected, _ = _processor_ids(engine, hf_msgs)
    out = engine.generate(mmkv_msgs, max_new_tokens=1)
    assert out.usage.prompt_tokens == len(expected)


# ---- splice exactness and re-rotation on the real shapes ------------------------------------------------
def _splice_messages() -> list:
    a = {"type": "image", "image": _png(300, 200, 1)}
    b = {"type": "image", "image": _png(140, 112, 2)}
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Look at this one"}, a,
                                         {"type": "text", "text": "and this one"}, b,
                                         {"type": "text", "text": "What shape is in both?"}]}]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", FAMILIES)
def test_splice_equals_block_masked_forward_per_dtype(variants, family, dtype, device):
    engine = variants(family, dtype, device)
    plan = engine.splice_plan(_splice_messages())
    worst = 0.0
    for seam in (0, 1):
        spliced = prefill_spliced(engine.adapter, plan.input_ids, plan.positions, plan.placements, seam).logits
        oracle = block_masked_logits(engine.adapter, plan.input_ids, plan.positions, plan.placements, seam,
                                     engine.anchor_ids)
        diff = (spliced - oracle).abs().max().item()
        worst = max(worst, diff)
        assert diff <= SPLICE_TOL[dtype], f"{family} {dtype} seam={seam}: {diff:.2e}"
        # The same first greedy token, unless the oracle's top two are closer than the tolerance.
        top2 = oracle[0].topk(2).values
        if (top2[0] - top2[1]).item() > 2 * SPLICE_TOL[dtype]:
            assert spliced[0].argmax() == oracle[0].argmax()
    print(f"{family} {dtype} {device}: spliced vs oracle max |diff| {worst:.2e} (logit scale "
          f"{oracle.abs().max().item():.1f})")


def test_half_precision_keeps_the_first_greedy_tokens(variants):
    """bfloat16 / float16 reuse vs float32 reuse: the same first greedy tokens (Qwen2.5-VL shape)."""
    msgs = _splice_messages()
    ref = variants("qwen2_5_vl", torch.float32).generate(msgs, max_new_tokens=4)
    for dtype in (torch.bfloat16, torch.float16):
        out = variants("qwen2_5_vl", dtype).generate(msgs, max_new_tokens=4)
        cos = torch.nn.functional.cosine_similarity(out.first_logits, ref.first_logits, dim=0).item()
        print(f"{dtype}: tokens {out.token_ids} vs float32 {ref.token_ids}; first-logit cosine {cos:.5f}")
        assert out.token_ids[:2] == ref.token_ids[:2] and cos > 0.999


def _keys_at(adapter, grid, feats, shift: int):
    """Isolated prefill of one image span after the chat header, every position shifted by `shift`."""
    anchor = torch.tensor(adapter.tokenizer("<|im_start|>user\n")["input_ids"])
    ids = torch.cat((anchor, adapter.image_span_ids(grid)))
    pos = adapter.native_positions(ids, [grid]) + shift
    cache = adapter.new_cache()
    adapter.forward(ids, pos, cache, feats)
    a = anchor.numel()
    return pos[:, a:], [layer.keys[0, :, a:].float() for layer in cache.layers]


def _rotation_error(adapter, delta: int) -> tuple[float, float]:
    """max |rotated - direct| for an image chunk moved by `delta`, and the bound it must meet."""
    pixels, grid = adapter.preprocess_image(Image.open(io.BytesIO(_png(150, 120))).convert("RGB"))
    feats = adapter.encode_image(pixels, grid)
    src_pos, src = _keys_at(adapter, grid, feats, 10)
    dst_pos, dst = _keys_at(adapter, grid, feats, 10 + delta)
    worst = max((reposition_keys(k, src_pos, dst_pos, adapter.rope) - d).abs().max().item() for k, d in zip(src, dst))
    # The model's own angles are float32 position * inv_freq: ~position * 2^-24 rad of rounding.
    scale = max(k.abs().max().item() for k in dst)
    bound = max(1e-5, 4 * dst_pos.max().item() * 2**-24) * max(1.0, scale)
    return worst, bound


@pytest.mark.parametrize("delta", [1, 37, 5000, 120000])
@pytest.mark.parametrize("family", FAMILIES)
def test_reposition_equals_direct_prefill_at_real_shapes(engines, family, delta):
    worst, bound = _rotation_error(engines[family].adapter, delta)
    print(f"{family} delta={delta}: max |diff| {worst:.2e} (bound {bound:.1e})")
    assert worst <= bound


# ---- YaRN ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def yarn_engine(hub):
    return Engine.from_pretrained(YARN_REPO, dtype=torch.float32, device="cpu")


def test_yarn_checkpoint_is_accepted_with_its_frequencies(yarn_engine, engines):
    ad = yarn_engine.adapter
    rotary = ad.language_model.rotary_emb
    assert ad.text_config.rope_parameters["rope_type"] == "yarn"
    assert rotary.attention_scaling > 1.0  # the factor is really there: 0.1 ln(4) + 1
    torch.testing.assert_close(ad.rope.inv_freq, rotary.inv_freq.float().cpu())
    plain = engines["qwen2_5_vl"].adapter.rope.inv_freq
    assert not torch.allclose(ad.rope.inv_freq, plain)  # YaRN's blended frequencies, not the default ones
    assert torch.equal(ad.rope.axis_of_freq, engines["qwen2_5_vl"].adapter.rope.axis_of_freq)


@pytest.mark.parametrize("delta", [3, 700, 100000])
def test_yarn_rotation_equals_direct_prefill(yarn_engine, delta):
    worst, bound = _rotation_error(yarn_engine.adapter, delta)
    print(f"yarn delta={delta}: max |diff| {worst:.2e} (bound {bound:.1e})")
    assert worst <= bound


def test_yarn_splice_equals_block_masked_forward(yarn_engine):
    plan = yarn_engine.splice_plan(_splice_messages())
    for seam in (0, 1):
        spliced = prefill_spliced(yarn_engine.adapter, plan.input_ids, plan.positions, plan.placements, seam).logits
        oracle = block_masked_logits(yarn_engine.adapter, plan.input_ids, plan.positions, plan.placements, seam,
                                     yarn_engine.anchor_ids)
        assert (spliced - oracle).abs().max().item() <= SPLICE_TOL[torch.float32]
    # The no-rotation control must be measurably wrong: the test can fail.
    wrong = prefill_spliced(yarn_engine.adapter, plan.input_ids, plan.positions, plan.placements, 0,
                            rotate=False).logits
    assert (wrong - oracle).abs().max().item() > 100 * SPLICE_TOL[torch.float32]


# ---- hub ids, dtypes and devices ---------------------------------------------------------------------------
def test_hub_id_resolution_and_its_errors(hub, tmp_path, monkeypatch):
    spec = RELEASED["qwen3_vl"]
    resolved = resolve_model(spec.repo_id)
    assert resolved.model_id == spec.repo_id and resolved.path.parent.parent == hub / spec.hub_dir_name
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelLoadError, match=str(tmp_path / "hf" / "hub" / spec.hub_dir_name)):
        resolve_model(spec.repo_id)
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model("./no/such/dir")
    monkeypatch.setenv("HF_HOME", str(hub.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    with pytest.raises(ModelLoadError, match="snapshots/0000"):
        resolve_model(spec.repo_id + "@" + "0" * 40)


def test_serve_names_where_it_looked_for_a_missing_hub_id(hub):
    result = CliRunner().invoke(app, ["serve", "Qwen/Qwen9-VL-1T-Instruct"])
    assert result.exit_code == 2
    assert "models--Qwen--Qwen9-VL-1T-Instruct" in result.output and str(hub) in result.output


@pytest.mark.parametrize("kwargs, match", [({"dtype": "float8"}, "unsupported dtype"),
                                           ({"dtype": "device"}, "unsupported dtype"),
                                           ({"device": "cuda:99"}, "cuda:99"),
                                           ({"device": "tpu"}, "unknown device")])
def test_bad_dtype_or_device_is_a_load_error(hub, kwargs, match):
    with pytest.raises(ModelLoadError, match=match):
        load_adapter(resolve_model(RELEASED["qwen2_vl"].repo_id).path, **kwargs)


def test_from_pretrained_loads_bfloat16_by_name(hub):
    engine = Engine.from_pretrained(RELEASED["qwen2_vl"].repo_id, dtype="bfloat16", device="cpu")
    assert engine.adapter.dtype == torch.bfloat16 and engine.adapter.device.type == "cpu"
    ids = engine.prompt_ids([{"role": "user", "content": "hi"}])
    kv = engine.adapter.new_cache()
    engine.adapter.forward(ids, engine.adapter.native_positions(ids, []), kv)
    assert kv.layers[0].keys.dtype == torch.bfloat16


def test_image_features_keep_the_model_dtype(variants):
    engine = variants("qwen3_vl", torch.bfloat16)
    pixels, grid = engine.adapter.preprocess_image(Image.open(io.BytesIO(_png(64, 64))).convert("RGB"))
    feats: ImageFeatures = engine.adapter.encode_image(pixels, grid)
    chunk = precompile_image(engine.adapter, feats, grid, "k", engine.anchor_ids)
    assert feats.embeds.dtype == torch.bfloat16 and len(feats.deepstack) == 3
    assert all(k.dtype == torch.bfloat16 for k in chunk.keys)


def test_http_usage_and_model_id_on_a_real_shape_checkpoint(engines):
    """Through the OpenAI-compatible server: /v1/models names the hub id, and usage.prompt_tokens
    (streamed and not) is the processor's count for the same messages."""
    from fastapi.testclient import TestClient

    from mmkv.server.app import ServerSettings, create_app

    engine = engines["qwen2_5_vl"]
    mmkv_msgs, hf_msgs = _conversation("multi_turn")
    expected, _ = _processor_ids(engine, hf_msgs)
    with TestClient(create_app(engine, ServerSettings())) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [RELEASED["qwen2_5_vl"].repo_id]
        body = {"model": RELEASED["qwen2_5_vl"].repo_id, "messages": mmkv_msgs, "max_tokens": 2}
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(expected)
        stream = client.post("/v1/chat/completions",
                             json={**body, "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(line[6:]) for line in stream.text.splitlines()
                  if line.startswith("data: {")]
        assert [c["usage"]["prompt_tokens"] for c in chunks if c.get("usage")] == [len(expected)]
