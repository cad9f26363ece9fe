"""Prefix cache across requests: chained block hashes over the prompt, stored in the KV store.

A block's key hashes its parent's key, its token ids and, per token, the key of the chunk it
was spliced from (an image's or skill's cache key; none for prefilled text). So the same tokens
with a different image, or text that was spliced rather than prefilled, never match. The tenant
salt and the splice settings sit at the root. Only full blocks are stored; a lookup is capped
at len-1 tokens so the last prompt token is always computed. Each block names the chunks spliced
into its tokens (`sources`), so deleting an image or skill purges the blocks holding its KV and,
through the tree, every block after them.

A block whose tokens all came from one chunk's cached body (rotated into place, not recomputed)
holds no copy: a `ChunkRefBlock` names the chunk, the offset and the per-axis position change
its keys were turned by, and costs only the heap its entry holds (`BLOCK_ENTRY_BYTES`) in the
store's budget. The KV store keeps it only while that very chunk is stored and drops it (and the
blocks after it) with the chunk.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import xxhash

from mmkv.adapters import RopeLayout
from mmkv.kv.chunks import CachedChunk, tensor_bytes
from mmkv.store.kv_store import KVStore
from mmkv.kv.rerotate import place_rows, rotation

BLOCK_TOKENS = 16
# The heap a stored block holds besides tensor data: the block object, its key and its parent's
# key as strings, the KV store's bookkeeping (its slots in the entry dict and the LRU order, its
# parent's child set, its slots in the sources and referrers indexes, each dict or set just after
# it grew). Measured with tracemalloc: 0.55-0.8 KB a reference block, 0.97-1.11 KB for the first one
# of a chunk (its index sets are new; the most seen inside the full test suite); the charge keeps a
# margin above that, and tests/test_prefix_cache.py holds it above the measure. A `ChunkRefBlock`
# is charged this and nothing else; a copied block this beside its tensors.
BLOCK_ENTRY_BYTES = 1536


class BlockKey(str):
    """A block's chained key that also names the chunks spliced into its tokens (`sources`): a
    deleted image or skill purges every block holding its KV (KVStore.purge)."""

    sources: frozenset[str]

    def __new__(cls, key: str, sources: frozenset[str] = frozenset()) -> BlockKey:
        obj = super().__new__(cls, key)
        obj.sources = sources
        return obj


@dataclass
class PrefixBlock:
    """A block's own copy of its KV."""

    key: str
    parent: str | None
    positions: torch.Tensor  # [3, B] positions the block's keys were rotated for
    keys: tuple[torch.Tensor, ...]  # per layer [kv_heads, B, head_dim]
    values: tuple[torch.Tensor, ...]
    sources: frozenset[str] = frozenset()  # chunk keys whose KV the block's tokens hold
    kind = "prefix"

    @property
    def nbytes(self) -> int:  # its tensors with their own heap, and the entry, as a reference block's
        return tensor_bytes((*self.keys, *self.values, self.positions)) + BLOCK_ENTRY_BYTES


