"""Real-shape Qwen-VL checkpoints for tests: what a user downloads, minus the depth and the width.

Each family mirrors one released Instruct checkpoint: Qwen's real 151k-token byte-level BPE (the
vendored samples/tokenizers/qwen, special tokens at their released ids), the released chat
template and processor settings, and a config that keeps the per-layer shapes that matter to KV
reuse (head_dim 128, mrope sections, rope_theta, GQA, Qwen2.5-VL window attention with its
full-attention blocks, Qwen3-VL deepstack, tied or untied embeddings as released) with few layers
and a narrow hidden size. Weights are random. Saved in bfloat16 as sharded safetensors with an
index, inside a Hugging Face hub-cache layout (models--Qwen--X/{refs/main, snapshots/<rev>, blobs}).

Deviations from the released shapes, all forced by CPU test budgets: 2-4 LM layers and 4 vision
blocks (released 28-36 and 27-32); LM hidden 256 (the 151k-row embedding dominates memory), hence
Qwen2/2.5-VL, whose head_dim is hidden / heads, keep 2 query heads per KV head (released 6-7),
while Qwen3-VL, whose head_dim is set apart, keeps its released 4 (the MoE its released 8); vision
towers keep their head dims (80, 72) with 2 heads. Qwen3-VL MoE keeps its sparse MLP in every layer
with 8 experts, 2 per token (released 128 and 8), each 96 wide (released 768 at hidden 2048: the
same ratio), its expert weights stored fused and transposed as released.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

# Qwen2-VL-*-Instruct's and Qwen2.5-VL-*-Instruct's chat_template.json (one text for both: default
# system turn "You are a helpful assistant.", "Picture N: " / "Video N: " under add_vision_id); the
# tiny models already use it verbatim.
from mmkv.testing.tiny import CHAT_TEMPLATE as QWEN2_VL_CHAT_TEMPLATE
from mmkv.testing.tiny import QWEN3_FAMILIES  # their config and weight names are transformers 5's own

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "samples" / "tokenizers" / "qwen"

# Special-token ids of the released tokenizers (identical for Qwen2-VL, Qwen2.5-VL and Qwen3-VL).
SPECIAL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}

# Qwen/Qwen3-VL-8B-Instruct's chat_template.json (also its tokenizer_config.json): no default
# system turn, tool blocks, image parts counted across messages including tool results.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n"
    "        {%- if messages[0].content is string %}\n            {{- messages[0].content }}\n"
    "        {%- else %}\n            {%- for content in messages[0].content %}\n"
    "                {%- if 'text' in content %}\n                    {{- content.text }}\n"
    "                {%- endif %}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '\\n\\n' }}\n    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0].role == 'system' %}\n        {{- '<|im_start|>system\\n' }}\n"
    "        {%- if messages[0].content is string %}\n            {{- messages[0].content }}\n"
    "        {%- else %}\n            {%- for content in messages[0].content %}\n"
    "                {%- if 'text' in content %}\n                    {{- content.text }}\n"
    "                {%- endif %}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- set image_count = namespace(value=0) %}\n{%- set video_count = namespace(value=0) %}\n"
    "{%- for message in messages %}\n    {%- if message.role == \"user\" %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' }}\n        {%- if message.content is string %}\n"
    "            {{- message.content }}\n        {%- else %}\n            {%- for content in message.content %}\n"
    "                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}\n"
    "                    {%- set image_count.value = image_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|image_pad|><|vision_end|>\n"
    "                {%- elif content.type == 'video' or 'video' in content %}\n"
    "                    {%- set video_count.value = video_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|video_pad|><|vision_end|>\n"
    "                {%- elif 'text' in content %}\n                    {{- content.text }}\n"
    "                {%- endif %}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' }}\n        {%- if message.content is string %}\n"
    "            {{- message.content }}\n        {%- else %}\n"
    "            {%- for content_item in message.content %}\n                {%- if 'text' in content_item %}\n"
    "                    {{- content_item.text }}\n                {%- endif %}\n            {%- endfor %}\n"
    "        {%- endif %}\n        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and message.content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n                {%- endif %}\n                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {%- if message.content is string %}\n            {{- message.content }}\n        {%- else %}\n"
    "            {%- for content in message.content %}\n"
    "                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}\n"
    "                    {%- set image_count.value = image_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|image_pad|><|vision_end|>\n"
    "                {%- elif content.type == 'video' or 'video' in content %}\n"
    "                    {%- set video_count.value = video_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|video_pad|><|vision_end|>\n"
    "                {%- elif 'text' in content %}\n                    {{- content.text }}\n"
    "                {%- endif %}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclass(frozen=True)
class ReleasedCheckpoint:
    """One released Instruct checkpoint and the narrow, shallow config that mirrors it."""

    repo_id: str
    text: dict  # text_config
    vision: dict  # vision_config
    tie_word_embeddings: bool
    chat_template: str
    preprocessor_config: dict  # preprocessor_config.json, as released
    video_preprocessor_config: dict | None = None  # video_preprocessor_config.json, where released

    @property
    def hub_dir_name(self) -> str:
        return "models--" + self.repo_id.replace("/", "--")


_SPECIAL_CONFIG = dict(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
_QWEN2_PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                       "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                       "image_processor_type": "Qwen2VLImageProcessor"}
# Qwen3-VL's preprocessor_config.json and video_preprocessor_config.json (8B and 30B-A3B alike).
_QWEN3_PREPROCESSOR = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                       "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                       "image_processor_type": "Qwen2VLImageProcessorFast"}
_QWEN3_VIDEO_PREPROCESSOR = {"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16,
                             "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                             "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                             "video_processor_type": "Qwen3VLVideoProcessor"}
# Qwen3-VL-8B's vision tower (4 of 27 blocks, narrow), template and processors: the dense and the MoE
# entries share them, as the released Qwen3-VL-8B and 30B-A3B do.
_QWEN3_VISION_AND_PROCESSOR = dict(
    vision=dict(depth=4, hidden_size=144, intermediate_size=544, num_heads=2, out_hidden_size=256,
                hidden_act="gelu_pytorch_tanh", patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                num_position_embeddings=2304, deepstack_visual_indexes=[1, 2, 3], in_channels=3),
    tie_word_embeddings=False, chat_template=QWEN3_VL_CHAT_TEMPLATE,
    preprocessor_config=_QWEN3_PREPROCESSOR, video_preprocessor_config=_QWEN3_VIDEO_PREPROCESSOR)

RELEASED: dict[str, ReleasedCheckpoint] = {
    # Qwen2-VL-2B-Instruct: 12 heads / 2 KV, tied embeddings, vocab 151936.
    "qwen2_vl": ReleasedCheckpoint(
        repo_id="Qwen/Qwen2-VL-2B-Instruct",
        text=dict(vocab_size=151936, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  hidden_act="silu", tie_word_embeddings=True, use_sliding_window=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                  **_SPECIAL_CONFIG),
        vision=dict(depth=4, embed_dim=160, num_heads=2, mlp_ratio=4, hidden_size=256, hidden_act="quick_gelu",
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        tie_word_embeddings=True, chat_template=QWEN2_VL_CHAT_TEMPLATE,
        preprocessor_config={**_QWEN2_PREPROCESSOR, "processor_class": "Qwen2VLProcessor"}),
    # Qwen2.5-VL-7B-Instruct: 28 heads / 4 KV, untied, vocab 152064; vision window 112 px with
    # full attention every 8th block (released [7, 15, 23, 31]; here every 2nd of 4).
    "qwen2_5_vl": ReleasedCheckpoint(
        repo_id="Qwen/Qwen2.5-VL-7B-Instruct",
        text=dict(vocab_size=152064, hidden_size=256, intermediate_size=1024, num_hidden_layers=3,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128000, rms_norm_eps=1e-6,
                  hidden_act="silu", tie_word_embeddings=False, use_sliding_window=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                  **_SPECIAL_CONFIG),
        vision=dict(depth=4, hidden_size=160, intermediate_size=432, num_heads=2, out_hidden_size=256,
                    hidden_act="silu", patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[1, 3], tokens_per_second=2, in_channels=3),
        tie_word_embeddings=False, chat_template=QWEN2_VL_CHAT_TEMPLATE,
        preprocessor_config={**_QWEN2_PREPROCESSOR, "processor_class": "Qwen2_5_VLProcessor"}),
    # Qwen3-VL-8B-Instruct: 32 heads / 8 KV of head_dim 128, untied, vocab 151936, interleaved
    # mrope [24, 20, 20] at theta 5e6; deepstack from 3 vision blocks (released [8, 16, 24] of 27).
    "qwen3_vl": ReleasedCheckpoint(
        repo_id="Qwen/Qwen3-VL-8B-Instruct",
        text=dict(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=128, max_position_embeddings=262144,
                  rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True},
                  **_SPECIAL_CONFIG),
        **_QWEN3_VISION_AND_PROCESSOR),
    # Qwen3-VL-30B-A3B-Instruct: Qwen3-VL-8B's vision tower, template and processor; 32 heads / 4 KV
    # of head_dim 128, 48 sparse layers of 128 experts (8 per token, 768 wide), untied, vocab 151936.
    "qwen3_vl_moe": ReleasedCheckpoint(
        repo_id="Qwen/Qwen3-VL-30B-A3B-Instruct",
        text=dict(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=1, head_dim=128, max_position_embeddings=262144,
                  rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, decoder_sparse_step=1,
                  mlp_only_layers=[],
                  rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True},
                  **_SPECIAL_CONFIG),
        **_QWEN3_VISION_AND_PROCESSOR),
}

# The MoE's fused expert weights, stored [experts, in, out] as released (transformers 5 holds them
# [experts, out, in] and transposes on load).
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

# Qwen2.5-VL's documented long-context setting (its model card): YaRN x4 over 32768 positions.
QWEN2_5_VL_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                   "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}


def _write_processor_files(family: str, snapshot: Path) -> None:
    """The tokenizer and processor files as the released repo ships them: tokenizer.json (the vendored
    one, byte for byte), tokenizer_config.json and chat_template.json carrying the family's template,
    preprocessor_config.json (and video_preprocessor_config.json for Qwen3-VL)."""
    spec = RELEASED[family]
    (snapshot / "tokenizer.json").write_bytes(gzip.decompress((TOKENIZER_DIR / "tokenizer.json.gz").read_bytes()))
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    config["chat_template"] = spec.chat_template
    files = {"tokenizer_config.json": config, "chat_template.json": {"chat_template": spec.chat_template},
             "preprocessor_config.json": spec.preprocessor_config,
             "video_preprocessor_config.json": spec.video_preprocessor_config}
    for name, content in files.items():
        if content is not None:
            (snapshot / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")


def reshaped(family: str, text: dict | None = None, vision: dict | None = None,
             tie_word_embeddings: bool | None = None) -> ReleasedCheckpoint:
    """The family's released checkpoint with other text / vision sizes (tokenizer, template and
    processor as released): a checkpoint of another size that converters for the released one read."""
    spec = RELEASED[family]
    tie = spec.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
    return replace(spec, text={**spec.text, **(text or {}), "tie_word_embeddings": tie},
                   vision={**spec.vision, **(vision or {})}, tie_word_embeddings=tie)


def real_config(family: str, rope_parameters: dict | None = None, initializer_range: float = 0.02,
                spec: ReleasedCheckpoint | None = None):
    """The narrow, shallow config of the family's released checkpoint (see the module docstring),
    or of `spec` (`reshaped`)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

    spec = spec or RELEASED[family]
    text = dict(spec.text, initializer_range=initializer_range)
    if rope_parameters is not None:
        text["rope_parameters"] = rope_parameters
    cls = {"qwen2_vl": Qwen2VLConfig, "qwen2_5_vl": Qwen2_5_VLConfig, "qwen3_vl": Qwen3VLConfig,
           "qwen3_vl_moe": Qwen3VLMoeConfig}[family]
    return cls(text_config=text, vision_config=dict(spec.vision, initializer_range=initializer_range),
               image_token_id=SPECIAL_IDS["<|image_pad|>"], video_token_id=SPECIAL_IDS["<|video_pad|>"],
               vision_start_token_id=SPECIAL_IDS["<|vision_start|>"],
               vision_end_token_id=SPECIAL_IDS["<|vision_end|>"], tie_word_embeddings=spec.tie_word_embeddings,
               initializer_range=initializer_range)


ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                 "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}


