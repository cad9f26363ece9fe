"""Move cached keys to new positions by rotating them, never by recomputing them.

Keys are cached after RoPE and values carry no position, so a key computed at position ids P
becomes the key at P' by rotating each frequency j by (P'[axis(j)] - P[axis(j)]) * inv_freq[j].
The rotate-half layout pairs channel i with channel i + head_dim/2.

A moved chunk changes every token's position by the same amount per axis, so its rotation is
one cos/sin vector ([head_dim]), not a per-token table: `rotate_into` applies it
straight into a slice of a preallocated cache at about copy speed.
"""

from __future__ import annotations

import torch

from mmkv.adapters import RopeLayout

POLICIES = ("native", "temporal", "none")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def constant_delta(from_pos: torch.Tensor, to_pos: torch.Tensor) -> tuple[int, int, int] | None:
    """The per-axis position change (dt, dh, dw) if every token of [3, L] moves by the same one."""
    delta = to_pos - from_pos
    first = delta[:, :1]
    if not torch.equal(delta, first.expand_as(delta)):
        return None
    return tuple(int(d) for d in first[:, 0]) if delta.numel() else (0, 0, 0)


def rotation(delta: tuple[int, int, int], rope: RopeLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [head_dim] (float32) for a constant per-axis change, laid out for
    `rotate_into`: cos of each frequency's angle twice, then (-sin, sin). Angles in float64, as in
    `reposition_keys`."""
    angles = torch.tensor(delta, dtype=torch.float64)[rope.axis_of_freq] * rope.inv_freq.to(torch.float64)
    cos, sin = angles.cos().float(), angles.sin().float()
    return torch.cat((cos, cos)), torch.cat((-sin, sin))


def rotate_into(out: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Write `keys` [..., L, D] turned by `rotation`'s (cos, signed sin) [D] into `out` (same
    shape; typically a slice of a preallocated cache): out = k cos + rotate_half(k) sin, in three
    elementwise passes and no temporaries. Float32 keys rotate directly; other dtypes rotate in
    float32 and are cast back once."""
    if keys.dtype != torch.float32:
        out.copy_(rotate_into(torch.empty(keys.shape, device=keys.device), keys.float(), cos, sin))
        return out
    cos, sin = cos.to(keys.device), sin.to(keys.device)
    half = keys.shape[-1] // 2
    torch.mul(keys, cos, out=out)
    out[..., :half].addcmul_(keys[..., half:], sin[:half])  # x1 cos - x2 sin
    out[..., half:].addcmul_(keys[..., :half], sin[half:])  # x2 cos + x1 sin
    return out


def reposition_keys(keys: torch.Tensor, from_pos: torch.Tensor, to_pos: torch.Tensor, rope: RopeLayout) -> torch.Tensor:
    """Keys [..., L, D] computed at position ids `from_pos` [3, L], as if computed at `to_pos` [3, L].

    Each frequency turns by its own axis' delta. Angles in float64, rotation in float32, then cast
    back to the keys' dtype.
    """
    delta = (to_pos - from_pos).to(torch.float64)  # [3, L]
    if not delta.any():
        return keys
    shift = constant_delta(from_pos, to_pos)
    if shift is not None:
        return rotate_into(torch.empty_like(keys), keys, *rotation(shift, rope))
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
