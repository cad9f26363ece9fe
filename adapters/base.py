"""What the core needs from a Qwen vision-language model, behind one small interface.

An adapter owns the transformers model and processor. It never decides what to cache; it only
encodes images, assigns native position ids and runs the language model over explicit position
ids, an optional cache and an optional 4D mask (never the model's stored `rope_deltas`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mmkv.adapters.cpu_kernels import gqa_without_copies, pack_linears
from mmkv.errors import ModelLoadError, RopeNotComposableError
from mmkv.kv.cascade import PREFIX_KWARG, shared_prefix_attention
from mmkv.kv.packed import PACKED_KWARG, Packing, PackedLayer, packed_attention_for

# Rope types whose rotation by d composes with the stored angle: inv_freq does not depend on the
# sequence length. YaRN qualifies: its attention factor scales cos and sin alike, so a cached key
# is factor * R(angle) k and rotating it by d gives factor * R(angle + d) k, the key at the target.
# Dynamic NTK and LongRoPE change inv_freq (and LongRoPE its factor) with length: refused.
COMPOSABLE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeLayout:
    """Which position axis (0 = temporal, 1 = height, 2 = width) drives each rotary frequency."""

    inv_freq: torch.Tensor  # [head_dim/2] float32
    axis_of_freq: torch.Tensor  # [head_dim/2] long in {0, 1, 2}
    name: str  # "sectioned" | "interleaved"

    def __post_init__(self):
        assert self.inv_freq.shape == self.axis_of_freq.shape, "one axis per frequency"


@dataclass
class ImageFeatures:
    """Vision tower output for one image, in the order of its image-pad tokens."""

    embeds: torch.Tensor  # [n_tokens, hidden]
    deepstack: tuple[torch.Tensor, ...] = field(default_factory=tuple)  # per deepstack layer [n_tokens, hidden]

    def slice(self, start: int, stop: int) -> ImageFeatures:
        return ImageFeatures(self.embeds[start:stop], tuple(d[start:stop] for d in self.deepstack))

    @staticmethod
    def concat(parts: list[ImageFeatures]) -> ImageFeatures | None:
        parts = [p for p in parts if p.embeds.shape[0]]
        if not parts:
            return None
        depth = len(parts[0].deepstack)
        return ImageFeatures(
            torch.cat([p.embeds for p in parts]),
            tuple(torch.cat([p.deepstack[i] for p in parts]) for i in range(depth)),
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, *self.deepstack))


@dataclass(frozen=True)
class VisualGrid:
    """One run of visual pad tokens in a prompt: an image, a whole Qwen2/2.5-VL video (its temporal
    groups back to back), or one Qwen3-VL frame (a one-group grid between its timestamp and the next)."""

    token_id: int  # the image or video pad
    grid_thw: tuple[int, int, int]  # in patches, before the spatial merge
    second_per_grid_t: float = 1.0  # videos: temporal_patch_size / sampled fps
    tokens_per_second: float = 1.0  # videos: the vision config's (Qwen2.5-VL)


def mrope_positions(input_ids: torch.Tensor, visuals: list[VisualGrid], merge_size: int) -> torch.Tensor:
    """Position ids [3, L] by the rule of vLLM and transformers 4.x, the one the released models
    were trained and are served with: text continues from the largest id so far + 1 on all three
    axes; a visual run starting at s has temporal ids s + (arange(T) * time_interval).long()
    (a float32 product, as vLLM computes it), heights s + row, widths s + column. The text after a
    video therefore starts past its temporal extent too. (transformers 5.x's `get_rope_index`
    advances the text by max(h, w) only, so after a long Qwen2/2.5-VL video its text positions
    overlap the video's and disagree with where decoding continues: not followed.)"""
    ids = input_ids.tolist()
    out = torch.empty(3, len(ids), dtype=torch.long)
    grids, pads = iter(visuals), {v.token_id for v in visuals}
    i, next_id = 0, 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and (ids[j] in pads) == (ids[i] in pads) and (ids[i] not in pads or ids[j] == ids[i]):
            j += 1
        if ids[i] not in pads:
            out[:, i:j] = torch.arange(next_id, next_id + j - i)
        else:
            grid = next(grids, None)
            if grid is None:
                raise ValueError("more runs of visual pads than grids")
            t, h, w = grid.grid_thw[0], grid.grid_thw[1] // merge_size, grid.grid_thw[2] // merge_size
            if t * h * w != j - i or grid.token_id != ids[i]:
                raise ValueError(f"a run of {j - i} pads does not match its grid {grid.grid_thw}")
            seconds = torch.tensor(grid.second_per_grid_t, dtype=torch.float32)
            temporal = (torch.arange(t).view(-1, 1, 1) * seconds * grid.tokens_per_second).long()
            out[0, i:j] = (next_id + temporal.expand(t, h, w)).flatten()
            out[1, i:j] = (next_id + torch.arange(h).view(1, -1, 1).expand(t, h, w)).flatten()
            out[2, i:j] = (next_id + torch.arange(w).view(1, 1, -1).expand(t, h, w)).flatten()
        next_id = int(out[:, i:j].max()) + 1
        i = j
    if next(grids, None) is not None:
        raise ValueError("fewer runs of visual pads than grids")
    return out


class VLAdapter:
    """Base for the Qwen-VL families. Subclasses give the rope layout and the deepstack hooks."""

    family = "base"
    model_types: tuple[str, ...] = ()

    def __init__(self, model, processor):
        self.model = model.eval()
        self.family = model.config.model_type
        self.processor = processor
        self.config = model.config
        self.text_config = model.config.text_config
        self.tokenizer = processor.tokenizer
        self.image_token_id = self.config.image_token_id
        self.video_token_id = self.config.video_token_id
        self.vision_start_id = self.config.vision_start_token_id
        self.vision_end_id = self.config.vision_end_token_id
        self.merge_size = self.config.vision_config.spatial_merge_size
        self.language_model = model.model.language_model
        self.rope = self._rope_layout()
        gqa_without_copies()  # on a CPU, SDPA takes the query groups as they are (adapters/cpu_kernels.py)

    # ---- rope ---------------------------------------------------------------------------
    def _rope_layout(self) -> RopeLayout:
        params = self.text_config.rope_parameters or {}
        rope_type = params.get("rope_type", "default")
        rotary = self.language_model.rotary_emb
        if rope_type not in COMPOSABLE_ROPE_TYPES:
            raise RopeNotComposableError(
                f"rope type {rope_type!r} does not compose: its frequencies change with the sequence length, "
                f"so a key rotated by a delta would differ from one computed at the target position. "
                f"Supported: {', '.join(COMPOSABLE_ROPE_TYPES)}."
            )
        inv_freq = rotary.inv_freq.detach().float().cpu()
        section = list(params.get("mrope_section") or rotary.mrope_section)
        return RopeLayout(inv_freq, self._axis_of_freq(section, inv_freq.numel()), self.rope_layout_name)

    rope_layout_name = "sectioned"

    @staticmethod
    def _axis_of_freq(section: list[int], n_freq: int) -> torch.Tensor:
        raise NotImplementedError

    # ---- tokens and positions -------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def native_positions(self, input_ids: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Position ids [3, L] the model itself assigns to `input_ids` [L] holding these images."""
        ids = input_ids.view(1, -1)
        mm_types = (ids == self.image_token_id).int()
        grid = torch.tensor(grids, dtype=torch.long) if grids else None
        pos, _ = self.model.model.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=grid)
        return pos[:, 0, :].cpu()

    def positions(self, input_ids: torch.Tensor, visuals: list[VisualGrid]) -> torch.Tensor:
        """Position ids [3, L] of a prompt holding these visual runs, in order (`mrope_positions`)."""
        return mrope_positions(input_ids, visuals, self.merge_size)

    def visual_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Where image and video pads sit: the tokens that take visual feature rows, in order."""
        return (input_ids == self.image_token_id) | (input_ids == self.video_token_id)

    def video_grid(self, grid_thw: tuple[int, int, int], sample_fps: float) -> VisualGrid:
        """The visual run of a video's pads (Qwen3-VL: of one frame, grid_thw with t = 1)."""
        return VisualGrid(self.video_token_id, grid_thw)

    def preprocess_video(self, frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Pixel patches and (t, h, w) grid of sampled, resized frames [N, 3, H, W] uint8 (mmkv.video),
        by the checkpoint's own video processor (normalised and patchified, not resized again)."""
        out = self.processor.video_processor(videos=[frames], do_resize=False, do_sample_frames=False,
                                             return_tensors="pt")
        return out["pixel_values_videos"], tuple(int(x) for x in out["video_grid_thw"][0])

    def image_token_count(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // (self.merge_size**2)

    def image_span_ids(self, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """Token ids of one image's span: vision_start, its image pads, vision_end."""
        n = self.image_token_count(grid_thw)
        return torch.tensor([self.vision_start_id] + [self.image_token_id] * n + [self.vision_end_id])

    def image_spans(self, input_ids: torch.Tensor) -> list[tuple[int, int]]:
        """[start, end) of every vision_start..vision_end span holding image pads, in order."""
        ids = input_ids.tolist()
        spans, i = [], 0
        while i < len(ids):
            if ids[i] == self.vision_start_id and i + 1 < len(ids) and ids[i + 1] == self.image_token_id:
                j = i + 1
                while j < len(ids) and ids[j] == self.image_token_id:
                    j += 1
                if j < len(ids) and ids[j] == self.vision_end_id:
                    spans.append((i, j + 1))
                    i = j + 1
                    continue
            i += 1
        return spans

    # ---- vision ---------------------------------------------------------------------------
    def preprocess_image(self, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Pixel patches and (t, h, w) grid for one decoded RGB PIL image, as the processor does."""
        out = self.processor.image_processor(images=[image], return_tensors="pt")
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return out["pixel_values"], grid

    @torch.no_grad()
    def encode_image(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> ImageFeatures:
        """Run the vision tower once; merged embeddings (and deepstack features) for one image."""
        grid = torch.tensor([grid_thw], device=self.device)
        out = self.model.model.get_image_features(pixel_values.to(self.device), grid, return_dict=True)
        deep = tuple(feats[0] for feats in (getattr(out, "deepstack_features", None) or ()))
        return ImageFeatures(out.pooler_output[0].to(self.dtype), tuple(d.to(self.dtype) for d in deep))

    # ---- language model ---------------------------------------------------------------------
    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.text_config)

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def kv_shape(self) -> tuple[int, int]:
        """(key/value heads, head_dim) of each LM layer's KV."""
        text = self.text_config
        return text.num_key_value_heads, getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads

    def _lm_kwargs(self, is_image: torch.Tensor, features: ImageFeatures | None) -> dict:
        return {}

    def _run_lm(self, input_ids, position_ids, cache, features, attention_mask):
        ids = input_ids.view(1, -1).to(self.device)
        is_image = self.visual_mask(ids)
        embeds = self.language_model.embed_tokens(ids)
        n_img = int(is_image.sum())
        if n_img:
            if features is None or features.embeds.shape[0] != n_img:
                got = 0 if features is None else features.embeds.shape[0]
                raise ValueError(f"{n_img} image / video pad tokens but {got} visual feature rows")
            embeds = embeds.masked_scatter(is_image[..., None], features.embeds.to(self.device, embeds.dtype))
        return self.language_model(
            inputs_embeds=embeds,
            position_ids=position_ids.view(3, 1, -1).to(self.device),
            past_key_values=cache,
            attention_mask=attention_mask.to(self.device, embeds.dtype) if attention_mask is not None else None,
            use_cache=cache is not None,
            **(self._lm_kwargs(is_image, features) if n_img else {}),
        )

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache | None = None,
        features: ImageFeatures | None = None,
        attention_mask: torch.Tensor | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run the LM over `input_ids` [L] at `position_ids` [3, L], appending to `cache`.

        Image pads take `features` rows in order. `attention_mask` is an optional float mask
        [1, 1, L, past + L] (0 / -inf). Returns float32 logits [L, V] or, by default, [1, V]
        for the last token.
        """
        out = self._run_lm(input_ids, position_ids, cache, features, attention_mask)
        hidden = out.last_hidden_state[0] if all_logits else out.last_hidden_state[0, -1:]
        return self.model.lm_head(hidden).float()

    @torch.no_grad()
    def forward_decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                       attention_mask: torch.Tensor, shared_prefix: list | None = None) -> torch.Tensor:
        """One decode step of a batch: token b of `tokens` [B] (text) at `positions` [B] (all
        three M-RoPE axes alike), appended to row b of `cache` (rows left-padded to one length
        K); `attention_mask` [B, 1, 1, K + 1] (0 / -inf) hides each row's padding. With
        `shared_prefix` (per layer (keys, values) [1, kv_heads, P, head_dim]) every row also
        attends to that prefix, held once (mmkv.kv.cascade). Returns float32 logits [B, V]."""
        embeds = self.language_model.embed_tokens(tokens.view(-1, 1).to(self.device))
        kwargs = {} if shared_prefix is None else {PREFIX_KWARG: shared_prefix}
        with contextlib.nullcontext() if shared_prefix is None else shared_prefix_attention(self.text_config):
            out = self.language_model(
                inputs_embeds=embeds,
                position_ids=positions.view(1, -1, 1).expand(3, -1, -1).to(self.device),
                past_key_values=cache,
                attention_mask=attention_mask.to(self.device, embeds.dtype),
                use_cache=True,
                **kwargs,
            )
        return self.model.lm_head(out.last_hidden_state[:, -1]).float()

    @torch.no_grad()
    def forward_packed(self, tokens: torch.Tensor, positions: torch.Tensor, batch_layers: list,
                       decode_mask: torch.Tensor, pieces: list, shared_prefix: list | None = None
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One decode step of a batch (as `forward_decode`: `tokens` [B] at `positions` [B] into
        `batch_layers`, rows masked by `decode_mask` [B, 1, 1, K + 1]) and prefilling requests'
        text pieces (`pieces`: mmkv.request.splice.RidePiece) in one forward (mmkv.kv.packed).
        Returns float32 logits [B, V] of the rows and [1, V] of each piece's last token."""
        b = tokens.numel()
        ids = torch.cat([tokens.view(-1)] + [p.ids.view(-1) for p in pieces]).to(self.device)
        position_ids = torch.cat([positions.view(1, -1).expand(3, -1)] + [p.positions for p in pieces], dim=1)
        with packed_attention_for(self.text_config) as own, contextlib.ExitStack() as writing:
            packing = Packing(b, decode_mask.to(self.device, self.dtype), [p.n for p in pieces],
                              [p.mask.to(self.device) for p in pieces], shared_prefix, own)
            cache = Cache(layers=[PackedLayer(i, layer, [p.layers[i] for p in pieces], packing)
                                  for i, layer in enumerate(batch_layers)])
            for p in pieces:
                writing.enter_context(p.writing())
            out = self.language_model(
                inputs_embeds=self.language_model.embed_tokens(ids.view(1, -1)),
                position_ids=position_ids.view(3, 1, -1).to(self.device),
                past_key_values=cache,
                attention_mask=pieces[0].mask.to(self.device),  # 4D: used as is; packed_attention reads `packing`
                use_cache=True,
                **{PACKED_KWARG: packing},
            )
        hidden, ends = out.last_hidden_state[0], torch.tensor([p.n for p in pieces]).cumsum(0) + b - 1
        logits = self.model.lm_head(torch.cat((hidden[:b], hidden[ends]))).float()  # the head's weights read once
        return logits[:b], list(logits[b:].split(1))

    def pack_linears(self, mode: str = "onednn") -> str:
        """The language model's and the vision tower's linear layers and an untied LM head on
        oneDNN with prepacked weights on a CPU (adapters/cpu_kernels.py). Returns the backend in
        use, with the reason when it stays dense."""
        lm, vision = (next(name for name, module in self.model.named_modules() if module is part)
                      for part in (self.language_model, self.model.model.visual))
        return pack_linears(self.model, (f"{lm}.", "lm_head", f"{vision}."), mode)

    def can_pack(self) -> bool:
        """Whether the model's attention can run inside a packed forward (mmkv.kv.packed)."""
        return self.text_config._attn_implementation in ALL_ATTENTION_FUNCTIONS

    @torch.no_grad()
    def forward_layers(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache,
                       n_layers: int, features: ImageFeatures | None = None) -> None:
        """Run only the first `n_layers` decoder layers, appending their KV to `cache` (used to
        rank tokens by KV change at one layer). Not thread-safe: the engine's lock covers it."""
        layers = self.language_model.layers
        self.language_model.layers = layers[:n_layers]
        try:
            self._run_lm(input_ids, position_ids, cache, features, None)
        finally:
            self.language_model.layers = layers


def read_model_type(model_dir: str | Path) -> str:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist or is not a directory")
    config = path / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"{str(path)!r} holds no config.json: not a Hugging Face checkpoint directory")
    import json

    try:
        return json.loads(config.read_text())["model_type"]
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{config} is not a readable model config: {exc}") from exc
