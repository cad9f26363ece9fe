"""The engine: one model, its image and skill registries (mmkv.request.registry), the KV store (image and
skill chunks, prefix blocks) and generation with reuse.

Life of a request (docs/structure.md): parse messages -> decode/hash images -> render the chat
template -> lookup each chunk's KV (precompile on a miss) -> reposition -> prefix-cache lookup
-> edit policy -> splice -> seam repair -> prefill the text -> decode -> stream text deltas.

Thread-safety: every public method but `prepare_image` takes the engine's lock, so calls from
several threads are serialised; the HTTP server still runs one worker that owns the engine and
prepares images (decode, hash, resize) in a thread pool before they reach it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from mmkv.adapters import ImageFeatures, VLAdapter, load_adapter
from mmkv.adapters.cpu_kernels import CPU_LINEAR
from mmkv.store.fingerprint import model_fingerprint
from mmkv.errors import InvalidRequestError, InvalidVideoError, ModelLoadError, PromptTooLongError
from mmkv.hub import resolve_model
from mmkv.images import DEFAULT_MAX_IMAGE_PIXELS, PreparedImage
from mmkv.video import DecodedVideo, RequestVideoTokens, VideoLimits, VideoSampling
from mmkv.store.kv_store import KVStore
from mmkv.request.messages import parse_messages
from mmkv.store.prefix_cache import PrefixCache
from mmkv.request.decode import DecodeStream
from mmkv.request.grammar import GrammarCompiler
from mmkv.request.sampling import TokenLogprob, TokenTexts
from mmkv.request.spec import RequestSpec, build_spec
from mmkv.request.tools import ContentFilter, ToolCall, ToolSpec
from mmkv.request.compose import HistoryReport
from mmkv.request.first_sight import DEFAULT_BUDGET_BYTES, BackgroundRun, FirstSight
from mmkv.request.place import EditReport, KVPlacer, Placed
from mmkv.request.blend import BlendReport, parse_blend
from mmkv.request.plan import PROCESSOR_ONLY, Planner, SplicePlan, check_policy, check_seam_tokens
from mmkv.request.registry import ImageInfo, Registries, Skill, SkillInfo, check_skill
from mmkv.request.streams import PreparedFrames, StreamInfo, StreamSettings
from mmkv.request.videos import RegisteredVideo, VideoInfo
from mmkv.request.registry import image_id_for  # noqa: F401  re-exported: mmkv.bench.run imports it from here
from mmkv.request.splice import PrefillResult, SlotPool, prefill_full
from mmkv.store.tiers import StoreConfig, Tiers, digest_cache_path

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_MODEL = REPO_ROOT / "samples" / "models" / "qwen2_5_vl-tiny"
ANCHORS = ("system", "none")


@dataclass(frozen=True)
class EngineSettings:
    seam_tokens: int = 1
    rope_policy: str = "native"
    cache_bytes: int = 2 << 30  # one budget for image and skill chunks and prefix blocks
    anchor: str = "system"  # precompile chunks after the chat template's default system header
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    image_store_bytes: int = 1 << 30  # sources kept for uploaded images (encoded bytes / downscaled RGB)
    max_context: int | None = None  # tokens; None = the model's max_position_embeddings
    prefix_cache: bool = True
    edit_max_tokens: int = 16  # longest substitution the edit detector treats as a field change
    selective_layer: int = 1  # layer whose KV change ranks tokens for selective@K
    video_limits: VideoLimits = VideoLimits()  # per video: bytes, frame size, duration, frames, tokens, decode time
    video_store_bytes: int = 1 << 30  # sampled frames kept for uploaded videos
    # Every video one request references, together (video_limits bounds each alone); checked once
    # they are known, before any group's vision tower or LM prefill runs.
    max_video_tokens_per_request: int = 32768
    blend: float | dict = 0.0  # the fidelity dial's default: a ratio, or {chunk kind: ratio} (mmkv.request.blend)
    blend_select: str = "deviation"  # how it chooses the tokens: deviation (the probe) or stride
    blend_layer: int = 1  # the probe's layer: layers 0..blend_layer run, K/V compared at blend_layer
    # An image whose KV is in no tier is computed in its request's context (as exact-prefix caching
    # would), its reusable chunk built afterwards in idle time (mmkv.request.first_sight); False:
    # precompiled (vision tower + isolated prefill) before the turn, as an upload is.
    first_sight_in_context: bool = True
    background_bytes: int = DEFAULT_BUDGET_BYTES  # pending background builds' features and KV in flight
    # On a CPU, the language model's linear layers on oneDNN with prepacked weights (held once), or
    # PyTorch's dense nn.Linear (mmkv.adapters.cpu_kernels); no effect on a GPU.
    cpu_linear: str = "onednn"
    # Prompt-length KV buffers kept for reuse on a CPU, in use and free together (mmkv.request.splice.SlotPool):
    # a reused buffer's pages are mapped already, and a conversation's buffer from its last turn holds
    # the prefix blocks its next turn hits in place (neither copied nor rotated in again).
    slot_bytes: int = 1 << 30

    def __post_init__(self):
        check_seam_tokens(self.seam_tokens)
        parse_blend(self.blend, self.blend_select)
        check_policy(self.rope_policy)
        if self.anchor not in ANCHORS:
            raise InvalidRequestError(f"anchor must be one of {ANCHORS}", param="anchor")
        if self.cache_bytes < 0:
            raise InvalidRequestError("cache_bytes must be >= 0", param="cache_bytes")
        if self.image_store_bytes < 0:
            raise InvalidRequestError("image_store_bytes must be >= 0", param="image_store_bytes")
        if self.background_bytes < 0:
            raise InvalidRequestError("background_bytes must be >= 0", param="background_bytes")
        if self.slot_bytes < 0:
            raise InvalidRequestError("slot_bytes must be >= 0", param="slot_bytes")
        if self.cpu_linear not in CPU_LINEAR:
            raise InvalidRequestError(f"cpu_linear must be one of {CPU_LINEAR}", param="cpu_linear")
        if self.max_video_tokens_per_request < 0:
            raise InvalidRequestError("max_video_tokens_per_request must be >= 0", param="max_video_tokens_per_request")


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

    @classmethod
    def between(cls, got: torch.Tensor, ref: torch.Tensor) -> Fidelity:
        """`got` [V] against the reference's `ref` [V]."""
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=0).item()
        return cls(cos, (got - ref).abs().max().item(), bool(got.argmax() == ref.argmax()))


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
    prefix_tokens_reused: int = 0
    skill_tokens_reused: int = 0
    video_tokens_reused: int = 0
    images_in_context: int = 0  # images seen for the first time: computed in the prompt's context, their
    #                             reusable KV built afterwards in the background (mmkv.request.first_sight)
    fidelity: Fidelity | None = None
    edit: EditReport | None = None
    history: HistoryReport | None = None  # history_policy "compose": what it composed
    blend: BlendReport | None = None  # the fidelity dial's report (None: off, or reuse=False)
    first_logits: torch.Tensor | None = None  # [V] float32, next-token logits after the prompt
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids when asked for
    tool_calls: list[ToolCall] = field(default_factory=list)  # parsed from `<tool_call>` blocks (then not in text)


