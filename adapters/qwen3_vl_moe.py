"""Qwen3-VL MoE (30B-A3B, 235B-A22B): the dense Qwen3-VL's attention, rope and deepstack, with
sparse expert MLPs. The experts change no KV shape or position, so the dense adapter serves it."""

from __future__ import annotations

from .qwen3_vl import Qwen3VLAdapter


class Qwen3VLMoeAdapter(Qwen3VLAdapter):
    family = "qwen3_vl_moe"
    model_types = ("qwen3_vl_moe",)
