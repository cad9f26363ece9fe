"""The exact oracle for a splice: one forward pass of the model over the same tokens and
positions with a 4D attention mask, no cache surgery.

A spliced chunk's cached tokens were computed seeing only their own chunk (and the precompile
anchor), while its seam-repaired tokens see everything before them. Later tokens see the
repaired seam tokens *and* the cached rest, whose KV was computed against the isolated seam.
One copy per token cannot express that, so the oracle sequence holds, for each chunk,
[anchor copy][isolated copy of the whole chunk][seam copy of its first k tokens]: the isolated
copy sees only itself and its anchor; the seam copy sees everything before the chunk; later
tokens see the seam copy and the isolated copy's tokens from k on. With k = 0 this is the
plain block mask.
"""

from __future__ import annotations

import torch

from mmkv.adapters import ImageFeatures, VLAdapter
from mmkv.request.splice import Placement, pad_features


def block_masked_logits(adapter: VLAdapter, input_ids: torch.Tensor, positions: torch.Tensor,
                        placements: list[Placement], seam_tokens: int,
                        anchor_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token logits [1, V] after the prompt, from one masked forward (prompt ends in text)."""
    anchor_ids = anchor_ids if anchor_ids is not None else torch.empty(0, dtype=torch.long)
    ids, pos, feats = [], [], []
    sees: list[list[int]] = []  # per oracle token: indices of the keys it may attend to
    main: list[int] = []  # keys visible to ordinary (non-isolated) tokens

    def add(tok_ids, tok_pos, visible_before, features=None):
        first = len(ids)
        for i in range(tok_ids.numel()):
            ids.append(int(tok_ids[i]))
            pos.append(tok_pos[:, i])
            sees.append(visible_before + list(range(first, first + i + 1)))
        if features is not None:
            feats.append(features)
        return list(range(first, len(ids)))

    cursor = 0
    for p in sorted(placements, key=lambda p: p.start):
        main += add(input_ids[cursor:p.start], positions[:, cursor:p.start], main)
        entry = p.entry
        shift = (p.target[:, :1] - entry.position_ids[:, :1])
        a = anchor_ids.numel()
        anchor_pos = torch.arange(a).expand(3, a) + shift
        anchor = add(anchor_ids, anchor_pos, [])
        isolated = add(entry.token_ids, p.target, anchor, entry.features)
        seam = min(seam_tokens, entry.num_tokens)
        repaired = add(entry.token_ids[:seam], p.target[:, :seam], main, pad_features(entry, 0, seam))
        main += repaired + isolated[seam:]
        cursor = p.end
    if cursor >= input_ids.numel():
        raise ValueError("the oracle expects the prompt to end in text")
    add(input_ids[cursor:], positions[:, cursor:], main)

    n = len(ids)
    mask = torch.full((n, n), float("-inf"))
    for q, keys in enumerate(sees):
        mask[q, keys] = 0.0
    logits = adapter.forward(
        torch.tensor(ids), torch.stack(pos, dim=1), None, ImageFeatures.concat(feats),
        attention_mask=mask[None, None].to(adapter.dtype),
    )
    return logits
