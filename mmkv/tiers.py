"""The tiers under the RAM KV store: RAM -> disk -> shared (Redis). One interface for the engine.

`load` is asked only after a RAM miss: the disk tier first, then the shared tier (a shared hit is
also written to disk). `store` writes a freshly precompiled chunk through to every tier. `purge`
removes a chunk from every tier. Every stored entry is checked on load (chunk_codec): a bad one
is deleted from its tier, counted as corrupt and treated as a miss, so the caller recomputes it
from the stored image bytes or skill text; it is never spliced. A tier that fails (disk error,
Redis down) is a miss too: a request never fails because a lower tier did.

`store_dir=None` and no `redis_url` means no tiers at all (the engine's RAM-only behaviour).
Thread-safe: the disk tier, the registry and redis-py are; the counters take a lock.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmkv.chunk_codec import CorruptEntryError, decode_chunk, encode_chunk
from mmkv.chunks import CachedChunk
from mmkv.disk_tier import DiskTier, atomic_write
from mmkv.durable_registry import DurableRegistry
from mmkv.redis_tier import RedisTier

log = logging.getLogger("mmkv.tiers")
TIERS = ("disk", "redis")
MODEL_FILE = "MODEL"  # the fingerprint a store directory belongs to
AUTO = "auto"  # store_dir: default_store_dir(fingerprint)


def default_store_dir(fingerprint: str) -> Path:
    """$XDG_CACHE_HOME/mmkv/<fingerprint[:16]> (default ~/.cache/mmkv/...)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mmkv" / fingerprint[:16]


