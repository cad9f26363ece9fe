"""Prefix cache across requests: chained block hashes over the prompt, stored in the KV store.

A block's key hashes its parent's key, its token ids and, per token, the key of the chunk it
was spliced from (an image's or skill's cache key; none for prefilled text). So the same tokens
with a different image, or text that was spliced rather than prefilled, never match. The tenant
salt and the splice settings sit at the root. Only full blocks are stored; a lookup is capped
at len-1 tokens so the last prompt token is always computed. Each block names the chunks spliced
into its tokens (`sources`), so deleting an image or skill purges the blocks holding its KV and,
through the tree, every block after them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash
from transformers import DynamicCache

from mmkv.kv_store import KVStore

BLOCK_TOKENS = 16


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
    key: str
    parent: str | None
    positions: torch.Tensor  # [3, B] positions the block's keys were rotated for
    keys: tuple[torch.Tensor, ...]  # per layer [kv_heads, B, head_dim]
    values: tuple[torch.Tensor, ...]
    sources: frozenset[str] = frozenset()  # chunk keys whose KV the block's tokens hold
    kind = "prefix"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def block_keys(token_ids: torch.Tensor, chunk_keys: list[str | None], salt: str,
               block: int = BLOCK_TOKENS) -> list[BlockKey]:
    """Chained keys of the prompt's full blocks. `chunk_keys[i]` names what token i was spliced from."""
    keys, parent = [], xxhash.xxh3_128(salt.encode()).hexdigest()
    ids = token_ids.tolist()
    for start in range(0, len(ids) - block + 1, block):
        h = xxhash.xxh3_128(parent.encode())
        h.update(torch.tensor(ids[start:start + block], dtype=torch.int64).numpy().tobytes())
        h.update("\x1f".join(k or "" for k in chunk_keys[start:start + block]).encode())
        parent = h.hexdigest()
        keys.append(BlockKey(parent, frozenset(k for k in chunk_keys[start:start + block] if k)))
    return keys


class PrefixCache:
    """Lookup and insert of prompt prefixes; the blocks live in (and share the budget of) `store`."""

    def __init__(self, store: KVStore, block: int = BLOCK_TOKENS):
        self.store = store
        self.block = block
        self.query_tokens = 0
        self.hit_tokens = 0

    def lookup(self, keys: list[str], prompt_len: int) -> list[PrefixBlock]:
        """The longest run of cached blocks from the start, within the len-1 cap."""
        usable = (prompt_len - 1) // self.block
        found = []
        for key in keys[:usable]:
            blk = self.store.get(key, "prefix")
            if blk is None:
                break
            found.append(blk)
        self.query_tokens += prompt_len
        self.hit_tokens += len(found) * self.block
        return found

    def load(self, blocks: list[PrefixBlock], cache: DynamicCache, device) -> None:
        """Append the blocks' KV to an empty `cache`."""
        if not blocks:
            return
        for layer in range(len(blocks[0].keys)):
            k = torch.cat([b.keys[layer] for b in blocks], dim=-2)
            v = torch.cat([b.values[layer] for b in blocks], dim=-2)
            cache.update(k[None].to(device), v[None].to(device), layer)

    def insert(self, keys: list[str], cache: DynamicCache, positions: torch.Tensor, have: int,
               upto_tokens: int) -> int:
        """Store blocks `have`.. of the prompt whose tokens end at or before `upto_tokens`.
        Returns how many blocks were stored."""
        stored = 0
        for i in range(have, min(len(keys), upto_tokens // self.block)):
            if keys[i] in self.store:
                continue
            sl = slice(i * self.block, (i + 1) * self.block)
            blk = PrefixBlock(
                key=keys[i], parent=keys[i - 1] if i else None, positions=positions[:, sl].clone(),
                keys=tuple(layer.keys[0, :, sl].detach().clone() for layer in cache.layers),
                values=tuple(layer.values[0, :, sl].detach().clone() for layer in cache.layers),
                sources=getattr(keys[i], "sources", frozenset()),
            )
            if not self.store.put(blk):
                break
            stored += 1
        return stored
