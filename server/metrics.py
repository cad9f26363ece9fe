"""Prometheus metrics, one registry per app so that several apps in one process (tests) never
share counters. Request-level numbers are recorded by the handlers; engine-level counters
(vision tower runs, image cache, evictions, cache bytes) are read from the worker's snapshot of
`engine.stats()` at scrape time, so the engine stays the single source of truth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# engine.stats() key -> (metric name, help, kind). Keys the engine does not report are skipped.
_ENGINE_METRICS = {
    "vision_tower_runs": ("mmkv:vision_tower_runs", "Vision tower forward passes (one per image encoded).", "counter"),
    "image_cache_hits": ("mmkv:image_cache_hits", "Image lookups served from cached KV (items).", "counter"),
    "image_cache_misses": ("mmkv:image_cache_misses", "Image lookups that had to encode (items).", "counter"),
    "skill_cache_hits": ("mmkv:skill_cache_hits", "Skill lookups served from cached KV (items).", "counter"),
    "skill_cache_misses": ("mmkv:skill_cache_misses", "Skill lookups that had to prefill (items).", "counter"),
    "prefix_cache_query_tokens": ("mmkv:prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.",
                                  "counter"),
    "prefix_cache_hit_tokens": ("mmkv:prefix_cache_hits_tokens", "Prompt tokens served from the prefix cache.",
                                "counter"),
    "prefill_tokens": ("mmkv:prefill_tokens", "Tokens run through the language model at prefill.", "counter"),
    "reused_tokens": ("mmkv:reused_tokens", "Prompt tokens spliced from cached KV instead of computed.", "counter"),
    "evictions": ("mmkv:cache_evictions", "Cache entries evicted to stay under the byte budget.", "counter"),
    "cache_bytes": ("mmkv:cache_bytes", "Bytes of KV held by the cache.", "gauge"),
    "cache_budget_bytes": ("mmkv:cache_budget_bytes", "The cache's byte budget.", "gauge"),
    "slot_bytes": ("mmkv:slot_pool_bytes", "Bytes of prompt-length KV buffers kept for reuse (CPU), in use and free.",
                   "gauge"),
    "slot_budget_bytes": ("mmkv:slot_pool_budget_bytes", "The slot pool's byte budget.", "gauge"),
    "slot_in_place_tokens": ("mmkv:slot_in_place_tokens", "Prefix-cache hit tokens a conversation's kept buffer held "
                             "in place (neither copied nor rotated in).", "counter"),
    "slot_copied_tokens": ("mmkv:slot_copied_tokens", "Prefix-cache hit tokens copied from a conversation's outgrown "
                           "buffer.", "counter"),
    "slot_grown": ("mmkv:slot_grown", "Conversations moved into a larger kept buffer between turns, before their "
                   "next turn outgrew theirs.", "counter"),
    "slot_tail_tokens": ("mmkv:slot_tail_tokens", "Tokens after a conversation's last full prefix block (the end of "
                         "its previous prompt) that its kept buffer still held, reused with the hit.", "counter"),
    "image_cache_entries": ("mmkv:image_cache_entries", "Images whose KV is cached.", "gauge"),
    "skill_entries": ("mmkv:skill_cache_entries", "Skills whose KV is cached.", "gauge"),
    "prefix_blocks": ("mmkv:prefix_cache_blocks", "Prompt-prefix blocks cached.", "gauge"),
    "registered_images": ("mmkv:registered_images", "Images registered with the engine, all tenants.", "gauge"),
    "decode_batch_rows": ("mmkv:decode_batch_rows", "Requests decoding in the batch.", "gauge"),
    "decode_batch_kv_bytes": ("mmkv:decode_batch_kv_bytes", "Bytes of KV the decode batch holds (a prefix its rows "
                              "share counted once).", "gauge"),
    "decode_batch_shared_tokens": ("mmkv:decode_batch_shared_tokens", "Leading KV slots every decoding row shares, "
                                   "held once.", "gauge"),
    "disk_bytes": ("mmkv:disk_tier_bytes", "Bytes of chunk KV in the disk tier.", "gauge"),
    **{f"{b}_{k}": (f"mmkv:{b}_{m}", doc.format(store=store), kind)
       for b, store in (("redis", "Redis"), ("mooncake", "Mooncake Store"))
       for k, m, doc, kind in (
           ("up", "up", "1 while the shared tier ({store}) answers, 0 while degraded.", "gauge"),
           ("errors", "errors", "Shared-tier ({store}) calls that failed (timeouts, connection errors).", "counter"),
           ("call_s", "call_seconds", "Total latency of the shared-tier ({store}) calls that answered.", "counter"),
           ("calls", "calls", "Shared-tier ({store}) calls that answered.", "counter"),
           ("skipped", "skipped", "Shared-tier ({store}) calls skipped while degraded.", "counter"))},
    "tier_write_queue_bytes": ("mmkv:tier_write_queue_bytes", "Bytes of chunk KV waiting for the background tier "
                               "writer.", "gauge"),
    "tier_writes_dropped": ("mmkv:tier_writes_dropped", "Tier writes dropped because the writer's queue was full "
                            "(recomputed later if needed).", "counter"),
    "tier_writes_failed": ("mmkv:tier_writes_failed", "Tier writes that failed (counted, never a request error).",
                           "counter"),
    "registry_corrupt": ("mmkv:registry_corrupt", "Stored upload / skill records or blobs dropped as corrupt.",
                         "counter"),
    **{f"background_{k}": (f"mmkv:background_{k}", doc, kind) for k, doc, kind in (
        ("pending", "First-seen images whose reusable KV waits for its background build.", "gauge"),
        ("bytes", "Bytes the pending background builds are charged (features and the KV they will hold).", "gauge"),
        ("built", "Background builds stored.", "counter"),
        ("dropped", "Background builds dropped: their byte budget was full.", "counter"),
        ("cancelled", "Background builds cancelled: the image was deleted while pending.", "counter"),
        ("failed", "Background builds that failed (logged, never a request error).", "counter"),
        ("tokens", "LM tokens run by background builds.", "counter"),
        ("seconds", "Seconds spent in background builds.", "counter"))},
}

# Per tier (label tier = ram / disk / redis / mooncake): engine.stats() key "<tier>_<key>" -> (metric, help).
_TIER_METRICS = {
    "hits": ("mmkv:tier_hits", "Chunk lookups answered by this tier."),
    "misses": ("mmkv:tier_misses", "Chunk lookups this tier could not answer."),
    "bytes_read": ("mmkv:tier_read_bytes", "Bytes of chunk KV loaded from this tier."),
    "load_s": ("mmkv:tier_load_seconds", "Time spent loading (reading, checking, decoding) chunk KV from this tier."),
    "writes": ("mmkv:tier_writes", "Chunks written to this tier."),
    "evictions": ("mmkv:tier_evictions", "Chunks evicted from this tier to stay in its byte budget."),
    "corrupt": ("mmkv:tier_corrupt", "Entries found truncated, corrupted or foreign on load: dropped, recomputed."),
}


class _EngineStatsCollector:
    def __init__(self, stats: Callable[[], Mapping[str, Any]]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for key, (name, doc, kind) in _ENGINE_METRICS.items():
            if key in stats:
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(name, doc, value=float(stats[key]))
        if "cpu_linear" in stats:
            backend = GaugeMetricFamily("mmkv:linear_backend", "The language model's linear layers: onednn, dense, "
                                        "or dense with the reason (--cpu-linear); 1 on the one in use.",
                                        labels=["backend"])
            backend.add_metric([str(stats["cpu_linear"])], 1.0)
            yield backend
        if "image_cache_hits" in stats:  # the RAM tier's chunk lookups: images and skills
            stats = {**stats, "ram_hits": stats["image_cache_hits"] + stats.get("skill_cache_hits", 0),
                     "ram_misses": stats.get("image_cache_misses", 0) + stats.get("skill_cache_misses", 0)}
        for key, (name, doc) in _TIER_METRICS.items():
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier in ("ram", "disk", "redis", "mooncake"):
                if f"{tier}_{key}" in stats:
                    family.add_metric([tier], float(stats[f"{tier}_{key}"]))
            yield family
        if "image_cache_hits" in stats and "image_cache_misses" in stats:
            queries = stats["image_cache_hits"] + stats["image_cache_misses"]
            yield CounterMetricFamily("mmkv:image_cache_queries", "Image lookups (items).", value=float(queries))


class _ShadowCollector:
    """The fidelity monitor's counts per kind (mmkv/request/shadow.py), read at scrape time."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        kinds = snapshot["kinds"]
        families = {key: CounterMetricFamily(f"mmkv:shadow_{key}", doc, labels=["kind"]) for key, doc in (
            ("shadowed", "Fast-path requests recomputed exactly and compared."),
            ("agreed", "Shadowed requests whose first token equals the full recompute's."),
            ("dropped", "Sampled requests not shadowed: the queue was full (busy) or the shadow failed."),
            ("alerts", "Times a kind's agreement over the window fell below --shadow-alert."))}
        gap = HistogramMetricFamily("mmkv:shadow_logit_gap", "Largest |logit| gap of a shadowed request's first "
                                    "next-token logits from the full recompute's.", labels=["kind"])
        for kind, k in kinds.items():
            for key, family in families.items():
                family.add_metric([kind], float(k[key]))
            gap.add_metric([kind], [(b, float(c)) for b, c in k["gap_buckets"].items()], float(k["gap_sum"]))
        yield from families.values()
        yield gap
        yield from _blend_families(snapshot.get("blend"))


