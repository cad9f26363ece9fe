"""First sight of an image: the turn computed as exact-prefix caching would, the reusable chunk
built afterwards, off the request path.

A request that references an image whose KV is in no tier (RAM, disk, shared) does not precompile
it first (a vision tower run and an isolated LM prefill of the image, then the spliced turn: two
LM passes over the image). The image is placed `InContextImage`: its span is computed with the
rest of the prompt after the longest prefix-cache hit, in one forward, with the features of one
vision-tower run. The KV it gets attends to everything before it, exactly as a full recompute's,
so the turn's prefix blocks are ordinary exact blocks (keyed by the image's chunk key, so a
delete purges them).

Once the request's first token is out, the image's isolated, reusable chunk is queued for a
background build (`BackgroundBuilds`): the same isolated prefill a precompile runs, from the
features the request computed (the vision tower never runs twice), at the lowest priority: the
scheduler runs a piece in a turn with nothing else to do (no request waiting, prefilling or
decoding, no fidelity shadow pending), `Engine.run_background` runs them for a program that
calls `Engine.generate` itself. The chunk is used from the moment it is stored; until then a
request that meets the image again computes it in context from the pending build's features.

Bounded: each pending build is charged its features and the KV its isolated prefill will hold
(anchor and image span, every layer), and the charges stay within `budget_bytes`; a build that
does not fit is dropped and counted (the image is then seen for the first time again). A delete of the image while its build is pending cancels it (`KVStore.watch`:
nothing derived from a purged image is stored).

Not thread-safe: the engine's lock covers every call; `BackgroundBuilds.pending` (a length) may be
read from any thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from mmkv.adapters import ImageFeatures, VLAdapter
from mmkv.kv.chunks import CachedChunk
from mmkv.request.registry import Registries, RegisteredImage, image_id_for
from mmkv.request.splice import PrefillResult, isolated_chunk, kv_elements_per_token, prefill_full
from mmkv.store.kv_store import PurgeWatch

log = logging.getLogger("mmkv.first_sight")

DEFAULT_BUDGET_BYTES = 256 << 20  # pending builds' features and the KV their prefills will hold


def kv_bytes_per_token(adapter: VLAdapter) -> int:
    """K and V of every layer for one token, at the model's dtype."""
    return kv_elements_per_token(adapter) * adapter.dtype.itemsize


@dataclass(eq=False)
class InContextImage:
    """An image seen for the first time, placed in a request's plan as a chunk that the turn
    computes whole at its native positions (mmkv.request.splice.splice_layout) with `features`;
    what its background build needs."""

    key: str  # the chunk key its cached KV will have
    token_ids: torch.Tensor  # [Lc] vision_start, pads, vision_end
    features: ImageFeatures
    grid_thw: tuple[int, int, int]
    tenant: str
    image_id: str
    durable: str | None  # its durable key in the lower tiers (None without tiers)
    watch: PurgeWatch  # purges since the image was placed: a delete cancels its build
    kind = "image"
    in_context = True
    sources: frozenset[str] = frozenset()  # it attended to nothing cached (composed turns name theirs)
    pad_offset = 1  # its pads follow vision_start

    @property
    def num_tokens(self) -> int:
        return self.token_ids.numel()


@dataclass(eq=False)
class _Build:
    image: InContextImage
    charge: int  # bytes: its features and the KV its isolated prefill will hold
    prefill: PrefillResult | None = None  # the isolated prefill once started, its forward pending
    positions: torch.Tensor | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class BackgroundRun:
    """What `Engine.run_background` did: builds stored, LM tokens run, seconds, builds still pending."""

    built: int
    tokens: int
    seconds: float
    pending: int


@dataclass
class _Counts:
    offered: int = 0
    built: int = 0
    dropped: int = 0  # did not fit the budget
    cancelled: int = 0  # the image was deleted while its build was pending
    superseded: int = 0  # the chunk was stored meanwhile (an upload precompiled it)
    failed: int = 0
    tokens: int = 0
    seconds: float = 0.0


