"""The KV store: one byte budget shared by cached chunks (images, skills) and prefix blocks.

Thread-safe: every public method takes the store's lock. LRU over the leaves: `put` evicts the
least recently used entry that has no children (chunks, and prefix blocks at the end of a chain)
until the budget holds; an inner prefix block becomes evictable when its last child goes. Every
operation is O(1) amortised: only leaves sit in the LRU order, so eviction never walks past inner
blocks. An entry larger than the whole budget is not kept (the request that made it still uses
it). Requests hold entries by reference, so eviction never breaks one in flight; a later miss
recomputes.

Entries may name `sources`: the chunk keys whose KV they contain (a prefix block holding a spliced
image). `purge(key)` drops a chunk and everything derived from it, so a deleted image or skill
leaves nothing behind.

Entries may also name `referenced`: stored entries whose tensors they read instead of holding a
copy (a prefix block inside a spliced chunk references the chunk's KV). Such an entry costs only
its own bytes, is stored only while every entry it references is the one stored under that key,
and never outlives one: removing a referenced entry (eviction, purge, discard, replacement)
removes its referrers and their descendants too.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter, OrderedDict
from typing import Protocol


class Entry(Protocol):
    key: str
    kind: str  # "image" | "skill" | "prefix"
    parent: str | None  # prefix blocks: the previous block's key

    @property
    def nbytes(self) -> int: ...


def _sources(entry: Entry) -> frozenset[str]:
    return getattr(entry, "sources", frozenset())


def _referenced(entry: Entry) -> tuple[Entry, ...]:
    return getattr(entry, "referenced", ())


class PurgeWatch:
    """The keys purged from a store since the watch began (`KVStore.watch`). A request takes one
    when its cached KV is placed and checks it before storing anything derived from that KV once
    its first token is out: a delete in between must not be undone by the request's prefix blocks."""

    __slots__ = ("purged", "__weakref__")

    def __init__(self):
        self.purged: set[str] = set()

    def touches(self, keys) -> bool:
        """Whether any of `keys` was purged since the watch began."""
        return not self.purged.isdisjoint(keys)


