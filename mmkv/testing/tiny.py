"""Tiny Qwen-VL checkpoints built from the real config classes, for tests, benchmarks and the
bundled sample models. Nothing here downloads: the tokenizer is a byte-level BPE trained on a
small corpus, the processor uses transformers' own Qwen2-VL image and video processors.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForImageTextToText,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
QWEN3_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")  # interleaved mrope, deepstack, patch 16, Qwen3VLProcessor
# Qwen3-VL MoE's sparse MLP, small: 4 experts of width 48 (gate_up_proj not square, so a wrong
# transpose on load shows), 2 per token, in every layer.
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1)

# Qwen's special tokens, in Qwen's order, so ids keep their usual meaning.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The Qwen2-VL chat template, with the default system turn, one placeholder per image.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

DEFAULT_CORPUS = (
    "You are a helpful assistant.",
    "what color is the shape ? what shape is it ? how many shapes are there ?",
    "red green blue yellow circle square triangle one two three four yes no",
    "describe the image . the quick brown fox jumps over the lazy dog 0123456789",
)


def build_tokenizer(corpus: Iterable[str] = DEFAULT_CORPUS, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with Qwen's special tokens: any text encodes, corpus words stay short."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>",
            "vision_end_token": "<|vision_end|>",
        },
    )


def _special_ids(tokenizer) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def tiny_config(family: str, tokenizer, **overrides):
    """A small config of the real architecture. `overrides` may hold `text` and `vision` dicts."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    text_over = overrides.pop("text", {})
    vision_over = overrides.pop("vision", {})
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    vocab = len(tokenizer)
    head_dim = 16
    text = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    if family in QWEN3_FAMILIES:
        text.update(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "mrope_section": [4, 2, 2], "mrope_interleaved": True})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                      num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
        cls = Qwen3VLConfig
        if family == "qwen3_vl_moe":
            text.update(TINY_MOE)
            cls = Qwen3VLMoeConfig
    else:
        text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
        if family == "qwen2_5_vl":
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                          fullatt_block_indexes=[0, 1])
            cls = Qwen2_5_VLConfig
        else:
            vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
            cls = Qwen2VLConfig
    text.update(text_over)
    vision.update(vision_over)
    return cls(text_config=text, vision_config=vision, **_special_ids(tokenizer), **overrides)


def build_processor(family: str, tokenizer, min_pixels: int = 56 * 56, max_pixels: int = 224 * 224):
    """The family's real processor class around `tokenizer`, with the token grid bounded by pixels."""
    patch = 16 if family in QWEN3_FAMILIES else 14
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image_processor = Qwen2VLImageProcessor(size=size, patch_size=patch, merge_size=2, temporal_patch_size=2)
    if family in QWEN3_FAMILIES:
        video = Qwen3VLVideoProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2)
        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video,
                                chat_template=CHAT_TEMPLATE)
    video = Qwen2VLVideoProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2)
    cls = Qwen2_5_VLProcessor if family == "qwen2_5_vl" else Qwen2VLProcessor
    return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=video,
               chat_template=CHAT_TEMPLATE)


def save_tiny_checkpoint(family: str, out_dir: str | Path, *, seed: int = 0, corpus: Iterable[str] = DEFAULT_CORPUS,
                         min_pixels: int = 56 * 56, max_pixels: int = 224 * 224, model=None, tokenizer=None,
                         **config_overrides) -> Path:
    """Write a loadable checkpoint dir (config, safetensors, tokenizer, processor). Returns the dir.

    With `model` given (e.g. after training) its weights are saved; otherwise a seeded random model.
    `tokenizer` (e.g. the one a model was trained with) replaces the one built from `corpus`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(corpus) if tokenizer is None else tokenizer
    if model is None:
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(tiny_config(family, tokenizer, **config_overrides))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.save_pretrained(out)
    build_processor(family, tokenizer, min_pixels, max_pixels).save_pretrained(out)
    return out
