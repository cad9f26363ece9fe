"""samples/soup.py: a uniform weight average of checkpoints that must line up, recorded so it can be rebuilt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import sample_module

ROOT = Path(__file__).resolve().parents[1]


def _soup():
    return sample_module("soup")


def _checkpoint(d: Path, tensors: dict, config: dict | None = None) -> Path:
    d.mkdir(parents=True)
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config or {"model_type": "qwen2_5_vl", "hidden_size": 4}))
    (d / "tokenizer.json").write_text('{"first": true}')
    return d


def test_soup_is_the_elementwise_mean_and_keeps_dtypes(tmp_path):
    S = _soup()
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(3, 5, generator=g) for _ in range(3)]
    half = [torch.randn(4, generator=g).to(torch.bfloat16) for _ in range(3)]
    dirs = [_checkpoint(tmp_path / f"c{i}", {"w": ws[i], "h": half[i]}) for i in range(3)]
    (dirs[1] / "tokenizer.json").write_text('{"first": false}')
    rec = S.write(dirs, tmp_path / "out")
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    torch.testing.assert_close(out["w"], (ws[0].double() + ws[1].double() + ws[2].double()).div(3).float(),
                               rtol=0, atol=0)
    assert out["h"].dtype == torch.bfloat16
    torch.testing.assert_close(out["h"], sum(h.double() for h in half).div(3).to(torch.bfloat16), rtol=0, atol=0)
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"first": true}'  # files from the first input
    saved = json.loads((tmp_path / "out" / "soup.json").read_text())
    assert saved == rec
    assert [i["sha256"] for i in rec["inputs"]] == [S.sha256(d / "model.safetensors") for d in dirs]
    assert rec["sha256"] == S.sha256(tmp_path / "out" / "model.safetensors")


def test_soup_of_one_checkpoint_twice_is_that_checkpoint(tmp_path):
    S = _soup()
    w = torch.randn(7, 2)
    a = _checkpoint(tmp_path / "a", {"w": w})
    b = _checkpoint(tmp_path / "b", {"w": w.clone()})
    S.write([a, b], tmp_path / "out")
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["w"], w)


@pytest.mark.parametrize("bad, message", [
    ({"tensors": {"w": torch.zeros(2, 3), "extra": torch.zeros(1)}}, "tensor names differ"),
    ({"tensors": {"w": torch.zeros(3, 2)}}, "is (3, 2)"),
    ({"tensors": {"w": torch.zeros(2, 3, dtype=torch.float16)}}, "torch.float16"),
    ({"tensors": {"w": torch.zeros(2, 3)}, "config": {"model_type": "qwen3_vl", "hidden_size": 4}}, "config.json differs"),
])
def test_soup_refuses_checkpoints_that_do_not_line_up_and_writes_nothing(tmp_path, bad, message):
    S = _soup()
    a = _checkpoint(tmp_path / "a", {"w": torch.ones(2, 3)})
    b = _checkpoint(tmp_path / "b", bad["tensors"], bad.get("config"))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        S.write([a, b], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_soup_refuses_one_input_a_missing_checkpoint_and_overwriting_an_input(tmp_path):
    S = _soup()
    a = _checkpoint(tmp_path / "a", {"w": torch.ones(2)})
    b = _checkpoint(tmp_path / "b", {"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="at least two"):
        S.write([a], tmp_path / "out")
    with pytest.raises(ValueError, match="no model.safetensors"):
        S.write([a, tmp_path / "missing"], tmp_path / "out")
    before = S.sha256(a / "model.safetensors")
    with pytest.raises(ValueError, match="must not be one of the inputs"):
        S.write([a, b], a)
    assert S.sha256(a / "model.safetensors") == before
