"""A cached chunk as bytes, for the disk and shared tiers: safetensors whose header carries the
full durable key, the model fingerprint, the tensors' dtype and a SHA-256 checksum of every
tensor and every other header field the planner reads (kind, layer count, image grid, deepstack
count, the first pad's index: a Qwen3-VL video group's pads follow its timestamp text; 1 when an
entry does not say). `decode_chunk` trusts nothing: a truncated, corrupted, swapped (another key)
or foreign (another model or dtype) entry raises CorruptEntryError, and the caller drops it and
recomputes.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from mmkv.adapters import ImageFeatures
from mmkv.kv.chunks import CachedChunk

FORMAT = "mmkv-chunk-2"


class CorruptEntryError(Exception):
    """A stored entry that must not be used: unreadable, tampered with, or made for another key or model."""


def _checksum(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of every header field but the checksum itself, then of every tensor (name, dtype,
    shape, bytes; hashed in place, no copy)."""
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def chunk_tensors(chunk: CachedChunk) -> dict[str, torch.Tensor]:
    """Every tensor an encoded chunk holds, by its name in the file (on the chunk's device)."""
    tensors = {"token_ids": chunk.token_ids, "position_ids": chunk.position_ids}
    for i, (k, v) in enumerate(zip(chunk.keys, chunk.values)):
        tensors[f"k.{i}"], tensors[f"v.{i}"] = k, v
    if chunk.features is not None:
        tensors["embeds"] = chunk.features.embeds
        for i, d in enumerate(chunk.features.deepstack):
            tensors[f"deepstack.{i}"] = d
    return tensors


def encoded_nbytes(chunk: CachedChunk) -> int:
    """The tensor bytes of `chunk`'s encoding (its header adds a few hundred bytes)."""
    return sum(t.numel() * t.element_size() for t in chunk_tensors(chunk).values())


def encode_chunk(chunk: CachedChunk, key: str, fingerprint: str) -> bytes:
    """Safetensors bytes of `chunk` (tensors moved to the CPU) under durable `key`."""
    tensors = {n: t.detach().contiguous().cpu() for n, t in chunk_tensors(chunk).items()}
    meta = {"format": FORMAT, "key": key, "fingerprint": fingerprint, "kind": chunk.kind,
            "layers": str(len(chunk.keys)), "deepstack": str(len(chunk.features.deepstack) if chunk.features else 0),
            "grid_thw": json.dumps(list(chunk.grid_thw) if chunk.grid_thw else None),
            "dtype": str(chunk.keys[0].dtype), "pad_offset": str(chunk.pad_offset)}
    meta["checksum"] = _checksum(meta, tensors)
    return st_save(tensors, metadata=meta)


def _metadata(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise CorruptEntryError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CorruptEntryError("truncated header")
    try:
        return json.loads(data[8:8 + n]).get("__metadata__") or {}
    except (ValueError, AttributeError) as exc:
        raise CorruptEntryError(f"unreadable header: {exc}") from None


def decode_chunk(data: bytes, key: str, fingerprint: str, ram_key: str, kind: str, layers: int,
                 dtype: torch.dtype, device: torch.device) -> CachedChunk:
    """The chunk stored under durable `key`, as the in-RAM entry `ram_key` on `device`."""
    meta = _metadata(data)
    expected = {"format": FORMAT, "key": key, "fingerprint": fingerprint, "kind": kind, "layers": str(layers),
                "dtype": str(dtype)}
    for field, want in expected.items():
        if meta.get(field) != want:
            raise CorruptEntryError(f"{field} is {meta.get(field)!r}, expected {want!r}")
    try:
        tensors = st_load(data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for every bad byte
        raise CorruptEntryError(f"unreadable tensors: {exc}") from None
    if _checksum(meta, tensors) != meta.get("checksum"):
        raise CorruptEntryError("checksum mismatch")
    try:
        t = {n: x.to(device) for n, x in tensors.items()}
        features = None
        if "embeds" in t:
            features = ImageFeatures(t["embeds"], tuple(t[f"deepstack.{i}"] for i in range(int(meta["deepstack"]))))
        grid = json.loads(meta["grid_thw"])
        return CachedChunk(ram_key, kind, t["token_ids"], t["position_ids"],
                           tuple(t[f"k.{i}"] for i in range(layers)), tuple(t[f"v.{i}"] for i in range(layers)),
                           features, tuple(grid) if grid else None, int(meta.get("pad_offset", "1")))
    except (KeyError, ValueError, AssertionError) as exc:
        raise CorruptEntryError(f"malformed entry: {exc!r}") from None
