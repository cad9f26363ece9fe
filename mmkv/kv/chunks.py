"""A chunk is a span of tokens prefilled once in isolation and spliced anywhere: an image
(vision_start, image pads, vision_end), one temporal group of a video (its pads; on Qwen3-VL its
timestamp text, vision_start, pads, vision_end) or a text skill. Its keys are stored after RoPE at the
positions it was computed at, so a splice only has to rotate them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from mmkv.adapters import ImageFeatures


# A CPU tensor's own heap beside its data (TensorImpl, storage, the Python object): 360-440 bytes
# measured with glibc's mallinfo2 over thousands of small tensors; tests/test_prefix_cache.py holds
# the charge of a prefix block above what it really leaves allocated.
TENSOR_HEAP_BYTES = 512
# A source key a turn chunk names: the 32-character str (81 bytes), its slot in the frozenset and in
# the KV store's sources index, with margin.
SOURCE_BYTES = 192


def tensor_bytes(tensors) -> int:
    """What `tensors` cost the heap: their data and each one's own bookkeeping."""
    return sum(t.numel() * t.element_size() + TENSOR_HEAP_BYTES for t in tensors)


def text_chunk_bytes(tokens: int, layers: int, kv_bytes_per_token: int) -> int:
    """A skill chunk's `CachedChunk.nbytes` before it exists (a quota check): K and V of every
    layer, the token ids and the [3, L] positions (int64), each tensor's own heap."""
    return tokens * (kv_bytes_per_token + 4 * 8) + (2 * layers + 2) * TENSOR_HEAP_BYTES


def chunk_cache_key(kind: str, content_hash: str, model_fingerprint: str, grid_settings: str, anchor: str,
                    tenant: str) -> str:
    """xxh3-128 over everything that changes a chunk's cached KV. 32 hex digits."""
    text = "\x1f".join((kind, content_hash, model_fingerprint, grid_settings, anchor, tenant))
    return xxhash.xxh3_128(text.encode()).hexdigest()


@dataclass
class CachedChunk:
    key: str
    kind: str  # "image" | "video" | "skill" | "turn" (a finished message's text run: mmkv.request.compose)
    token_ids: torch.Tensor  # [Lc] long
    position_ids: torch.Tensor  # [3, Lc] positions the KV was computed at (canonical)
    keys: tuple[torch.Tensor, ...]  # per layer [kv_heads, Lc, head_dim], after RoPE at position_ids
    values: tuple[torch.Tensor, ...]  # per layer [kv_heads, Lc, head_dim]
    features: ImageFeatures | None = None  # images, videos: merged visual embeddings (+ deepstack), one row per pad
    grid_thw: tuple[int, int, int] | None = None  # images, videos (a video group's is (1, h, w))
    pad_offset: int = 1  # index of the first pad among the chunk's tokens (its pads are contiguous)
    sources: frozenset[str] = frozenset()  # turn chunks: every chunk their KV attended to (purged with any)
    parent = None  # chunks are never inner nodes of the prefix tree
    in_context = False  # a cached chunk is spliced; a first-sight image (mmkv.request.first_sight) is computed

    def __post_init__(self):
        n = self.token_ids.numel()
        assert self.position_ids.shape == (3, n), "positions [3, Lc]"
        assert len(self.keys) == len(self.values) and self.keys, "one K and V per layer"
        assert all(k.shape[-2] == n and v.shape[-2] == n for k, v in zip(self.keys, self.values)), "KV length == Lc"
        if self.kind == "image":
            assert self.features is not None and self.features.embeds.shape[0] == n - 2, "a feature row per pad"
        if self.kind == "video":
            assert self.features is not None and self.pad_offset + self.features.embeds.shape[0] <= n, "pads in chunk"

    @property
    def num_tokens(self) -> int:
        return self.token_ids.numel()

    @property
    def nbytes(self) -> int:
        own = tensor_bytes((*self.keys, *self.values, self.token_ids, self.position_ids))
        return own + (self.features.nbytes if self.features is not None else 0) + SOURCE_BYTES * len(self.sources)