def _blend_families(blend: Mapping[str, Any] | None) -> Iterator[Metric]:
    """The dial's replays per kind and ratio, and the recommended ratio per kind (--shadow-blend)."""
    if blend is None:
        return
    shadowed = CounterMetricFamily("mmkv:shadow_blend_shadowed", "Shadowed splices replayed at this blend ratio "
                                   "and compared with the full recompute.", labels=["kind", "ratio"])
    agreed = CounterMetricFamily("mmkv:shadow_blend_agreed", "Replays whose first token equals the full "
                                 "recompute's.", labels=["kind", "ratio"])
    bound = GaugeMetricFamily("mmkv:shadow_blend_lower_bound", "Exact one-sided lower bound on the agreement at "
                              "this ratio.", labels=["kind", "ratio"])
    recommended = GaugeMetricFamily("mmkv:shadow_blend_recommended_ratio", "The smallest ratio whose lower bound "
                                    "meets --shadow-target; NaN while none does.", labels=["kind"])
    needed = GaugeMetricFamily("mmkv:shadow_blend_agreeing_needed", "Further agreeing shadows the closest ratio "
                               "needs to meet --shadow-target (0: met).", labels=["kind"])
    for kind, k in blend["kinds"].items():
        for row in k["ratios"].values():
            labels = [kind, repr(row["ratio"])]
            shadowed.add_metric(labels, float(row["shadowed"]))
            agreed.add_metric(labels, float(row["agreed"]))
            bound.add_metric(labels, row["lower_bound"])
        recommended.add_metric([kind], float("nan") if k["recommended"] is None else k["recommended"])
        needed.add_metric([kind], float(k["agreeing_needed"]))
    yield from (shadowed, agreed, bound, recommended, needed)


