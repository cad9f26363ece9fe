"""The KV store's promises: LRU over leaves only, parents evictable once childless, purge of an
entry and everything derived from it, and its accounting (check_integrity) after every operation."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from mmkv.store.kv_store import KVStore


@dataclass
class Item:
    key: str
    kind: str = "image"
    parent: str | None = None
    size: int = 1
    sources: frozenset[str] = field(default_factory=frozenset)
    referenced: tuple = ()  # entries whose tensors this one reads instead of copying

    @property
    def nbytes(self) -> int:
        return self.size


def _keys(store: KVStore) -> set[str]:
    return set(store._entries)


def test_least_recently_used_leaf_goes_first():
    store = KVStore(3)
    for k in "abc":
        assert store.put(Item(k))
    assert store.get("a", "image") is not None
    store.put(Item("d"))
    assert _keys(store) == {"a", "c", "d"} and store.evictions == 1
    store.check_integrity()


def test_inner_blocks_wait_for_their_children_then_go_next():
    store = KVStore(4)
    store.put(Item("p1", "prefix"))
    store.put(Item("p2", "prefix", parent="p1"))
    store.put(Item("p3", "prefix", parent="p2"))
    store.put(Item("x"))
    for k in ("p1", "p2", "p3"):  # a lookup walks the chain from the root
        store.get(k, "prefix")
    store.put(Item("y"))  # x is the LRU leaf: p1 and p2 are inner, never candidates
    assert _keys(store) == {"p1", "p2", "p3", "y"}
    store.put(Item("z"))  # p3 is now the LRU leaf; then p2 becomes the next one
    store.put(Item("w"))
    assert _keys(store) == {"p1", "y", "z", "w"}
    assert store.count("prefix") == 1 and store.count("image") == 3
    store.check_integrity()


def test_the_parent_of_the_entry_being_stored_is_never_evicted_for_it():
    store = KVStore(2)
    store.put(Item("p1", "prefix"))
    store.put(Item("x"))
    assert store.put(Item("p2", "prefix", parent="p1"))  # p1 is the LRU leaf but must stay
    assert _keys(store) == {"p1", "p2"}
    store.check_integrity()


def test_purge_removes_what_is_derived_and_its_descendants():
    store = KVStore(100)
    store.put(Item("img"))
    store.put(Item("b1", "prefix"))
    store.put(Item("b2", "prefix", parent="b1", sources=frozenset({"img"})))
    store.put(Item("b3", "prefix", parent="b2"))
    store.put(Item("b4", "prefix", parent="b3", sources=frozenset({"img", "skill"})))
    store.put(Item("c2", "prefix", parent="b1"))
    assert not store.discard("b2")  # an inner block is not discarded alone
    assert store.purge("img") == 4
    assert _keys(store) == {"b1", "c2"}
    store.check_integrity()
    assert store.purge("img") == 0
    store.put(Item("d"))  # b1 still has a child: only c2 and d are leaves
    assert set(store._leaves) == {"c2", "d"}


def test_a_reference_costs_its_own_bytes_and_never_outlives_what_it_reads():
    store = KVStore(100)
    chunk = Item("img", size=60)
    assert not store.put(Item("r0", "prefix", size=1, referenced=(chunk,)))  # not stored: nothing to read
    store.put(chunk)
    assert not store.put(Item("r0", "prefix", size=1, referenced=(Item("img", size=60),)))  # another object
    store.put(Item("b1", "prefix", size=10))
    store.put(Item("r2", "prefix", parent="b1", size=1, referenced=(chunk,), sources=frozenset({"img"})))
    store.put(Item("b3", "prefix", parent="r2", size=10))
    assert store.nbytes == 60 + 10 + 1 + 10  # the chunk's bytes counted once
    store.check_integrity()
    store.put(Item("x", size=25))  # the chunk is the LRU leaf: it goes, with r2 and the block after it
    assert _keys(store) == {"b1", "x"} and store.evictions == 3 and store.nbytes == 35
    store.check_integrity()


def test_storing_a_reference_never_evicts_what_it_reads_and_replacing_it_drops_the_reference():
    store = KVStore(62)
    chunk = Item("img", size=60)
    store.put(chunk)
    store.put(Item("y", size=1))
    assert store.put(Item("r1", "prefix", size=2, referenced=(chunk,)))  # img is the LRU leaf, y goes instead
    assert _keys(store) == {"img", "r1"}
    store.put(Item("img", size=50))  # the same key, a new object: the old one's readers go
    assert _keys(store) == {"img"} and store.nbytes == 50
    store.check_integrity()


def test_random_operations_keep_the_invariants():
    rng = random.Random(0)
    store = KVStore(40)
    chunks = [f"c{i}" for i in range(8)]
    for step in range(3000):
        op = rng.random()
        if op < 0.35:
            store.put(Item(rng.choice(chunks), size=rng.randint(1, 6)))
        elif op < 0.7:
            present = [k for k, e in store._entries.items() if e.kind == "prefix"]
            parent = rng.choice(present) if present and rng.random() < 0.8 else None
            src = frozenset(rng.sample(chunks, rng.randint(0, 2)))
            stored = [store._entries[c] for c in src if c in store._entries]
            refs = tuple(stored[:1]) if rng.random() < 0.5 else ()
            store.put(Item(f"b{step}", "prefix", parent=parent, size=rng.randint(1, 4), sources=src, referenced=refs))
        elif op < 0.85:
            keys = list(store._entries)
            if keys:
                store.get(rng.choice(keys), "prefix")
        elif op < 0.95:
            store.purge(rng.choice(chunks))
        else:
            keys = list(store._entries)
            if keys:
                store.discard(rng.choice(keys))
        store.check_integrity()
    assert store.evictions > 100
