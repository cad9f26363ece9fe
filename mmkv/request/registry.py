"""The image, skill and video registries and where a request's chunks come from: registration,
lookup, purge, the records kept in the durable tiers, the inline images a request registers for
itself, and each chunk's KV (the RAM store, then the disk and shared tiers, then a precompile: the vision
tower and an isolated LM prefill).

Thread-safety: `prepare_image` reads only the model's settings and is lock-free; every other
method mutates the registries, the KV store or the tiers and runs under the engine's lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import xxhash
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from mmkv.adapters import ImageFeatures, VLAdapter
from mmkv.kv.chunks import CachedChunk, chunk_cache_key
from mmkv.errors import (
    ImageStoreFullError,
    ImageTooLargeError,
    InvalidRequestError,
    MMKVError,
    PromptTooLongError,
    UnknownImageError,
    UnknownSkillError,
    UnknownVideoError,
    VideoStoreFullError,
)
from mmkv.store.fingerprint import content_digest, durable_key, image_source_digest
from mmkv.images import PreparedImage, decode_image
from mmkv.store.kv_store import KVStore
from mmkv.request.messages import ImageRef, SkillRef, VideoRef, check_unicode, parse_messages
from mmkv.request.splice import precompile_chunk, precompile_image
from mmkv.request.videos import VideoGroupRef, VideoRegistry, prepare_error
from mmkv.store.tiers import Tiers

log = logging.getLogger("mmkv.engine")


@dataclass(frozen=True)
class ImageInfo:
    image_id: str
    width: int
    height: int
    image_tokens: int  # image-pad tokens the LM sees for it
    nbytes: int  # bytes of the source it was decoded from (0 for a PIL image)


@dataclass(frozen=True)
class SkillInfo:
    skill_id: str
    name: str
    tokens: int
    created_at: int


@dataclass
class RegisteredImage:
    """A registered image: its compact source (counted in the image store) and, until its first
    vision-tower run, that run's input. Never the full-resolution RGB."""

    content_hash: str
    width: int  # of the original
    height: int
    source_bytes: int
    source: bytes | Image.Image  # the encoded upload, or an RGB of at most max_pixels
    source_nbytes: int
    grid_thw: tuple[int, int, int]
    pixel_values: torch.Tensor | None  # dropped once encoded; remade from `source` after an eviction
    uploaded: bool  # added by add_image (kept until removed); else inline, released when its request ends

    @classmethod
    def of(cls, image: PreparedImage, uploaded: bool) -> RegisteredImage:
        return cls(image.content_hash, image.width, image.height, image.source_bytes, image.source,
                   image.source_nbytes, image.grid_thw, image.pixel_values, uploaded)


@dataclass
class Skill:
    info: SkillInfo
    token_ids: torch.Tensor


def image_id_for(content_hash: str) -> str:
    return f"img-{content_hash}"


def skill_id_for(text: str) -> str:
    return f"skill-{xxhash.xxh3_128(text.encode()).hexdigest()}"


