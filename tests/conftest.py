"""Tiny random checkpoints of each family, built from config once per test session."""

from __future__ import annotations

import importlib.util
import io
import socket
import os
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from mmkv.testing.tiny import FAMILIES, QWEN3_FAMILIES, save_tiny_checkpoint

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test starts and ends on one torch thread: a command under test that sets more (the
    benches' --threads) would leave an OpenMP pool behind, and a forked child that then runs a
    parallel region (tests/test_tiers_crash.py) hangs in it."""
    yield
    torch.set_num_threads(1)
# `mmkv serve` keeps a disk tier under ~/.cache/mmkv by default: servers the tests start stay RAM-only
# (and leave nothing in the home directory) unless a test passes --store-dir.
os.environ.setdefault("MMKV_STORE_DIR", "none")


# A random model with default init barely uses position (near-uniform attention), so a wrong
# rotation would go unnoticed. A low rope_theta and larger init make the test models sensitive.
INIT = 0.1


def _rope(family: str) -> dict:
    if family in QWEN3_FAMILIES:
        return {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    return {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]}


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        fam: save_tiny_checkpoint(fam, root / fam, seed=3, initializer_range=INIT,
                                  text={"rope_parameters": _rope(fam), "initializer_range": INIT},
                                  vision={"initializer_range": INIT})
        for fam in FAMILIES
    }


def make_png(width: int, height: int, color=(200, 30, 30), seed: int = 0) -> bytes:
    """A small test picture: a coloured rectangle and a circle on grey, PNG bytes."""
    img = Image.new("RGB", (width, height), (128 + seed % 50, 128, 128))
    draw = ImageDraw.Draw(img)
    draw.rectangle([width // 8, height // 8, width // 2, height // 2], fill=color)
    if min(width, height) >= 16:
        draw.ellipse([width // 2, height // 2, width - 4, height - 4], fill=(20, 20, 220 - seed % 100))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def free_port() -> int:
    """A loopback port nobody listens on now (the OS picks it), for a server started as a subprocess."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample_module(name: str):
    """``samples/<name>.py`` as a module (the samples are scripts, not package members); registered in
    ``sys.modules`` so that its dataclasses can look their module up."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "samples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def transformers_greedy(model_dir, max_new_tokens: int):
    """The reference for `reuse=False`: transformers' own processor and `generate` (greedy, end
    tokens disabled) on one image and a question. Returns the same request in mmkv's message form,
    the processor's prompt ids and the generated ids."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    img = Image.open(io.BytesIO(make_png(120, 80, seed=4))).convert("RGB")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image"},
                                         {"type": "text", "text": "what color is the shape ?"}]}]
    text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[img], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1)
    ours = [{"role": "user", "content": [{"type": "text", "text": "see"}, img,
                                         {"type": "text", "text": "what color is the shape ?"}]}]
    return ours, inputs["input_ids"][0], out[0, inputs["input_ids"].shape[1]:].tolist()


def serve_kwargs(monkeypatch, *args: str) -> dict:
    """What `mmkv serve *args` passes to Engine.from_pretrained (the load is stopped: nothing is
    served); the command exits 2 on the stopped load."""
    from typer.testing import CliRunner

    import mmkv.engine
    import mmkv.errors
    from mmkv.cli import app

    seen = {}

    def stop(*_, **kw):
        seen.update(kw)
        raise mmkv.errors.ModelLoadError("stopped by the test")

    monkeypatch.setattr(mmkv.engine.Engine, "from_pretrained", stop)
    assert CliRunner().invoke(app, ["serve", *args]).exit_code == 2
    return seen


def forget_slot_records(engine) -> None:
    """Drop what `engine`'s kept KV buffers remember (mmkv.request.splice.SlotPool): the next
    request loads its whole hit from the prefix cache's blocks, as another conversation's would,
    instead of finding its previous turn's prompt in place (its last tokens included)."""
    with engine.slots._lock:
        for e in engine.slots._kept:
            e.owner, e.held, e.tail = None, (), ()


def prefix_hit(previous: int, shared: int, prompt: int, block: int = 16) -> int:
    """The cached tokens of a text prompt of `prompt` tokens whose first `shared` are those of the
    conversation's previous prompt (`previous` tokens): the shared part's whole blocks, short of
    the prompt's last token, and when those are all of the previous prompt's blocks, the rest of
    the shared part too (the previous turn's buffer holds what followed them)."""
    common = min(shared, prompt - 1)
    blocks = common // block * block
    return common if blocks == previous // block * block else blocks
