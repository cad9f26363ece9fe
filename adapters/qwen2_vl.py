"""Qwen2-VL and Qwen2.5-VL: sectioned M-RoPE, no deepstack, patch 14 (factor 28)."""

from __future__ import annotations

import torch

from mmkv.errors import ModelLoadError

from .base import VisualGrid, VLAdapter


class Qwen2VLAdapter(VLAdapter):
    family = "qwen2_vl"
    model_types = ("qwen2_vl", "qwen2_5_vl")
    rope_layout_name = "sectioned"

    def video_grid(self, grid_thw: tuple[int, int, int], sample_fps: float) -> VisualGrid:
        """Qwen2.5-VL spaces groups by second_per_grid_t = temporal_patch_size / sample_fps (its
        processor's) times the vision config's tokens_per_second; Qwen2-VL has neither: 1 per group."""
        tokens_per_second = getattr(self.config.vision_config, "tokens_per_second", None)
        if tokens_per_second is None:
            return VisualGrid(self.video_token_id, grid_thw)
        seconds = self.config.vision_config.temporal_patch_size / sample_fps
        return VisualGrid(self.video_token_id, grid_thw, seconds, tokens_per_second)

    @staticmethod
    def _axis_of_freq(section: list[int], n_freq: int) -> torch.Tensor:
        """`mrope_section` [t, h, w] splits the frequencies into contiguous temporal, height and
        width groups (transformers' `recomposition_frequencies`: chunk i takes axis i % 3)."""
        if sum(section) != n_freq:
            raise ModelLoadError(f"mrope_section {section} does not cover {n_freq} rotary frequencies")
        return torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])
