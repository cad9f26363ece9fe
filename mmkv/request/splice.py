"""Build a request's KV from segments: cached chunks (images, skills), re-rotated into place,
and freshly computed text; the first `seam_tokens` tokens of each chunk are recomputed with full
attention to everything before them (seam repair).

One turn is one LM forward. The cache is preallocated for the whole prompt; the reused KV (a
prefix-cache hit, each chunk's body rotated by its constant position change) is written into its
slots first, then every token the turn computes (text between chunks, seams, the tail) runs in a
single forward that writes its KV into its own slots. Slots are in prompt order, so that forward's
mask is causal by prompt index: text and seam tokens see everything before them, and a chunk's
body, never recomputed, keeps the KV it got seeing only itself and its anchor.

Chunked prefill: with `defer=True` the KV is placed but the forward waits in the result
(`PrefillResult.pending`, a `ChunkedForward`), to run a few tokens at a time between the
scheduler's decode steps. Each piece is one forward of the next computed tokens (prompt order)
over every slot written so far; since a token only sees slots before it, which are all written by
then, the pieces together equal the one forward (within float rounding).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from mmkv.adapters import ImageFeatures, VLAdapter
from mmkv.kv.chunks import CachedChunk
from mmkv.kv.rerotate import constant_delta, place_rows, reposition_keys, rotation
from mmkv.store.prefix_cache import BLOCK_TOKENS, common_prefix


@dataclass
class Placement:
    """A cached chunk placed in a request: its first token sits at index `start`."""

    start: int
    entry: CachedChunk
    target: torch.Tensor  # [3, Lc] position ids of the chunk's tokens in this request

    @property
    def end(self) -> int:
        return self.start + self.entry.num_tokens


@dataclass
class PrefillResult:
    cache: DynamicCache
    logits: torch.Tensor | None  # [1, V] float32, next-token logits after the prompt; None while `pending`
    computed_tokens: int  # LM tokens run through the model for this prompt
    reused_tokens: int  # tokens whose KV came from a cache (chunks re-rotated, prefix blocks)
    reused_ranges: list[tuple[int, int]]  # [start, end) token ranges whose KV was reused
    prefix_tokens: int = 0  # leading tokens whose KV is the prompt's own from the prefix cache (`prefill_spliced`)
    pending: ChunkedForward | None = None  # the forward still to run (defer=True); `advance` runs it

    def advance(self, max_tokens: int | None = None) -> bool:
        """Run the next at most `max_tokens` tokens of the pending forward (None: all of it);
        True once it is done and `logits` is set."""
        if self.pending is not None and self.pending.advance(max_tokens):
            self.logits, self.pending = self.pending.logits, None
        return self.pending is None


@dataclass(frozen=True)
class SpliceLayout:
    """Which prompt tokens a turn computes and which chunk tokens it reuses."""

    computed: list[tuple[int, int]]  # [start, end) prompt ranges, in order
    reused: list[tuple[Placement, int, int]]  # (placement, first, stop): chunk tokens [first, stop)


class SlotLayer(DynamicLayer):
    """A cache layer preallocated for a whole prompt. While `slots` [Q] is set, an update writes
    the Q new tokens' KV into those slots (prompt indices) and returns the whole buffer; with
    `slots` None (decoding) it appends like any DynamicLayer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):  # [1, kv_heads, L, head_dim]
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.slots: torch.Tensor | None = None
        self.visible = 0  # with `slots`: the buffer's first `visible` slots are returned (the rest unwritten)

    def update(self, key_states, value_states, *args, **kwargs):
        if self.slots is None:
            return super().update(key_states, value_states, *args, **kwargs)
        self.keys.index_copy_(-2, self.slots, key_states)
        self.values.index_copy_(-2, self.slots, value_states)
        return self.keys[:, :, :self.visible], self.values[:, :, :self.visible]


def precompile_chunk(adapter: VLAdapter, kind: str, token_ids: torch.Tensor, key: str, anchor_ids: torch.Tensor,
                     features: ImageFeatures | None = None, grid_thw=None) -> CachedChunk:
    """Prefill one chunk in isolation (after `anchor_ids`, whose KV is then dropped)."""
    ids = torch.cat((anchor_ids, token_ids))
    positions = adapter.native_positions(ids, [grid_thw] if grid_thw else [])
    cache = adapter.new_cache()
    adapter.forward(ids, positions, cache, features)
    return isolated_chunk(adapter, cache, positions, anchor_ids.numel(), kind, token_ids, key, features, grid_thw)


