"""Packed attention: one forward runs the decode batch's next tokens and prefilling requests'
pieces together (prefills that ride in the decode step, as vLLM's and SGLang's mixed batches do).

The forward's sequence is the batch's B decode tokens followed by each rider's prompt tokens,
each at its own M-RoPE position; the projections, MLPs and norms run over all of them at once,
so the weights are read once for all. Only attention keeps them apart: the cache's `update`
(`PackedLayer`) writes the decode tokens' keys and values into the batch's rows and each rider's
into that rider's own cache, and `packed_attention` (registered with transformers'
`AttentionInterface`, in force inside `packed_attention_for`) runs the model's own attention per
part: the decode queries over the batch rows with the batch's mask (cascade attention over a
shared prefix where the batch keeps one), and each rider's queries over its cache with its own
mask. Each
token therefore sees exactly what it sees in a separate forward; only the matrix shapes differ
(float rounding, tested within a tolerance against the separate forwards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mmkv.kv.cascade import PREFIX_KWARG, cascade_attention

NAME = "mmkv_packed"
PACKED_KWARG = "mmkv_packed"


@dataclass
class Packing:
    """What one packed forward's attention needs beyond its queries: the split, both masks, the
    batch's shared prefix, the model's own attention function, and per layer the keys and values
    `PackedLayer.update` produced (taken by `packed_attention`)."""

    rows: int  # decode tokens first: one per batch row
    decode_mask: torch.Tensor  # [B, 1, 1, K + 1] over the batch rows' slots (0 / -inf)
    rider_tokens: list[int]  # then each rider's tokens, in order
    rider_masks: list[torch.Tensor]  # [1, 1, n, visible] each, over its own cache (0 / -inf)
    prefix: list | None  # per layer (keys, values) [1, kv_heads, P, head_dim] the batch rows share, or None
    attention: str  # the model's attention implementation, run for both parts
    kv: dict[int, tuple] = field(default_factory=dict)  # layer -> ((decode k, v), [(rider k, v), ...])


class PackedLayer(DynamicLayer):
    """One layer's cache for a packed forward: the first `rows` new tokens go to the decode batch's
    layer (one per row), each rider's to its own layer; what each returns is kept for attention."""

    def __init__(self, index: int, batch_layer, rider_layers: list, packing: Packing):
        super().__init__()
        self.index, self.batch_layer, self.rider_layers, self.packing = index, batch_layer, rider_layers, packing
        self.dtype, self.device, self.is_initialized = batch_layer.dtype, batch_layer.device, True
        self.keys, self.values = batch_layer.keys, batch_layer.values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        b = self.packing.rows
        decoded = self.batch_layer.update(key_states[0, :, :b].transpose(0, 1).unsqueeze(2),
                                          value_states[0, :, :b].transpose(0, 1).unsqueeze(2))
        riders, start = [], b
        for layer, n in zip(self.rider_layers, self.packing.rider_tokens):
            riders.append(layer.update(key_states[:, :, start:start + n], value_states[:, :, start:start + n]))
            start += n
        self.packing.kv[self.index] = (decoded, riders)
        return key_states, value_states  # unused: packed_attention reads `packing.kv`


def packed_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, Hq, B + N, D]: the decode rows' queries, then each rider's. Returns [1, B + N, Hq, D]."""
    packing: Packing = kwargs.pop(PACKED_KWARG)
    (dk, dv), riders = packing.kv.pop(module.layer_idx)
    b = packing.rows
    own = ALL_ATTENTION_FUNCTIONS[packing.attention]
    q_decode = query[0, :, :b].transpose(0, 1).unsqueeze(2)  # [B, Hq, 1, D]
    if packing.prefix is None:
        decoded, _ = own(module, q_decode, dk, dv, packing.decode_mask, scaling=scaling, dropout=dropout)
    else:
        decoded, _ = cascade_attention(module, q_decode, dk, dv, packing.decode_mask, scaling=scaling,
                                       **{PREFIX_KWARG: packing.prefix})
    parts, start = [decoded.transpose(0, 1).reshape(1, b, *decoded.shape[2:])], b
    for (rk, rv), n, mask in zip(riders, packing.rider_tokens, packing.rider_masks):
        parts.append(own(module, query[:, :, start:start + n], rk, rv, mask, scaling=scaling, dropout=dropout)[0])
        start += n
    return torch.cat(parts, dim=1), None


AttentionInterface.register(NAME, packed_attention)


@contextlib.contextmanager
def packed_attention_for(text_config) -> Iterator[str]:
    """The language model's layers call `packed_attention` inside the block (the caller holds the
    engine's lock: no other forward runs meanwhile); yields the implementation it replaced."""
    before = text_config._attn_implementation_internal
    text_config._attn_implementation_internal = NAME
    try:
        yield before
    finally:
        text_config._attn_implementation_internal = before