@dataclass(frozen=True)
class StoreConfig:
    store_dir: Path | str | None = None  # None: no disk tier; "auto": default_store_dir(fingerprint)
    store_bytes: int = 20 << 30  # chunk KV on disk (uploads and skills are not evicted)
    redis_url: str | None = None  # redis://[user:pass@]host:port/db or rediss://...; None: no shared tier
    redis_timeout_s: float = 0.5
    redis_retry_s: float = 1.0

    def __post_init__(self):
        if self.store_bytes < 0:
            raise ValueError("store_bytes must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.store_dir is not None or self.redis_url is not None


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    load_s: float = 0.0  # reading, checking and decoding the hits
    writes: int = 0
    bytes_written: int = 0
    corrupt: int = 0  # entries found bad on load, deleted and recomputed


@dataclass
class Tiers:
    config: StoreConfig
    fingerprint: str
    layers: int
    dtype: torch.dtype
    device: torch.device
    root: Path | None  # the store directory (None: no disk tier)
    disk: DiskTier | None
    shared: RedisTier | None
    registry: DurableRegistry
    counters: dict[str, TierCounters] = field(default_factory=lambda: {t: TierCounters() for t in TIERS})
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, config: StoreConfig | None, fingerprint: str, layers: int, dtype: torch.dtype,
             device: torch.device) -> Tiers | None:
        """The tiers `config` asks for; None when it asks for none. A store directory made for another
        model fingerprint is refused (ValueError): one store directory serves one model."""
        if config is None or not config.enabled:
            return None
        disk, root = None, None
        if config.store_dir is not None:
            root = default_store_dir(fingerprint) if str(config.store_dir) == AUTO else Path(config.store_dir).expanduser()
            root.mkdir(parents=True, exist_ok=True)
            marker = root / MODEL_FILE
            if marker.exists() and marker.read_text().strip() != fingerprint:
                raise ValueError(f"the store directory {root} belongs to another model (fingerprint "
                                 f"{marker.read_text().strip()[:16]}...); give this model its own --store-dir")
            if not marker.exists():
                atomic_write(marker, fingerprint.encode())
            disk = DiskTier(root, config.store_bytes)
        shared = None
        if config.redis_url is not None:
            shared = RedisTier(config.redis_url, fingerprint[:16], config.redis_timeout_s, config.redis_retry_s)
            if not shared.check():
                log.warning("redis at %s does not answer; starting degraded, retrying on use", shared.url)
        return cls(config, fingerprint, layers, dtype, device, root, disk, shared, DurableRegistry(root, shared))

    # ---- chunks ----------------------------------------------------------------------------------
    def load(self, key: str, ram_key: str, kind: str) -> tuple[CachedChunk, str] | None:
        """The chunk stored under durable `key` and the tier it came from, or None (recompute)."""
        for tier in TIERS:
            if (self.disk if tier == "disk" else self.shared) is None:
                continue
            t0 = time.perf_counter()
            data = self._read(tier, key)
            if data is None:
                self._count(tier, misses=1)
                continue
            try:
                chunk = decode_chunk(data, key, self.fingerprint, ram_key, kind, self.layers, self.dtype, self.device)
            except CorruptEntryError as exc:
                log.warning("%s tier: dropped a bad entry %s... (%s); recomputing", tier, key[:16], exc)
                self._delete(tier, key)
                self._count(tier, misses=1, corrupt=1)
                continue
            self._count(tier, hits=1, bytes_read=len(data), load_s=time.perf_counter() - t0)
            if tier == "redis" and self.disk is not None:
                self._write("disk", key, data)
            return chunk, tier
        return None

    def store(self, key: str, chunk: CachedChunk) -> None:
        """Write a freshly computed chunk through to every tier."""
        data = encode_chunk(chunk, key, self.fingerprint)
        for tier in TIERS:
            self._write(tier, key, data)

    def purge(self, key: str) -> None:
        for tier in TIERS:
            self._delete(tier, key)

    def _read(self, tier: str, key: str) -> bytes | None:
        if tier == "disk":
            return self.disk.get(key) if self.disk is not None else None
        s = self.shared
        return s.call("kv read", lambda c: c.get(s.key("kv", key))) if s is not None else None

    def _write(self, tier: str, key: str, data: bytes) -> None:
        if tier == "disk" and self.disk is not None:
            ok = self.disk.put(key, data)
        elif tier == "redis" and self.shared is not None:
            s = self.shared
            ok = s.call("kv write", lambda c: c.set(s.key("kv", key), data), False)
        else:
            return
        if ok:
            self._count(tier, writes=1, bytes_written=len(data))

    def _delete(self, tier: str, key: str) -> None:
        if tier == "disk" and self.disk is not None:
            self.disk.delete(key)
        elif tier == "redis" and self.shared is not None:
            s = self.shared
            s.call("kv delete", lambda c: c.delete(s.key("kv", key)))

    def _count(self, tier: str, **deltas) -> None:
        with self._lock:
            c = self.counters[tier]
            for name, value in deltas.items():
                setattr(c, name, getattr(c, name) + value)

    # ---- state -----------------------------------------------------------------------------------
    def tenant_secret(self) -> bytes:
        """The secret API keys become tenants with, the same after a restart and on every server
        sharing the Redis. The disk's (made once) is offered to Redis; Redis keeps the first one it
        was offered, and that one wins, so servers agree. While Redis does not answer, the disk's."""
        path = self.root / "tenant_secret" if self.root is not None else None
        local = path.read_bytes() if path is not None and path.exists() else None
        secret = local or secrets.token_bytes(32)
        shared = self.shared.tenant_secret(secret) if self.shared is not None else None
        if shared is not None and local is not None and shared != local:
            log.warning("this store's tenant secret differs from the shared one; API keys now map to the shared "
                        "tenants, so uploads made here under the old secret are no longer visible to them")
        secret = shared or secret
        if path is not None and secret != local:
            atomic_write(path, secret)
            path.chmod(0o600)
        return secret

    def stats(self) -> dict:
        """Per tier: hits, misses, bytes read and written, load seconds, evictions, corrupt entries."""
        with self._lock:
            out = {}
            for tier, c in self.counters.items():
                for name, value in vars(c).items():
                    out[f"{tier}_{name}"] = value
        out["disk_evictions"] = self.disk.evictions if self.disk is not None else 0
        out["disk_bytes"] = self.disk.nbytes if self.disk is not None else 0
        out["disk_entries"] = len(self.disk) if self.disk is not None else 0
        out["registry_corrupt"] = self.registry.corrupt
        if self.shared is not None:
            s = self.shared
            out.update(redis_errors=s.errors, redis_skipped=s.skipped, redis_calls=s.calls, redis_call_s=s.call_s,
                       redis_up=0 if s.degraded else 1)
        return out