def isolated_chunk(adapter: VLAdapter, cache: DynamicCache, positions: torch.Tensor, anchor: int, kind: str,
                   token_ids: torch.Tensor, key: str, features: ImageFeatures | None = None,
                   grid_thw=None) -> CachedChunk:
    """The chunk out of a cache holding its isolated prefill (`anchor` tokens first, their KV dropped)."""
    layers = cache.layers[: adapter.num_layers]
    return CachedChunk(
        key=key, kind=kind, token_ids=token_ids, position_ids=positions[:, anchor:].clone(),
        keys=tuple(layer.keys[0, :, anchor:].clone() for layer in layers),
        values=tuple(layer.values[0, :, anchor:].clone() for layer in layers),
        features=features, grid_thw=tuple(grid_thw) if grid_thw else None,
    )


def precompile_image(adapter: VLAdapter, features: ImageFeatures, grid_thw, key: str,
                     anchor_ids: torch.Tensor) -> CachedChunk:
    """Prefill one image span (vision_start, pads, vision_end) in isolation."""
    return precompile_chunk(adapter, "image", adapter.image_span_ids(grid_thw), key, anchor_ids, features, grid_thw)


def pad_features(entry: CachedChunk, start: int, stop: int) -> ImageFeatures | None:
    """Feature rows for the image / video pads among chunk tokens [start, stop) (pads are the n
    tokens from `entry.pad_offset` on)."""
    if entry.features is None:
        return None
    n, o = entry.features.embeds.shape[0], entry.pad_offset
    return entry.features.slice(min(max(start - o, 0), n), min(max(stop - o, 0), n))


def splice_layout(placements: list[Placement], total: int, start: int, seam_tokens: int) -> SpliceLayout:
    """Tokens [0, start) are cached already. Each chunk's first `seam_tokens` tokens are computed
    and the rest reused (a first-sight image, `in_context`, is computed whole); a chunk that ends the prompt keeps its last token computed, so the
    prompt's last logits always come from the model. Everything else is computed text."""
    cursor, computed, reused = start, [], []
    for p in sorted(placements, key=lambda p: p.start):
        if p.end <= cursor:
            continue
        if p.start > cursor:
            computed.append((cursor, p.start))
        n = p.entry.num_tokens
        keep_end = n - 1 if p.end == total else n
        seam = keep_end if p.entry.in_context else min(seam_tokens, keep_end)  # first sight: all computed
        first = max(cursor - p.start, 0)  # chunk tokens already in the cache
        if first < seam:
            computed.append((p.start + first, p.start + seam))
        if keep_end > max(seam, first):
            reused.append((p, max(seam, first), keep_end))
        cursor = max(cursor, p.start + keep_end)
    if cursor < total:
        computed.append((cursor, total))
    return SpliceLayout(computed, reused)


POOL_BYTES = 256 << 20  # what the process-wide pool keeps (an Engine keeps its own: EngineSettings.slot_bytes)
POOL_GROWTH = 1.5  # a fresh kept buffer's room over its request: a conversation's next turns, longer, fit it
OUTGROWN_ROOM = 2.0  # the room of the buffer that replaces one a conversation outgrew: it keeps growing


@dataclass(eq=False)
class _Kept:
    """A buffer the pool keeps: `alone` its storage's use count when only the pool holds it; `held`
    the prefix-cache block keys whose KV sits at its front (in `preallocate`'s layout), written
    by a request of `owner` (a weak reference to that engine's PrefixCache) that finished its
    prefill and stored them, and `tail` the text tokens of that prompt after its last full block
    (their KV follows the blocks'). Cleared whenever the buffer is handed out."""

    buf: torch.Tensor
    alone: int
    owner: weakref.ref | None = None
    held: tuple[str, ...] = ()
    tail: tuple[int, ...] = ()  # token ids right after the held blocks whose KV sits there too (text only)


@dataclass
class Lent:
    """What `SlotPool.lend` hands out: a flat buffer of at least the numel asked for (its whole
    room), how many of the wanted blocks its front holds already (`in_place`), and else a free kept
    buffer whose front holds more of them (`source`, to copy from: a conversation that outgrew its
    buffer), with how many (`source_blocks`). `tail`: when every wanted block is held (in place or
    in the source) and nothing more, how many of the tokens after them (`after`) are held too."""

    buffer: torch.Tensor
    in_place: int = 0
    source: torch.Tensor | None = None
    source_blocks: int = 0
    tail: int = 0


