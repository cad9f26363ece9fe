"""The engine: one model, its image registry and image-KV cache, and generation with reuse.

Life of a request (docs/structure.md): parse messages -> decode/hash images -> render the chat
template -> lookup each image's KV (precompile on a miss) -> reposition -> splice -> seam repair
-> prefill the text -> decode -> stream text deltas.

Thread-safety: every public method takes the engine's lock, so calls from several threads are
serialised; the HTTP server still runs one worker that owns the engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from mmkv.adapters import ImageFeatures, VLAdapter, load_adapter
from mmkv.errors import InvalidRequestError, ModelLoadError, PromptTooLongError, UnknownImageError
from mmkv.image_cache import CachedImage, ImageKVCache, image_cache_key
from mmkv.images import DEFAULT_MAX_IMAGE_PIXELS, DecodedImage, decode_image
from mmkv.messages import ImageRef, parse_messages
from mmkv.rerotate import POLICIES, target_positions
from mmkv.sampling import next_token
from mmkv.splice import Placement, PrefillResult, precompile_image, prefill_full, prefill_spliced

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_MODEL = REPO_ROOT / "samples" / "models" / "qwen2_5_vl-tiny"
ANCHORS = ("system", "none")


@dataclass(frozen=True)
class EngineSettings:
    seam_tokens: int = 1
    rope_policy: str = "native"
    cache_bytes: int = 2 << 30
    anchor: str = "system"  # precompile images after the chat template's default system header
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_context: int | None = None  # tokens; None = the model's max_position_embeddings

    def __post_init__(self):
        check_seam_tokens(self.seam_tokens)
        check_policy(self.rope_policy)
        if self.anchor not in ANCHORS:
            raise InvalidRequestError(f"anchor must be one of {ANCHORS}", param="anchor")
        if self.cache_bytes < 0:
            raise InvalidRequestError("cache_bytes must be >= 0", param="cache_bytes")


def check_seam_tokens(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 64:
        raise InvalidRequestError("seam_tokens must be an integer from 0 to 64", param="seam_tokens")
    return value


def check_policy(value) -> str:
    if value not in POLICIES:
        raise InvalidRequestError(f"rope_policy must be one of {', '.join(POLICIES)}", param="rope_policy")
    return value


@dataclass(frozen=True)
class ImageInfo:
    image_id: str
    width: int
    height: int
    image_tokens: int  # image-pad tokens the LM sees for it
    nbytes: int  # bytes of the source it was decoded from (0 for a PIL image)


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Fidelity:
    """How far the fast path's first next-token logits are from a full recompute's."""

    logit_cosine: float
    max_abs_diff: float
    same_argmax: bool


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: Usage
    ttft_s: float
    total_s: float
    image_tokens_reused: int
    lm_tokens_computed: int
    vision_tower_runs: int
    seam_tokens: int
    rope_policy: str
    reuse: bool
    fidelity: Fidelity | None = None
    first_logits: torch.Tensor | None = None  # [V] float32, next-token logits after the prompt


@dataclass
class SplicePlan:
    input_ids: torch.Tensor  # [L]
    positions: torch.Tensor  # [3, L] with each chunk at its policy's target
    native_positions: torch.Tensor  # [3, L] the model's own
    placements: list[Placement]


@dataclass
class _Registered:
    decoded: DecodedImage
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]


@dataclass
class _Counters:
    vision_tower_runs: int = 0
    prefill_tokens: int = 0
    reused_tokens: int = 0
    requests: int = 0
    extra: dict = field(default_factory=dict)


def image_id_for(content_hash: str) -> str:
    return f"img-{content_hash}"


class Engine:
    def __init__(self, adapter: VLAdapter, settings: EngineSettings | None = None, model_id: str | None = None):
        self.adapter = adapter
        self.settings = settings or EngineSettings()
        self.model_id = model_id or adapter.config.name_or_path or adapter.family
        self.cache = ImageKVCache(self.settings.cache_bytes)
        self._images: dict[tuple[str, str], _Registered] = {}
        self._lock = threading.RLock()
        self._counters = _Counters()
        self.fingerprint = xxhash.xxh3_128(adapter.fingerprint_source().encode()).hexdigest()
        ip = adapter.processor.image_processor
        self.grid_settings = f"{ip.size}|patch={ip.patch_size}|merge={ip.merge_size}"
        self.anchor_ids = self._anchor_ids() if self.settings.anchor == "system" else torch.empty(0, dtype=torch.long)
        self.stop_ids = self._stop_ids()
        limit = adapter.text_config.max_position_embeddings
        self.max_context = min(self.settings.max_context or limit, limit)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path | None = None, dtype: torch.dtype | str | None = None,
                        device: str | None = None, seam_tokens: int = 1, rope_policy: str = "native",
                        cache_bytes: int = 2 << 30, min_pixels: int | None = None, max_pixels: int | None = None,
                        **settings) -> Engine:
        """Load a local checkpoint dir (None = the bundled sample model) and wrap it."""
        if model_dir is None:
            if not BUNDLED_MODEL.is_dir():
                raise ModelLoadError(f"no model directory given and the bundled model {BUNDLED_MODEL} is missing; "
                                     f"pass the path of a local Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint")
            model_dir = BUNDLED_MODEL
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        adapter = load_adapter(model_dir, dtype=dtype, device=device)
        ip = adapter.processor.image_processor
        if min_pixels is not None or max_pixels is not None:
            size = dict(ip.size)
            size["shortest_edge"] = min_pixels if min_pixels is not None else size["shortest_edge"]
            size["longest_edge"] = max_pixels if max_pixels is not None else size["longest_edge"]
            ip.size = size
        cfg = EngineSettings(seam_tokens=seam_tokens, rope_policy=rope_policy, cache_bytes=cache_bytes, **settings)
        return cls(adapter, cfg, model_id=Path(model_dir).name)

    # ---- setup ---------------------------------------------------------------------------------
    def _render(self, template_messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.adapter.processor.apply_chat_template(
            template_messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _anchor_ids(self) -> torch.Tensor:
        """The chat template's default header up to a first-turn image: the tokens an image
        normally follows, so its first token is not the attention sink."""
        text = self._render([{"role": "user", "content": [{"type": "image"}]}], add_generation_prompt=False)
        start = self.adapter.processor.tokenizer.convert_ids_to_tokens(self.adapter.vision_start_id)
        return self._tokenize(text.split(start)[0])

    def _tokenize(self, text: str) -> torch.Tensor:
        return torch.tensor(self.adapter.tokenizer(text)["input_ids"], dtype=torch.long)

    def _stop_ids(self) -> set[int]:
        ids = set()
        eos = self.adapter.model.generation_config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        tok = self.adapter.tokenizer
        for t in ("<|im_end|>", "<|endoftext|>"):
            tid = tok.convert_tokens_to_ids(t)
            if isinstance(tid, int) and tid != tok.unk_token_id:
                ids.add(tid)
        if tok.eos_token_id is not None:
            ids.add(tok.eos_token_id)
        return ids

    # ---- images ----------------------------------------------------------------------------------
    def add_image(self, data, tenant: str = "") -> str:
        """Decode, register and precompile an image; returns its stable id (from the content hash)."""
        with self._lock:
            image_id, reg = self._register(decode_image(data, self.settings.max_image_pixels), tenant)
            self._cached_chunk(reg, tenant)
            return image_id

    def image_info(self, image_id: str, tenant: str = "") -> ImageInfo:
        with self._lock:
            reg = self._lookup(image_id, tenant)
            return ImageInfo(image_id, reg.decoded.width, reg.decoded.height,
                             self.adapter.image_token_count(reg.grid_thw), reg.decoded.source_bytes)

    def remove_image(self, image_id: str, tenant: str = "") -> None:
        """Drop an image's pixels and its cached KV."""
        with self._lock:
            reg = self._lookup(image_id, tenant)
            self.cache.discard(self._cache_key(reg, tenant))
            del self._images[(tenant, image_id)]

    def _register(self, decoded: DecodedImage, tenant: str) -> tuple[str, _Registered]:
        image_id = image_id_for(decoded.content_hash)
        reg = self._images.get((tenant, image_id))
        if reg is None:
            pixel_values, grid = self.adapter.preprocess_image(decoded.image)
            reg = self._images[(tenant, image_id)] = _Registered(decoded, pixel_values, grid)
        return image_id, reg

    def _lookup(self, image_id: str, tenant: str, param: str | None = None) -> _Registered:
        reg = self._images.get((tenant, image_id))
        if reg is None:
            raise UnknownImageError(f"no image with id {image_id!r}", param=param)
        return reg

    def _cache_key(self, reg: _Registered, tenant: str) -> str:
        return image_cache_key(reg.decoded.content_hash, self.fingerprint, self.grid_settings,
                               self.settings.anchor, tenant)

    def _encode(self, reg: _Registered) -> ImageFeatures:
        self._counters.vision_tower_runs += 1
        return self.adapter.encode_image(reg.pixel_values, reg.grid_thw)

    def _cached_chunk(self, reg: _Registered, tenant: str) -> tuple[CachedImage, bool]:
        """The image's cached KV, precompiled (vision tower + isolated LM prefill) on a miss."""
        key = self._cache_key(reg, tenant)
        entry = self.cache.get(key)
        if entry is not None:
            return entry, False
        entry = precompile_image(self.adapter, self._encode(reg), reg.grid_thw, key, self.anchor_ids)
        self._counters.prefill_tokens += self.anchor_ids.numel() + entry.num_tokens
        self.cache.put(entry)
        return entry, True

    def _resolve(self, refs: list[ImageRef], tenant: str) -> list[_Registered]:
        """Every referenced image, registered; inline data is decoded and added for this tenant.
        Validates all references before anything is stored, so a bad one changes nothing."""
        resolved = []
        for ref in refs:
            if ref.image_id is not None:
                resolved.append(("id", self._lookup(ref.image_id, tenant, ref.param)))
            else:
                resolved.append(("new", decode_image(ref.data, self.settings.max_image_pixels)))
        return [self._register(x, tenant)[1] if kind == "new" else x for kind, x in resolved]

    # ---- generation -------------------------------------------------------------------------------
    def generate(self, messages, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop: list[str] | str | None = None, reuse: bool = True,
                 seam_tokens: int | None = None, rope_policy: str | None = None, tenant: str = "",
                 on_text: Callable[[str], None] | None = None, should_stop: Callable[[], bool] | None = None,
                 fidelity: bool = False) -> GenerationResult:
        """Answer OpenAI-shaped `messages`. `reuse=False` is the reference: one full causal forward.

        `on_text(delta)` receives text as it is decoded; `should_stop()` is polled between tokens.
        `fidelity=True` also runs the full recompute and reports how far the first logits are.
        """
        t0 = time.perf_counter()
        seam = check_seam_tokens(self.settings.seam_tokens if seam_tokens is None else seam_tokens)
        policy = check_policy(rope_policy or self.settings.rope_policy)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequestError("max_new_tokens must be a positive integer", param="max_tokens")
        if not 0.0 <= temperature <= 2.0 or not 0.0 < top_p <= 1.0:
            raise InvalidRequestError("temperature must be in [0, 2] and top_p in (0, 1]", param="temperature")
        template, refs = parse_messages(messages)
        with self._lock:
            runs_before = self._counters.vision_tower_runs
            regs = self._resolve(refs, tenant)
            input_ids = self._prompt_ids(template, regs)
            if input_ids.numel() + max_new_tokens > self.max_context:
                raise PromptTooLongError(
                    f"prompt of {input_ids.numel()} tokens plus max_tokens {max_new_tokens} exceeds the context "
                    f"of {self.max_context} tokens", param="messages")
            grids = [r.grid_thw for r in regs]
            positions = self.adapter.native_positions(input_ids, grids)
            if reuse:
                prefill, reused_image, positions = self._prefill_reuse(input_ids, positions, regs, tenant, seam,
                                                                       policy)
            else:
                feats = ImageFeatures.concat([self._encode(r) for r in regs])
                prefill, reused_image = prefill_full(self.adapter, input_ids, positions, feats), 0
            report = self._fidelity(prefill, input_ids, positions, regs) if fidelity and reuse else None
            self._counters.prefill_tokens += prefill.computed_tokens
            self._counters.reused_tokens += prefill.reused_tokens
            self._counters.requests += 1
            ids, finish, ttft, text = self._decode(prefill, positions, max_new_tokens, temperature, top_p, seed,
                                                   stops, on_text, should_stop, t0)
            return GenerationResult(
                text=text, token_ids=ids, finish_reason=finish,
                usage=Usage(input_ids.numel(), prefill.reused_tokens, len(ids)),
                ttft_s=ttft, total_s=time.perf_counter() - t0, image_tokens_reused=reused_image,
                lm_tokens_computed=prefill.computed_tokens,
                vision_tower_runs=self._counters.vision_tower_runs - runs_before,
                seam_tokens=seam, rope_policy=policy, reuse=reuse, fidelity=report,
                first_logits=prefill.logits[0].cpu())

    def prompt_ids(self, messages, tenant: str = "") -> torch.Tensor:
        """The prompt's token ids [L] exactly as generate() builds them."""
        template, refs = parse_messages(messages)
        with self._lock:
            return self._prompt_ids(template, self._resolve(refs, tenant))

    def _prompt_ids(self, template: list[dict], regs: list[_Registered]) -> torch.Tensor:
        """Render the chat template and expand each image placeholder to its pad tokens, as the
        processor does."""
        text = self._render(template)
        pad = self.adapter.processor.image_token
        pieces = text.split(pad)
        if len(pieces) - 1 != len(regs):
            raise InvalidRequestError("the chat template did not place every image exactly once")
        out = pieces[0]
        for reg, piece in zip(regs, pieces[1:]):
            out += pad * self.adapter.image_token_count(reg.grid_thw) + piece
        return self._tokenize(out)

    def splice_plan(self, messages, rope_policy: str | None = None, tenant: str = "") -> SplicePlan:
        """Tokens, positions and chunk placements the reuse path would prefill for `messages`
        (images precompiled on a miss). For oracles, evaluations and tests."""
        template, refs = parse_messages(messages)
        with self._lock:
            regs = self._resolve(refs, tenant)
            input_ids = self._prompt_ids(template, regs)
            native = self.adapter.native_positions(input_ids, [r.grid_thw for r in regs])
            placements, positions = self._place(input_ids, native, regs, tenant, check_policy(rope_policy or
                                                                                               self.settings.rope_policy))
            return SplicePlan(input_ids, positions, native, placements)

    def _place(self, input_ids, native, regs, tenant, policy) -> tuple[list[Placement], torch.Tensor]:
        """A placement per image (cached KV, precompiled on a miss) and the sequence's position ids
        with each chunk at its policy's target."""
        spans = self.adapter.image_spans(input_ids)
        assert len(spans) == len(regs), "one span per referenced image"
        placements = []
        for (start, end), reg in zip(spans, regs):
            entry, _ = self._cached_chunk(reg, tenant)
            target = target_positions(native[:, start:end], entry.position_ids, policy)
            placements.append(Placement(start, entry, target))
        return placements, self._query_positions(native, placements)

    def _prefill_reuse(self, input_ids, positions, regs, tenant, seam, policy):
        """Splice every image from the cache. Returns the prefill, the image tokens reused and the
        position ids used."""
        placements, positions = self._place(input_ids, positions, regs, tenant, policy)
        result = prefill_spliced(self.adapter, input_ids, positions, placements, seam, rotate=policy != "none")
        reused_image = sum(max(p.entry.num_tokens - 2 - max(seam - 1, 0), 0) for p in placements)
        return result, min(reused_image, result.reused_tokens), positions

    @staticmethod
    def _query_positions(positions: torch.Tensor, placements: list[Placement]) -> torch.Tensor:
        """The sequence's position ids with each chunk at its policy's target positions."""
        out = positions.clone()
        for p in placements:
            out[:, p.start:p.end] = p.target
        return out

    def _fidelity(self, fast: PrefillResult, input_ids, positions, regs) -> Fidelity:
        native = self.adapter.native_positions(input_ids, [r.grid_thw for r in regs])
        feats = ImageFeatures.concat([self._encode(r) for r in regs])
        ref = prefill_full(self.adapter, input_ids, native, feats).logits[0]
        got = fast.logits[0]
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=0).item()
        return Fidelity(cos, (got - ref).abs().max().item(), bool(got.argmax() == ref.argmax()))

    def _decode(self, prefill: PrefillResult, positions, max_new_tokens, temperature, top_p, seed, stops,
                on_text, should_stop, t0) -> tuple[list[int], str, float, str]:
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        tokenizer = self.adapter.tokenizer
        logits, cache = prefill.logits[0], prefill.cache
        next_pos = int(positions.max()) + 1
        ids: list[int] = []
        emitted, finish, ttft = "", "length", None
        hold = max((len(s) for s in stops), default=1) - 1
        for step in range(max_new_tokens):
            token = next_token(logits, temperature, top_p, generator)
            if ttft is None:
                ttft = time.perf_counter() - t0
            if token in self.stop_ids:
                finish = "stop"
                break
            ids.append(token)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            if cut >= 0:
                text, finish = text[:cut], "stop"
            ready = text if finish == "stop" else text[: max(len(text) - hold, len(emitted))]
            if ready.endswith("\ufffd") and finish != "stop":
                ready = emitted  # an incomplete UTF-8 sequence: wait for the next token
            if on_text and len(ready) > len(emitted):
                on_text(ready[len(emitted):])
            emitted = ready if len(ready) > len(emitted) else emitted
            if finish == "stop":
                break
            if should_stop is not None and should_stop():
                finish = "cancelled"
                break
            if step + 1 < max_new_tokens:
                pos = torch.full((3, 1), next_pos + step, dtype=torch.long)
                logits = self.adapter.forward(torch.tensor([token]), pos, cache)[0]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        text = text[:cut] if cut >= 0 else text
        if on_text and len(text) > len(emitted):
            on_text(text[len(emitted):])
        return ids, finish, ttft if ttft is not None else time.perf_counter() - t0, text

    # ---- introspection -------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            c = self._counters
            return {
                "vision_tower_runs": c.vision_tower_runs,
                "image_cache_hits": self.cache.hits,
                "image_cache_misses": self.cache.misses,
                "image_cache_entries": len(self.cache),
                "cache_bytes": self.cache.nbytes,
                "cache_budget_bytes": self.cache.budget_bytes,
                "evictions": self.cache.evictions,
                "prefill_tokens": c.prefill_tokens,
                "reused_tokens": c.reused_tokens,
                "requests": c.requests,
                "registered_images": len(self._images),
            }

    def check_integrity(self) -> None:
        """AssertionError unless the cache's accounting holds and every entry is well formed."""
        with self._lock:
            self.cache.check_integrity()
