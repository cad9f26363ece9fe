"""mmkv: cache, re-rotate and splice the KV of images and text for vision-language models."""

import importlib

from mmkv.errors import (
    ImageTooLargeError,
    ImageURLNotAllowedError,
    InvalidImageError,
    InvalidRequestError,
    MMKVError,
    ModelLoadError,
    PromptTooLongError,
    RopeNotComposableError,
    UnknownImageError,
    UnknownSkillError,
)

__all__ = [
    "Engine", "EngineSettings", "GenerationResult", "MMKVError", "InvalidRequestError", "InvalidImageError",
    "ImageTooLargeError", "ImageURLNotAllowedError", "PromptTooLongError", "UnknownImageError", "ModelLoadError",
    "RopeNotComposableError", "UnknownSkillError",
]

_ENGINE_NAMES = ("Engine", "EngineSettings", "GenerationResult")


def __getattr__(name: str):
    """The engine imports torch (seconds): load it on first use, so `mmkv --help` and the
    server's light modules do not pay for it."""
    if name in _ENGINE_NAMES:
        return getattr(importlib.import_module("mmkv.engine"), name)
    raise AttributeError(f"module 'mmkv' has no attribute {name!r}")
