"""Move cached keys to new positions by rotating them, never by recomputing them.

Keys are cached after RoPE and values carry no position, so a key computed at position ids P
becomes the key at P' by rotating each frequency j by (P'[axis(j)] - P[axis(j)]) * inv_freq[j].
The rotate-half layout pairs channel i with channel i + head_dim/2.
"""

from __future__ import annotations

import torch

from mmkv.adapters import RopeLayout

POLICIES = ("native", "temporal", "none")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reposition_keys(keys: torch.Tensor, from_pos: torch.Tensor, to_pos: torch.Tensor, rope: RopeLayout) -> torch.Tensor:
    """Keys [..., L, D] computed at position ids `from_pos` [3, L], as if computed at `to_pos` [3, L].

    Each frequency turns by its own axis' delta. Angles in float64, rotation in float32, then cast
    back to the keys' dtype.
    """
    delta = (to_pos - from_pos).to(torch.float64)  # [3, L]
    if not delta.any():
        return keys
    axis = rope.axis_of_freq.to(delta.device)
    angles = delta[axis].T * rope.inv_freq.to(delta.device, torch.float64)  # [L, D/2]
    angles = torch.cat((angles, angles), dim=-1).to(keys.device)
    cos, sin = angles.cos().float(), angles.sin().float()
    k = keys.float()
    return (k * cos + rotate_half(k) * sin).to(keys.dtype)


def target_positions(native: torch.Tensor, cached: torch.Tensor, policy: str) -> torch.Tensor:
    """Where a cached chunk's tokens sit in a new sequence, given the positions [3, L] the model
    would assign there (`native`) and those it was cached at (`cached`).

    - native: exactly the model's own positions; under HF's scheme all three axes move together.
    - temporal: only the temporal axis moves; height and width stay image-intrinsic (as cached).
    - none: the no-rotation control; the chunk sits at native positions but its keys are left as
      cached (the splice is told not to rotate). It must measure worse.
    """
    if policy in ("native", "none"):
        return native
    if policy == "temporal":
        return torch.stack((native[0], cached[1], cached[2]))
    raise ValueError(f"unknown rope policy {policy!r}; expected one of {POLICIES}")