@dataclass
class Run:
    """A request between its plan and its last token: the turn's forward (cached KV already in
    place; `prefill` runs it whole or a chunk at a time), the decode state, its KV, and what its
    result will report. `result()` once `stream` has finished."""

    stream: DecodeStream
    prefilled: PrefillResult  # its forward pending until `prefill` returns True
    report: dict  # GenerationResult fields known at prefill
    calls: ContentFilter | None = None  # tool calls being held back from the text
    tool_spec: ToolSpec | None = None
    on_text: Callable[[str], None] | None = None
    deferred: Callable[[], None] | None = None  # work that waits until the first token is out
    reference: PrefillResult | None = None  # `fidelity`: the full recompute, run after the turn's forward
    exact: Callable[[], PrefillResult] | None = None  # the client prompt's full recompute, pending (the shadow
    #                                                   monitor's); None for a request that was one
    replay: Callable[[float], PrefillResult] | None = None  # the client prompt spliced at blend r, pending
    #                                                          (the monitor's dial replays); None: not a splice

    @property
    def cache(self) -> DynamicCache:  # per layer [1, kv_heads, L, head_dim]: the prompt, then every token fed
        return self.prefilled.cache

    @property
    def first_logits(self) -> torch.Tensor | None:  # [V] next-token logits after the prompt, once prefilled
        return None if self.prefilled.logits is None else self.prefilled.logits[0]

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens the turn's forward (and, with `fidelity`, the reference's) has still to run."""
        return sum(r.pending.remaining for r in (self.prefilled, self.reference) if r is not None and r.pending)

    def prefill(self, max_tokens: int | None = None) -> bool:
        """Run the next at most `max_tokens` tokens of the turn's forward, then of the reference
        forward `fidelity` asked for (None: all that are left); True once both are done and
        `first_logits` is set. Chunked like any prefill, so a fidelity check never holds the
        running requests' decoding for two whole forwards. The caller holds the engine's lock."""
        before = self.pending_tokens
        if not self.prefilled.advance(max_tokens):
            return False
        if self.reference is not None:
            left = None if max_tokens is None else max_tokens - (before - self.pending_tokens)
            if left == 0 or not self.reference.advance(left):
                return False
            self.report["fidelity"] = Fidelity.between(self.first_logits, self.reference.logits[0])
            self.reference = None  # its cache goes: only the comparison is kept
        if self.report["first_logits"] is None:
            self.report["first_logits"] = self.first_logits.cpu()
        return True

    def ride(self, max_tokens: int):
        """The next at most `max_tokens` tokens of the turn's forward as a piece the decode step's
        forward runs too (mmkv.kv.packed), or None when they cannot ride: a `fidelity` reference
        forward is pending, or they hold image pads (mmkv.request.splice.ChunkedForward.ride)."""
        pending = self.prefilled.pending
        if self.reference is not None or pending is None:
            return None
        return pending.ride(max_tokens)

    def rode(self, piece, logits: torch.Tensor) -> bool:
        """Record a ridden piece as run (`logits` [1, V] of its last token); True once the turn's
        forward is done and `first_logits` is set: `prefill` then has no token left to run and
        finishes it as after its own last piece."""
        return piece.done(logits) and self.prefill()

    def release_prompt_kv(self) -> None:
        """Drop the run's reference to its prompt KV once a decode batch holds a copy (the batch
        decodes it from there): a running request keeps one copy of its KV, not two."""
        self.prefilled.cache = None

    def first_token_out(self) -> None:
        """Call once the first token was sampled and passed on: stores the prompt's prefix blocks."""
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            deferred()

    def result(self) -> GenerationResult:
        s = self.stream
        text, finish, tool_calls = s.text, s.finish_reason, []
        if self.calls:  # the content went out through the filter; what it held is parsed now
            sent = self.calls.text[:self.calls.sent]
            rest, tool_calls = self.calls.finish(self.tool_spec.names)
            if self.on_text and rest:
                self.on_text(rest)
            text = (sent + rest).strip() if tool_calls else sent + rest
            finish = "tool_calls" if tool_calls and finish != "cancelled" else finish
        fields = dict(self.report)
        fields["usage"] = Usage(fields["usage"].prompt_tokens, fields["usage"].cached_tokens, len(s.ids))
        return GenerationResult(text=text, token_ids=list(s.ids), finish_reason=finish, ttft_s=s.ttft,
                                total_s=time.perf_counter() - s.t0, logprobs=s.logprobs, tool_calls=tool_calls,
                                **fields)


