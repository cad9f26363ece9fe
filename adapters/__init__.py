"""One adapter per model family; `load_adapter` picks it from the checkpoint's model_type."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkv.errors import ModelLoadError

from .base import ImageFeatures, RopeLayout, VLAdapter, read_model_type
from .qwen2_vl import Qwen2VLAdapter
from .qwen3_vl import Qwen3VLAdapter

ADAPTERS: tuple[type[VLAdapter], ...] = (Qwen2VLAdapter, Qwen3VLAdapter)


def adapter_class(model_type: str) -> type[VLAdapter]:
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls
    supported = sorted(t for cls in ADAPTERS for t in cls.model_types)
    raise ModelLoadError(f"unsupported architecture {model_type!r}; mmkv supports {', '.join(supported)}")


def load_adapter(model_dir: str | Path, dtype: torch.dtype | None = None, device: str | None = None) -> VLAdapter:
    """Load a local checkpoint dir offline with AutoProcessor and the model class."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    cls = adapter_class(read_model_type(model_dir))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    try:
        processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=dtype, local_files_only=True, attn_implementation="sdpa"
        ).to(device)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"could not load the checkpoint in {str(model_dir)!r}: {exc}") from exc
    return cls(model, processor)


__all__ = ["ImageFeatures", "RopeLayout", "VLAdapter", "load_adapter", "adapter_class", "ADAPTERS"]
