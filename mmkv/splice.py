"""Build a request's KV from segments: cached image chunks, re-rotated into place, and freshly
prefilled text; the first `seam_tokens` tokens of each chunk are recomputed with full attention
to everything before them (seam repair).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from mmkv.adapters import ImageFeatures, VLAdapter
from mmkv.image_cache import CachedImage
from mmkv.rerotate import reposition_keys


@dataclass
class Placement:
    """A cached chunk placed in a request: its first token sits at index `start`."""

    start: int
    entry: CachedImage
    target: torch.Tensor  # [3, Lc] position ids of the chunk's tokens in this request

    @property
    def end(self) -> int:
        return self.start + self.entry.num_tokens


@dataclass
class PrefillResult:
    cache: DynamicCache
    logits: torch.Tensor  # [1, V] float32, next-token logits after the prompt
    computed_tokens: int  # LM tokens run through the model for this prompt
    reused_tokens: int  # tokens whose KV came from a cache, re-rotated


def precompile_image(adapter: VLAdapter, features: ImageFeatures, grid_thw, key: str,
                     anchor_ids: torch.Tensor) -> CachedImage:
    """Prefill one image span in isolation (after `anchor_ids`, whose KV is then dropped)."""
    span = adapter.image_span_ids(grid_thw)
    ids = torch.cat((anchor_ids, span))
    positions = adapter.native_positions(ids, [grid_thw])
    cache = adapter.new_cache()
    adapter.forward(ids, positions, cache, features)
    a = anchor_ids.numel()
    layers = cache.layers[: adapter.num_layers]
    return CachedImage(
        key=key,
        grid_thw=tuple(grid_thw),
        token_ids=span,
        position_ids=positions[:, a:].clone(),
        keys=tuple(layer.keys[0, :, a:].clone() for layer in layers),
        values=tuple(layer.values[0, :, a:].clone() for layer in layers),
        features=features,
    )


def pad_features(entry: CachedImage, start: int, stop: int) -> ImageFeatures:
    """Feature rows for the image pads among chunk tokens [start, stop) (pads are tokens 1..n)."""
    n = entry.features.embeds.shape[0]
    return entry.features.slice(min(max(start - 1, 0), n), min(max(stop - 1, 0), n))


def append_kv(cache: DynamicCache, entry: CachedImage, target: torch.Tensor, start: int, stop: int,
              adapter: VLAdapter, rotate: bool = True) -> None:
    """Append the cached KV of chunk tokens [start, stop), re-rotated to `target` positions
    (left where they were cached with `rotate=False`: the control that must be worse)."""
    src = entry.position_ids[:, start:stop]
    dst = target[:, start:stop] if rotate else src
    for layer, (k, v) in enumerate(zip(entry.keys, entry.values)):
        k = reposition_keys(k[:, start:stop], src, dst, adapter.rope)
        cache.update(k[None].to(adapter.device), v[None, :, start:stop].to(adapter.device), layer)


def prefill_spliced(adapter: VLAdapter, input_ids: torch.Tensor, positions: torch.Tensor,
                    placements: list[Placement], seam_tokens: int, rotate: bool = True) -> PrefillResult:
    """Prefill `input_ids` [L] at `positions` [3, L] with every image span taken from `placements`.

    The result equals one forward pass over the same tokens and positions in which each chunk's
    tokens see only their own chunk (see mmkv.oracle). A chunk that ends the prompt keeps its
    last token computed, so the prompt's last logits always come from the model.
    """
    if seam_tokens < 0:
        raise ValueError("seam_tokens must be >= 0")
    cache = adapter.new_cache()
    total = input_ids.numel()
    cursor = computed = reused = 0
    for p in sorted(placements, key=lambda p: p.start):
        if p.start < cursor:
            raise ValueError("overlapping chunk placements")
        if p.start > cursor:
            adapter.forward(input_ids[cursor:p.start], positions[:, cursor:p.start], cache)
            computed += p.start - cursor
        n = p.entry.num_tokens
        keep_end = n - 1 if p.end == total else n
        seam = min(seam_tokens, keep_end)
        if seam:
            adapter.forward(p.entry.token_ids[:seam], p.target[:, :seam], cache, pad_features(p.entry, 0, seam))
            computed += seam
        if keep_end > seam:
            append_kv(cache, p.entry, p.target, seam, keep_end, adapter, rotate)
            reused += keep_end - seam
        cursor = p.start + keep_end
    logits = adapter.forward(input_ids[cursor:], positions[:, cursor:], cache)
    computed += total - cursor
    return PrefillResult(cache, logits, computed, reused)


def prefill_full(adapter: VLAdapter, input_ids: torch.Tensor, positions: torch.Tensor,
                 features: ImageFeatures | None) -> PrefillResult:
    """The reference: one ordinary causal forward over the whole prompt, no cached KV used."""
    cache = adapter.new_cache()
    logits = adapter.forward(input_ids, positions, cache, features)
    return PrefillResult(cache, logits, input_ids.numel(), 0)