class BackgroundBuilds:
    """The bounded FIFO of chunk builds (module docstring)."""

    def __init__(self, adapter: VLAdapter, registry: Registries, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        if budget_bytes < 0:
            raise ValueError("background budget must be >= 0 bytes")
        self.adapter, self.registry, self.budget_bytes = adapter, registry, budget_bytes
        self._jobs: deque[_Build] = deque()
        self._counts = _Counts()

    @property
    def pending(self) -> int:
        return len(self._jobs)

    @property
    def nbytes(self) -> int:
        """What the pending builds are charged: their features and the KV their prefills will hold."""
        return sum(j.charge for j in self._jobs)

    def charge(self, image: InContextImage) -> int:
        tokens = self.registry.anchor_ids.numel() + image.num_tokens
        return image.features.nbytes + tokens * kv_bytes_per_token(self.adapter)

    def features(self, key: str) -> ImageFeatures | None:
        """The visual features a pending build of chunk `key` holds (the vision tower ran)."""
        self.prune()
        return next((j.image.features for j in self._jobs if j.image.key == key), None)

    def offer(self, image: InContextImage) -> bool:
        """Queue the build of a first-sight image's chunk; False when it is pending already, was
        purged meanwhile, or does not fit the budget (dropped and counted)."""
        self.prune()
        if image.watch.touches((image.key,)) or any(j.image.key == image.key for j in self._jobs):
            return False
        charge = self.charge(image)
        self._counts.offered += 1
        if self.nbytes + charge > self.budget_bytes:
            self._counts.dropped += 1
            return False
        self._jobs.append(_Build(image, charge))
        return True

    def step(self, max_tokens: int | None = None) -> int:
        """Run at most `max_tokens` LM tokens (None: all it needs) of the oldest build; store its
        chunk once done. Returns the tokens run. A build that fails is dropped and logged: it never
        fails a request or the loop."""
        self.prune()
        if not self._jobs:
            return 0
        job, t0 = self._jobs[0], time.perf_counter()
        try:
            if job.prefill is None and job.image.key in self.registry.cache:
                self._finish(job, "superseded")
                return 0
            if job.prefill is None:
                self._start(job)
            before = job.prefill.pending.remaining
            done = job.prefill.advance(max_tokens)
            ran = before - (0 if done else job.prefill.pending.remaining)
            job.seconds += time.perf_counter() - t0
            self._counts.tokens += ran
            if done:
                self._store(job)
            return ran
        except Exception:  # noqa: BLE001 - a background build never takes a request or the loop down
            log.exception("a background chunk build failed; dropped")
            self._finish(job, "failed")
            return 0

    def run(self, budget: int | None = None) -> BackgroundRun:
        """Run pending builds, oldest first, until `budget` LM tokens ran (None: until none is pending)."""
        if budget is not None and budget < 1:
            raise ValueError("a background budget must be at least 1 token (None: everything pending)")
        built, tokens, t0 = self._counts.built, 0, time.perf_counter()
        while self._jobs and (budget is None or tokens < budget):
            tokens += self.step(None if budget is None else budget - tokens)
        return BackgroundRun(self._counts.built - built, tokens, time.perf_counter() - t0, self.pending)

    def stats(self) -> dict:
        self.prune()
        c = self._counts
        return {"background_pending": len(self._jobs), "background_bytes": self.nbytes,
                "background_budget_bytes": self.budget_bytes, "background_offered": c.offered,
                "background_built": c.built, "background_dropped": c.dropped, "background_cancelled": c.cancelled,
                "background_superseded": c.superseded, "background_failed": c.failed, "background_tokens": c.tokens,
                "background_seconds": round(c.seconds, 6)}

    def _start(self, job: _Build) -> None:
        """The isolated prefill a precompile runs (mmkv.request.splice.precompile_image): the
        anchor, then the image span, from the features the request computed; left pending."""
        image, anchor = job.image, self.registry.anchor_ids
        ids = torch.cat((anchor, image.token_ids))
        job.positions = self.adapter.native_positions(ids, [image.grid_thw])
        job.prefill = prefill_full(self.adapter, ids, job.positions, image.features, defer=True)

    def _store(self, job: _Build) -> None:
        image = job.image
        if image.watch.touches((image.key,)):
            self._finish(job, "cancelled")
            return
        entry = isolated_chunk(self.adapter, job.prefill.cache, job.positions, self.registry.anchor_ids.numel(),
                               "image", image.token_ids, image.key, image.features, image.grid_thw)
        stored = self.registry.store_built(entry, image.tenant, image.image_id, image.durable)
        self._finish(job, "built" if stored else "superseded")

    def _finish(self, job: _Build, outcome: str) -> None:
        self._jobs.remove(job)
        setattr(self._counts, outcome, getattr(self._counts, outcome) + 1)
        self._counts.seconds += job.seconds

    def prune(self) -> None:
        """Cancel the builds of images purged (deleted) since they were placed: their features go now."""
        for job in [j for j in self._jobs if j.image.watch.touches((j.image.key,))]:
            self._finish(job, "cancelled")


class FirstSight:
    """Where a request's chunks come from when first sight is on: a cached chunk (RAM, disk,
    shared), else the image in context (`InContextImage`); `offer` queues the builds once the
    request's first token is out. With `enabled` False every miss precompiles, as before."""

    def __init__(self, adapter: VLAdapter, registry: Registries, enabled: bool = True,
                 budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self.adapter, self.registry, self.enabled = adapter, registry, enabled
        self.builds = BackgroundBuilds(adapter, registry, budget_bytes)
        registry.pending_features = self.builds.features  # a precompile reuses a pending build's features

    def chunks(self, spans: list, tenant: str) -> list[tuple[int, CachedChunk | InContextImage]]:
        """Each span's chunk (start, entry); an image seen twice in one request is placed once."""
        out, seen = [], {}
        for start, ref in spans:
            if not (self.enabled and isinstance(ref, RegisteredImage)):
                out.append((start, self.registry.chunk_for(ref, tenant)))
                continue
            key = self.registry.image_key(ref, tenant)
            if key not in seen:
                cached = self.registry.image_chunk(ref, tenant, build=False)
                seen[key] = cached if cached is not None else self._in_context(ref, key, tenant)
            out.append((start, seen[key]))
        return out

    def _in_context(self, reg: RegisteredImage, key: str, tenant: str) -> InContextImage:
        """The image placed for the turn to compute: the vision tower runs unless a pending build
        holds its features."""
        watch = self.registry.cache.watch()
        features = self.builds.features(key)
        if features is None:
            features = self.registry.encode(reg)
        durable = self.registry.image_durable_key(reg, tenant) if self.registry.tiers is not None else None
        return InContextImage(key, self.adapter.image_span_ids(reg.grid_thw), features, tuple(reg.grid_thw), tenant,
                              image_id_for(reg.content_hash), durable, watch)

    @staticmethod
    def in_context(placements) -> list[InContextImage]:
        """The distinct first-sight images among a plan's placements."""
        found = {}
        for p in placements:
            if p.entry.in_context:
                found.setdefault(p.entry.key, p.entry)
        return list(found.values())

    def offer(self, placements) -> None:
        """Queue the build of every first-sight image among `placements` (the request's first token is out)."""
        for image in self.in_context(placements):
            self.builds.offer(image)
