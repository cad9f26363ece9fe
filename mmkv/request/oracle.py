"""The exact oracle for a splice: one forward pass of the model over the same tokens and
positions with a 4D attention mask, no cache surgery.

A spliced chunk's cached tokens were computed seeing only their own chunk (and the precompile
anchor), while its seam-repaired tokens see everything before them. Later tokens see the
repaired seam tokens *and* the cached rest, whose KV was computed against the isolated seam.
One copy per token cannot express that, so the oracle sequence holds, for each chunk,
[anchor copy][isolated copy of the whole chunk][seam copy of its first k tokens]: the isolated
copy sees only itself and its anchor; the seam copy sees everything before the chunk; later
tokens see the seam copy and the isolated copy's tokens from k on. With k = 0 this is the
plain block mask. A composed turn (mmkv.request.compose) is such a chunk whose isolated copy sees,
instead of the anchor, the context it was computed in (`Seen`), laid out the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmkv.adapters import ImageFeatures, VLAdapter
from mmkv.request.splice import Placement, pad_features


@dataclass(frozen=True)
class Seen:
    """What a composed turn's tokens saw when they were computed (mmkv.request.compose): the prompt
    of the request that computed them, up to their first token (`upto`), as that request placed it:
    its chunks, and its own composed turns with what they saw (`seen`, by placement start)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    placements: list[Placement]
    upto: int
    seen: dict[int, Seen] = field(default_factory=dict)


def block_masked_logits(adapter: VLAdapter, input_ids: torch.Tensor, positions: torch.Tensor,
                        placements: list[Placement], seam_tokens: int,
                        anchor_ids: torch.Tensor | None = None, seen: dict[int, Seen] | None = None) -> torch.Tensor:
    """Next-token logits [1, V] after the prompt, from one masked forward (prompt ends in text).
    `seen`: for a composed turn's placement (by its start), the context its isolated copy sees
    instead of the anchor, itself laid out by the same rules, moved by the turn's position change."""
    anchor_ids = anchor_ids if anchor_ids is not None else torch.empty(0, dtype=torch.long)
    ids, pos, feats = [], [], []
    sees: list[list[int]] = []  # per oracle token: indices of the keys it may attend to

    def add(tok_ids, tok_pos, visible_before, features=None):
        first = len(ids)
        for i in range(tok_ids.numel()):
            ids.append(int(tok_ids[i]))
            pos.append(tok_pos[:, i])
            sees.append(visible_before + list(range(first, first + i + 1)))
        if features is not None:
            feats.append(features)
        return list(range(first, len(ids)))

    def lay_out(tokens, token_pos, chunks, contexts, end, shift) -> list[int]:
        """Tokens [0, end) of a prompt, positions moved by `shift` [3, 1]: the keys its next token sees."""
        main: list[int] = []  # keys visible to ordinary (non-isolated) tokens
        cursor = 0
        for p in sorted(chunks, key=lambda p: p.start):
            if p.start >= end:
                break
            main += add(tokens[cursor:p.start], token_pos[:, cursor:p.start] + shift, main)
            entry, target = p.entry, p.target + shift
            delta = target[:, :1] - entry.position_ids[:, :1]
            context = contexts.get(p.start)
            if context is None:
                a = anchor_ids.numel()
                before = add(anchor_ids, torch.arange(a).expand(3, a) + delta, [])
            else:
                before = lay_out(context.input_ids, context.positions, context.placements, context.seen,
                                 context.upto, delta)
            isolated = add(entry.token_ids, target, before, entry.features)
            seam = min(seam_tokens, entry.num_tokens)
            repaired = add(entry.token_ids[:seam], target[:, :seam], main, pad_features(entry, 0, seam))
            main += repaired + isolated[seam:]
            cursor = p.end
        if cursor < end:
            main += add(tokens[cursor:end], token_pos[:, cursor:end] + shift, main)
        return main

    total = input_ids.numel()
    if any(p.end >= total for p in placements):
        raise ValueError("the oracle expects the prompt to end in text")
    lay_out(input_ids, positions, placements, seen or {}, total, torch.zeros(3, 1, dtype=positions.dtype))

    n = len(ids)
    mask = torch.full((n, n), float("-inf"))
    for q, keys in enumerate(sees):
        mask[q, keys] = 0.0
    logits = adapter.forward(
        torch.tensor(ids), torch.stack(pos, dim=1), None, ImageFeatures.concat(feats),
        attention_mask=mask[None, None].to(adapter.dtype),
    )
    return logits