class ServerMetrics:
    """Everything /metrics shows. Thread-safe (prometheus_client metrics are)."""

    def __init__(self, engine_stats: Callable[[], Mapping[str, Any]], queue_depth: Callable[[], int],
                 shadow: Callable[[], Mapping[str, Any]] | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mmkv:requests", "HTTP requests by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("mmkv:time_to_first_token_seconds", "Request arrival to first token, queue wait included.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("mmkv:e2e_request_latency_seconds", "Request arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("mmkv:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_tokens = Counter("mmkv:cached_prompt_tokens",
                                     "Prompt tokens whose KV came from any cache (usage.cached_tokens).", registry=r)
        self.image_tokens_reused = Counter("mmkv:image_cache_hits_tokens", "Image tokens spliced from cached KV.",
                                           registry=r)
        self.generation_tokens = Counter("mmkv:generation_tokens", "Completion tokens generated.", registry=r)
        self.cancelled = Counter("mmkv:requests_cancelled", "Generations stopped because the client went away.",
                                 registry=r)
        self.queue_depth = Gauge("mmkv:queue_depth", "Engine jobs waiting (not counting the running one).",
                                 registry=r)
        self.queue_depth.set_function(queue_depth)
        r.register(_EngineStatsCollector(engine_stats))
        if shadow is not None:
            r.register(_ShadowCollector(shadow))

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_completion(self, *, ttft_s: float, e2e_s: float, prompt_tokens: int, cached_tokens: int,
                           completion_tokens: int, image_tokens_reused: int) -> None:
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.image_tokens_reused.inc(image_tokens_reused)

    def render(self) -> bytes:
        return generate_latest(self.registry)
