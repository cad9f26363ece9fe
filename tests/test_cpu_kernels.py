"""The language model's and the vision tower's linear layers on oneDNN with prepacked weights
(mmkv.adapters.cpu_kernels).

Oracle: the same checkpoint loaded with `cpu_linear="dense"` (PyTorch's nn.Linear, MKL), and
transformers' own forward over it: logits and KV within TOL (float32 products summed in another
order), greedy tokens identical. The packed model keeps its weights once and gives them back
bit for bit (state_dict, fingerprint); a layer oneDNN cannot reproduce, a tied head, another dtype
stay dense and the engine says so."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mmkv import Engine, EngineSettings
from mmkv.adapters.cpu_kernels import OneDNNLinear, onednn_available, pack_linears
from mmkv.errors import InvalidRequestError
from mmkv.request.batch import DecodeBatch

from conftest import make_png, serve_kwargs

TOL = 1e-5
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tiny_dirs):
    load = dict(dtype=torch.float32, device="cpu")
    return (Engine.from_pretrained(tiny_dirs[request.param], **load),
            Engine.from_pretrained(tiny_dirs[request.param], cpu_linear="dense", **load))


def _chat(engine, text: str) -> list[dict]:
    image = {"type": "image_file", "image_file": {"file_id": engine.add_image(make_png(84, 56, seed=5))}}
    return [{"role": "user", "content": [image, {"type": "text", "text": text}]}]


def test_every_language_model_and_vision_linear_is_packed(pair):
    packed, dense = pair
    assert packed.cpu_linear == "onednn" and packed.stats()["cpu_linear"] == "onednn"
    assert dense.cpu_linear == "dense" and dense.stats()["cpu_linear"] == "dense"
    for part in (lambda e: e.adapter.language_model, lambda e: e.adapter.model.model.visual):
        linears = [n for n, m in part(dense).named_modules() if isinstance(m, nn.Linear)]
        assert linears and all(isinstance(part(packed).get_submodule(n), OneDNNLinear) for n in linears)
    assert isinstance(packed.adapter.model.lm_head, OneDNNLinear)  # the tiny models' head is untied
    assert not any(isinstance(m, OneDNNLinear) for m in dense.adapter.model.modules())


def test_the_vision_tower_encodes_as_dense(pair):
    """An image's merged embeddings (and Qwen3-VL's deepstack features) from the packed tower
    equal the dense tower's within TOL."""
    from PIL import Image
    import io

    packed, dense = pair
    image = Image.open(io.BytesIO(make_png(84, 56, seed=9))).convert("RGB")
    pixels, grid = dense.adapter.preprocess_image(image)
    got, want = (e.adapter.encode_image(pixels, grid) for e in (packed, dense))
    for g, w in zip((got.embeds, *got.deepstack), (want.embeds, *want.deepstack)):
        assert g.shape == w.shape and (g - w).abs().max().item() < TOL * max(1.0, w.abs().max().item())


def test_weights_kept_once_and_given_back_bit_for_bit(pair):
    packed, dense = pair
    assert packed.fingerprint == dense.fingerprint
    a, b = packed.adapter.model.state_dict(), dense.adapter.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the dense weight of a packed layer is gone: the model holds its linear weights once
    held = {p.data_ptr() for p in packed.adapter.model.parameters()}
    q = packed.adapter.language_model.layers[0].self_attn.q_proj
    assert isinstance(q, OneDNNLinear) and not any(n.endswith("q_proj.weight") for n, _ in
                                                   packed.adapter.model.named_parameters())
    assert q.weight.data_ptr() not in held


def test_transformers_forward_matches_dense(pair):
    packed, dense = pair
    ids = torch.tensor([[5, 17, 42, 8, 99, 3, 61, 12]])
    with torch.no_grad():
        got, want = (e.adapter.model(input_ids=ids, use_cache=True) for e in (packed, dense))
    assert (got.logits - want.logits).abs().max().item() < TOL * max(1.0, want.logits.abs().max().item())
    for lg, lw in zip(got.past_key_values.layers, want.past_key_values.layers):
        assert (lg.keys - lw.keys).abs().max().item() < TOL * max(1.0, lw.keys.abs().max().item())


def test_a_chat_with_an_image_answers_as_dense(pair):
    packed, dense = pair
    kw = dict(max_new_tokens=6, logprobs=True)
    got, want = (e.generate(_chat(e, "what shape is it ?"), **kw) for e in (packed, dense))
    assert got.token_ids == want.token_ids
    assert max(abs(g.logprob - w.logprob) for g, w in zip(got.logprobs, want.logprobs)) < 1e-4


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_batched_decode_step_matches_dense(pair, rows):
    """A few rows are where MKL's kernels are slow and oneDNN's are used instead."""
    steps = []
    for engine in pair:
        batch = DecodeBatch(engine.adapter, max_rows=4)
        for r in range(rows):
            run = engine.start(_chat(engine, f"question {r} : what is it ?"), max_new_tokens=4)
            with engine._lock:
                run.prefill(None)
            batch.add(run.cache)
        steps.append(batch.step([7] * rows, [batch.length + 3] * rows))
    got, want = steps
    assert got.shape == want.shape == (rows, want.shape[1])
    assert (got - want).abs().max().item() < TOL * max(1.0, want.abs().max().item())


def test_bad_setting_is_refused():
    with pytest.raises(InvalidRequestError) as err:
        EngineSettings(cpu_linear="mkl")
    assert err.value.param == "cpu_linear"


