"""Cascade attention (mmkv/kv/cascade.py): a decode step over a prefix held once plus each row's
own slots equals the same step over every row holding the prefix itself.

Oracle: `forward_decode` over a plain cache whose rows are [prefix, own], with the model's own
attention; float32, relative to the largest logit, within 1e-5."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from mmkv import Engine


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def adapter(request, tiny_dirs):
    return Engine.from_pretrained(tiny_dirs[request.param], dtype=torch.float32, device="cpu").adapter


def _mask(pad: list[int], slots: int) -> torch.Tensor:
    visible = torch.arange(slots)[None, :] >= torch.tensor(pad)[:, None]
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[:, None, None, :]


def test_a_step_over_a_shared_prefix_equals_every_row_holding_it(adapter):
    torch.manual_seed(0)
    cfg = adapter.text_config
    heads, dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    p, k, pad = 40, 7, [0, 2, 4]
    prefix = [(torch.randn(1, heads, p, dim), torch.randn(1, heads, p, dim)) for _ in range(adapter.num_layers)]
    own = [(torch.randn(3, heads, k, dim), torch.randn(3, heads, k, dim)) for _ in range(adapter.num_layers)]
    whole, part = adapter.new_cache(), adapter.new_cache()
    for i, ((pk, pv), (ok, ov)) in enumerate(zip(prefix, own)):
        whole.update(torch.cat((pk.expand(3, -1, -1, -1), ok), 2), torch.cat((pv.expand(3, -1, -1, -1), ov), 2), i)
        part.update(ok.clone(), ov.clone(), i)
    tokens, positions = torch.tensor([5, 6, 7]), torch.tensor([50, 51, 52])
    # whole rows: [prefix, padding, own]; the prefix visible to every row
    visible = _mask([0, 0, 0], p + k + 1)
    visible[..., p:] = _mask(pad, k + 1)
    want = adapter.forward_decode(tokens, positions, whole, visible)
    got = adapter.forward_decode(tokens, positions, part, _mask(pad, k + 1), shared_prefix=prefix)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert adapter.text_config._attn_implementation == "sdpa"  # the model's own attention is back
