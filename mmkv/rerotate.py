"""Move cached keys to new positions by rotating them, never by recomputing them.

Keys are cached after RoPE and values carry no position, so a key computed at position ids P
becomes the key at P' by rotating each frequency j by (P'[axis(j)] - P[axis(j)]) * inv_freq[j].
The rotate-half layout pairs channel i with channel i + head_dim/2.

A moved chunk changes every token's position by the same amount per axis, so its rotation is
one cos/sin vector ([head_dim]), not a per-token table: `rotate_into` applies it
straight into a slice of a preallocated cache at about copy speed. On CPU that is one fused
pass (a small numba kernel: each key read once, each output written once); elementwise torch
ops need three passes over the keys (`rotate_into_torch`, also the path for other devices).
"""

from __future__ import annotations

import numba
import numpy as np
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
    shape; typically a slice of a preallocated cache): out = k cos + rotate_half(k) sin, with no
    temporaries. Float32 keys on CPU with contiguous rows (a cache slice, a chunk's slice) go
    through the fused kernel, one pass; anything else through `rotate_into_torch`."""
    flat = _flat_rows(out, keys) if keys.dtype == out.dtype == torch.float32 else None
    if flat is None:
        return rotate_into_torch(out, keys, cos, sin)
    (o, o_head, o_row), (k, k_head, k_row), heads = flat
    _rotate_rows(o, o_head, o_row, k, k_head, k_row, heads, keys.shape[-2], keys.shape[-1],
                 cos.cpu().numpy(), sin.cpu().numpy())
    return out


def rotate_into_torch(out: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate_into` in three elementwise torch passes (any device). Float32 keys rotate
    directly; other dtypes rotate in float32 and are cast back once."""
    if keys.dtype != torch.float32:
        out.copy_(rotate_into_torch(torch.empty(keys.shape, device=keys.device), keys.float(), cos, sin))
        return out
    cos, sin = cos.to(keys.device), sin.to(keys.device)
    half = keys.shape[-1] // 2
    torch.mul(keys, cos, out=out)
    out[..., :half].addcmul_(keys[..., half:], sin[:half])  # x1 cos - x2 sin
    out[..., half:].addcmul_(keys[..., :half], sin[half:])  # x2 cos + x1 sin
    return out


def _flat_rows(out: torch.Tensor, keys: torch.Tensor):
    """Each of `out` and `keys` [..., L, D] as (1-D float32 array over its memory, stride of the
    flattened leading dim, row stride), and the leading size: what the kernel indexes. None unless
    both are CPU tensors whose rows are contiguous and whose leading dims flatten to one."""
    if out.shape != keys.shape or keys.dim() < 2 or out.device.type != "cpu" or keys.device.type != "cpu":
        return None
    views = []
    for t in (out, keys):
        if t.dim() != 3:
            try:
                t = t.view(-1, *t.shape[-2:])  # a view: a copy would be written in vain
            except RuntimeError:
                return None
        heads, rows, dim = t.shape
        s_head, s_row, s_col = t.stride()
        if s_col != 1 or t.requires_grad or not t.numel():
            return None
        span = (heads - 1) * s_head + (rows - 1) * s_row + dim
        views.append((torch.as_strided(t, (span,), (1,), t.storage_offset()).numpy(), s_head, s_row))
    return views[0], views[1], t.shape[0]


@numba.njit(nogil=True, cache=True)
def _rotate_rows(out, o_head, o_row, keys, k_head, k_row, heads, rows, dim, cos, sin):  # pragma: no cover - JIT
    """out = keys cos + rotate_half(keys) sin, row by row (rows of `dim` contiguous float32 at
    head * stride + row * stride in the flat arrays; sin signed as `rotation` lays it out): each
    key read once, each output written once. Row slices keep the inner loop's indices
    non-negative, so it vectorises."""
    half = dim // 2
    for h in range(heads):
        for r in range(rows):
            o, k = h * o_head + r * o_row, h * k_head + r * k_row
            dst, src = out[o:o + dim], keys[k:k + dim]
            for i in range(half):
                x1, x2 = src[i], src[i + half]
                dst[i] = x1 * cos[i] + x2 * sin[i]
                dst[i + half] = x2 * cos[i + half] + x1 * sin[i + half]


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
