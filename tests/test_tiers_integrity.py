"""What a stored chunk is trusted for: its checksum covers every field the planner reads (the
grid, the deepstack count, the positions), and the model fingerprint that names a store depends on
what the model computes, never on the path it was loaded from."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
import transformers

from mmkv.adapters import ImageFeatures, load_adapter
from mmkv.kv.chunks import CachedChunk
from mmkv.store.chunk_codec import CorruptEntryError, decode_chunk, encode_chunk
from mmkv.store.fingerprint import model_fingerprint

KEY, FINGERPRINT = "k" * 64, "f" * 64


def image_chunk(grid=(1, 4, 6), deepstack: int = 2, pads: int = 6) -> CachedChunk:
    """An image chunk: `pads` pad tokens between its start and end, 2 layers, `deepstack` layers of features."""
    g = torch.Generator().manual_seed(0)
    n = pads + 2
    kv = lambda: torch.randn(2, n, 4, generator=g)  # noqa: E731
    features = ImageFeatures(torch.randn(pads, 8, generator=g), tuple(torch.randn(pads, 8, generator=g)
                                                                       for _ in range(deepstack)))
    return CachedChunk("ram", "image", torch.arange(n), torch.arange(3 * n).reshape(3, n), (kv(), kv()), (kv(), kv()),
                       features, grid)


def decode(data: bytes) -> CachedChunk:
    return decode_chunk(data, KEY, FINGERPRINT, "ram", "image", 2, torch.float32, torch.device("cpu"))


def with_metadata(data: bytes, **changes: str) -> bytes:
    """`data` with header metadata fields replaced: a well-formed safetensors file whose tensors are untouched."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["__metadata__"].update(changes)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n:]


def test_codec_round_trips_every_field():
    chunk = image_chunk()
    got = decode(encode_chunk(chunk, KEY, FINGERPRINT))
    assert got.grid_thw == chunk.grid_thw and len(got.features.deepstack) == 2
    torch.testing.assert_close(got.position_ids, chunk.position_ids, atol=0, rtol=0)
    for a, b in zip((*got.keys, *got.values, *got.features.deepstack), (*chunk.keys, *chunk.values,
                                                                          *chunk.features.deepstack)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("field, value", [("grid_thw", "[1, 6, 4]"), ("grid_thw", "[2, 4, 6]"), ("deepstack", "1"),
                                          ("deepstack", "0")])
def test_checksum_covers_the_grid_and_the_deepstack_count(field, value):
    """Review finding 9: the checksum left out grid_thw and deepstack, so an entry whose grid was
    changed decoded and placed the image at the wrong M-RoPE positions with no error."""
    data = encode_chunk(image_chunk(), KEY, FINGERPRINT)
    decode(with_metadata(data))  # rewriting the header alone keeps it valid
    with pytest.raises(CorruptEntryError):
        decode(with_metadata(data, **{field: value}))


def test_checksum_covers_the_positions():
    data = bytearray(encode_chunk(image_chunk(), KEY, FINGERPRINT))
    (n,) = struct.unpack("<Q", data[:8])
    start, _ = json.loads(data[8:8 + n])["position_ids"]["data_offsets"]
    data[8 + n + start] ^= 1  # position 0 becomes 1
    with pytest.raises(CorruptEntryError, match="checksum"):
        decode(bytes(data))


@pytest.fixture(scope="module")
def model_dir(tiny_dirs):
    return tiny_dirs["qwen2_5_vl"]


def test_fingerprint_does_not_depend_on_the_load_path(model_dir, tmp_path):
    """Review finding 7: the hashed config held `_name_or_path`, so a trailing '/' or a symlink to
    the same checkpoint gave another fingerprint (two servers on the same weights never shared)."""
    link = tmp_path / "link"
    link.symlink_to(model_dir, target_is_directory=True)
    base = model_fingerprint(load_adapter(model_dir))
    assert model_fingerprint(load_adapter(f"{model_dir}/")) == base
    assert model_fingerprint(load_adapter(link)) == base
    changed = tmp_path / "changed"  # the same files, one semantic config field changed
    shutil.copytree(model_dir, changed)
    config = json.loads((changed / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] *= 2
    (changed / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(load_adapter(changed)) != base


def test_fingerprint_names_the_library_versions(model_dir, monkeypatch):
    """Review finding 7: the transformers and torch versions are hashed explicitly (the config's
    own `transformers_version` is the writer's, not the one computing the KV)."""
    adapter = load_adapter(model_dir)
    base = model_fingerprint(adapter)
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".post1")
    assert model_fingerprint(adapter) != base
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".post1")
    assert model_fingerprint(adapter) != base