class SlotPool:
    """Prompt-length KV buffers reused across requests, on CPU: a fresh buffer of a long prompt
    costs a page fault on the first write to each of its pages (about as long as the splice copy
    itself), a reused one does not. A buffer is handed out again only when nothing but the pool
    holds its storage: no cache layer, view or slice of an earlier request is alive (its request's
    cache was released), so two live requests never share one. A kept buffer is allocated with
    `POOL_GROWTH` times the room asked for (the budget allowing; pages never written are never
    mapped), so the next turn of a conversation, a few hundred tokens longer, reuses it instead of
    faulting in a fresh one (13k page faults, 23 ms, for a 3.3k-token prompt of the bench model).

    A kept buffer also remembers which prefix-cache blocks its front holds (`hold`, once a request's
    blocks are stored): the next turn of that conversation, whose prefix-cache hit starts with
    those blocks, gets that buffer back with them in place (`lend`), so its hit is neither copied
    nor rotated in again. The blocks must still be in the store (the hit is looked up there first:
    a deleted image's blocks are gone, so a buffer never serves them), and the record is for one
    engine's prefix cache only. At most `budget` bytes are kept, buffers in use included; beyond
    that, or on another device, buffers are allocated fresh and not kept. Thread-safe."""

    def __init__(self, budget: int = POOL_BYTES):
        self.budget = budget
        self._kept: list[_Kept] = []
        self._lock = threading.Lock()
        self.in_place_blocks = 0  # blocks a lent buffer held in place, over the pool's life
        self.copied_blocks = 0  # blocks copied from a conversation's outgrown buffer
        self.tail_tokens = 0  # tokens after those blocks held in place or copied with them
        self.grown = 0  # buffers a conversation was moved into, between its turns, before it outgrew its own

    @staticmethod
    def _uses(buf: torch.Tensor) -> int:
        return torch._C._storage_Use_Count(buf.untyped_storage()._cdata)

    def _free(self, entry: _Kept) -> bool:
        return self._uses(entry.buf) == entry.alone

    def _entry(self, tensor: torch.Tensor) -> _Kept | None:
        """The kept buffer under `tensor` (a view of it), or None. The caller holds the lock."""
        ptr = tensor.untyped_storage().data_ptr()
        return next((e for e in self._kept if e.buf.untyped_storage().data_ptr() == ptr), None)

    @property
    def nbytes(self) -> int:
        return sum(e.buf.nbytes for e in self._kept)

    def lend(self, numel: int, dtype: torch.dtype, device: torch.device, owner: object = None,
             want: list[str] = (), after: tuple[int, ...] = ()) -> Lent:
        """A flat buffer of at least `numel` elements (its whole room; contents undefined but for
        `Lent.in_place` leading blocks of `want`, block keys of `owner`'s prefix cache, and then
        `Lent.tail` leading tokens of `after`, the text token ids that follow them). The free
        kept buffer whose record starts with the most of `want` when it has room, else a free kept
        one of between numel and 2 x numel elements, else a new one (kept if the budget allows);
        a free kept buffer too small but holding more of `want` comes as `Lent.source`. A record's
        tail counts only when its blocks are exactly `want`: the tokens after them are the same
        prompt's, at the same positions, after the same KV."""
        need = numel * dtype.itemsize
        if device.type != "cpu" or need > self.budget:
            return Lent(torch.empty(numel, dtype=dtype, device=device))
        with self._lock:
            best, in_place, source, copy = None, 0, None, 0
            for e in self._kept if owner is not None and want else ():
                if e.owner is None or e.owner() is not owner or e.buf.dtype != dtype or not self._free(e):
                    continue
                m = common_prefix(e.held, want)
                if e.buf.numel() >= numel and m > in_place:
                    best, in_place = e, m
                elif e.buf.numel() < numel and m > copy:
                    source, copy = e, m
            grown = int(numel * (POOL_GROWTH if source is None else OUTGROWN_ROOM))
            if best is None:  # a free one that fits, without another conversation's blocks while there is room
                fits = [e for e in self._kept if e.buf.dtype == dtype and numel <= e.buf.numel() <= 2 * numel
                        and self._free(e)]
                plain = [e for e in fits if not e.held]
                if plain:
                    best = min(plain, key=lambda e: e.buf.numel())
                elif fits and self.nbytes + grown * dtype.itemsize > self.budget:
                    best = fits[0]  # the least recently used
            held = best if in_place else source if copy else None
            tail = common_prefix(held.tail, after) if held is not None and \
                len(held.held) == len(want) == (in_place or copy) else 0
            if best is not None:
                best.owner, best.held, best.tail = None, (), ()  # the request may write anywhere past its hit
                self._kept = [e for e in self._kept if e is not best] + [best]  # most recently used last
                self.in_place_blocks += in_place
                self.tail_tokens += tail if in_place else 0
                return self._lent(best.buf, in_place, source, copy, tail)
            for entry in list(self._kept):  # make room: the free buffers that fit nothing, oldest first
                if self.nbytes + need <= self.budget:
                    break
                if entry is not source and self._free(entry):  # the buffer to copy from stays until copied
                    self._kept = [e for e in self._kept if e is not entry]
            size = grown if self.nbytes + grown * dtype.itemsize <= self.budget else numel
            buf = torch.empty(size, dtype=dtype, device=device)
            if self.nbytes + size * dtype.itemsize <= self.budget:
                self._kept.append(_Kept(buf, self._uses(buf)))
            return self._lent(buf, in_place, source, copy, tail)

    @staticmethod
    def _lent(buf: torch.Tensor, in_place: int, source: _Kept | None, copy: int, tail: int) -> Lent:
        """Views, never the pool's own tensors: the use count that says a buffer is free sees views."""
        if in_place or source is None:
            return Lent(buf[:], in_place, tail=tail if in_place else 0)
        return Lent(buf[:], 0, source.buf[:], copy, tail)

    def copied(self, lent: Lent) -> None:
        """`lent.source` was copied from: the outgrown buffer is dropped (its blocks live on in the
        new one)."""
        with self._lock:
            self.copied_blocks += lent.source_blocks
            self.tail_tokens += lent.tail
            source = self._entry(lent.source)
            self._kept = [e for e in self._kept if e is not source]
        lent.source = None

    def room_for(self, tensor: torch.Tensor, numel: int, size: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A new kept buffer of `size` elements (a view) for what the kept buffer under `tensor`
        holds, when that one's room is under `numel` (the conversation's next turn would outgrow
        it) and the budget holds both; else None. The old buffer stays kept, without a record,
        until its request lets it go."""
        with self._lock:
            entry = self._entry(tensor)
            if entry is None or entry.buf.numel() >= numel or self.nbytes + size * dtype.itemsize > self.budget:
                return None
            buf = torch.empty(size, dtype=dtype, device=tensor.device)
            self._kept.append(_Kept(buf, self._uses(buf)))
            self.grown += 1
            return buf[:]

    def hold(self, tensor: torch.Tensor, owner: object, keys: list[str], tail: tuple[int, ...] = ()) -> None:
        """Record that the kept buffer under `tensor` (a view of it) holds the KV of blocks `keys`
        of `owner`'s prefix cache at its front, then that of the text tokens `tail` (ids) of the
        same prompt: called once those blocks are stored."""
        with self._lock:
            e = self._entry(tensor)
            if e is not None:
                e.owner, e.held, e.tail = weakref.ref(owner), tuple(str(k) for k in keys), tuple(tail)
                self._kept = [x for x in self._kept if x is not e] + [e]


SLOT_POOL = SlotPool()  # for adapters without their own (an Engine gives its adapter one: `slot_pool`)


def pool_of(adapter: VLAdapter) -> SlotPool:
    """The pool `adapter`'s prompt-length buffers come from: its engine's, else the process-wide one."""
    return getattr(adapter, "slot_pool", None) or SLOT_POOL


ADAPTER_POOL = "adapter"  # `preallocate`'s default: the adapter's pool (`pool_of`)


def kv_elements_per_token(adapter: VLAdapter) -> int:
    """Elements one token's KV takes in a slot buffer: keys and values of every layer."""
    heads, head_dim = adapter.kv_shape
    return 2 * adapter.num_layers * heads * head_dim