def check_skill(name, text) -> None:
    """A skill's name and text, checked as message text is (no lock needed: changes nothing)."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequestError("skill name must be a non-empty string", param="name")
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequestError("skill text must be a non-empty string", param="text")
    check_unicode(name, "name")
    check_unicode(text, "text")
    parse_messages([{"role": "user", "content": text}])  # same reserved-token checks as messages


class Registries:
    """Uploaded (and inline) images and skills per tenant, and their chunks' KV. `store_bytes`
    counts the sources of every registered image against `settings.image_store_bytes`;
    `vision_tower_runs`, `precompiled_tokens` and `fresh` (chunk keys precompiled since the
    engine last cleared it) are what a request's report counts."""

    def __init__(self, adapter: VLAdapter, settings, cache: KVStore, tiers: Tiers | None, fingerprint: str,
                 grid_settings: str, anchor_ids: torch.Tensor, max_context: int):
        self.adapter = adapter
        self.settings = settings
        self.cache = cache
        self.tiers = tiers
        self.fingerprint = fingerprint
        self.grid_settings = grid_settings
        self.anchor_ids = anchor_ids
        self.max_context = max_context
        self.images: dict[tuple[str, str], RegisteredImage] = {}
        self.skills: dict[tuple[str, str], Skill] = {}
        self.store_bytes = 0  # sources of every registered image
        self.fresh: set[str] = set()
        self.vision_tower_runs = 0
        self.precompiled_tokens = 0  # anchor + chunk tokens of every precompile
        self.videos = VideoRegistry(self, settings.video_limits, settings.video_store_bytes)
        # a chunk key's visual features held by a pending background build (the engine sets it)
        self.pending_features: Callable[[str], ImageFeatures | None] = lambda key: None

    # ---- images ----------------------------------------------------------------------------------
    def prepare_image(self, data) -> PreparedImage:
        """Engine.prepare_image: decode, hash, downscale, preprocess; lock-free, changes nothing."""
        if isinstance(data, PreparedImage):
            return data
        decoded = decode_image(data, self.settings.max_image_pixels)
        source = decoded.encoded if decoded.encoded is not None else self._fit_to_processor(decoded.image)
        pixel_values, grid = self.adapter.preprocess_image(decoded.image if isinstance(source, bytes) else source)
        span = self.adapter.image_token_count(grid) + 2
        if self.anchor_ids.numel() + span >= self.max_context:
            raise ImageTooLargeError(f"image is {decoded.width}x{decoded.height}: its {span} tokens leave no room in "
                                     f"the context of {self.max_context} tokens", param="image")
        return PreparedImage(decoded.content_hash, decoded.width, decoded.height, decoded.source_bytes, source,
                             pixel_values, grid)

    def _fit_to_processor(self, image: Image.Image) -> Image.Image:
        """The image at the size the processor's resize would give it, if that is smaller."""
        ip = self.adapter.processor.image_processor
        h, w = smart_resize(image.height, image.width, factor=ip.patch_size * ip.merge_size,
                            min_pixels=ip.size["shortest_edge"], max_pixels=ip.size["longest_edge"])
        if h * w >= image.height * image.width:
            return image
        return image.resize((w, h), Image.Resampling.BICUBIC)

    def add_image(self, prepared: PreparedImage, tenant: str) -> str:
        image_id, reg = self.register(prepared, tenant, uploaded=True)
        self.image_chunk(reg, tenant, publish=True)  # KV first computed for an inline use goes to the shared tier now
        reg.pixel_values = None  # also when its KV was already cached: the source remakes it on a miss
        self._persist_image(image_id, reg, tenant)
        return image_id

    def image_info(self, image_id: str, tenant: str) -> ImageInfo:
        reg = self.lookup_image(image_id, tenant)
        return ImageInfo(image_id, reg.width, reg.height, self.adapter.image_token_count(reg.grid_thw),
                         reg.source_bytes)

    def remove_image(self, image_id: str, tenant: str) -> None:
        self._purge_image(image_id, self.lookup_image(image_id, tenant), tenant, everywhere=True)

    def _purge_image(self, image_id: str, reg: RegisteredImage, tenant: str, everywhere: bool) -> None:
        durable = self.durable_key("image", image_source_digest(reg.source), tenant)
        self._forget_durable("image", image_id, [durable], tenant, everywhere)
        self.cache.purge(self.image_key(reg, tenant))
        self._unregister((tenant, image_id))

    def _forget_durable(self, kind: str, id_: str, durables: list[str], tenant: str, everywhere: bool) -> None:
        """Drop an image's, skill's or video's KV (under its durable keys: a video's groups) and
        record from the lower tiers before anything here: with `everywhere` (a delete) from the
        shared tier first, so a shared tier that does not take it raises
        SharedTierUnavailableError and this server still holds (and serves) what it had; else
        (deleted on another server, which left the tombstone) from this server's tiers only."""
        if self.tiers is None:
            return
        for durable in durables:
            (self.tiers.purge if everywhere else self.tiers.purge_local)(durable)
        if everywhere:
            self.tiers.registry.remove(kind, tenant, id_)
        else:
            self.tiers.registry.drop_local(kind, tenant, id_)

    def register(self, image: PreparedImage, tenant: str, uploaded: bool) -> tuple[str, RegisteredImage]:
        image_id = image_id_for(image.content_hash)
        reg = self.images.get((tenant, image_id))
        if reg is None:
            if uploaded and self.store_bytes + image.source_nbytes > self.settings.image_store_bytes:
                raise ImageStoreFullError(
                    f"the image store holds {self.store_bytes} of {self.settings.image_store_bytes} bytes; "
                    f"this image needs {image.source_nbytes}: delete images first", param="image")
            reg = self.images[(tenant, image_id)] = RegisteredImage.of(image, uploaded)
            self.store_bytes += reg.source_nbytes
        elif uploaded:
            reg.uploaded = True
        return image_id, reg

    def _unregister(self, key: tuple[str, str]) -> None:
        self.store_bytes -= self.images.pop(key).source_nbytes

    def lookup_image(self, image_id: str, tenant: str, param: str | None = None) -> RegisteredImage:
        return self._lookup("image", image_id, tenant, param)

    def _lookup(self, kind: str, id_: str, tenant: str, param: str | None):
        """A registered image, skill or video: held here, or adopted from the durable tiers; one
        deleted on another server is purged here too and is unknown."""
        held, purge, unknown = {"image": (self.images, self._purge_image, UnknownImageError),
                                "skill": (self.skills, self._purge_skill, UnknownSkillError),
                                "video": (self.videos.videos, self.videos.purge, UnknownVideoError)}[kind]
        entry = held.get((tenant, id_)) or self._fetch(kind, id_, tenant, param)
        if entry is not None and self.tiers is not None and self.tiers.registry.gone(kind, tenant, id_):
            purge(id_, entry, tenant, everywhere=False)  # deleted on another server
            entry = None
        if entry is None:
            raise unknown(f"no {kind} with id {id_!r}", param=param)
        return entry

    def _fetch(self, kind: str, id_: str, tenant: str, param: str | None = None):
        """An upload or skill this engine does not hold but the durable tiers do (another server's,
        or one left on disk at start for want of room); ImageStoreFullError / VideoStoreFullError
        when its store has no room for it."""
        rec = self.tiers.registry.get(kind, tenant, id_) if self.tiers is not None else None
        if rec is None:
            return None
        adopt = {"image": self._adopt_image, "video": self.videos.adopt}.get(kind)
        return adopt(rec, param) if adopt is not None else self._adopt_skill(rec)

    def image_key(self, reg: RegisteredImage, tenant: str) -> str:
        return chunk_cache_key("image", reg.content_hash, self.fingerprint, self.grid_settings,
                               self.settings.anchor, tenant)

    def encode(self, reg: RegisteredImage) -> ImageFeatures:
        """Run the vision tower; its input is then dropped (remade from the source on a later miss)."""
        pixel_values = reg.pixel_values
        if pixel_values is None:
            rgb = decode_image(reg.source, self.settings.max_image_pixels).image if isinstance(reg.source, bytes) \
                else reg.source
            pixel_values = self.adapter.preprocess_image(rgb)[0]
        self.vision_tower_runs += 1
        features = self.adapter.encode_image(pixel_values, reg.grid_thw)
        reg.pixel_values = None
        return features

    def _cached_chunk(self, key: str, kind: str, precompile: Callable[[], CachedChunk] | None,
                      durable: Callable[[], str] | None = None, shared: bool = True,
                      publish: bool = False) -> CachedChunk | None:
        """The chunk under `key`; on a RAM miss the lower tiers are asked (under the durable key
        `durable()` gives: mmkv/store/tiers.py), and only then `precompile()` builds it (counted, stored,
        written through to the disk and, when `shared`, the shared tier); None when every tier
        misses and `precompile` is None. `publish`: write it through even when it was found (an
        image uploaded after an inline use, a skill added again)."""
        entry = self.cache.get(key, kind)
        want_tiers = self.tiers is not None and durable is not None and (entry is None or publish)
        stored = durable() if want_tiers else None
        if entry is None and stored is not None:
            loaded = self.tiers.load(stored, key, kind)
            if loaded is not None:
                entry = loaded[0]
                self.cache.put(entry)
        fresh = entry is None
        if fresh and precompile is None:
            return None
        if fresh:
            entry = precompile()
            self.precompiled_tokens += self.anchor_ids.numel() + entry.num_tokens
            self.fresh.add(key)
            self.cache.put(entry)
        if stored is not None and (fresh or publish):
            self.tiers.store(stored, entry, shared=shared)
        return entry

    def image_chunk(self, reg: RegisteredImage, tenant: str, publish: bool = False,
                    build: bool = True) -> CachedChunk | None:
        """The image's cached KV, precompiled (vision tower + isolated LM prefill) on a miss, from
        the features a pending background build holds when there is one (`pending_features`: the
        tower ran already); with `build` False, None on a miss (a first sight:
        mmkv.request.first_sight). Only an uploaded image's KV goes to the shared tier: an inline
        one's stays on this server."""
        key = self.image_key(reg, tenant)

        def precompile() -> CachedChunk:
            features = self.pending_features(key)
            features = self.encode(reg) if features is None else features
            return precompile_image(self.adapter, features, reg.grid_thw, key, self.anchor_ids)
        return self._cached_chunk(key, "image", precompile if build else None,
                                  durable=lambda: self.image_durable_key(reg, tenant), shared=reg.uploaded,
                                  publish=publish)

    def image_durable_key(self, reg: RegisteredImage, tenant: str) -> str:
        return self.durable_key("image", image_source_digest(reg.source), tenant)

    def store_built(self, entry: CachedChunk, tenant: str, image_id: str, durable: str | None) -> bool:
        """A chunk built off the request path (mmkv.request.first_sight) stored as a precompile's
        would be: counted, in the RAM store, written through to the lower tiers (to the shared
        tier only while the image is an upload). False, and nothing stored, when the store
        already holds a chunk under its key (an upload precompiled it meanwhile)."""
        if entry.key in self.cache:
            return False
        self.precompiled_tokens += self.anchor_ids.numel() + entry.num_tokens
        self.cache.put(entry)
        if self.tiers is not None and durable is not None:
            reg = self.images.get((tenant, image_id))
            self.tiers.store(durable, entry, shared=reg is not None and reg.uploaded)
        return True

    # ---- skills ----------------------------------------------------------------------------------
    def add_skill(self, name: str, text: str, tenant: str) -> str:
        """Engine.add_skill once `check_skill` passed: tokenized, precompiled, recorded."""
        token_ids = self._tokenize(text)
        if token_ids.numel() + self.anchor_ids.numel() >= self.max_context:
            raise PromptTooLongError(f"skill of {token_ids.numel()} tokens exceeds the context", param="text")
        skill_id = skill_id_for(text)
        if (tenant, skill_id) not in self.skills:
            info = SkillInfo(skill_id, name, token_ids.numel(), int(time.time()))
            self.skills[(tenant, skill_id)] = Skill(info, token_ids)
        self.skill_chunk(self.skills[(tenant, skill_id)], tenant, publish=True)
        if self.tiers is not None:
            info = self.skills[(tenant, skill_id)].info
            self.tiers.registry.put("skill", tenant, skill_id,
                                    {"name": info.name, "text": text, "created_at": info.created_at})
        return skill_id

    def list_skills(self, tenant: str) -> list[SkillInfo]:
        if self.tiers is not None:  # skills another server added to the shared tier
            for skill_id in self.tiers.registry.shared_ids("skill", tenant):
                if (tenant, skill_id) not in self.skills:
                    self._fetch("skill", skill_id, tenant)
        return [s.info for (t, _), s in self.skills.items() if t == tenant]

    def remove_skill(self, skill_id: str, tenant: str) -> None:
        self._purge_skill(skill_id, self.skill(skill_id, tenant), tenant, everywhere=True)

    def _purge_skill(self, skill_id: str, skill: Skill, tenant: str, everywhere: bool) -> None:
        durable = self.durable_key("skill", content_digest(skill.token_ids.numpy().tobytes()), tenant)
        self._forget_durable("skill", skill_id, [durable], tenant, everywhere)
        self.cache.purge(self._skill_key(skill, tenant))
        del self.skills[(tenant, skill_id)]

    def skill(self, skill_id: str, tenant: str, param: str | None = None) -> Skill:
        return self._lookup("skill", skill_id, tenant, param)

    def _skill_key(self, skill: Skill, tenant: str) -> str:
        return chunk_cache_key("skill", skill.info.skill_id, self.fingerprint, "", self.settings.anchor, tenant)

    def skill_chunk(self, skill: Skill, tenant: str, publish: bool = False) -> CachedChunk:
        key = self._skill_key(skill, tenant)
        return self._cached_chunk(key, "skill", lambda: precompile_chunk(
            self.adapter, "skill", skill.token_ids, key, self.anchor_ids),
            durable=lambda: self.durable_key("skill", content_digest(skill.token_ids.numpy().tobytes()), tenant),
            publish=publish)

    def _tokenize(self, text: str) -> torch.Tensor:
        """A skill's text is text: a special token's string in it is tokenized as plain text, as in
        messages (mmkv.request.plan.ClientText), so a skill cannot end its turn or open another."""
        return torch.tensor(self.adapter.tokenizer(text, split_special_tokens=True)["input_ids"], dtype=torch.long)

    def chunk_for(self, ref: RegisteredImage | Skill | VideoGroupRef, tenant: str) -> CachedChunk:
        if isinstance(ref, VideoGroupRef):
            return self.videos.group_chunk(ref, tenant)
        return self.image_chunk(ref, tenant) if isinstance(ref, RegisteredImage) else self.skill_chunk(ref, tenant)

    def features_for(self, ref: RegisteredImage | VideoGroupRef) -> ImageFeatures:
        """The vision tower's output for an image or a video group (the full-recompute path)."""
        return self.videos.encode(ref) if isinstance(ref, VideoGroupRef) else self.encode(ref)

    # ---- durable tiers: keys, records of uploads and skills (mmkv/store/tiers.py) ----------------------
    def durable_key(self, kind: str, digest: str, tenant: str) -> str:
        grid = {"image": self.grid_settings, "video": self.videos.grid_settings}.get(kind, "")
        return durable_key(kind, digest, self.fingerprint, grid, self.settings.anchor, tenant)

    def restore(self) -> None:
        """Register the uploads (images, videos) and skills the disk tier holds, inside their
        stores' budgets; their KV loads on first use."""
        if self.tiers is None:
            return
        registry = self.tiers.registry
        for kind, adopt, purge, full in (("image", self._adopt_image, self._purge_image, ImageStoreFullError),
                                         ("video", self.videos.adopt, self.videos.purge, VideoStoreFullError)):
            for rec in registry.local(kind):
                try:
                    reg = adopt(rec)
                except full:
                    log.warning("%s store full: stored upload %s not restored (it stays on disk)", kind, rec.id)
                    continue
                if reg is not None and registry.gone(kind, rec.tenant, rec.id):  # deleted on another server
                    purge(rec.id, reg, rec.tenant, everywhere=False)
        for rec in registry.local("skill"):
            skill = self._adopt_skill(rec)
            if registry.gone("skill", rec.tenant, rec.id):
                self._purge_skill(rec.id, skill, rec.tenant, everywhere=False)

    def _persist_image(self, image_id: str, reg: RegisteredImage, tenant: str) -> None:
        if self.tiers is None:
            return
        src = reg.source
        meta = {"content_hash": reg.content_hash, "width": reg.width, "height": reg.height,
                "source_bytes": reg.source_bytes, "grid_thw": list(reg.grid_thw),
                "rgb": None if isinstance(src, bytes) else [src.width, src.height]}
        self.tiers.registry.put("image", tenant, image_id, meta, src if isinstance(src, bytes) else src.tobytes())

    def _adopt_image(self, rec, param: str | None = None) -> RegisteredImage:
        """A stored upload registered again; ImageStoreFullError when the image store has no room
        for it (the upload exists: a full store is not an unknown image)."""
        m = rec.meta
        if self.store_bytes + len(rec.blob) > self.settings.image_store_bytes:
            raise ImageStoreFullError(
                f"the image store holds {self.store_bytes} of {self.settings.image_store_bytes} bytes; the stored "
                f"upload {rec.id} needs {len(rec.blob)} more: delete images first", param=param)
        source = rec.blob if m["rgb"] is None else Image.frombytes("RGB", tuple(m["rgb"]), rec.blob)
        reg = RegisteredImage(content_hash=m["content_hash"], width=m["width"], height=m["height"],
                              source_bytes=m["source_bytes"], source=source, source_nbytes=len(rec.blob),
                              grid_thw=tuple(m["grid_thw"]), pixel_values=None, uploaded=True)
        self.images[(rec.tenant, rec.id)] = reg
        self.store_bytes += reg.source_nbytes
        return reg

    def _adopt_skill(self, rec) -> Skill:
        m = rec.meta
        token_ids = self._tokenize(m["text"])
        skill = self.skills[(rec.tenant, rec.id)] = Skill(SkillInfo(rec.id, m["name"], token_ids.numel(),
                                                                    m["created_at"]), token_ids)
        return skill

    # ---- a request's references --------------------------------------------------------------------
    def prepare_inline(self, refs: list[ImageRef | SkillRef]) -> dict[int, PreparedImage]:
        """Inline images decoded and preprocessed before the engine lock is taken; the same data
        referenced twice is prepared once. An error names the message part."""
        prepared, by_data = {}, {}
        for i, ref in enumerate(refs):
            if isinstance(ref, VideoRef) and ref.video_id is None:
                try:
                    prepared[i] = self.videos.prepare(ref.data, ref.sampling)
                except MMKVError as exc:
                    raise prepare_error(exc, ref.param) from exc
            if isinstance(ref, (SkillRef, VideoRef)) or ref.image_id is not None:
                continue
            same = ref.data if isinstance(ref.data, (str, bytes)) else id(ref.data)
            if same not in by_data:
                try:
                    by_data[same] = self.prepare_image(ref.data)
                except MMKVError as exc:
                    raise type(exc)(f"{ref.param}: {exc.message}", param=ref.param) from exc
            prepared[i] = by_data[same]
        return prepared

    def resolve(self, refs: list[ImageRef | SkillRef], tenant: str, prepared: dict[int, PreparedImage],
                held: list[tuple[str, str]]) -> list[RegisteredImage | Skill]:
        """Every referenced image and skill. Ids are checked before anything is registered, so a
        bad one changes nothing. Inline images are registered for this request only: the keys of
        those it registers go to `held` (see inline_images)."""
        known = [self.skill(r.skill_id, tenant, r.param) if isinstance(r, SkillRef)
                 else (self.videos.lookup(r.video_id, tenant, r.param) if r.video_id is not None else None)
                 if isinstance(r, VideoRef)
                 else self.lookup_image(r.image_id, tenant, r.param) if r.image_id is not None else None
                 for r in refs]
        resolved = []
        for i, ref in enumerate(refs):
            if known[i] is None and isinstance(ref, VideoRef):
                video_id, known[i] = self.videos.register(prepared[i], tenant, uploaded=False)
                held.append((tenant, video_id))
            elif known[i] is None:
                image_id = image_id_for(prepared[i].content_hash)
                if (tenant, image_id) not in self.images:
                    held.append((tenant, image_id))
                known[i] = self.register(prepared[i], tenant, uploaded=False)[1]
            resolved.append(known[i])
        return resolved

    @contextmanager
    def inline_images(self):
        """The keys of the inline images a request registers (filled by resolve); when it ends they
        are forgotten (their KV stays in the LRU), unless an upload of the same image came since."""
        held: list[tuple[str, str]] = []
        try:
            yield held
        finally:
            for key in held:
                if key in self.videos.videos:
                    self.videos.release(key)
                    continue
                reg = self.images.get(key)
                if reg is not None and not reg.uploaded:
                    self._unregister(key)

    # ---- introspection -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """AssertionError unless the image store counts exactly the sources of the registered
        images (none of them pixel arrays left over from a finished precompile)."""
        kept = sum(reg.source_nbytes for reg in self.images.values())
        assert kept == self.store_bytes, f"image store tracks {self.store_bytes}, holds {kept}"
        assert all(reg.pixel_values is None for reg in self.images.values()), "pixel_values kept after encoding"
        self.videos.check_integrity()
