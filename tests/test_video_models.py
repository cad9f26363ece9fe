"""The bundled video checkpoints (samples/models/*-video, fine-tuned by samples/train_video.py) are the
tiny models' size and answer the video evaluation's fixed clips (full recompute and splice) as stored; `mmkv eval
--task video` uses the Qwen2.5-VL one when no model is given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmkv.engine import Engine
from mmkv.vqa_eval import video_eval as V

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "samples" / "models"
EXPECTATIONS = MODELS / "expected_video_answers.json"
VIDEO_MODELS = {"qwen2_5_vl-tiny-video": "qwen2_5_vl-tiny", "qwen3_vl-tiny-video": "qwen3_vl-tiny"}


@pytest.mark.parametrize("name", sorted(VIDEO_MODELS))
def test_video_checkpoint_is_its_base_size(name):
    """The same files as the bundled checkpoint it was fine-tuned from, the weights the same size."""
    d, base = MODELS / name, MODELS / VIDEO_MODELS[name]
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in base.iterdir())
    assert (d / "model.safetensors").stat().st_size == (base / "model.safetensors").stat().st_size


@pytest.mark.parametrize("name", sorted(VIDEO_MODELS))
def test_video_checkpoint_answers_as_stored(name):
    """Greedy answers of the full recompute and the splice on the stored evaluation clips, recorded by
    `python samples/train_video.py --write-expectations`."""
    expected = json.loads(EXPECTATIONS.read_text())[name]
    assert len(expected) == 3, f"no stored answers for {name}"
    engine = Engine.from_pretrained(MODELS / name)
    for row in expected:
        record = V.serve(engine, V.draw_clip(row["type"], row["item"]), row["item"] * 1000, max_new_tokens=4)
        assert {arm: record[arm]["answer"] for arm in row["answers"]} == row["answers"], (row["type"], row["item"])
        assert set(row["answers"]) == {"full", "splice"}


def test_video_eval_defaults_to_the_video_checkpoint():
    assert V.VIDEO_MODEL == MODELS / "qwen2_5_vl-tiny-video" and (V.VIDEO_MODEL / "model.safetensors").exists()
