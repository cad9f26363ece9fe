"""Move cached keys to new positions by rotating them, never by recomputing them.

Keys are cached after RoPE and values carry no position, so a key computed at position ids P
becomes the key at P' by rotating each frequency j by (P'[axis(j)] - P[axis(j)]) * inv_freq[j].
The rotate-half layout pairs channel i with channel i + head_dim/2.

A moved chunk changes every token's position by the same amount per axis, so its rotation is
one cos/sin vector ([head_dim]), not a per-token table: `rotate_into` applies it
straight into a slice of a preallocated cache at about copy speed. On CPU that is one fused
pass (a small numba kernel: each key read once, each output written once); elementwise torch
ops need three passes over the keys (`rotate_into_torch`, also the path for other devices).
`place_layers` places every layer of a chunk (keys turned, values copied) in one kernel call:
for a small chunk the per-layer Python and dispatch cost, not the bytes, was the splice's time.
"""

from __future__ import annotations

import numba
import numba.core.cgutils
import numba.extending
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
    inv_freq, axis = _rope_arrays(rope)
    angles = np.asarray(delta, dtype=np.float64)[axis] * inv_freq  # numpy: a few us, torch's small ops ~100 us
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    return torch.from_numpy(np.concatenate((cos, cos))), torch.from_numpy(np.concatenate((-sin, sin)))


def _rope_arrays(rope: RopeLayout) -> tuple[np.ndarray, np.ndarray]:
    """The rope's inv_freq (float64) and axis of each frequency as numpy arrays, made once per
    layout (kept on the frozen layout object, outside its fields)."""
    arrays = rope.__dict__.get("_arrays")
    if arrays is None:
        arrays = (rope.inv_freq.detach().cpu().double().numpy(), rope.axis_of_freq.detach().cpu().numpy())
        object.__setattr__(rope, "_arrays", arrays)
    return arrays


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


@numba.extending.intrinsic
def _as_pointer(typingctx, address):  # pragma: no cover - JIT
    """An integer address as a void pointer (for numba.carray), inside a jitted function."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], numba.core.cgutils.voidptr_t)
    return numba.types.voidptr(address), codegen


@numba.njit(nogil=True, cache=True)
def _place_layers(jobs, heads, rows, dim, cos, sin, rotate):  # pragma: no cover - JIT
    """For each layer (a row of `jobs`: destination keys, source keys, destination values, source
    values, each as address, head stride, row stride in elements), write the source rows into
    the destination rows: keys turned by (cos, signed sin) when `rotate`, else copied; values
    copied. One call for every layer of a chunk: the per-layer Python cost is gone."""
    half = dim // 2
    for j in range(jobs.shape[0]):
        for t in range(4):
            base = jobs[j, 3 * t]
            span = (heads - 1) * jobs[j, 3 * t + 1] + (rows - 1) * jobs[j, 3 * t + 2] + dim
            if t == 0:
                dk = numba.carray(_as_pointer(base), (span,), np.float32)
            elif t == 1:
                sk = numba.carray(_as_pointer(base), (span,), np.float32)
            elif t == 2:
                dv = numba.carray(_as_pointer(base), (span,), np.float32)
            else:
                sv = numba.carray(_as_pointer(base), (span,), np.float32)
        for h in range(heads):
            for r in range(rows):
                o, k = h * jobs[j, 1] + r * jobs[j, 2], h * jobs[j, 4] + r * jobs[j, 5]
                dst, src = dk[o:o + dim], sk[k:k + dim]
                if rotate:
                    for i in range(half):
                        x1, x2 = src[i], src[i + half]
                        dst[i] = x1 * cos[i] + x2 * sin[i]
                        dst[i + half] = x2 * cos[i + half] + x1 * sin[i + half]
                else:
                    for i in range(dim):
                        dst[i] = src[i]
                o, k = h * jobs[j, 7] + r * jobs[j, 8], h * jobs[j, 10] + r * jobs[j, 11]
                dst, src = dv[o:o + dim], sv[k:k + dim]
                for i in range(dim):
                    dst[i] = src[i]


def _rows_view(t: torch.Tensor, heads: int, dim: int, first: int, rows: int):
    """(address of row `first` of head 0, head stride, row stride) of a CPU float32 tensor
    [heads, L, dim] or [1, heads, L, dim] whose rows are contiguous and hold rows first..first+rows;
    None otherwise. (Plain attribute reads only: this runs per layer on the splice's hot path.)"""
    shape, stride = t.shape, t.stride()
    if len(shape) == 4 and shape[0] == 1:
        shape, stride = shape[1:], stride[1:]
    if (len(shape) != 3 or t.dtype != torch.float32 or t.device.type != "cpu" or t.requires_grad
            or shape[0] != heads or shape[2] != dim or stride[2] != 1 or first < 0 or first + rows > shape[1]):
        return None
    return t.data_ptr() + 4 * first * stride[1], stride[0], stride[1]


def place_layers(dst_keys: list[torch.Tensor], dst_values: list[torch.Tensor], at: int,
                 src_keys: list[torch.Tensor], src_values: list[torch.Tensor], first: int, stop: int,
                 turn: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Write source rows [first, stop) of every layer's keys and values ([kv_heads, L, D]) into
    destination rows [at, at + stop - first) ([1, kv_heads, L', D]), keys turned by `turn`
    (`rotation`'s cos, signed sin) or copied when None: one fused call for all layers. Returns
    False, having written nothing, unless every tensor is a CPU float32 one with contiguous rows
    and the rows fit (the caller then goes layer by layer)."""
    n = stop - first
    if not dst_keys or n <= 0 or not (len(dst_keys) == len(dst_values) == len(src_keys) == len(src_values)):
        return False
    heads, dim = src_keys[0].shape[0], src_keys[0].shape[-1]
    jobs = []
    for tensors in zip(dst_keys, src_keys, dst_values, src_values):
        for x, start in zip(tensors, (at, first, at, first)):
            view = _rows_view(x, heads, dim, start, n)
            if view is None:
                return False
            jobs.extend(view)
    jobs = np.array(jobs, dtype=np.int64).reshape(len(dst_keys), 12)
    if turn is None:
        cos = sin = np.zeros(dim, dtype=np.float32)
    else:
        cos, sin = (x.cpu().numpy() for x in turn)
    _place_layers(jobs, heads, n, dim, cos, sin, turn is not None)
    return True


def place_rows(dst_keys: list[torch.Tensor], dst_values: list[torch.Tensor], at: int,
               src_keys: list[torch.Tensor], src_values: list[torch.Tensor], first: int, stop: int,
               turn: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """`place_layers`, or where it cannot (another device or dtype, rows it cannot view) the same
    layer by layer: source rows [first, stop) into destination rows [at, ...) of every layer
    ([kv_heads, L, D] or [1, kv_heads, L, D]), keys turned by `turn` (copied when None), values
    copied."""
    if place_layers(dst_keys, dst_values, at, src_keys, src_values, first, stop, turn):
        return
    n = stop - first
    for dk, dv, sk, sv in zip(dst_keys, dst_values, src_keys, src_values):
        k = (dk[0] if dk.dim() == 4 else dk)[:, at:at + n]
        v = (dv[0] if dv.dim() == 4 else dv)[:, at:at + n]
        rows = sk[:, first:stop].to(k.device)
        if turn is None:
            k.copy_(rows)
        else:
            rotate_into(k, rows, *turn)
        v.copy_(sv[:, first:stop])


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
