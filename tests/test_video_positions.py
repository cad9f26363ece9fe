"""Video position ids exactly as the released models are served (vLLM, transformers 4.x): checked
against an independent, token-by-token implementation of that rule written here, against
transformers' own `get_rope_index` where the two rules agree (images, Qwen3-VL frames, a short
Qwen2.5-VL video), and the case where transformers 5.x departs from it, shown."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmkv.adapters import VisualGrid, load_adapter, mrope_positions
from mmkv.testing.tiny import QWEN3_FAMILIES

IMG, VID, TEXT = 100, 101, 7


def vllm_rule(tokens: list[int], grids: list[VisualGrid], merge: int) -> list[tuple[int, int, int]]:
    """The 4.x / vLLM loop, token by token: each visual run starts at st (the previous max + 1);
    its pad k of group ti, row hi, column wi sits at (st + int(f32(f32(ti * sec) * tps)), st + hi,
    st + wi); text runs count up from st."""
    out, st, k, it = [], 0, 0, iter(grids)
    while k < len(tokens):
        if tokens[k] in (IMG, VID):
            g = next(it)
            t, h, w = g.grid_thw[0], g.grid_thw[1] // merge, g.grid_thw[2] // merge
            sec = np.float32(g.second_per_grid_t)
            run = [(st + int(np.float32(np.float32(ti * sec) * np.float32(g.tokens_per_second))), st + hi, st + wi)
                   for ti in range(t) for hi in range(h) for wi in range(w)]
            k += len(run)
        else:
            run = [(st, st, st)]
            k += 1
        out += run
        st = max(max(p) for p in run) + 1 if tokens[k - 1] in (IMG, VID) else st + 1
    return out


def _prompt(parts):
    tokens, grids = [], []
    for p in parts:
        if isinstance(p, int):
            tokens += [TEXT] * p
        else:
            grids.append(p)
            t, h, w = p.grid_thw
            tokens += [p.token_id] * (t * h * w // 4)
    return tokens, grids


CASES = {
    "issue example (8, 8, 8) video": [3, VisualGrid(VID, (8, 16, 16), 1.0, 2), 5],
    "fps 1.9": [2, VisualGrid(VID, (5, 4, 6), 2 / 1.9, 2), 3],
    "fps 3 (0.667 s a group)": [2, VisualGrid(VID, (7, 2, 2), 2 / 3, 2), 1],
    "tokens_per_second 25": [1, VisualGrid(VID, (3, 4, 4), 1.0, 25), 2],
    "image then video then image": [2, VisualGrid(IMG, (1, 6, 4)), 1, VisualGrid(VID, (4, 2, 2), 0.5, 4), 2,
                                    VisualGrid(IMG, (1, 2, 8)), 2],
    "qwen3 frames": [1, VisualGrid(VID, (1, 4, 4)), 3, VisualGrid(VID, (1, 4, 4)), 3, VisualGrid(VID, (1, 4, 4)), 2],
}


@pytest.mark.parametrize("case", list(CASES))
def test_positions_equal_the_reference_rule(case):
    tokens, grids = _prompt(CASES[case])
    got = mrope_positions(torch.tensor(tokens), grids, 2)
    assert got.T.tolist() == [list(p) for p in vllm_rule(tokens, grids, 2)]


def test_text_after_a_long_video_starts_past_its_temporal_extent():
    """The issue's example: text after an (8, 8, 8) video at 2 tokens a group starts at 1 + 14 + 1."""
    tokens, grids = _prompt([1, VisualGrid(VID, (8, 16, 16), 1.0, 2), 2])
    pos = mrope_positions(torch.tensor(tokens), grids, 2)
    assert pos[0, 1:-2].max() == 1 + 14 and pos[:, -2].tolist() == [16, 16, 16]


@pytest.fixture(scope="module")
def adapters(tiny_dirs):
    return {f: load_adapter(tiny_dirs[f], dtype=torch.float32, device="cpu")
            for f in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")}


def _hf(adapter, ids, images, videos, seconds=None):
    mm = (ids == adapter.image_token_id).int() + 2 * (ids == adapter.video_token_id).int()
    extra = {"second_per_grid_ts": torch.tensor(seconds)} if seconds is not None else {}
    pos, _ = adapter.model.model.get_rope_index(
        ids.view(1, -1), mm_token_type_ids=mm.view(1, -1),
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None, **extra)
    return pos[:, 0]


def _ids(adapter, parts):
    ids = []
    for p in parts:
        ids += [50] * p if isinstance(p, int) else [p.token_id] * (int(np.prod(p.grid_thw)) // 4)
    return torch.tensor(ids)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_agrees_with_transformers_where_transformers_is_right(adapters, family):
    """Images, Qwen3-VL's one-group frames (the MoE's own get_rope_index too), and a video no
    longer in time than in space: the two rules agree there."""
    a = adapters[family]
    qwen3 = family in QWEN3_FAMILIES
    video = a.video_grid((1, 8, 8), 8.0) if qwen3 else a.video_grid((2, 8, 8), 8.0)
    parts = [3, VisualGrid(a.image_token_id, (1, 4, 6)), 2, video, 4]
    if qwen3:
        parts += [a.video_grid((1, 8, 8), 8.0), 2]
    ids = _ids(a, parts)
    grids = [p for p in parts if not isinstance(p, int)]
    images = [list(g.grid_thw) for g in grids if g.token_id == a.image_token_id]
    videos = [[2, 8, 8]]  # Qwen3-VL splits a (2, h, w) grid per frame
    seconds = [g.second_per_grid_t for g in grids if g.token_id == a.video_token_id] if family == "qwen2_5_vl" \
        else None
    assert torch.equal(a.positions(ids, grids), _hf(a, ids, images, videos, seconds))


def test_transformers_5_departs_after_a_long_qwen2_5_video(adapters):
    """transformers 5.x starts the text after an 8-group video at s + max(h, w) (inside the video's
    temporal extent), while mmkv, vLLM and transformers 4.x start it past the video's last id."""
    a = adapters["qwen2_5_vl"]
    video = a.video_grid((8, 4, 4), 2.0)
    parts = [1, video, 3]
    ids = _ids(a, parts)
    ours, theirs = a.positions(ids, [video]), _hf(a, ids, [], [[8, 4, 4]], [video.second_per_grid_t])
    n = ids.numel()
    assert torch.equal(ours[:, :n - 3], theirs[:, :n - 3])
    last_video = int(ours[:, 1:n - 3].max())
    assert ours[:, n - 3].tolist() == [last_video + 1] * 3
    assert theirs[:, n - 3].tolist() == [1 + 2] * 3 and last_video + 1 > 3
