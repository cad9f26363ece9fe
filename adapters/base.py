"""What the core needs from a Qwen vision-language model, behind one small interface.

An adapter owns the transformers model and processor. It never decides what to cache; it only
encodes images, assigns native position ids and runs the language model over explicit position
ids, an optional cache and an optional 4D mask (never the model's stored `rope_deltas`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from mmkv.errors import ModelLoadError, RopeNotComposableError

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
        self.vision_start_id = self.config.vision_start_token_id
        self.vision_end_id = self.config.vision_end_token_id
        self.merge_size = self.config.vision_config.spatial_merge_size
        self.language_model = model.model.language_model
        self.rope = self._rope_layout()

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

    def _lm_kwargs(self, is_image: torch.Tensor, features: ImageFeatures | None) -> dict:
        return {}

    def _run_lm(self, input_ids, position_ids, cache, features, attention_mask):
        ids = input_ids.view(1, -1).to(self.device)
        is_image = ids == self.image_token_id
        embeds = self.language_model.embed_tokens(ids)
        n_img = int(is_image.sum())
        if n_img:
            if features is None or features.embeds.shape[0] != n_img:
                got = 0 if features is None else features.embeds.shape[0]
                raise ValueError(f"{n_img} image-pad tokens but {got} image feature rows")
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
                       attention_mask: torch.Tensor) -> torch.Tensor:
        """One decode step of a batch: token b of `tokens` [B] (text) at `positions` [B] (all
        three M-RoPE axes alike), appended to row b of `cache` (rows left-padded to one length
        K); `attention_mask` [B, 1, 1, K + 1] (0 / -inf) hides each row's padding. Returns
        float32 logits [B, V]."""
        embeds = self.language_model.embed_tokens(tokens.view(-1, 1).to(self.device))
        out = self.language_model(
            inputs_embeds=embeds,
            position_ids=positions.view(1, -1, 1).expand(3, -1, -1).to(self.device),
            past_key_values=cache,
            attention_mask=attention_mask.to(self.device, embeds.dtype),
            use_cache=True,
        )
        return self.model.lm_head(out.last_hidden_state[:, -1]).float()

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