def _slot_layers(adapter: VLAdapter, flat: torch.Tensor, total: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) [1, kv_heads, total, head_dim] in `flat`, laid out for as many
    tokens as it has room for: a buffer's layout depends on its size only, so a later request in
    it finds an earlier one's KV where that one left it."""
    heads, head_dim = adapter.kv_shape
    room = flat.numel() // kv_elements_per_token(adapter)
    grid = flat[:2 * adapter.num_layers * heads * room * head_dim].view(adapter.num_layers, 2, 1, heads, room, head_dim)
    return [(grid[i, 0, :, :, :total], grid[i, 1, :, :, :total]) for i in range(adapter.num_layers)]


def _lend(adapter: VLAdapter, total: int, pool: SlotPool | None | str, owner: object = None,
          want: list[str] = (), after: tuple[int, ...] = ()) -> tuple[SlotPool | None, Lent]:
    """A buffer for `total` tokens of KV from `pool` (None: fresh; ADAPTER_POOL: `pool_of`)."""
    numel = kv_elements_per_token(adapter) * total
    pool = pool_of(adapter) if pool == ADAPTER_POOL else pool
    if pool is None:
        return None, Lent(torch.empty(numel, dtype=adapter.dtype, device=adapter.device))
    return pool, pool.lend(numel, adapter.dtype, adapter.device, owner, want, after)