def released_config_json(family: str, rope_parameters: dict | None = None, initializer_range: float = 0.02,
                         spec: ReleasedCheckpoint | None = None) -> dict:
    """config.json spelled as the released checkpoint spells it (transformers 4.x): Qwen2/2.5-VL flat,
    with `rope_scaling` {"type": "mrope", ...}; Qwen3-VL nested, with `rope_scaling` in text_config
    (the MoE's vision_config under the model's own type, and `norm_topk_prob`). transformers 5
    converts them on load, as it does for a downloaded checkpoint."""
    spec = spec or RELEASED[family]
    rope = dict(rope_parameters or spec.text["rope_parameters"])
    theta, rope_type = rope.pop("rope_theta"), rope.pop("rope_type")
    text = {k: v for k, v in spec.text.items() if k != "rope_parameters"}
    text.update(rope_theta=theta, initializer_range=initializer_range)
    vision = dict(spec.vision, initializer_range=initializer_range)
    out = {"architectures": [ARCHITECTURES[family]], "model_type": family, "torch_dtype": "bfloat16",
           "image_token_id": SPECIAL_IDS["<|image_pad|>"], "video_token_id": SPECIAL_IDS["<|video_pad|>"],
           "vision_start_token_id": SPECIAL_IDS["<|vision_start|>"],
           "vision_end_token_id": SPECIAL_IDS["<|vision_end|>"], "tie_word_embeddings": spec.tie_word_embeddings}
    if family in QWEN3_FAMILIES:
        text.update(model_type=f"{family}_text", rope_scaling={"rope_type": rope_type, **rope})
        if family == "qwen3_vl_moe":
            text["norm_topk_prob"] = True
        return {**out, "text_config": text, "vision_config": {**vision, "model_type": family},
                "transformers_version": "4.57.0.dev0"}
    scaling = {"type": "mrope" if rope_type == "default" else rope_type, **rope}
    return {**out, **text, "rope_scaling": scaling, "vision_config": vision, "initializer_range": initializer_range,
            "vision_token_id": SPECIAL_IDS["<|vision_pad|>"], "transformers_version": "4.49.0"}


