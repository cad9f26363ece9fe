"""The KV store: one byte budget shared by cached chunks (images, skills) and prefix blocks.

Thread-safe: every public method takes the store's lock. LRU: `put` evicts least recently used
entries until the budget holds, skipping prefix blocks that still have children (only leaves of
the prefix tree go). An entry larger than the whole budget is not kept (the request that made
it still uses it). Requests hold entries by reference, so eviction never breaks one in flight;
a later miss recomputes.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Protocol


class Entry(Protocol):
    key: str
    kind: str  # "image" | "skill" | "prefix"
    parent: str | None  # prefix blocks: the previous block's key

    @property
    def nbytes(self) -> int: ...


class KVStore:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError("cache budget must be >= 0 bytes")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._children: Counter[str] = Counter()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits: Counter[str] = Counter()  # per kind
        self.misses: Counter[str] = Counter()
        self.evictions = 0

    def get(self, key: str, kind: str) -> Entry | None:
        """The entry under `key`, now most recently used; counts a hit or a miss for `kind`."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses[kind] += 1
                return None
            self._entries.move_to_end(key)
            self.hits[kind] += 1
            return entry

    def put(self, entry: Entry) -> bool:
        """Store `entry`, evicting LRU leaves to fit. False if it does not fit or its parent is gone."""
        size = entry.nbytes
        with self._lock:
            if entry.key in self._entries:
                self._remove(entry.key)
            if size > self.budget_bytes:
                return False
            while self._bytes + size > self.budget_bytes and self._evict_one(protect=entry.parent):
                pass
            if self._bytes + size > self.budget_bytes or (entry.parent and entry.parent not in self._entries):
                return False
            self._entries[entry.key] = entry
            self._bytes += size
            if entry.parent:
                self._children[entry.parent] += 1
            return True

    def discard(self, key: str) -> bool:
        """Remove one entry (a prefix block only if it has no children)."""
        with self._lock:
            if key not in self._entries or self._children[key]:
                return False
            self._remove(key)
            return True

    def _evict_one(self, protect: str | None) -> bool:
        for key in self._entries:
            if not self._children[key] and key != protect:
                self._remove(key)
                self.evictions += 1
                return True
        return False

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        if entry.parent:
            self._children[entry.parent] -= 1
            if not self._children[entry.parent]:
                del self._children[entry.parent]

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def count(self, kind: str) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.kind == kind)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def check_integrity(self) -> None:
        """AssertionError unless bytes match the entries, fit the budget, and the prefix tree's
        child counts match its parent links (every block's parent is present)."""
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            assert total == self._bytes, f"tracked {self._bytes} bytes but entries hold {total}"
            assert self._bytes <= self.budget_bytes, f"{self._bytes} bytes over the budget {self.budget_bytes}"
            children: Counter[str] = Counter()
            for key, entry in self._entries.items():
                assert key == entry.key, f"entry {entry.key} stored under {key}"
                if entry.parent:
                    assert entry.parent in self._entries, f"block {key} lost its parent {entry.parent}"
                    children[entry.parent] += 1
                if hasattr(entry, "__post_init__"):
                    entry.__post_init__()
            assert children == +self._children, "child counts out of step with parent links"
