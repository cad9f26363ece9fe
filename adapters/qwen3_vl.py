"""Qwen3-VL: interleaved M-RoPE, deepstack visual features in the first LM layers, patch 16."""

from __future__ import annotations

import torch

from .base import ImageFeatures, VLAdapter


class Qwen3VLAdapter(VLAdapter):
    family = "qwen3_vl"
    model_types = ("qwen3_vl",)
    rope_layout_name = "interleaved"

    @staticmethod
    def _axis_of_freq(section: list[int], n_freq: int) -> torch.Tensor:
        """Frequency j takes height if j % 3 == 1 and j < 3 * section[1], width if j % 3 == 2 and
        j < 3 * section[2], else temporal (transformers' interleaved `recomposition_frequencies`)."""
        axis = torch.zeros(n_freq, dtype=torch.long)
        for dim in (1, 2):
            axis[dim : 3 * section[dim] : 3] = dim
        return axis

    def _lm_kwargs(self, is_image: torch.Tensor, features: ImageFeatures | None) -> dict:
        """Deepstack adds per-layer visual features at the image-pad positions of this call."""
        if features is None or not features.deepstack:
            return {}
        return {
            "visual_pos_masks": is_image,
            "deepstack_visual_embeds": [d.to(self.device, self.dtype) for d in features.deepstack],
        }
