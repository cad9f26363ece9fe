"""Build a request's KV from segments: cached chunks (images, skills), re-rotated into place,
and freshly prefilled text; the first `seam_tokens` tokens of each chunk are recomputed with full
attention to everything before them (seam repair).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from mmkv.adapters import ImageFeatures, VLAdapter
from mmkv.chunks import CachedChunk
from mmkv.rerotate import reposition_keys


@dataclass
class Placement:
    """A cached chunk placed in a request: its first token sits at index `start`."""

    start: int
    entry: CachedChunk
    target: torch.Tensor  # [3, Lc] position ids of the chunk's tokens in this request

    @property
    def end(self) -> int:
        return self.start + self.entry.num_tokens


@dataclass
class PrefillResult:
    cache: DynamicCache
    logits: torch.Tensor  # [1, V] float32, next-token logits after the prompt
    computed_tokens: int  # LM tokens run through the model for this prompt
    reused_tokens: int  # tokens whose KV came from a cache (chunks re-rotated, prefix blocks)
    reused_ranges: list[tuple[int, int]]  # [start, end) token ranges whose KV was reused
    prefix_tokens: int = 0  # leading tokens taken from the prefix cache


def precompile_chunk(adapter: VLAdapter, kind: str, token_ids: torch.Tensor, key: str, anchor_ids: torch.Tensor,
                     features: ImageFeatures | None = None, grid_thw=None) -> CachedChunk:
    """Prefill one chunk in isolation (after `anchor_ids`, whose KV is then dropped)."""
    ids = torch.cat((anchor_ids, token_ids))
    positions = adapter.native_positions(ids, [grid_thw] if grid_thw else [])
    cache = adapter.new_cache()
    adapter.forward(ids, positions, cache, features)
    a = anchor_ids.numel()
    layers = cache.layers[: adapter.num_layers]
    return CachedChunk(
        key=key, kind=kind, token_ids=token_ids, position_ids=positions[:, a:].clone(),
        keys=tuple(layer.keys[0, :, a:].clone() for layer in layers),
        values=tuple(layer.values[0, :, a:].clone() for layer in layers),
        features=features, grid_thw=tuple(grid_thw) if grid_thw else None,
    )


def precompile_image(adapter: VLAdapter, features: ImageFeatures, grid_thw, key: str,
                     anchor_ids: torch.Tensor) -> CachedChunk:
    """Prefill one image span (vision_start, pads, vision_end) in isolation."""
    return precompile_chunk(adapter, "image", adapter.image_span_ids(grid_thw), key, anchor_ids, features, grid_thw)


def pad_features(entry: CachedChunk, start: int, stop: int) -> ImageFeatures | None:
    """Feature rows for the image pads among chunk tokens [start, stop) (pads are tokens 1..n)."""
    if entry.features is None:
        return None
    n = entry.features.embeds.shape[0]
    return entry.features.slice(min(max(start - 1, 0), n), min(max(stop - 1, 0), n))


def append_kv(cache: DynamicCache, entry: CachedChunk, target: torch.Tensor, start: int, stop: int,
              adapter: VLAdapter, rotate: bool = True) -> None:
    """Append the cached KV of chunk tokens [start, stop), re-rotated to `target` positions
    (left where they were cached with `rotate=False`: the control that must be worse)."""
    src = entry.position_ids[:, start:stop]
    dst = target[:, start:stop] if rotate else src
    for layer, (k, v) in enumerate(zip(entry.keys, entry.values)):
        k = reposition_keys(k[:, start:stop], src, dst, adapter.rope)
        cache.update(k[None].to(adapter.device), v[None, :, start:stop].to(adapter.device), layer)


def prefill_spliced(adapter: VLAdapter, input_ids: torch.Tensor, positions: torch.Tensor,
                    placements: list[Placement], seam_tokens: int, rotate: bool = True,
                    cache: DynamicCache | None = None, start: int = 0) -> PrefillResult:
    """Prefill `input_ids` [L] at `positions` [3, L] with every chunk taken from `placements`.

    `cache` may already hold the KV of tokens [0, start) (a prefix-cache hit). The result equals
    one forward pass over the same tokens and positions in which each chunk's tokens see only
    their own chunk (see mmkv.oracle). A chunk that ends the prompt keeps its last token
    computed, so the prompt's last logits always come from the model.
    """
    if seam_tokens < 0:
        raise ValueError("seam_tokens must be >= 0")
    cache = cache if cache is not None else adapter.new_cache()
    total = input_ids.numel()
    cursor, computed, reused = start, 0, [(0, start)] if start else []
    for p in sorted(placements, key=lambda p: p.start):
        if p.end <= cursor:
            continue
        if p.start > cursor:
            adapter.forward(input_ids[cursor:p.start], positions[:, cursor:p.start], cache)
            computed += p.start - cursor
        n = p.entry.num_tokens
        keep_end = n - 1 if p.end == total else n
        seam = min(seam_tokens, keep_end)
        first = max(cursor - p.start, 0)  # chunk tokens already in the cache
        if first < seam:
            adapter.forward(p.entry.token_ids[first:seam], p.target[:, first:seam], cache,
                            pad_features(p.entry, first, seam))
            computed += seam - first
        if keep_end > max(seam, first):
            append_kv(cache, p.entry, p.target, max(seam, first), keep_end, adapter, rotate)
            reused.append((p.start + max(seam, first), p.start + keep_end))
        cursor = max(cursor, p.start + keep_end)
    logits = adapter.forward(input_ids[cursor:], positions[:, cursor:], cache)
    computed += total - cursor
    return PrefillResult(cache, logits, computed, sum(b - a for a, b in reused), reused, start)


def prefill_full(adapter: VLAdapter, input_ids: torch.Tensor, positions: torch.Tensor,
                 features: ImageFeatures | None) -> PrefillResult:
    """The reference: one ordinary causal forward over the whole prompt, no cached KV used."""
    cache = adapter.new_cache()
    logits = adapter.forward(input_ids, positions, cache, features)
    return PrefillResult(cache, logits, input_ids.numel(), 0, [])
