"""Benchmarks: `mmkv bench` and its arms, concurrency, tiers and the KV store's eviction cost."""

# The random models `mmkv bench --config` builds (mmkv.bench.run); here so the command and its arms
# share the list without importing each other.
CONFIGS = ("bench", "tiny", "qwen2.5-vl-7b", "qwen3-vl-8b")
