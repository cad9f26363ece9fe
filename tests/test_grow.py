"""samples/grow.py: inserted identity layers leave a checkpoint's logits exactly as they were, and train."""

from __future__ import annotations

import io
import json
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
    src = tiny_dirs[family]
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
    ([], "nothing to insert"),
    ([3], "layers 0-2"),
    ([-1], "layers 0-2"),
])
def test_bad_plans_are_refused(after, message):
    with pytest.raises(ValueError, match=message):
        _grow().layer_plan(3, after)


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