@dataclass
class _Counters:
    prefill_tokens: int = 0  # LM forwards of requests (precompiles: Registries.precompiled_tokens)
    reused_tokens: int = 0
    requests: int = 0


class Engine:
    def __init__(self, adapter: VLAdapter, settings: EngineSettings | None = None, model_id: str | None = None,
                 store: StoreConfig | None = None):
        self.adapter = adapter
        self.settings = settings or EngineSettings()
        self.model_id = model_id or adapter.config.name_or_path or adapter.family
        self.cache = KVStore(self.settings.cache_bytes)
        self.prefix = PrefixCache(self.cache)
        self._lock = threading.RLock()
        self._counters = _Counters()
        # SHA-256: config, dtype, weights (file digests cached in the store), tokenizer, template, processor
        self.fingerprint = model_fingerprint(adapter, digest_cache=digest_cache_path(store))
        # after the fingerprint: packed layers hash as their dense weights, but reading them back costs
        self.cpu_linear = adapter.pack_linears(self.settings.cpu_linear)
        self.slots = adapter.slot_pool = SlotPool(self.settings.slot_bytes)  # the prompt-length buffers kept
        ip = adapter.processor.image_processor
        self.grid_settings = f"{ip.size}|patch={ip.patch_size}|merge={ip.merge_size}"
        # the request's stage before placement: template, tokens, positions (mmkv.request.plan)
        self.planner = Planner(adapter)
        self.anchor_ids = self.planner.anchor_ids() if self.settings.anchor == "system" \
            else torch.empty(0, dtype=torch.long)
        self.stop_ids = self._stop_ids()
        self.vocab_size = int(adapter.text_config.vocab_size)
        self.banned_ids = self._processor_only_ids()
        self.token_texts = TokenTexts(adapter.tokenizer)
        self.grammars = GrammarCompiler(adapter.tokenizer, self.vocab_size, self.stop_ids)  # structured outputs
        limit = adapter.text_config.max_position_embeddings
        self.max_context = min(self.settings.max_context or limit, limit)
        # place cached KV (edit detection, edit policies, prefix cache, splice): mmkv.request.place
        self.placer = KVPlacer(adapter, self.cache, self.prefix, self.settings, self.planner, self.max_context)
        # Disk and shared tiers under the RAM store (None: RAM only); their uploads and skills come back.
        self.tiers = Tiers.open(store, self.fingerprint, adapter.num_layers, adapter.dtype, adapter.device)
        # uploads, skills and their chunks' KV (RAM, the tiers, else precompiled): mmkv.request.registry
        self.registry = Registries(adapter, self.settings, self.cache, self.tiers, self.fingerprint,
                                   self.grid_settings, self.anchor_ids, self.max_context)
        self.registry.restore()
        self.planner.videos = self.registry.videos
        # first sight of an image: computed in context, its chunk built in idle time (mmkv.request.first_sight)
        self.first_sight = FirstSight(adapter, self.registry, self.settings.first_sight_in_context,
                                      self.settings.background_bytes)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path | None = None, dtype: torch.dtype | str | None = None,
                        device: str | None = None, seam_tokens: int = 1, rope_policy: str = "native",
                        cache_bytes: int = 2 << 30, min_pixels: int | None = None, max_pixels: int | None = None,
                        store_dir: str | Path | None = None, store_bytes: int = 20 << 30, redis_url: str | None = None,
                        mooncake_master: str | None = None, mooncake_metadata: str | None = None,
                        store_options: dict | None = None,
                        **settings) -> Engine:
        """Load a local checkpoint dir or a hub id in the local hub cache (None = the bundled sample
        model) and wrap it. `dtype`: float32 / bfloat16 / float16; `device`: cpu / cuda / cuda:N.
        `store_dir` (a directory, or "auto": ~/.cache/mmkv/<fingerprint>) adds the disk tier with
        `store_bytes` of chunk KV, `redis_url` the shared tier (mmkv/store/tiers.py), or `mooncake_master`
        (HOST:PORT, with `mooncake_metadata`) on Mooncake Store instead; none: RAM only. `store_options`:
        more StoreConfig fields (timeouts, Mooncake segment and buffer, the write queue's bound)."""
        if model_dir is None:
            if not BUNDLED_MODEL.is_dir():
                raise ModelLoadError(f"no model directory given and the bundled model {BUNDLED_MODEL} is missing; "
                                     f"pass the path of a local Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint")
            model_dir = BUNDLED_MODEL
        # checked before the model loads: a bad tier flag or a missing library fails fast
        store = StoreConfig(Path(store_dir) if store_dir is not None else None, store_bytes, redis_url,
                            mooncake_master=mooncake_master, mooncake_metadata=mooncake_metadata, **(store_options or {}))
        resolved = resolve_model(model_dir)
        adapter = load_adapter(resolved.path, dtype=dtype, device=device)
        ip = adapter.processor.image_processor
        if min_pixels is not None or max_pixels is not None:
            size = dict(ip.size)
            size["shortest_edge"] = min_pixels if min_pixels is not None else size["shortest_edge"]
            size["longest_edge"] = max_pixels if max_pixels is not None else size["longest_edge"]
            ip.size = size
        cfg = EngineSettings(seam_tokens=seam_tokens, rope_policy=rope_policy, cache_bytes=cache_bytes, **settings)
        return cls(adapter, cfg, model_id=resolved.model_id, store=store)

    # ---- setup ---------------------------------------------------------------------------------
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

    def _processor_only_ids(self) -> list[int]:
        """Tokens only the processor may place (image / video pads, vision start / end): sampling one
        would put a placeholder with no features into the cache."""
        config = self.adapter.config
        ids = {self.adapter.image_token_id, self.adapter.vision_start_id, self.adapter.vision_end_id,
               getattr(config, "video_token_id", None)}
        added = self.adapter.tokenizer.get_added_vocab()
        ids.update(tid for tok, tid in added.items() if PROCESSOR_ONLY.fullmatch(tok))
        return sorted(i for i in ids if isinstance(i, int))

    # ---- images ----------------------------------------------------------------------------------
    def prepare_image(self, data) -> PreparedImage:
        """Decode (size and bomb limits), hash, downscale and preprocess an image: bytes, a PIL image
        or a data: URL. Thread-safe and lock-free (reads only the model's settings), so the server
        runs it in a thread pool off the engine worker; changes nothing. The result goes to
        add_image or into a message part wherever a PIL image is accepted.

        Bytes keep their encoded form as the source (a recompute decodes them again, exactly); a
        PIL image larger than the processor's max_pixels is kept downscaled to the processor's
        own target size (the size its resize would produce). An image whose span alone does not
        fit the context raises ImageTooLargeError."""
        return self.registry.prepare_image(data)

    def add_image(self, data, tenant: str = "") -> str:
        """Register and precompile an image (bytes, PIL image, data: URL or a PreparedImage);
        returns its stable id (from the content hash). Decoding runs before the engine lock is
        taken. Raises ImageStoreFullError when its source would overflow `image_store_bytes`.
        An upload is built here, ahead of its first use; an image sent inline whose KV is in no
        tier is computed in its request's context instead (first sight, `run_background`)."""
        prepared = self.prepare_image(data)
        with self._lock:
            return self.registry.add_image(prepared, tenant)

    def image_info(self, image_id: str, tenant: str = "") -> ImageInfo:
        with self._lock:
            return self.registry.image_info(image_id, tenant)

    def remove_image(self, image_id: str, tenant: str = "") -> None:
        """Drop an image's source and everything derived from it: its cached KV and every prefix
        block holding that KV (and the blocks after them)."""
        with self._lock:
            self.registry.remove_image(image_id, tenant)
            self.first_sight.builds.prune()  # a pending build of it is cancelled, its features dropped now

    # ---- videos ----------------------------------------------------------------------------------
    def prepare_video(self, data, **sampling) -> DecodedVideo:
        """Decode, sample, resize and hash a video: MP4 / MOV / WebM / MKV bytes, a binary file
        object, a data: URL, or [(PIL image, seconds), ...] (mmkv.video). `sampling`: fps, nframes,
        max_pixels, video_start, video_end. Thread-safe and lock-free; changes nothing. Limits
        (`EngineSettings.video_limits`) raise VideoTooLargeError, bad data InvalidVideoError."""
        return self.registry.videos.prepare(data, VideoSampling.parse(sampling))

    def add_video(self, data, tenant: str = "", **sampling) -> str:
        """Register a video and precompile every temporal group's KV; returns its stable id (from
        the content hash). A message splices it with {"type": "video_file", "video_file":
        {"file_id": id}}. Raises VideoStoreFullError when its frames would overflow
        `video_store_bytes`."""
        prepared = self.prepare_video(data, **sampling)
        with self._lock:
            return self.registry.videos.add(prepared, tenant)

    def video_info(self, video_id: str, tenant: str = "") -> VideoInfo:
        with self._lock:
            return self.registry.videos.info(video_id, tenant)

    def remove_video(self, video_id: str, tenant: str = "") -> None:
        """Drop a video's frames and every group's cached KV, with every prefix block holding it."""
        with self._lock:
            self.registry.videos.remove(video_id, tenant)

    # ---- live video streams (mmkv.request.streams) -------------------------------------------------
    def create_stream(self, tenant: str = "", **settings) -> str:
        """A live video stream: an id that messages reference like an uploaded video's
        ({"type": "video_file", "video_file": {"file_id": id}}), seeing its last `window_groups`
        complete temporal groups. `settings`: fps (its sampling clock, 2), window_groups (64),
        max_pixels (per frame). Delete it with `remove_video`."""
        parsed = StreamSettings.parse(settings)
        with self._lock:
            return self.registry.videos.create_stream(tenant, parsed)

    def append_frames(self, stream_id: str, frames, tenant: str = "", start: float | None = None) -> StreamInfo:
        """Append to a stream: [(PIL image or HxWx3 uint8 array, seconds of stream time), ...], or
        an encoded segment (MP4 / MOV / WebM / MKV bytes or file object) whose frames sit at `start`
        + their own times. All or nothing: a bad frame changes nothing. The frames are decoded and
        resized off the lock; the vision tower runs when a prompt first holds a new group."""
        if not isinstance(frames, PreparedFrames):
            frames = self.prepare_frames(stream_id, frames, tenant, start)
        with self._lock:
            return self.registry.videos.append(stream_id, tenant, frames)

    def prepare_frames(self, stream_id: str, frames, tenant: str = "", start: float | None = None,
                       param: str = "frames") -> PreparedFrames:
        """`append_frames`' decoding and resizing, lock-free (changes nothing); the result appends
        with `append_frames`."""
        with self._lock:
            stream = self.registry.videos.stream(stream_id, tenant, "stream")
        if isinstance(frames, (list, tuple)):
            if start is not None:
                raise InvalidVideoError("start applies to an encoded segment; frames carry their own times",
                                        param="start")
            return stream.prepare(frames, param)
        return stream.prepare_segment(frames, start)

    def frames_at(self, stream_id: str, images: list, tenant: str = "", start: float | None = None,
                  interval: float | None = None) -> list[tuple]:
        """`images` at `start` + i x `interval` seconds (by default one tick of the stream's clock
        apart, just after its latest frame): the (image, seconds) pairs `append_frames` takes."""
        with self._lock:
            stream = self.registry.videos.stream(stream_id, tenant, "stream")
        step = interval if interval is not None else 1 / stream.settings.fps
        first = stream.start_time(start, step)
        return [(img, first + i * step) for i, img in enumerate(images)]

    def stream_info(self, stream_id: str, tenant: str = "") -> StreamInfo:
        with self._lock:
            return self.registry.videos.stream(stream_id, tenant).info()

    # ---- skills ----------------------------------------------------------------------------------
    def add_skill(self, name: str, text: str, tenant: str = "") -> str:
        """Precompile a text skill (a policy, a tool spec, a memory block) in isolation; returns its
        stable id. A message splices it in with {"type": "skill", "skill_id": id}."""
        check_skill(name, text)
        with self._lock:
            return self.registry.add_skill(name, text, tenant)

    def skill_info(self, skill_id: str, tenant: str = "") -> SkillInfo:
        with self._lock:
            return self.registry.skill(skill_id, tenant).info

    def list_skills(self, tenant: str = "") -> list[SkillInfo]:
        with self._lock:
            return self.registry.list_skills(tenant)

    def remove_skill(self, skill_id: str, tenant: str = "") -> None:
        with self._lock:
            self.registry.remove_skill(skill_id, tenant)

    # ---- prompts ---------------------------------------------------------------------------------
    def prompt_ids(self, messages, tenant: str = "", tools: list[dict] | None = None,
                   tool_choice: str | dict | None = None) -> torch.Tensor:
        """The prompt's token ids [L] exactly as generate() builds them."""
        tool_spec = self.planner.tool_spec(tools, tool_choice)
        template, refs = parse_messages(messages)
        prepared = self.registry.prepare_inline(refs)
        with self._lock, self.registry.inline_images() as held:
            return self.planner.prompt(template, self._resolve(refs, tenant, prepared, held), tool_spec)[0]

    def splice_plan(self, messages, rope_policy: str | None = None, tenant: str = "") -> SplicePlan:
        """Tokens, positions and chunk placements the reuse path would prefill for `messages`
        (chunks precompiled on a miss). For oracles, evaluations and tests."""
        template, refs = parse_messages(messages)
        policy = check_policy(rope_policy or self.settings.rope_policy)
        prepared = self.registry.prepare_inline(refs)
        with self._lock, self.registry.inline_images() as held:
            ids, spans = self.planner.prompt(template, self._resolve(refs, tenant, prepared, held))
            native = self.planner.native_positions(ids, [r for _, r in spans])
            return self.planner.plan(ids, [(s, self.registry.chunk_for(r, tenant)) for s, r in spans], policy, native)

    # ---- generation -------------------------------------------------------------------------------
    def generate(self, messages, **kwargs) -> GenerationResult:
        """Answer OpenAI-shaped `messages`: `start` (validate, prefill), then decode one token at a
        time until the request is done. Arguments as `start` documents them."""
        run = self.start(messages, **kwargs)
        with self._lock:
            run.prefill()
            token = run.stream.step(run.first_logits)
            run.first_token_out()
            while token is not None:
                position = torch.full((3, 1), run.stream.position, dtype=torch.long)
                token = run.stream.step(self.adapter.forward(torch.tensor([token]), position, run.cache)[0])
        return run.result()

    def start(self, messages, **kwargs) -> Run:
        """Validate, plan and place one request's cached KV; returns its `Run`, whose forward
        (`Run.prefill`: whole, or chunked between decode steps) and decoding `generate` or the
        scheduler drives (mmkv.request.scheduler). The same arguments as `generate`; keyword
        arguments: max_new_tokens (64), temperature, top_p, top_k, seed, stop, presence_penalty,
        frequency_penalty, logit_bias, logprobs, top_logprobs, reuse (True), seam_tokens,
        rope_policy, tenant, fidelity, edit_policy, history_policy, blend, blend_select, tools, tool_choice,
        response_format, on_text, should_stop, on_logprobs (mmkv.request.spec.build_spec checks them).
        `blend` (a ratio in [0, 1], or {chunk kind: ratio}) recomputes that share of each spliced
        chunk's tokens in context (mmkv.request.blend; default: the engine's `blend` setting).

        Answer OpenAI-shaped `messages`. `reuse=False` is the reference: one full causal forward.

        With reuse, images and skills are spliced from their cached KV and the longest cached
        prompt prefix is reused. An image whose KV is in no tier is computed in the prompt's
        context, as exact-prefix caching would (`result.images_in_context`), and its reusable KV
        built in the background once the first token is out (`run_background`; the scheduler runs
        it in idle turns); `EngineSettings.first_sight_in_context=False` precompiles it first. `edit_policy` decides what happens when the prompt equals a recent
        one except for a short changed field (see mmkv.request.edits). `on_text(delta)` receives text as
        it is decoded; `should_stop()` is polled between tokens. `fidelity=True` also runs the
        full recompute (after the turn's own forward, in the same chunks) and reports how far the
        first logits are.

        Sampling follows OpenAI: temperature in [0, 2] (below 1e-5 greedy), top_p in (0, 1], top_k
        (0 = off), presence / frequency penalties in [-2, 2] over the tokens generated so far,
        logit_bias {token id: [-100, 100]} (at most 300), an int64 `seed`, at most 4 `stop`
        strings of at most 256 characters. Tokens only the processor places (image pads, vision
        start / end) are never sampled. With `logprobs`, `result.logprobs` holds one entry per
        generated token with the `top_logprobs` (0..20) most likely alternatives: log-softmax of
        the processed distribution, i.e. the logits after penalties, logit_bias, the vision-token
        mask, a grammar's mask and temperature (temperature 1 when greedy), before top-k / top-p
        truncation; alternatives are only tokens that could be sampled.
        `on_logprobs(entries)` (only with `logprobs`) receives the entries of the tokens whose
        text forms the next `on_text` delta just before that call, and once more at the end for
        tokens that produced no text: each token exactly once. Bad values raise
        InvalidRequestError with the parameter's name as `param`.

        `tools` / `tool_choice` (OpenAI's function tools, mmkv.request.tools) render through the chat
        template (refused when it has no tool support); `<tool_call>` blocks in the answer become
        `result.tool_calls` (finish_reason "tool_calls") and never reach `on_text`.

        `response_format` (OpenAI's: {"type": "json_object"} or {"type": "json_schema", "json_schema":
        {"name", "schema", "strict"}}) and a forced `tool_choice` decode under a grammar
        (mmkv.request.grammar): a finished answer parses and validates against the schema; one cut
        by max_new_tokens ends with finish_reason "length" and is cut mid-JSON, as OpenAI's.
        """
        return self.start_request(self.request_spec(messages, **kwargs))

    def request_spec(self, messages, **kwargs) -> RequestSpec:
        """`start`'s keyword arguments validated into one `RequestSpec` (the first stage)."""
        return build_spec(messages, vocab_size=self.vocab_size, default_seam=self.settings.seam_tokens,
                          default_policy=self.settings.rope_policy, tool_spec=self.planner.tool_spec,
                          grammars=self.grammars,
                          default_blend=parse_blend(self.settings.blend, self.settings.blend_select), **kwargs)

    def start_request(self, spec: RequestSpec) -> Run:
        """The stages after validation (docs/structure.md): the prompt (messages parsed, images and
        skills resolved, the template tokenized), placement (cached KV placed, the forward left
        pending), accounting (what was reused), and the decoding stream."""
        t0 = time.perf_counter()
        template, refs = parse_messages(spec.messages)
        prepared = self.registry.prepare_inline(refs)  # decoding and hashing: before the lock
        with self._lock, self.registry.inline_images() as held:
            before = (self.registry.vision_tower_runs, self.registry.precompiled_tokens)
            self.registry.fresh.clear()  # reused counts only KV that existed before this request
            resolved = self._resolve(refs, spec.tenant, prepared, held)
            input_ids, spans = self._prompt(spec, template, resolved)
            placed, client = self._place(spec, input_ids, spans, resolved)
            report = self._account(spec, placed, before)
            calls, stream = self._stream(spec, placed.plan, t0)
            return Run(stream, placed.prefill, report, calls, spec.tools, spec.on_text,
                       self._run_under_lock(self._after_first_token(placed)), self._reference(spec, placed.plan),
                       self._exact(client), self._replay(spec, placed, client))

    def _resolve(self, refs: list, tenant: str, prepared: dict, held: list) -> list:
        """Every reference resolved (inline ones registered for the request, into `held`), then its
        videos together checked against `max_video_tokens_per_request`: a refusal comes before any
        group's vision tower or LM prefill runs, and `held` releases what was registered."""
        resolved = self.registry.resolve(refs, tenant, prepared, held)
        total = RequestVideoTokens(self.settings.max_video_tokens_per_request, self.registry.videos.budget.factor)
        for ref, item in zip(refs, resolved):
            if isinstance(item, RegisteredVideo):
                total.add(item.video, ref.param)
        return resolved

    def _after_first_token(self, placed: Placed) -> Callable[[], None] | None:
        """What the request leaves once its first token is out: its prefix blocks, and the
        background builds of the images it saw for the first time."""
        if not FirstSight.in_context(placed.plan.placements):
            return placed.insert

        def commit() -> None:
            if placed.insert is not None:
                placed.insert()
            self.first_sight.offer(placed.plan.placements)
        return commit

    def _prompt(self, spec: RequestSpec, template: list[dict], resolved: list) -> tuple[torch.Tensor, list]:
        """The prompt's token ids and its image and skill spans; refused when it and its answer do
        not fit the context."""
        input_ids, spans = self.planner.prompt(template, resolved, spec.tools)
        if input_ids.numel() + spec.max_new_tokens > self.max_context:
            raise PromptTooLongError(
                f"prompt of {input_ids.numel()} tokens plus max_tokens {spec.max_new_tokens} exceeds the context "
                f"of {self.max_context} tokens", param="messages")
        return input_ids, spans

    def _place(self, spec: RequestSpec, input_ids: torch.Tensor, spans: list,
               resolved: list) -> tuple[Placed, SplicePlan | None]:
        """Reuse: every chunk's cached KV and the longest prefix hit placed, edits applied
        (mmkv.request.place). Else the reference: one full forward over the whole prompt. Either
        forward is left pending (the scheduler runs it in chunks). Also returns the client's own
        plan on the reuse path (an erratum rewrites the one placed), None on the reference path."""
        native = self.planner.native_positions(input_ids, [r for _, r in spans])
        if spec.reuse:
            chunks = self.first_sight.chunks(spans, spec.tenant)
            plan = self.planner.plan(input_ids, chunks, spec.policy, native)
            salt = self._salt(spec.tenant, spec.seam, spec.policy) + (f"|blend={spec.blend}" if spec.blend.active else "")
            return self.placer.prefill(plan, spec.tenant, salt, spec.seam, spec.policy, spec.edit,
                                       spec.max_new_tokens, spec.history, spec.blend), plan
        feats = ImageFeatures.concat([self.registry.features_for(r) for _, r in spans if not isinstance(r, Skill)])
        prefill = prefill_full(self.adapter, input_ids, native, feats, defer=True)
        return Placed(prefill, SplicePlan(input_ids, native, native, [], [None] * input_ids.numel()), None, None), None

    def _exact(self, client: SplicePlan | None) -> Callable[[], PrefillResult] | None:
        """What a reuse request's answer is checked against (the shadow monitor): the full
        recompute of the client's prompt as sent (an erratum's original, not its rewrite), made
        only when asked for."""
        return None if client is None else lambda: self._full_recompute(client)

    def _replay(self, spec: RequestSpec, placed: Placed, client: SplicePlan | None
                ) -> Callable[[float], PrefillResult] | None:
        """What the shadow monitor's `--shadow-blend` replays run: the client's prompt spliced at
        blend r (every chunk kind, the engine's selector), cold and stored nowhere. None off the
        splice path: a full recompute, or a composed turn (the dial does not apply there)."""
        if client is None or placed.history is not None:
            return None
        select = self.settings.blend_select
        return lambda ratio: self.placer.replay(client, spec.seam, spec.policy, parse_blend(ratio, select))

    def _reference(self, spec: RequestSpec, plan: SplicePlan) -> PrefillResult | None:
        """`fidelity` on the reuse path: the full recompute of the same tokens."""
        return self._full_recompute(plan) if spec.fidelity and spec.reuse else None

    def _full_recompute(self, plan: SplicePlan) -> PrefillResult:
        """One ordinary forward over `plan`'s tokens at their native positions (cached visual
        features are what the tower gives), pending like the turn's own."""
        return prefill_full(self.adapter, plan.input_ids, plan.native_positions, plan.chunk_features(), defer=True)

    def _account(self, spec: RequestSpec, placed: Placed, before: tuple[int, int]) -> dict:
        """The result's fields known now (tokens reused by kind, computed, vision tower runs) and
        the engine's counters. Only KV that existed before the request counts as reused."""
        prefill, plan = placed.prefill, placed.plan
        runs_before, computed_before = before
        reused = self._reused_by_kind(plan, prefill, self.registry.fresh)
        self._counters.prefill_tokens += prefill.computed_tokens
        self._counters.reused_tokens += reused["all"]
        self._counters.requests += 1
        return dict(
            usage=Usage(plan.input_ids.numel(), reused["all"], 0), image_tokens_reused=reused["image"],
            lm_tokens_computed=prefill.computed_tokens + self.registry.precompiled_tokens - computed_before,
            vision_tower_runs=self.registry.vision_tower_runs - runs_before, seam_tokens=spec.seam,
            rope_policy=spec.policy, reuse=spec.reuse, prefix_tokens_reused=reused["prefix"],
            skill_tokens_reused=reused["skill"], video_tokens_reused=reused["video"],
            images_in_context=len(FirstSight.in_context(plan.placements)), fidelity=None, edit=placed.report,
            history=placed.history, blend=placed.blend,
            first_logits=None)  # both set by Run.prefill

    def _stream(self, spec: RequestSpec, plan: SplicePlan, t0: float) -> tuple[ContentFilter | None, DecodeStream]:
        """The decoding state; with tools, a filter that holds `<tool_call>` text back from `on_text`."""
        tools, on_text = spec.tools, spec.on_text
        calls = ContentFilter(tools.forced_prefix()) if tools and tools.choice != "none" else None
        content = (lambda delta: (out := calls.feed(delta)) and on_text and on_text(out)) if calls else on_text
        return calls, DecodeStream(
            tokenizer=self.adapter.tokenizer, token_texts=self.token_texts, stop_ids=self.stop_ids,
            banned_ids=self.banned_ids, sampling=spec.sampling, stops=spec.stops, max_new_tokens=spec.max_new_tokens,
            first_position=int(plan.positions.max()) + 1, on_text=content, on_logprobs=spec.on_logprobs,
            should_stop=spec.should_stop, t0=t0, device=self.adapter.device,
            grammar=spec.grammar.matcher() if spec.grammar is not None else None)

    def _run_under_lock(self, fn: Callable[[], object] | None) -> Callable[[], None] | None:
        if fn is None:
            return None

        def locked() -> None:
            with self._lock:
                fn()
        return locked

    def _salt(self, tenant: str, seam: int, policy: str) -> str:
        """Root of the prefix tree: who asked, and every setting that changes spliced KV."""
        return "|".join((tenant, self.fingerprint, self.grid_settings, self.settings.anchor, str(seam), policy))

    def _reused_by_kind(self, plan: SplicePlan, prefill: PrefillResult, fresh: set[str]) -> dict[str, int]:
        """Prompt tokens whose KV existed before the request: all of them (usage.cached_tokens),
        image pads and skill tokens (spliced or inside a prefix-cache hit), and the prefix-cache
        hit. A spliced chunk that was precompiled for this request (`fresh`) was computed. Counted
        per reused range and placement (`plan.chunk_keys` names each placement's tokens), not per token."""
        out = {"image": 0, "skill": 0, "video": 0, "prefix": prefill.prefix_tokens, "all": 0}
        pad, cut = self.adapter.image_token_id, prefill.prefix_tokens
        for a, b in prefill.reused_ranges:
            out["all"] += b - a
            for p in plan.placements:
                lo, hi = max(a, p.start), min(b, p.end)
                if lo >= hi:
                    continue
                if p.entry.key in fresh:  # its tokens past the prefix-cache hit were computed
                    out["all"] -= hi - max(lo, cut) if hi > cut else 0
                    hi = min(hi, cut)
                    if lo >= hi:
                        continue
                if p.entry.kind == "skill":
                    out["skill"] += hi - lo
                elif p.entry.kind == "image":
                    out["image"] += int((plan.input_ids[lo:hi] == pad).sum())
                elif p.entry.kind == "video":
                    out["video"] += int((plan.input_ids[lo:hi] == self.adapter.video_token_id).sum())
        return out

    # ---- background work -----------------------------------------------------------------------------
    def run_background(self, budget: int | None = None) -> BackgroundRun:
        """Build the reusable chunks of images first seen in context (mmkv.request.first_sight),
        oldest first, until `budget` LM tokens ran (None: until none is pending); each is used
        from the moment it is stored. The scheduler (the server) runs them in its idle turns; a
        program that calls `generate` itself calls this between turns (an agent's environment
        step is idle time)."""
        with self._lock:
            return self.first_sight.builds.run(budget)

    # ---- introspection -------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            c, reg = self._counters, self.registry
            return {
                "cpu_linear": self.cpu_linear,
                "vision_tower_runs": reg.vision_tower_runs,
                "image_cache_hits": self.cache.hits["image"],
                "image_cache_misses": self.cache.misses["image"],
                "image_cache_entries": self.cache.count("image"),
                "skill_cache_hits": self.cache.hits["skill"],
                "skill_cache_misses": self.cache.misses["skill"],
                "skill_entries": self.cache.count("skill"),
                "prefix_cache_query_tokens": self.prefix.query_tokens,
                "prefix_cache_hit_tokens": self.prefix.hit_tokens,
                "prefix_blocks": self.cache.count("prefix"),
                "cache_bytes": self.cache.nbytes,
                "cache_budget_bytes": self.cache.budget_bytes,
                "slot_bytes": self.slots.nbytes,
                "slot_budget_bytes": self.slots.budget,
                "slot_in_place_tokens": self.slots.in_place_blocks * self.prefix.block,
                "slot_copied_tokens": self.slots.copied_blocks * self.prefix.block,
                "slot_tail_tokens": self.slots.tail_tokens,
                "slot_grown": self.slots.grown,
                "evictions": self.cache.evictions,
                "prefill_tokens": c.prefill_tokens + reg.precompiled_tokens,
                "reused_tokens": c.reused_tokens,
                "requests": c.requests,
                "registered_images": len(reg.images),
                "image_store_bytes": reg.store_bytes,
                "image_store_budget_bytes": self.settings.image_store_bytes,
                "registered_skills": len(reg.skills),
                "video_cache_entries": self.cache.count("video"),
                "registered_videos": len(reg.videos.videos),
                "video_store_bytes": reg.videos.store_bytes,
                "ram_evictions": self.cache.evictions,  # per tier, as the tiers' stats below
                **self.first_sight.builds.stats(),
                **(self.tiers.stats() if self.tiers is not None else {}),
            }

    def check_integrity(self) -> None:
        """AssertionError unless the cache's accounting holds and every entry is well formed, and the
        image store counts exactly the sources of the registered images (none of them pixel arrays
        left over from a finished precompile)."""
        with self._lock:
            self.cache.check_integrity()
            self.registry.check_integrity()

    def close(self) -> None:
        """Write the chunks still queued for the lower tiers and release the store directory and the
        shared client (also done at interpreter exit): the last call on an engine."""
        if self.tiers is not None:
            self.tiers.close()
