"""Cascade attention: one decode step of many rows over a prefix they share plus each row's own KV.

The decode batch keeps the KV its rows hold bit-identical once, [1, kv_heads, P, head_dim] per
layer, and each row's own slots [B, kv_heads, K, head_dim]. Attention over the two parts is one
softmax over their concatenated scores; the shared part is read once for all rows (the rows'
queries are the batch of one matrix product per kv head) and never broadcast into a copy.
This is the decode-time half of FlashInfer's cascade / SGLang's shared-prefix attention, on the
model's own projections: transformers calls `cascade_attention` as the layer's attention function
(registered with `AttentionInterface`) while `shared_prefix_attention` is in force, and passes it
the prefix through the forward's keyword arguments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface

NAME = "mmkv_cascade"
PREFIX_KWARG = "mmkv_shared_prefix"


def cascade_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, L, D]; key / value the rows' own [B, Hkv, K, D]; `attention_mask` [B, 1, L, K]
    (0 / -inf) over the own slots only (the prefix is visible to every row). Returns [B, L, Hq, D]
    as transformers' attention functions do."""
    prefix_keys, prefix_values = kwargs[PREFIX_KWARG][module.layer_idx]
    rows, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads  # query head h reads kv head h // group (repeat_kv's order)
    scale = dim ** -0.5 if scaling is None else scaling
    q = query.reshape(rows, kv_heads, group * length, dim)
    shared = torch.einsum("bhqd,hpd->bhqp", q, prefix_keys[0]) * scale
    own = torch.matmul(q, key.transpose(-1, -2)) * scale
    if attention_mask is not None:
        mask = attention_mask[:, :, None].expand(rows, 1, group, length, attention_mask.shape[-1])
        own = own + mask.reshape(rows, 1, group * length, -1)
    weights = torch.softmax(torch.cat((shared, own), dim=-1), dim=-1, dtype=torch.float32).to(query.dtype)
    p = prefix_keys.shape[-2]
    out = torch.einsum("bhqp,hpd->bhqd", weights[..., :p], prefix_values[0]) + torch.matmul(weights[..., p:], value)
    return out.reshape(rows, heads, length, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, cascade_attention)


@contextlib.contextmanager
def shared_prefix_attention(text_config) -> Iterator[None]:
    """The language model's layers call `cascade_attention` inside the block (the caller holds the
    engine's lock: no other forward runs meanwhile), their usual attention after."""
    before = text_config._attn_implementation_internal
    text_config._attn_implementation_internal = NAME
    try:
        yield
    finally:
        text_config._attn_implementation_internal = before