def preallocate(adapter: VLAdapter, cache: DynamicCache, start: int, total: int,
                pool: SlotPool | None | str = ADAPTER_POOL) -> list[SlotLayer]:
    """Give every layer of `cache` (holding `start` tokens) a buffer for `total` tokens, the held
    KV copied to its front. Returns the new layers (also installed in `cache`). Layers that are
    prompt-length already (PrefixCache.load wrote tokens [0, start) into them) are used as they are.
    The buffers are views of one block taken from `pool` (None: allocated fresh; by default the
    adapter's, `pool_of`)."""
    held = cache.get_seq_length() if cache.layers else 0
    if start and held == total and all(isinstance(layer, SlotLayer) for layer in cache.layers[:adapter.num_layers]):
        return list(cache.layers[:adapter.num_layers])
    if held != start:
        raise ValueError(f"the cache holds {held} tokens but start is {start}")
    return _install(adapter, cache, _lend(adapter, total, pool)[1].buffer, total, start)


def _install(adapter: VLAdapter, cache: DynamicCache, flat: torch.Tensor, total: int, start: int) -> list[SlotLayer]:
    layers = []
    for i, (k, v) in enumerate(_slot_layers(adapter, flat, total)):
        if start:
            k[:, :, :start].copy_(cache.layers[i].keys)
            v[:, :, :start].copy_(cache.layers[i].values)
        layers.append(SlotLayer(k, v))
    cache.layers[: len(layers)] = layers
    return layers


def hold_for_next_turn(adapter: VLAdapter, layers: list, owner: object, keys: list[str], tail: tuple[int, ...],
                       block: int = BLOCK_TOKENS) -> None:
    """Once a request's prefix blocks are stored: record that its buffer (under `layers`) holds
    blocks `keys` of `owner`'s prefix cache and then the text `tail` (`SlotPool.hold`), for the
    conversation's next turn. When that buffer has less room than `POOL_GROWTH` x those tokens,
    they move first into a buffer with `OUTGROWN_ROOM` x their room (`SlotPool.room_for`), so the
    next turn, a few hundred tokens longer, still finds them in place: the copy and the new
    buffer's page faults are paid here, after this request's first token, not on the next turn's
    time to its first."""
    pool = pool_of(adapter)
    held = len(keys) * block + len(tail)
    per_token = kv_elements_per_token(adapter)
    into = pool.room_for(layers[0].keys, int(held * POOL_GROWTH) * per_token, int(held * OUTGROWN_ROOM) * per_token,
                         layers[0].keys.dtype) if held else None
    if into is not None:
        for layer, (k, v) in zip(layers, _slot_layers(adapter, into, held)):
            k.copy_(layer.keys[:, :, :held])
            v.copy_(layer.values[:, :, :held])
    pool.hold(into if into is not None else layers[0].keys, owner, keys, tail)


def prefix_slots(adapter: VLAdapter, cache: DynamicCache, total: int, pool: SlotPool | None | str = ADAPTER_POOL,
                 owner: object = None, want: list[str] = (), block: int = BLOCK_TOKENS,
                 after: tuple[int, ...] = ()) -> tuple[list[SlotLayer], int, int]:
    """Prompt-length layers for an empty `cache` about to take a prefix-cache hit of blocks `want`
    (keys of `owner`'s prefix cache, `block` tokens each), how many of those blocks are in place
    already, and how many of the text tokens after them (`after`, ids) too: a conversation's buffer
    from its last turn, kept by `pool` with those blocks and its prompt's last tokens at its front
    (`SlotPool.hold`), or copied from it when the conversation outgrew it."""
    pool, lent = _lend(adapter, total, pool, owner, want, after)
    layers = _install(adapter, cache, lent.buffer, total, 0)
    if lent.source is None:
        return layers, lent.in_place, lent.tail
    n = lent.source_blocks * block + lent.tail
    for layer, (k, v) in zip(layers, _slot_layers(adapter, lent.source, n)):
        layer.keys[:, :, :n].copy_(k)
        layer.values[:, :, :n].copy_(v)
    pool.copied(lent)
    return layers, lent.source_blocks, lent.tail


