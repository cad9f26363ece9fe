"""The image-KV cache: each image's LM-side KV, prefilled once in isolation, under a full-width key.

Thread-safe: every public method takes the cache's lock. Byte-budgeted LRU: `put` evicts least
recently used entries until the budget holds; an entry larger than the whole budget is not kept
(the request that made it still uses it). A request holds its entries by reference, so eviction
never breaks a request in flight; a later miss recomputes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xxhash

from mmkv.adapters import ImageFeatures


def image_cache_key(content_hash: str, model_fingerprint: str, grid_settings: str, anchor: str, tenant: str) -> str:
    """xxh3-128 over everything that changes an image's cached KV. 32 hex digits."""
    text = "\x1f".join((content_hash, model_fingerprint, grid_settings, anchor, tenant))
    return xxhash.xxh3_128(text.encode()).hexdigest()


@dataclass
class CachedImage:
    """One image span (vision_start, image pads, vision_end) prefilled in isolation."""

    key: str
    grid_thw: tuple[int, int, int]
    token_ids: torch.Tensor  # [Lc] long
    position_ids: torch.Tensor  # [3, Lc] positions the KV was computed at (canonical)
    keys: tuple[torch.Tensor, ...]  # per layer [kv_heads, Lc, head_dim], after RoPE at position_ids
    values: tuple[torch.Tensor, ...]  # per layer [kv_heads, Lc, head_dim]
    features: ImageFeatures  # merged visual embeddings (+ deepstack), for seam repair and fallbacks

    def __post_init__(self):
        n = self.token_ids.numel()
        assert self.position_ids.shape == (3, n), "positions [3, Lc]"
        assert len(self.keys) == len(self.values) and self.keys, "one K and V per layer"
        assert all(k.shape[-2] == n and v.shape[-2] == n for k, v in zip(self.keys, self.values)), "KV length == Lc"
        assert self.features.embeds.shape[0] == n - 2, "one feature row per image pad"

    @property
    def num_tokens(self) -> int:
        return self.token_ids.numel()

    @property
    def nbytes(self) -> int:
        kv = sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
        return kv + self.features.nbytes


class ImageKVCache:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError("cache budget must be >= 0 bytes")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, CachedImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: str) -> CachedImage | None:
        """The entry under `key`, now most recently used; counts a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, entry: CachedImage) -> bool:
        """Store `entry`, evicting LRU entries to fit. False if it alone exceeds the budget."""
        size = entry.nbytes
        with self._lock:
            if entry.key in self._entries:
                self._bytes -= self._entries.pop(entry.key).nbytes
            if size > self.budget_bytes:
                return False
            while self._bytes + size > self.budget_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
                self.evictions += 1
            self._entries[entry.key] = entry
            self._bytes += size
            return True

    def discard(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._bytes -= entry.nbytes
            return entry is not None

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def check_integrity(self) -> None:
        """Raise AssertionError unless the byte count matches the entries and fits the budget."""
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            assert total == self._bytes, f"tracked {self._bytes} bytes but entries hold {total}"
            assert self._bytes <= self.budget_bytes, f"{self._bytes} bytes over the budget {self.budget_bytes}"
            for key, entry in self._entries.items():
                assert key == entry.key, f"entry {entry.key} stored under {key}"
                entry.__post_init__()