def _toy(tied: bool = False, dtype=torch.float32) -> nn.Module:
    model = nn.Module()
    model.embed = nn.Embedding(50, 16)
    model.body = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 16, bias=False))
    model.lm_head = nn.Linear(16, 50, bias=False)
    if tied:
        model.lm_head.weight = model.embed.weight
    return model.to(dtype)


def test_a_tied_head_stays_dense():
    model = _toy(tied=True)
    assert pack_linears(model, ("body.", "lm_head")) == "onednn (2 of 3 layers; the rest dense)"
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.embed.weight
    assert all(isinstance(m, OneDNNLinear) for m in model.body)


def test_other_dtypes_stay_dense():
    model = _toy(dtype=torch.bfloat16)
    assert pack_linears(model, ("body.", "lm_head")).startswith("dense: ")
    assert not any(isinstance(m, OneDNNLinear) for m in model.modules())


def test_a_layer_onednn_gets_wrong_stays_dense(monkeypatch, caplog):
    """The packing checks each layer's product against the dense one before it keeps it."""
    ops = torch.ops.mkldnn
    real = ops._reorder_linear_weight

    class Ops:  # the namespace with a reorder that corrupts the second layer's weight
        def __getattr__(self, name):
            return getattr(ops, name)

        @staticmethod
        def _reorder_linear_weight(weight, batch):
            return real(weight * 1.01 if weight.shape == (16, 24) else weight, batch)

    import mmkv.adapters.cpu_kernels as cpu_kernels

    monkeypatch.setattr(cpu_kernels.torch.ops, "mkldnn", Ops(), raising=True)
    model = _toy()
    x = torch.randn(3, 16)
    want = model.lm_head(model.body(x))
    assert pack_linears(model, ("body.", "lm_head")) == "onednn (2 of 3 layers; the rest dense)"
    assert type(model.body[1]) is nn.Linear and isinstance(model.body[0], OneDNNLinear)
    assert "stays dense" in caplog.text
    monkeypatch.undo()
    assert (model.lm_head(model.body(x)) - want).abs().max().item() < 1e-5


def test_packed_layer_edges():
    model = _toy()
    x = torch.randn(2, 5, 16)
    want = model.lm_head(model.body(x))
    pack_linears(model, ("body.", "lm_head"))
    assert pack_linears(model, ("body.", "lm_head")) == "onednn"  # packing twice changes nothing
    assert (model.lm_head(model.body(x)) - want).abs().max().item() < 1e-5  # 3-D input
    assert model.body(torch.randn(0, 16)).shape == (0, 16)  # no rows
    twin = copy.deepcopy(model)
    assert torch.equal(twin.lm_head(twin.body(x)), model.lm_head(model.body(x)))
    assert pack_linears(_toy(), ("body.",), "dense") == "dense"
    assert pack_linears(model, ("body.", "lm_head"), "dense") == "onednn"  # packed earlier: says so
    with pytest.raises(ValueError):
        pack_linears(_toy(), ("body.",), "mkl")


def test_metrics_and_the_serve_flag_name_the_backend(pair, monkeypatch):
    from mmkv.server.app import ServerSettings, create_app
    from test_server import LiveServer

    packed, dense = pair
    for engine, want in ((packed, "onednn"), (dense, "dense")):
        live = LiveServer(create_app(engine, ServerSettings()))
        try:
            assert live.metrics()[f'mmkv:linear_backend{{backend="{want}"}}'] == 1.0
        finally:
            live.close()
    seen = serve_kwargs(monkeypatch, "--cpu-linear", "dense")
    assert seen["cpu_linear"] == "dense"


# ---- grouped-query attention without copies (gqa_without_copies) ------------------------------

def test_cpu_attention_takes_the_groups_as_they_are_bit_for_bit(pair, monkeypatch):
    """A masked prefill (every mmkv prefill passes a 4D mask) on the CPU goes through SDPA with
    `enable_gqa` instead of transformers' repeat_kv copies: the same logits and KV bit for bit."""
    from transformers.integrations import sdpa_attention

    packed, _ = pair
    ad = packed.adapter
    rule = sdpa_attention.use_gqa_in_sdpa
    assert rule.mmkv_cpu and ad.text_config.num_attention_heads > ad.text_config.num_key_value_heads
    ids = torch.tensor(ad.tokenizer("describe the red square in the picture please")["input_ids"])
    positions = torch.arange(ids.numel()).view(1, -1).expand(3, -1)
    mask = torch.full((ids.numel(), ids.numel()), float("-inf")).triu(1)[None, None]
    calls = []

    def run():
        cache = ad.new_cache()
        logits = ad.forward(ids, positions, cache, attention_mask=mask, all_logits=True)
        return logits, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]

    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: calls.append(n) or x.repeat_interleave(n, dim=1))
    fast = run()
    assert calls == []  # no copy of the keys and values
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", rule.transformers_rule)
    slow = run()
    assert calls  # transformers' own rule repeats them
    assert torch.equal(fast[0], slow[0])
    assert all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(fast[1], slow[1]) for a, b in ((ka, kb), (va, vb)))


def test_other_devices_keep_transformers_rule():
    from transformers.integrations import sdpa_attention

    from mmkv.adapters.cpu_kernels import gqa_without_copies

    assert gqa_without_copies() and gqa_without_copies()  # idempotent
    rule = sdpa_attention.use_gqa_in_sdpa
    assert rule.transformers_rule is not rule and not getattr(rule.transformers_rule, "mmkv_cpu", False)
    key = torch.empty(1, 2, 8, 16, device="meta")
    for mask in (None, torch.empty(1, 1, 4, 8, device="meta")):
        assert rule(mask, key, key) == rule.transformers_rule(mask, key, key)
    assert rule(torch.zeros(1, 1, 4, 8), torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16))
