"""Which KV the decode batch's rows have in common, so that it is kept once.

Eight requests about one long policy (a skill, a system prompt, an image at the same place) load
the same prefix-cache blocks, so their rows in the decode batch start with the same KV. The batch
(mmkv.request.batch) keeps that run once, [1, kv_heads, P, head_dim] per layer, and each row only
its own slots after it: the KV of B rows sharing P tokens is P + sum(own), not B * P + sum(own).

Sharing is exact by construction: two rows share a slot only where their keys and values are
bit-identical in every layer (`common_prefix_length`), so attention over the shared copy is the
attention each row would compute over its own. Rows whose KV merely agrees to rounding (the same
prompt prefilled twice, each in its own forward) keep their own copies. The step attends to the
prefix and the rows' own slots by cascade attention (mmkv.kv.cascade): no copy of the prefix.
"""

from __future__ import annotations

import torch


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