def place_chunk(layers: list[SlotLayer], p: Placement, first: int, stop: int, rope, rotate: bool = True) -> None:
    """Write the cached KV of chunk tokens [first, stop) into their slots, re-rotated to the
    placement's target positions (left where they were cached with `rotate=False`: the control
    that must be worse). A chunk moves by one constant per axis, so the rotation is one cos/sin
    vector, applied straight into the slots."""
    src, dst = p.entry.position_ids[:, first:stop], p.target[:, first:stop]
    shift = constant_delta(src, dst) if rotate else (0, 0, 0)
    a = p.start + first
    if shift is None:  # positions that do not move together (not produced by the policies)
        for layer, k, v in zip(layers, p.entry.keys, p.entry.values):
            layer.keys[0, :, a:a + stop - first].copy_(reposition_keys(k[:, first:stop].to(layer.device), src, dst, rope))
            layer.values[0, :, a:a + stop - first].copy_(v[:, first:stop])
        return
    place_rows([x.keys for x in layers], [x.values for x in layers], a, p.entry.keys, p.entry.values, first, stop,
               rotation(shift, rope) if any(shift) else None)  # CPU float32: one fused call for every layer


def image_features(placements: list[Placement], ranges: list[tuple[int, int]]) -> ImageFeatures | None:
    """Visual features of the image pads among prompt `ranges` (ascending, disjoint), in token order."""
    parts, ordered = [], sorted(placements, key=lambda p: p.start)
    for a, b in ranges:
        for p in ordered:
            lo, hi = max(a, p.start), min(b, p.end)
            if lo < hi and (f := pad_features(p.entry, lo - p.start, hi - p.start)) is not None:
                parts.append(f)
    return ImageFeatures.concat(parts)


def _cached_ranges(start: int, recompute: list[int], first: int = 0) -> list[tuple[int, int]]:
    """[first, start) less the `recompute` indices (ascending, inside it), as [a, b) ranges."""
    out, a = [], first
    for i in [*recompute, start]:
        if a < i:
            out.append((a, i))
        a = i + 1
    return out


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted disjoint [a, b) ranges with touching neighbours joined."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def ranges_less(ranges: list[tuple[int, int]], indices: list[int]) -> list[tuple[int, int]]:
    """[a, b) `ranges` (disjoint) less the prompt `indices` (ascending)."""
    return [r for a, b in ranges for r in _cached_ranges(b, [i for i in indices if a <= i < b], a)]


def prefill_spliced(adapter: VLAdapter, input_ids: torch.Tensor, positions: torch.Tensor,
                    placements: list[Placement], seam_tokens: int, rotate: bool = True,
                    cache: DynamicCache | None = None, start: int = 0, defer: bool = False,
                    recompute: list[int] = (), prefix_tokens: int | None = None,
                    blend: Callable[[list[SlotLayer], list[tuple[Placement, int, int]], int], list[int]] | None = None
                    ) -> PrefillResult:
    """Prefill `input_ids` [L] at `positions` [3, L] with every chunk taken from `placements`.

    `cache` may already hold the KV of tokens [0, start) (a prefix-cache hit; any order), but for
    the prompt indices `recompute` (ascending, below `start`; an edit's changed tokens), computed
    in the same forward as the rest (and counted computed, not reused). `prefix_tokens`: how many
    leading tokens of `cache` are this prompt's own exact KV, a prefix-cache hit (default: those
    before the first recomputed token); an edit policy's stale KV after the change is not. The result equals one forward pass over the same tokens and
    positions in which each chunk's tokens see only their own chunk (see mmkv.request.oracle). It runs one
    LM forward; `cache` is filled in place (its layers become prompt-length buffers) and returned
    in the result. With `defer` the KV is placed and the forward left in `result.pending`
    (chunked prefill: `result.advance`). `blend(layers, reused, start)`, called once the chunks'
    KV is placed, names chunk tokens (prompt indices, ascending, among `reused`) recomputed in
    context in the same forward instead (mmkv.request.blend).
    """
    if seam_tokens < 0:
        raise ValueError("seam_tokens must be >= 0")
    total = input_ids.numel()
    layout = splice_layout(placements, total, start, seam_tokens)
    if not layout.computed:
        raise ValueError("nothing left to compute: the prompt's last token must not be cached")
    recompute = list(recompute)
    if recompute != sorted(set(recompute)) or any(not 0 <= i < start for i in recompute):
        raise ValueError("recompute: ascending prompt indices below start")
    cache = cache if cache is not None else adapter.new_cache()
    layers = preallocate(adapter, cache, start, total)
    reused = _cached_ranges(start, recompute)
    for p, first, stop in layout.reused:
        place_chunk(layers, p, first, stop, adapter.rope, rotate)
    blended = blend(layers, layout.reused, start) if blend is not None and layout.reused else []
    reused += ranges_less([(p.start + first, p.start + stop) for p, first, stop in layout.reused], blended)
    computed = _merged(sorted([(i, i + 1) for i in recompute + blended] + layout.computed))
    index = torch.cat([torch.arange(a, b) for a, b in computed])  # [Q] prompt indices, ascending

    def features(lo: int, hi: int) -> ImageFeatures | None:  # of the computed tokens in prompt [lo, hi)
        return image_features(placements, [(max(a, lo), min(b, hi)) for a, b in computed if a < hi and lo < b])

    forward = ChunkedForward(adapter, cache, input_ids, positions, index, features, layers)
    if prefix_tokens is None:
        prefix_tokens = recompute[0] if recompute else start
    result = PrefillResult(cache, None, index.numel(), sum(b - a for a, b in reused), reused, prefix_tokens, forward)
    if not defer:
        result.advance()
    return result