class KVStore:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError("cache budget must be >= 0 bytes")
        self.budget_bytes = budget_bytes
        self._entries: dict[str, Entry] = {}
        self._leaves: OrderedDict[str, None] = OrderedDict()  # entries without children, LRU first
        self._children: dict[str, set[str]] = {}  # only for entries that have children
        self._derived: dict[str, set[str]] = {}  # chunk key -> keys of the entries holding its KV
        self._referrers: dict[str, set[str]] = {}  # key -> keys of the entries reading its tensors
        self._kinds: Counter[str] = Counter()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits: Counter[str] = Counter()  # per kind
        self.misses: Counter[str] = Counter()
        self.evictions = 0
        self._watches: weakref.WeakSet[PurgeWatch] = weakref.WeakSet()  # held by requests in flight

    def watch(self) -> PurgeWatch:
        """Start recording purges (thread-safe); the store forgets the watch when its holder does."""
        watch = PurgeWatch()
        with self._lock:
            self._watches.add(watch)
        return watch

    def get(self, key: str, kind: str) -> Entry | None:
        """The entry under `key`, now most recently used; counts a hit or a miss for `kind`."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses[kind] += 1
                return None
            if key in self._leaves:
                self._leaves.move_to_end(key)
            self.hits[kind] += 1
            return entry

    def put(self, entry: Entry) -> bool:
        """Store `entry`, evicting LRU leaves to fit. False if it does not fit, its parent is gone,
        or an entry it references is not the one stored under that key."""
        size = entry.nbytes
        referenced = _referenced(entry)
        with self._lock:
            if entry.key in self._children:
                return True  # an inner prefix block: the same key is the same content
            if entry.key in self._entries:
                self._remove(entry.key)
            if size > self.budget_bytes or not self._all_stored(referenced):
                return False
            protect = {entry.parent, *(r.key for r in referenced)}
            while self._bytes + size > self.budget_bytes and self._evict_one(protect):
                pass
            if (self._bytes + size > self.budget_bytes or (entry.parent and entry.parent not in self._entries)
                    or not self._all_stored(referenced)):  # an eviction's cascade may take a parent
                return False
            self._entries[entry.key] = entry
            self._leaves[entry.key] = None
            self._bytes += size
            self._kinds[entry.kind] += 1
            if entry.parent:
                self._leaves.pop(entry.parent, None)
                self._children.setdefault(entry.parent, set()).add(entry.key)
            for source in _sources(entry):
                self._derived.setdefault(source, set()).add(entry.key)
            for r in referenced:
                self._referrers.setdefault(r.key, set()).add(entry.key)
            return True

    def _all_stored(self, referenced: tuple[Entry, ...]) -> bool:
        return all(self._entries.get(r.key) is r for r in referenced)

    def discard(self, key: str) -> bool:
        """Remove one entry (a prefix block only if it has no children)."""
        with self._lock:
            if key not in self._entries or key in self._children:
                return False
            self._remove(key)
            return True

    def purge(self, key: str) -> int:
        """Remove `key`, every entry whose `sources` name it, and all their descendants in the
        prefix tree (their KV attended to it). Every open watch records the key. Returns how many
        entries went."""
        with self._lock:
            for watch in self._watches:
                watch.purged.add(key)
            return self._purge(key)

    def _purge(self, key: str) -> int:
        return self._remove_all([key, *self._derived.get(key, ())])

    def _remove_all(self, keys: list[str]) -> int:
        """Remove `keys` and all their descendants (children first). Returns how many went,
        referrers that went with a removed entry included."""
        doomed = [k for k in keys if k in self._entries]
        before = len(self._entries)
        while doomed:
            k = doomed.pop()
            if k not in self._entries:
                continue
            kids = self._children.get(k)
            if kids:
                doomed.append(k)
                doomed.extend(kids)
                continue
            self._remove(k)
        return before - len(self._entries)

    def _evict_one(self, protect: set[str | None]) -> bool:
        """Evict the LRU leaf not in `protect` (and the referrers that read it). Counts every entry
        that went."""
        for key in self._leaves:  # at most len(protect) + 1 steps
            if key not in protect:
                before = len(self._entries)
                self._remove(key)
                self.evictions += before - len(self._entries)
                return True
        return False

    def _remove(self, key: str) -> None:
        """Remove a leaf. A parent left without children becomes the least recently used leaf:
        a prefix lookup touches a block just before its child, so it was last used when its
        last child was, and that child has just gone as the LRU leaf (or was purged). The entries
        that reference it go too, with their descendants."""
        entry = self._entries.pop(key)
        del self._leaves[key]
        self._bytes -= entry.nbytes
        self._kinds[entry.kind] -= 1
        for source in _sources(entry):
            users = self._derived[source]
            users.discard(key)
            if not users:
                del self._derived[source]
        for r in _referenced(entry):
            users = self._referrers.get(r.key)  # gone when `r` itself is being removed
            if users is not None:
                users.discard(key)
                if not users:
                    del self._referrers[r.key]
        if entry.parent:
            siblings = self._children[entry.parent]
            siblings.discard(key)
            if not siblings:
                del self._children[entry.parent]
                self._leaves[entry.parent] = None
                self._leaves.move_to_end(entry.parent, last=False)
        referrers = self._referrers.pop(key, None)
        if referrers:
            self._remove_all(list(referrers))

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def count(self, kind: str) -> int:
        with self._lock:
            return self._kinds[kind]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def check_integrity(self) -> None:
        """AssertionError unless bytes match the entries, fit the budget, the prefix tree's child
        sets match its parent links (every block's parent is present), the LRU order holds exactly
        the leaves, the per-kind counts and the sources index match the entries, and every entry
        referenced is the one stored under its key."""
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            assert total == self._bytes, f"tracked {self._bytes} bytes but entries hold {total}"
            assert self._bytes <= self.budget_bytes, f"{self._bytes} bytes over the budget {self.budget_bytes}"
            children: dict[str, set[str]] = {}
            derived: dict[str, set[str]] = {}
            referrers: dict[str, set[str]] = {}
            for key, entry in self._entries.items():
                assert key == entry.key, f"entry {entry.key} stored under {key}"
                if entry.parent:
                    assert entry.parent in self._entries, f"block {key} lost its parent {entry.parent}"
                    children.setdefault(entry.parent, set()).add(key)
                for source in _sources(entry):
                    derived.setdefault(source, set()).add(key)
                for r in _referenced(entry):
                    assert self._entries.get(r.key) is r, f"{key} references {r.key}, which is not stored"
                    referrers.setdefault(r.key, set()).add(key)
                if hasattr(entry, "__post_init__"):
                    entry.__post_init__()
            assert children == self._children, "child sets out of step with parent links"
            assert derived == self._derived, "sources index out of step with the entries"
            assert referrers == self._referrers, "referrers index out of step with the entries"
            assert set(self._leaves) == set(self._entries) - set(children), "LRU order is not exactly the leaves"
            assert +self._kinds == Counter(e.kind for e in self._entries.values()), "per-kind counts"
