"""One adapter per model family; `load_adapter` picks it from the checkpoint's model_type."""

from __future__ import annotations

from pathlib import Path

import torch

from mmkv.errors import ModelLoadError

from .base import ImageFeatures, RopeLayout, VisualGrid, VLAdapter, mrope_positions, read_model_type
from .qwen2_vl import Qwen2VLAdapter
from .qwen3_vl import Qwen3VLAdapter
from .qwen3_vl_moe import Qwen3VLMoeAdapter

ADAPTERS: tuple[type[VLAdapter], ...] = (Qwen2VLAdapter, Qwen3VLAdapter, Qwen3VLMoeAdapter)


def adapter_class(model_type: str) -> type[VLAdapter]:
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls
    supported = sorted(t for cls in ADAPTERS for t in cls.model_types)
    raise ModelLoadError(f"unsupported architecture {model_type!r}; mmkv supports {', '.join(supported)}")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_device(device: str | torch.device | None) -> str:
    """"cpu", "cuda" or "cuda:N"; None picks CUDA when present. A GPU that is not there is an error."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    text = str(device)
    if text == "cpu":
        return text
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(text[5:]) if ":" in text else 0
        if index >= count:
            raise ModelLoadError(f"device {text!r} asked for, but {count} CUDA device(s) are available")
        return text
    raise ModelLoadError(f"unknown device {text!r}; expected cpu, cuda or cuda:N")


def parse_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """float32 / bfloat16 / float16 (name or torch dtype); None: bfloat16 on CUDA, float32 on CPU."""
    if dtype is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ModelLoadError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")


def load_adapter(model_dir: str | Path, dtype: str | torch.dtype | None = None,
                 device: str | torch.device | None = None) -> VLAdapter:
    """Load a local checkpoint dir offline with AutoProcessor and the model class, on `device`
    (default: CUDA when present) in `dtype` (default: bfloat16 on CUDA, float32 on CPU)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    cls = adapter_class(read_model_type(model_dir))
    device = parse_device(device)
    dtype = parse_dtype(dtype, device)
    try:
        processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=dtype, local_files_only=True, attn_implementation="sdpa"
        ).to(device)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"could not load the checkpoint in {str(model_dir)!r}: {exc}") from exc
    return cls(model, processor)


__all__ = ["ImageFeatures", "RopeLayout", "VisualGrid", "VLAdapter", "mrope_positions", "load_adapter", "adapter_class", "parse_device", "parse_dtype",
           "ADAPTERS", "DTYPES"]