class ChunkedForward:
    """The forward of a turn's computed tokens (`index` [Q], ascending prompt indices), runnable
    a piece at a time: `advance(n)` runs the next n of them, each seeing every token before it.
    Into the slots of the preallocated `layers` (the splice, mask causal by prompt index), or, with
    `layers` None, appended to `cache` by the model's own causal mask (the full recompute, whose
    `index` is the whole prompt). `features(lo, hi)` gives the visual features of the computed
    image pads in prompt [lo, hi). Not thread-safe: the engine's lock covers every piece."""

    def __init__(self, adapter: VLAdapter, cache: DynamicCache, input_ids: torch.Tensor, positions: torch.Tensor,
                 index: torch.Tensor, features: Callable[[int, int], ImageFeatures | None],
                 layers: list[SlotLayer] | None = None):
        self.adapter, self.cache, self.layers = adapter, cache, layers
        self.input_ids, self.positions, self.index, self.features = input_ids, positions, index, features
        self.done = 0  # tokens of `index` computed so far
        self.logits: torch.Tensor | None = None  # [1, V] once the last piece ran

    @property
    def remaining(self) -> int:
        return self.index.numel() - self.done

    def advance(self, max_tokens: int | None = None) -> bool:
        """Run the next min(max_tokens, remaining) tokens in one forward (None: all remaining).
        True once every token ran and `logits` (of the last one) is set. A forward that raises
        (the scheduler preempts one when a request arrives) changes nothing: the piece runs again."""
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("a prefill piece must have at least one token")
        if self.remaining:
            n, piece, lo, hi = self._next(self.remaining if max_tokens is None else max_tokens)
            if self.layers is None:
                past = self.cache.get_seq_length()
                try:
                    logits = self.adapter.forward(self.input_ids[lo:hi], self.positions[:, lo:hi], self.cache,
                                                  self.features(lo, hi))
                except BaseException:
                    _truncate(self.cache, past)  # a piece cut short (preempted, failed) leaves the cache as it was
                    raise
            else:  # a piece cut short leaves only its own slots written, rewritten when it runs again
                logits = forward_into_slots(self.adapter, self.cache, self.layers, self.input_ids, self.positions,
                                            piece, self.features(lo, hi))
            return self._ran(n, logits)
        return True

    def _next(self, max_tokens: int) -> tuple[int, torch.Tensor, int, int]:
        """The next min(max_tokens, remaining) tokens: (n, their prompt indices, lo, hi) with
        [lo, hi) the prompt range they span."""
        n = min(max_tokens, self.remaining)
        piece = self.index[self.done:self.done + n]
        return n, piece, int(piece[0]), int(piece[-1]) + 1

    def _ran(self, n: int, logits: torch.Tensor) -> bool:
        """The next `n` tokens ran, `logits` [1, V] of the last; True once every token ran."""
        self.done += n
        if not self.remaining:
            self.logits = logits
        return not self.remaining

    def ride(self, max_tokens: int) -> RidePiece | None:
        """The next min(max_tokens, remaining) tokens as a piece for the decode step's forward to run
        (mmkv.kv.packed), or None when they cannot ride: they hold image or video pads (visual
        features, deepstack), or nothing is left. `RidePiece.done(logits)` records it as run."""
        if not self.remaining or max_tokens < 1:
            return None
        n, piece, lo, hi = self._next(max_tokens)
        if self.features(lo, hi) is not None or bool(self.adapter.visual_mask(self.input_ids[piece]).any()):
            return None
        if self.layers is None:  # appended after the cache, causal
            past = self.cache.get_seq_length()
            seen, visible, slots = torch.arange(n) + past, past + n, None
            layers = self.cache.layers[:self.adapter.num_layers]
        else:  # into its slots, causal by prompt index
            seen, visible, slots = piece, hi, piece.to(self.adapter.device)
            layers = self.layers
        mask = mask_by_index(seen, visible, self.adapter.dtype)
        return RidePiece(self, n, self.input_ids[piece], self.positions[:, piece], mask[None, None], layers, slots,
                         visible)


