"""samples/grow.py: inserted identity layers leave a checkpoint's logits exactly as they were, and train."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import make_png, sample_module

ROOT = Path(__file__).resolve().parents[1]


def _grow():
    return sample_module("grow")


def _inputs(d: Path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(d, local_files_only=True)
    image = Image.open(io.BytesIO(make_png(90, 70, seed=4))).convert("RGB")
    msgs = [{"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color is it ?"}]}]
    text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return processor(text=[text], images=[image], return_tensors="pt")


def _model(d: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(d, local_files_only=True, dtype=torch.float32).eval()


@pytest.mark.parametrize("family, after", [("qwen2_5_vl", [0, 2]), ("qwen3_vl", [1, 2, 2]), ("qwen2_vl", [1])])
def test_grown_model_computes_exactly_what_the_source_did(tiny_dirs, tmp_path, family, after):
    G = _grow()
    src = Path(shutil.copytree(tiny_dirs[family], tmp_path / "src"))  # (the fixture is shared: left as it is)
    (src / "train_state.json").write_text(json.dumps({"family": family, "command": "python samples/train.py x",
                                                      "steps": 7, "elapsed_s": 3.0, "history": [],
                                                      "earlier_runs": [{"command": "a", "steps": 5, "elapsed_s": 2.0}]}))
    rec = G.grow(src, tmp_path / "g", after, seed=1)
    n = len(after) + 3  # the fixture's models have 3 LM layers
    assert rec["layers"] == [3, n]
    grown = _model(tmp_path / "g")
    assert grown.config.text_config.num_hidden_layers == n
    assert len(getattr(grown.config.text_config, "layer_types", None) or [None] * n) == n
    enc = _inputs(src)
    with torch.no_grad():
        want = _model(src)(**enc).logits
        got = grown(**enc).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    new = rec["new_layers"]
    assert len(new) == len(after)
    layers = grown.model.language_model.layers
    for j in new:  # zero output projections, live (random) inputs: a gradient reaches them
        assert not layers[j].self_attn.o_proj.weight.any() and not layers[j].mlp.down_proj.weight.any()
        assert layers[j].self_attn.q_proj.weight.std() > 0
    # one step of training moves the new layers' zero projections off zero
    grown.train()
    loss = grown(**enc, labels=enc["input_ids"]).loss
    loss.backward()
    assert all(layers[j].self_attn.o_proj.weight.grad.abs().sum() > 0 for j in new)
    assert all(layers[j].mlp.down_proj.weight.grad.abs().sum() > 0 for j in new)
    state = json.loads((tmp_path / "g" / "train_state.json").read_text())
    assert [r["command"] for r in state["earlier_runs"]] == ["a", "python samples/train.py x"]
    assert state["steps"] == 0 and state["total_steps"] == 12 and state["grow"] == rec
    assert (tmp_path / "g" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("after, message", [
    ([3], "layers 0-2"),
    ([-1], "layers 0-2"),
])
def test_bad_plans_are_refused(after, message):
    with pytest.raises(ValueError, match=message):
        _grow().layer_plan(3, after)


@pytest.mark.parametrize("family, after", [("qwen2_5_vl", []), ("qwen3_vl", [2])])
def test_a_wider_mlp_computes_exactly_what_the_source_did(tiny_dirs, tmp_path, family, after):
    """`--mlp N`: every LM layer's MLP widened (the fixture's 128 units to 200); the old units keep
    their weights, the new ones have random input rows and zero output columns: the logits are equal."""
    G = _grow()
    src = tiny_dirs[family]
    rec = G.grow(src, tmp_path / "w", after, seed=3, mlp=200)
    assert rec["mlp"] == [128, 200] and rec["layers"] == [3, 3 + len(after)]
    source, grown = _model(src), _model(tmp_path / "w")
    assert grown.config.text_config.intermediate_size == 200
    enc = _inputs(src)
    with torch.no_grad():
        # the zero columns add exact zeros, but a 200-long float32 reduction rounds otherwise than a
        # 128-long one: 1.5e-6 seen on logits up to 3.3
        torch.testing.assert_close(grown(**enc).logits, source(**enc).logits, rtol=0, atol=1e-5)
    old_mlp, new_mlp = source.model.language_model.layers[0].mlp, grown.model.language_model.layers[0].mlp
    assert torch.equal(new_mlp.gate_proj.weight[:128], old_mlp.gate_proj.weight)
    assert torch.equal(new_mlp.down_proj.weight[:, :128], old_mlp.down_proj.weight)
    assert not new_mlp.down_proj.weight[:, 128:].any() and new_mlp.up_proj.weight[128:].std() > 0
    with pytest.raises(ValueError, match="already has 128 units"):
        G.grow(src, tmp_path / "x", [], mlp=128)
    with pytest.raises(ValueError, match="nothing to grow"):
        G.grow(src, tmp_path / "x", [])
    assert not (tmp_path / "x").exists()


def test_a_layer_before_the_last_deepstack_layer_is_refused_and_nothing_is_written(tiny_dirs, tmp_path):
    G = _grow()
    assert G.layer_plan(3, [1], deepstack=2) == [0, 1, None, 2]
    with pytest.raises(ValueError, match="deepstack"):
        G.grow(tiny_dirs["qwen3_vl"], tmp_path / "g", [0])
    assert not (tmp_path / "g").exists()
    with pytest.raises(ValueError, match="source checkpoint"):
        G.grow(tiny_dirs["qwen2_5_vl"], tiny_dirs["qwen2_5_vl"], [1])


def test_cli_exits_with_the_reason(tiny_dirs, tmp_path, capsys):
    with pytest.raises(SystemExit, match="grow: --after 9"):
        _grow().main(["--out", str(tmp_path / "g"), "--after", "9", str(tiny_dirs["qwen2_5_vl"])])


def test_layer_lr_puts_each_parameter_in_one_group_at_its_multiple(tiny_dirs):
    """`train.py --layer-lr I=M`: LM decoder layer I trains at M x the lr; the decay rule is as before
    (matrices but embeddings decay); without the option the two groups of old."""
    train = sample_module("train")
    model = _model(tiny_dirs["qwen2_5_vl"])
    named = dict(model.named_parameters())
    plain = train.param_groups(model)
    assert [(g["weight_decay"], g["lr_mult"]) for g in plain] == [(0.01, 1.0), (0.0, 1.0)]
    groups = train.param_groups(model, {1: 10.0})
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in named.values())  # each parameter exactly once
    fast = {id(p) for g in groups if g["lr_mult"] == 10.0 for p in g["params"]}
    assert fast == {id(p) for n, p in named.items() if ".language_model.layers.1." in n} and fast
    for g in groups:
        for p in g["params"]:
            name = next(n for n, q in named.items() if q is p)
            assert g["weight_decay"] == (0.01 if p.ndim >= 2 and "embed" not in name else 0.0)


def test_grown_checkpoint_resumes_in_train_py_with_faster_new_layers(tiny_dirs, tmp_path):
    """The documented path: grow, then `train.py --resume` with `--layer-lr` on the new layers; the new
    layers' zero projections move, the run keeps the chain of commands, a bad layer index is refused."""
    import subprocess
    import sys

    out = tmp_path / "g"
    rec = sample_module("grow").grow(tiny_dirs["qwen2_5_vl"], out, [1], seed=2)
    cmd = [sys.executable, str(ROOT / "samples" / "train.py"), "--family", "qwen2_5_vl", "--out", str(out), "--resume",
           "--steps", "2", "--batch", "2", "--eval-every", "1000", "--warmup", "1"]
    bad = subprocess.run(cmd + ["--layer-lr", "4=10"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "--layer-lr" in bad.stderr and "0-3" in bad.stderr
    bad = subprocess.run(cmd + ["--layer-lr", "2=0"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "--layer-lr" in bad.stderr
    res = subprocess.run(cmd + ["--layer-lr", f"{rec['new_layers'][0]}=10"], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    layer = _model(out).model.language_model.layers[rec["new_layers"][0]]
    assert layer.self_attn.o_proj.weight.any() and layer.mlp.down_proj.weight.any()
    state = json.loads((out / "train_state.json").read_text())
    assert state["layer_lr"] == {"2": 10.0} and state["steps"] == 2
    assert state["earlier_runs"][-1]["command"].startswith("python samples/grow.py")


@pytest.mark.parametrize("family, vision_after, taps", [
    ("qwen2_5_vl", [0, 1], ("fullatt_block_indexes", [0, 1, 2, 3])),  # a new block takes its predecessor's type
    ("qwen3_vl", [0], ("deepstack_visual_indexes", [0, 2])),  # still tapped after source blocks 0 and 1
    ("qwen2_vl", [1], None),
])
def test_grown_vision_tower_computes_exactly_what_the_source_did(tiny_dirs, tmp_path, family, vision_after, taps):
    """`--vision-after I`: a vision block inserted after source block I starts as the identity (its
    attention and MLP output projections zero), so the logits are unchanged; it trains."""
    G = _grow()
    src = tiny_dirs[family]
    rec = G.grow(src, tmp_path / "v", [], seed=5, vision_after=vision_after)
    depth = 2 + len(vision_after)  # the fixture's vision towers have 2 blocks
    assert rec["vision_blocks"] == [2, depth] and rec["layers"] == [3, 3]
    grown = _model(tmp_path / "v")
    assert grown.config.vision_config.depth == depth
    if taps:
        assert getattr(grown.config.vision_config, taps[0]) == taps[1]
    enc = _inputs(src)
    with torch.no_grad():
        torch.testing.assert_close(grown(**enc).logits, _model(src)(**enc).logits, rtol=0, atol=1e-6)
    blocks = grown.model.visual.blocks
    assert len(blocks) == depth and len(rec["new_vision_blocks"]) == len(vision_after)
    grown.train()
    grown(**enc, labels=enc["input_ids"]).loss.backward()
    for j in rec["new_vision_blocks"]:
        out = [p for n, p in blocks[j].named_parameters() if n.startswith(G.VISION_ZEROED) and n.endswith("weight")]
        assert len(out) == 2 and not any(p.any() for p in out)  # zero at the start ...
        assert all(p.grad.abs().sum() > 0 for p in out)  # ... and a gradient moves them
    assert "--vision-after" in json.loads((tmp_path / "v" / "train_state.json").read_text())["command"]


def test_vision_plans_are_checked_and_remapped(tiny_dirs, tmp_path):
    G = _grow()
    assert G._remap([1], [0, None, 1, None], follow=True) == [2, 3]  # windowed block 0 stays windowed
    assert G._remap([1], [0, None, 1, None], follow=False) == [2]
    with pytest.raises(ValueError, match="--vision-after 2: the model has vision blocks 0-1"):
        G.grow(tiny_dirs["qwen2_5_vl"], tmp_path / "v", [], vision_after=[2])
    assert not (tmp_path / "v").exists()