@dataclass(slots=True)
class ChunkRefBlock:
    """A block inside a spliced chunk's body: its KV is the chunk's tokens [offset, offset + B)
    with the keys turned by `shift` (per axis). It holds no tensor: `read_blocks` / `write_blocks`
    turn its slice of the chunk into place (the edit policies), as `PrefixCache.load` does into
    the cache. Slotted and small: thousands of them sit in the store (`BLOCK_ENTRY_BYTES`)."""

    key: str
    parent: str | None
    chunk: CachedChunk
    offset: int  # chunk token index of the block's first token
    size: int  # tokens
    shift: tuple[int, int, int]  # position change (t, h, w) from the chunk's positions to the prompt's
    rope: RopeLayout
    kind = "prefix"

    def __post_init__(self):
        assert 0 <= self.offset and self.offset + self.size <= self.chunk.num_tokens, "block inside its chunk"

    @property
    def sources(self) -> frozenset[str]:
        """Every token of the block holds the chunk's KV, and only that."""
        return frozenset((self.chunk.key,))

    @property
    def referenced(self) -> tuple[CachedChunk]:
        return (self.chunk,)

    @property
    def nbytes(self) -> int:
        return BLOCK_ENTRY_BYTES

    @property
    def positions(self) -> torch.Tensor:
        pos = self.chunk.position_ids[:, self.offset:self.offset + self.size]
        return pos + torch.tensor(self.shift, dtype=pos.dtype)[:, None]

    def turn(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`rotation`'s (cos, signed sin) for the block's shift; None when nothing moves."""
        return rotation(self.shift, self.rope) if any(self.shift) else None


@dataclass(frozen=True)
class ChunkSpan:
    """Prompt tokens [start, stop) whose KV was placed from `chunk`'s tokens [offset, ...), keys
    turned by the constant per-axis `shift`: where a request's blocks may reference a chunk."""

    start: int
    stop: int
    chunk: CachedChunk
    offset: int
    shift: tuple[int, int, int]


def block_runs(blocks: list, block: int) -> Iterator[tuple[int, int, PrefixBlock | ChunkRefBlock]]:
    """(start, stop, block) over consecutive blocks of `block` tokens (token 0 = the first block's
    first): each copied block alone; consecutive references to the same chunk with the same shift
    and contiguous offsets merged under their first block (one rotation for the run)."""
    i = 0
    while i < len(blocks):
        first, j = blocks[i], i + 1
        if isinstance(first, ChunkRefBlock):
            while (j < len(blocks) and isinstance(nxt := blocks[j], ChunkRefBlock) and nxt.chunk is first.chunk
                   and nxt.shift == first.shift and nxt.offset == first.offset + (j - i) * block):
                j += 1
        yield i * block, j * block, first
        i = j


def _place_run(dst_keys: list, dst_values: list, at: int, run: PrefixBlock | ChunkRefBlock, first: int, stop: int) -> None:
    """Tokens [first, stop) of a run (counted from its first block's first token) into rows
    [at, ...) of every layer's destination ([kv_heads, L, D] or [1, kv_heads, L, D]): a reference's
    keys turned by its shift (computed once), a copy's copied (`place_rows`)."""
    if isinstance(run, ChunkRefBlock):
        place_rows(dst_keys, dst_values, at, run.chunk.keys, run.chunk.values, run.offset + first, run.offset + stop,
                   run.turn())
    else:
        place_rows(dst_keys, dst_values, at, run.keys, run.values, first, stop, None)


def write_blocks(blocks: list, start: int, stop: int, dst_keys: list, dst_values: list, at: int) -> None:
    """Tokens [start, stop) of consecutive blocks that begin at token 0 into rows [at, ...) of every
    layer's destination ([kv_heads, L, D] or [1, kv_heads, L, D]): each run of references to one
    chunk turned once, in one pass."""
    size = blocks[0].positions.shape[1]
    lo_block, hi_block = start // size, (stop - 1) // size
    base = lo_block * size
    for first, end, run in block_runs(blocks[lo_block:hi_block + 1], size):
        a, b = max(base + first, start), min(base + end, stop)  # prompt tokens this run supplies
        _place_run(dst_keys, dst_values, at + a - start, run, a - base - first, b - base - first)


def read_blocks(blocks: list, start: int, stop: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Per-layer K and V [kv_heads, stop - start, head_dim] (new tensors) and positions [3, n] of
    tokens [start, stop) of consecutive blocks that begin at token 0 (`write_blocks`)."""
    size = blocks[0].positions.shape[1]
    chosen = blocks[start // size:(stop - 1) // size + 1]
    src_k, src_v = (blk.chunk.keys, blk.chunk.values) if isinstance(blk := chosen[0], ChunkRefBlock) else (blk.keys, blk.values)
    keys = [k.new_empty((k.shape[0], stop - start, k.shape[-1])) for k in src_k]
    values = [v.new_empty((v.shape[0], stop - start, v.shape[-1])) for v in src_v]
    write_blocks(blocks, start, stop, keys, values, 0)
    lo = start // size * size
    return keys, values, torch.cat([b.positions for b in chosen], dim=1)[:, start - lo:stop - lo]


def block_keys(token_ids: torch.Tensor, chunk_keys: list[str | None], salt: str,
               block: int = BLOCK_TOKENS) -> list[BlockKey]:
    """Chained keys of the prompt's full blocks. `chunk_keys[i]` names what token i was spliced from.

    Block i hashes its parent's hex key, its ids as int64 bytes and its tokens' chunk keys joined
    by 0x1f. It runs on every request, so the ids are converted once and a block whose tokens all
    came from one chunk (or none) reuses that chunk's joined text."""
    keys, parent = [], xxhash.xxh3_128(salt.encode()).hexdigest()
    ids = token_ids.to(torch.int64).contiguous().numpy().tobytes()  # 8 bytes a token
    mixed = {i // block for i in range(1, len(chunk_keys)) if chunk_keys[i] != chunk_keys[i - 1] and i % block}
    uniform: dict[str | None, tuple[bytes, frozenset[str]]] = {}
    for start in range(0, len(ids) // 8 - block + 1, block):
        if start // block in mixed:
            run = chunk_keys[start:start + block]
            text, sources = "\x1f".join(k or "" for k in run).encode(), frozenset(k for k in run if k)
        else:
            k = chunk_keys[start]
            if k not in uniform:
                uniform[k] = "\x1f".join([k or ""] * block).encode(), frozenset((k,) if k else ())
            text, sources = uniform[k]
        parent = xxhash.xxh3_128_hexdigest(parent.encode() + ids[start * 8:(start + block) * 8] + text)
        keys.append(BlockKey(parent, sources))
    return keys


def common_prefix(a, b) -> int:
    """How many leading elements two sequences share (compared with ==)."""
    return sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(a, b)))


def stored_blocks(store: KVStore, keys: list[str]) -> list[PrefixBlock | ChunkRefBlock]:
    """The blocks stored under `keys`, from the first up to the first one missing (each a hit or
    a miss in the store's counts)."""
    found = []
    for key in keys:
        blk = store.get(key, "prefix")
        if blk is None:
            break
        found.append(blk)
    return found


class PrefixCache:
    """Lookup and insert of prompt prefixes; the blocks live in (and share the budget of) `store`."""

    def __init__(self, store: KVStore, block: int = BLOCK_TOKENS):
        self.store = store
        self.block = block
        self.query_tokens = 0
        self.hit_tokens = 0

    def lookup(self, keys: list[str], prompt_len: int) -> list[PrefixBlock | ChunkRefBlock]:
        """The longest run of cached blocks from the start, within the len-1 cap."""
        found = stored_blocks(self.store, keys[:(prompt_len - 1) // self.block])
        self.query_tokens += prompt_len
        self.hit_tokens += len(found) * self.block
        return found

    def load(self, blocks: list[PrefixBlock | ChunkRefBlock], layers: list, first: int = 0) -> None:
        """Write the blocks' KV, but for the first `first` (in place already), into their slots of
        prompt-length cache layers (each with `keys` / `values` [1, kv_heads, L, head_dim]): copies
        straight in, and each run of references to one chunk rotated straight in by one pass
        (`block_runs`, `_place_run`)."""
        dst_keys, dst_values = [x.keys for x in layers], [x.values for x in layers]
        skip = first * self.block
        for at, stop, run in block_runs(blocks[first:], self.block):
            _place_run(dst_keys, dst_values, skip + at, run, 0, stop - at)

    def insert(self, keys: list[str], cache, positions: torch.Tensor, have: int, upto_tokens: int,
               spans: list[ChunkSpan] = (), rope: RopeLayout | None = None) -> int:
        """Store blocks `have`.. of the prompt whose tokens end at or before `upto_tokens`: a block
        lying inside one of `spans` as a reference to its chunk, any other as a copy of `cache`'s
        KV. Returns how many blocks were stored."""
        stored, parent = 0, None
        for i in range(have, min(len(keys), upto_tokens // self.block)):
            if keys[i] in self.store:
                parent = None
                continue
            a, b = i * self.block, (i + 1) * self.block
            # the block keeps plain strings (a BlockKey carries a dict), its parent's the one stored
            key, parent = str(keys[i]), parent or (str(keys[i - 1]) if i else None)
            span = next((s for s in spans if s.start <= a and b <= s.stop), None)
            if span is not None and rope is not None:
                blk = ChunkRefBlock(key, parent, span.chunk, span.offset + a - span.start, self.block, span.shift, rope)
            else:
                blk = PrefixBlock(
                    key=key, parent=parent, positions=positions[:, a:b].clone(),
                    keys=tuple(layer.keys[0, :, a:b].detach().clone() for layer in cache.layers),
                    values=tuple(layer.values[0, :, a:b].detach().clone() for layer in cache.layers),
                    sources=getattr(keys[i], "sources", frozenset()),
                )
            if not self.store.put(blk):
                break
            stored, parent = stored + 1, key
        return stored
