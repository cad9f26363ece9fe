"""One copy of the KV that the decode batch's rows have in common.

Eight requests about one long policy (a skill, a system prompt, an image at the same place) load
the same prefix-cache blocks, so their rows in the decode batch start with the same KV. The batch
keeps that run once, `SharedPrefixLayer.prefix_*` [1, kv_heads, P, head_dim], and each row only
its own slots after it: the persistent KV of B rows sharing P tokens is P + sum(private), not
B * P + sum(private).

Sharing is exact by construction: two rows share a slot only where their keys and values are
bit-identical in every layer (`common_prefix_length`), so attention over the shared copy is the
attention each row would compute over its own. Rows whose KV merely agrees to rounding (the same
prompt prefilled twice, each in its own forward) keep their own copies. The attention step reads
the prefix broadcast to every row, concatenated per layer with the rows' slots: a transient of
one layer's size, the same copy `DynamicLayer.update` already makes each step.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class SharedPrefixLayer(DynamicLayer):
    """A decode-batch layer: `keys` / `values` are the rows' own slots [B, H, K, D] (grown by
    `update` as `DynamicLayer`'s), seen after the `prefix_*` every row shares."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self.prefix_keys: torch.Tensor | None = None
        self.prefix_values: torch.Tensor | None = None

    @property
    def prefix_length(self) -> int:
        return 0 if self.prefix_keys is None else self.prefix_keys.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        if self.prefix_keys is None:
            return keys, values
        rows = keys.shape[0]
        return (torch.cat((self.prefix_keys.expand(rows, -1, -1, -1), keys), dim=-2),
                torch.cat((self.prefix_values.expand(rows, -1, -1, -1), values), dim=-2))

    def get_seq_length(self) -> int:
        return self.prefix_length + super().get_seq_length()


def common_prefix_length(a: list[tuple[torch.Tensor, torch.Tensor]],
                         b: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """How many leading slots two single-row caches (per layer (keys, values), [1, H, n, D]) hold
    bit-identical in every layer."""
    n = min(a[0][0].shape[-2], b[0][0].shape[-2])
    same = torch.ones(n, dtype=torch.bool, device=a[0][0].device)
    for (ka, va), (kb, vb) in zip(a, b):
        same &= (ka[0, :, :n] == kb[0, :, :n]).all(dim=-1).all(dim=0)
        same &= (va[0, :, :n] == vb[0, :, :n]).all(dim=-1).all(dim=0)
    differ = (~same).nonzero()
    return n if differ.numel() == 0 else int(differ[0, 0])