def _truncate(cache: DynamicCache, length: int) -> None:
    """Every layer back to its first `length` slots (the layers a cut-short forward reached)."""
    for layer in cache.layers:
        if layer.is_initialized and layer.keys.shape[-2] > length:
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


@dataclass
class RidePiece:
    """Prompt tokens of a ChunkedForward run inside another forward (the decode step's: mmkv.kv.packed):
    `ids` [n] at `positions` [3, n], their keys and values into `layers` (at `slots`, else
    appended), attending under `mask` [1, 1, n, visible]."""

    forward: ChunkedForward
    n: int
    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    layers: list
    slots: torch.Tensor | None
    visible: int

    def writing(self):
        """Slot layers write this piece's slots while the forward runs (as `forward_into_slots`)."""
        return contextlib.nullcontext() if self.slots is None else writing_slots(self.layers, self.slots, self.visible)

    def done(self, logits: torch.Tensor) -> bool:
        """Record the piece as run; `logits` [1, V] are its last token's. True once the forward is done."""
        return self.forward._ran(self.n, logits)


def mask_by_index(index: torch.Tensor, visible: int, dtype: torch.dtype) -> torch.Tensor:
    """[Q, visible] float mask (0 / -inf): query q sees the slots up to `index[q]`."""
    mask = torch.zeros(index.numel(), visible, dtype=dtype)
    return mask.masked_fill_(torch.arange(visible)[None, :] > index[:, None], float("-inf"))


@contextlib.contextmanager
def writing_slots(layers: list[SlotLayer], slots: torch.Tensor, visible: int):
    """Inside the block an update of each slot layer writes `slots` and returns its first `visible`."""
    for layer in layers:
        layer.slots, layer.visible = slots, visible
    try:
        yield
    finally:
        for layer in layers:
            layer.slots = None


def forward_into_slots(adapter: VLAdapter, cache: DynamicCache, layers: list[SlotLayer], input_ids: torch.Tensor,
                       positions: torch.Tensor, index: torch.Tensor, features: ImageFeatures | None = None) -> torch.Tensor:
    """One LM forward of the prompt tokens at `index` [Q] (ascending) of `input_ids` [L] /
    `positions` [3, L]: each sees every slot up to its own index (causal by prompt index) and its
    KV goes into its slot of the preallocated `layers`; attention reads only the slots up to the
    last of them. Returns last-token logits [1, V]."""
    visible = int(index[-1]) + 1
    mask = mask_by_index(index, visible, adapter.dtype)
    with writing_slots(layers, index.to(adapter.device), visible):
        return adapter.forward(input_ids[index], positions[:, index], cache, features, attention_mask=mask[None, None])


def prefill_full(adapter: VLAdapter, input_ids: torch.Tensor, positions: torch.Tensor,
                 features: ImageFeatures | None, defer: bool = False) -> PrefillResult:
    """The reference: one ordinary causal forward over the whole prompt, no cached KV used. With
    `defer` the forward is left in `result.pending` (chunked prefill: `result.advance`)."""
    cache = adapter.new_cache()
    pads = torch.cumsum(torch.cat((torch.zeros(1, dtype=torch.long), adapter.visual_mask(input_ids).long())), 0)

    def pad_rows(lo: int, hi: int) -> ImageFeatures | None:  # `features` rows of the image pads in [lo, hi)
        a, b = int(pads[lo]), int(pads[hi])
        return features.slice(a, b) if features is not None and a < b else None

    forward = ChunkedForward(adapter, cache, input_ids, positions, torch.arange(input_ids.numel()), pad_rows)
    result = PrefillResult(cache, None, input_ids.numel(), 0, [], pending=forward)
    if not defer:
        result.advance()
    return result
