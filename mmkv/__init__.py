"""mmkv: cache, re-rotate and splice the KV of images and text for vision-language models."""

from mmkv.engine import Engine, EngineSettings, GenerationResult
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
