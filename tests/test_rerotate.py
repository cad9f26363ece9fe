"""Re-rotation: keys computed at P and moved to P' equal keys computed at P' by the model itself."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from mmkv.adapters import load_adapter
from mmkv.errors import RopeNotComposableError
from mmkv.kv.rerotate import reposition_keys, target_positions
from mmkv.request.splice import precompile_image
from mmkv.testing.tiny import FAMILIES, save_tiny_checkpoint

from conftest import make_png

TOL = 1e-5  # float32, for keys of unit scale: the bound is TOL * max(1, max |k|)


@pytest.fixture(scope="module")
def adapters(tiny_dirs):
    return {fam: load_adapter(d, dtype=torch.float32, device="cpu") for fam, d in tiny_dirs.items()}


def test_axis_maps_match_transformers_rotary(adapters):
    """For positions moving along one axis only, the model's cos differs from 1 exactly on the
    frequencies the layout assigns to that axis."""
    for fam, ad in adapters.items():
        rotary = ad.language_model.rotary_emb
        for axis in range(3):
            pos = torch.zeros(3, 1, 1, dtype=torch.long)
            pos[axis] = 7
            cos, _ = rotary(torch.zeros(1, dtype=torch.float32), pos)
            half = cos.shape[-1] // 2
            moved = (cos[0, 0, :half] - 1).abs() > 1e-6
            assert torch.equal(moved, ad.rope.axis_of_freq == axis), (fam, axis)
    assert adapters["qwen2_5_vl"].rope.axis_of_freq.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert adapters["qwen3_vl"].rope.axis_of_freq.tolist() == [0, 1, 2, 0, 1, 2, 0, 0]


def _chunk_at(ad, grid, feats, anchor, shift_by_axis):
    """Prefill anchor + image span in isolation with every position shifted by (dt, dh, dw)."""
    span = ad.image_span_ids(grid)
    ids = torch.cat((anchor, span))
    pos = ad.native_positions(ids, [grid]) + torch.tensor(shift_by_axis).view(3, 1)
    cache = ad.new_cache()
    ad.forward(ids, pos, cache, feats)
    a = anchor.numel()
    return pos[:, a:], [layer.keys[0, :, a:] for layer in cache.layers]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["native", "temporal"])
@pytest.mark.parametrize("delta", [-9, 1, 5, 40, 300, 4000])
def test_reposition_equals_direct_prefill(adapters, family, policy, delta):
    ad = adapters[family]
    pixels, grid = ad.preprocess_image(Image.open(io.BytesIO(make_png(90, 60))))
    feats = ad.encode_image(pixels, grid)
    anchor = torch.tensor(ad.tokenizer("<|im_start|>user\n")["input_ids"])
    base = 50  # room for negative deltas
    src_pos, src_keys = _chunk_at(ad, grid, feats, anchor, (base, base, base))
    shift = (base + delta,) * 3 if policy == "native" else (base + delta, base, base)
    dst_pos, dst_keys = _chunk_at(ad, grid, feats, anchor, shift)
    native_target = src_pos + delta
    assert torch.equal(target_positions(native_target, src_pos, policy), dst_pos)
    worst = max((reposition_keys(k, src_pos, dst_pos, ad.rope) - d).abs().max().item()
                for k, d in zip(src_keys, dst_keys))
    # The model itself computes angles as float32 position * inv_freq: past ~1k positions its own
    # keys carry a rounding of ~position * 2^-24 rad, which bounds any comparison with them.
    key_scale = max(k.abs().max().item() for k in dst_keys)
    far = dst_pos.max().item() >= 1024
    tol = 4 * dst_pos.max().item() * 2**-24 * key_scale if far else TOL * max(1.0, key_scale)
    print(f"{family} {policy} delta={delta}: max |diff| {worst:.2e} (tol {tol:.1e}, max |k| {key_scale:.1f})")
    assert worst <= tol, f"{family} {policy} delta={delta}: max |diff| {worst:.2e} > {tol:.1e}"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_temporal_only_rotation_is_wrong_against_native_positions(adapters, family):
    """MECHANISM.md 2: rotating only temporal channels is as wrong as no rotation against native
    positions; the test guards that the two policies really differ."""
    ad = adapters[family]
    pixels, grid = ad.preprocess_image(Image.open(io.BytesIO(make_png(90, 60))))
    feats = ad.encode_image(pixels, grid)
    entry = precompile_image(ad, feats, grid, "k", torch.empty(0, dtype=torch.long))
    native = entry.position_ids + 30
    _, direct = _chunk_at(ad, grid, feats, torch.empty(0, dtype=torch.long), (30, 30, 30))
    temporal_only = target_positions(native, entry.position_ids, "temporal")
    wrong = max((reposition_keys(k, entry.position_ids, temporal_only, ad.rope) - d).abs().max().item()
                for k, d in zip(entry.keys, direct))
    right = max((reposition_keys(k, entry.position_ids, native, ad.rope) - d).abs().max().item()
                for k, d in zip(entry.keys, direct))
    scale = max(1.0, max(d.abs().max().item() for d in direct))
    assert right <= TOL * scale and wrong > 100 * TOL * scale


def test_reposition_keeps_dtype_and_is_identity_at_zero(adapters):
    ad = adapters["qwen2_5_vl"]
    k = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    pos = torch.arange(5).expand(3, 5)
    assert reposition_keys(k, pos, pos, ad.rope) is k
    moved = reposition_keys(k, pos, pos + 3, ad.rope)
    assert moved.dtype == torch.bfloat16
    back = reposition_keys(moved.float(), pos + 3, pos, ad.rope)
    torch.testing.assert_close(back, k.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 1024,
                                   "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}])
def test_non_composable_rope_is_refused(tmp_path, rope):
    params = {"rope_theta": 10000.0, "mrope_section": [2, 3, 3], **rope}
    d = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "m", text={"rope_parameters": params})
    with pytest.raises(RopeNotComposableError, match="does not compose"):
        load_adapter(d, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("shape,at", [((2, 37, 16), 5), ((1, 2, 300, 128), 11)])
@pytest.mark.parametrize("delta", [(1, 1, 1), (-9, 4, 700), (4000, 4000, 4000)])
def test_fused_rotate_into_equals_the_three_pass_version_and_a_float64_rotation(adapters, shape, at, delta):
    """The one-pass CPU kernel writes into a slice of a larger cache (as the splice does) what the
    elementwise torch version writes, and both match the rotation done in float64."""
    from mmkv.kv.rerotate import _flat_rows, rotate_half, rotate_into, rotate_into_torch, rotation

    torch.manual_seed(0)
    *lead, n, d = shape
    head_dim = adapters["qwen2_5_vl"].rope.inv_freq.numel() * 2
    rope = adapters["qwen2_5_vl"].rope if d == head_dim else _rope_of(d)
    keys = torch.randn(*lead, n, d)
    cache = torch.full((*lead, n + at + 3, d), float("nan"))
    fused, three = cache[..., at:at + n, :], cache.clone()[..., at:at + n, :]
    assert _flat_rows(fused, keys) is not None  # the kernel's path, not the fallback
    cos, sin = rotation(delta, rope)
    rotate_into(fused, keys, cos, sin)
    rotate_into_torch(three, keys, cos, sin)
    angles = torch.tensor(delta, dtype=torch.float64)[rope.axis_of_freq] * rope.inv_freq.double()
    c, s = torch.cat((angles.cos(), angles.cos())), torch.cat((angles.sin(), angles.sin()))
    exact = keys.double() * c + rotate_half(keys.double()) * s
    assert (fused.double() - exact).abs().max().item() <= 1e-6 * keys.abs().max().item()
    assert (fused - three).abs().max().item() <= 1e-6
    assert cache[..., :at, :].isnan().all() and cache[..., at + n:, :].isnan().all()  # nothing outside the slice


def _rope_of(d: int):
    from mmkv.adapters import RopeLayout

    half = d // 2
    inv = 1.0 / (100.0 ** (torch.arange(half, dtype=torch.float32) / half))
    return RopeLayout(inv, torch.tensor([0, 0, 1, 1, 1, 2, 2, 2] * (half // 8)), "sectioned")


def test_rotate_into_falls_back_where_the_kernel_does_not_apply(adapters):
    """Strided rows or another dtype take the torch path, with the same result."""
    from mmkv.kv.rerotate import _flat_rows, rotate_into, rotate_into_torch, rotation

    rope = adapters["qwen2_5_vl"].rope
    d = rope.inv_freq.numel() * 2
    cos, sin = rotation((3, 3, 3), rope)
    keys = torch.randn(2, d, 9).transpose(-1, -2)  # [2, 9, d], rows not contiguous
    assert _flat_rows(torch.empty(2, 9, d), keys) is None
    torch.testing.assert_close(rotate_into(torch.empty(2, 9, d), keys, cos, sin),
                               rotate_into_torch(torch.empty(2, 9, d), keys, cos, sin), atol=1e-6, rtol=0)
    half = torch.randn(2, 9, d, dtype=torch.bfloat16)
    got = rotate_into(torch.empty_like(half), half, cos, sin)
    assert got.dtype == torch.bfloat16 and torch.equal(got, rotate_into_torch(torch.empty_like(half), half, cos, sin))


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("first,stop,at", [(0, 37, 5), (4, 30, 0), (36, 37, 60)])
def test_place_layers_equals_layer_by_layer_and_writes_only_its_rows(adapters, rotate, first, stop, at):
    """The one-call placement of every layer (the splice's CPU path) writes exactly what rotating
    each layer's key rows into the cache and copying its value rows writes, and nothing else."""
    from mmkv.kv.rerotate import place_layers, rotate_into, rotation

    torch.manual_seed(1)
    rope = adapters["qwen2_5_vl"].rope
    d, heads, layers = rope.inv_freq.numel() * 2, 2, 3
    keys = [torch.randn(heads, 37, d) for _ in range(layers)]
    values = [torch.randn(heads, 37, d) for _ in range(layers)]
    turn = rotation((-9, 4, 700), rope) if rotate else None
    n = stop - first
    dst_k = [torch.full((1, heads, at + n + 4, d), float("nan")) for _ in range(layers)]
    dst_v = [x.clone() for x in dst_k]
    assert place_layers(dst_k, dst_v, at, keys, values, first, stop, turn)
    for dk, dv, k, v in zip(dst_k, dst_v, keys, values):
        want = torch.empty(heads, n, d)
        if rotate:
            rotate_into(want, k[:, first:stop], *turn)
        else:
            want.copy_(k[:, first:stop])
        assert torch.equal(dk[0, :, at:at + n], want) and torch.equal(dv[0, :, at:at + n], v[:, first:stop])
        for x in (dk, dv):
            assert x[0, :, :at].isnan().all() and x[0, :, at + n:].isnan().all()


def test_place_layers_refuses_what_it_cannot_place_and_writes_nothing(adapters):
    """Rows that do not fit, another dtype, strided rows or mismatched heads: False, the cache
    untouched (the caller goes layer by layer)."""
    from mmkv.kv.rerotate import place_layers, rotation

    rope = adapters["qwen2_5_vl"].rope
    d = rope.inv_freq.numel() * 2
    turn = rotation((3, 3, 3), rope)
    keys, values = [torch.randn(2, 9, d)] * 2, [torch.randn(2, 9, d)] * 2

    def cache(n=12, dtype=torch.float32, heads=2):
        return [torch.full((1, heads, n, d), 7.0, dtype=dtype) for _ in range(2)]

    cases = [
        (cache(), cache(), 4, keys, values, 0, 9),  # rows 4..13 of a 12-slot cache
        (cache(), cache(), 0, keys, values, 0, 10),  # source rows past the chunk
        (cache(dtype=torch.bfloat16), cache(dtype=torch.bfloat16), 0, keys, values, 0, 9),
        (cache(), cache(), 0, [torch.randn(2, d, 9).transpose(-1, -2)] * 2, values, 0, 9),
        (cache(heads=1), cache(heads=1), 0, keys, values, 0, 9),
    ]
    for dk, dv, at, k, v, first, stop in cases:
        assert not place_layers(dk, dv, at, k, v, first, stop, turn)
        assert all((x == 7).all() for x in dk + dv)
    # (a bad layer after good ones: nothing is written to the good ones either)
    dk, dv = cache(), cache()
    assert not place_layers(dk, dv, 0, [keys[0], keys[0].to(torch.float64)], values, 0, 9, turn)
    assert all((x == 7).all() for x in dk + dv)
