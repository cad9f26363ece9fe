"""`python -m mmkv.bench.kv_store`: cost of one eviction from a full KVStore of 100k prefix blocks,
for one long chain (every block but the last is an inner node) and for many short chains.
Entries are 1-byte stand-ins: this measures the store's bookkeeping, not tensor copies."""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import dataclass

from mmkv.store.kv_store import KVStore


@dataclass
class _Block:
    key: str
    kind: str
    parent: str | None
    nbytes: int = 1


def eviction_us(chains: int, length: int, evictions: int) -> float:
    """Microseconds per `put` that has to evict, into a store filled with chains x length blocks."""
    store = KVStore(chains * length)
    for c in range(chains):
        parent = None
        for i in range(length):
            store.put(_Block(f"{c}/{i}", "prefix", parent))
            parent = f"{c}/{i}"
            store.get(parent, "prefix")  # a lookup walks the chain from its root
    start = time.perf_counter()
    for j in range(evictions):
        store.put(_Block(f"chunk{j}", "image", None))
    assert store.evictions == evictions
    return (time.perf_counter() - start) / evictions * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--evictions", type=int, default=20_000)
    args = parser.parse_args()
    print(f"# KVStore eviction, {args.blocks} blocks, {args.evictions} evictions; python {platform.python_version()}")
    print("| layout | us per eviction |")
    print("|---|---|")
    for chains, label in ((1, "one chain"), (args.blocks // 10, "chains of 10")):
        us = eviction_us(chains, args.blocks // chains, args.evictions)
        print(f"| {label} | {us:.1f} |")


if __name__ == "__main__":
    main()