def _released_weight_name(family: str, name: str) -> str:
    """Qwen2/2.5-VL were released before transformers nested the LM and the vision tower:
    model.layers.*, visual.*; Qwen3-VL's names are transformers 5's own."""
    if family in QWEN3_FAMILIES:
        return name
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    return name


def _released_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A fused expert weight as released, [experts, in, out]; any other tensor as it is."""
    return tensor.transpose(1, 2).contiguous() if name.endswith(EXPERT_WEIGHTS) else tensor


def _respell_as_released(family: str, snapshot: Path, config: dict) -> None:
    from safetensors.torch import load_file, save_file

    index_path = snapshot / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(snapshot / shard)
        save_file({_released_weight_name(family, k): _released_layout(k, v) for k, v in tensors.items()},
                  snapshot / shard, metadata={"format": "pt"})
    index["weight_map"] = {_released_weight_name(family, k): v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (snapshot / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _fake_revision(family: str, rope_parameters: dict | None, seed: int, spec: ReleasedCheckpoint) -> str:
    shape = "" if spec == RELEASED[family] else f"|{spec.text}|{spec.vision}"
    return hashlib.sha1(f"mmkv-realshape|{family}|{rope_parameters}|{seed}{shape}".encode()).hexdigest()


def _move_into_blobs(repo_dir: Path, snapshot: Path) -> None:
    """Hub-cache layout: each file's bytes live in blobs/<sha256>, the snapshot holds relative links."""
    blobs = repo_dir / "blobs"
    blobs.mkdir(exist_ok=True)
    for path in sorted(snapshot.iterdir()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        blob = blobs / digest
        if blob.exists():
            path.unlink()
        else:
            path.rename(blob)
        path.symlink_to(os.path.relpath(blob, snapshot))


def save_real_checkpoint(family: str, hub_cache: str | Path, *, seed: int = 0, repo_id: str | None = None,
                         rope_parameters: dict | None = None, initializer_range: float = 0.02,
                         max_shard_size: str = "64MB", spec: ReleasedCheckpoint | None = None) -> Path:
    """Write a random-weight checkpoint of `family` (or of `spec`: `reshaped`) into `hub_cache` as
    the hub would, under `repo_id` (default: the released repo it mirrors), in bfloat16, with
    config.json and weight names spelled as released. Returns the snapshot directory."""
    from transformers import AutoModelForImageTextToText

    spec = spec or RELEASED[family]
    repo_dir = Path(hub_cache) / ("models--" + (repo_id or spec.repo_id).replace("/", "--"))
    revision = _fake_revision(family, rope_parameters, seed, spec)
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    # Initialised in float32 (twice as fast as bfloat16 on CPU), stored in bfloat16.
    model = AutoModelForImageTextToText.from_config(real_config(family, rope_parameters, initializer_range, spec))
    model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = [SPECIAL_IDS["<|im_end|>"], SPECIAL_IDS["<|endoftext|>"]]
    model.generation_config.pad_token_id = SPECIAL_IDS["<|endoftext|>"]
    model.generation_config.bos_token_id = SPECIAL_IDS["<|endoftext|>"]
    model.save_pretrained(snapshot, max_shard_size=max_shard_size)
    _respell_as_released(family, snapshot, released_config_json(family, rope_parameters, initializer_range, spec))
    _write_processor_files(family, snapshot)
    _move_into_blobs(repo_dir, snapshot)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(revision)
    return snapshot


def main(argv: list[str] | None = None) -> None:
    """`python -m mmkv.testing.realshape HUB_CACHE [FAMILY ...]`: write real-shape checkpoints into a hub cache."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mmkv.testing.realshape", description=main.__doc__)
    parser.add_argument("hub_cache", type=Path, help="e.g. ~/.cache/huggingface/hub, or any dir for HF_HUB_CACHE")
    parser.add_argument("families", nargs="*", metavar="FAMILY", help=f"{', '.join(RELEASED)} (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.families) - set(RELEASED))
    if unknown:
        parser.error(f"unknown family {', '.join(unknown)}; expected {', '.join(RELEASED)}")
    for family in args.families or RELEASED:
        snapshot = save_real_checkpoint(family, args.hub_cache.expanduser(), seed=args.seed)
        print(f"{RELEASED[family].repo_id}: {snapshot}")


if __name__ == "__main__":
    main()
