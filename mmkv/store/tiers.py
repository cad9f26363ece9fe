"""The tiers under the RAM KV store: RAM -> disk -> shared (Redis, or Mooncake Store). One interface
for the engine.

`load` is asked only after a RAM miss: the disk tier first, then the shared tier (a shared hit is
also written to disk). `store` queues a freshly precompiled chunk for the background writer
(mmkv/store/tier_writer.py), which writes it through to the disk and, for an uploaded image, an
uploaded video's group or a skill (never an inline image or video: the shared store holds what
was registered, not every picture a request carried), to the shared tier, off the request path (a shared hit's copy to disk goes the
same way); `flush` waits for them. A queued chunk is counted at its KV plus its encoded copy and
held in host memory (device KV is copied when the write is accepted), so the queue never keeps
device memory the RAM store has let go. `purge` removes a chunk from every tier (a queued write of
it is taken back first; the shared tier first, and a shared tier that does not answer fails the
purge: SharedTierUnavailableError); `purge_local` only from this server's tiers. Every stored entry is checked on load (chunk_codec): a bad one
is deleted from its tier, counted as corrupt and treated as a miss, so the caller recomputes it
from the stored image bytes or skill text; it is never spliced. A tier that fails (disk error,
Redis down) is a miss too: a request never fails because a lower tier did.

`store_dir=None` and no shared store means no tiers at all (the engine's RAM-only behaviour). A
store directory is held by one process at a time (disk_tier.lock_store_dir); `close` flushes the
writer and lets it go (also run when the Tiers is collected and at interpreter exit).
Thread-safe: the disk tier, the registry, the writer and the shared clients are; the counters
take a lock.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmkv.adapters import ImageFeatures
from mmkv.kv.chunks import CachedChunk
from mmkv.store.chunk_codec import CorruptEntryError, decode_chunk, encode_chunk, encoded_nbytes
from mmkv.store.disk_tier import DiskTier, atomic_write, lock_store_dir
from mmkv.store.durable_registry import DurableRegistry
from mmkv.store.mooncake_tier import MooncakeTier, load_store_class, split_address
from mmkv.store.redis_tier import RedisTier
from mmkv.store.shared_tier import SharedTier, SharedTierUnavailableError
from mmkv.store.tier_writer import TierWriter

log = logging.getLogger("mmkv.store.tiers")
MODEL_FILE = "MODEL"  # the fingerprint a store directory belongs to
DIGEST_FILE = "weight_digests.json"  # mmkv/store/fingerprint.py's cache of weight-file digests
AUTO = "auto"  # store_dir: default_store_dir(fingerprint)
# What a chunk write holds beyond its KV and the encoded copy: the header, the hashing and the
# write's own objects (measured with tracemalloc: about 40 KiB).
WRITE_OVERHEAD_BYTES = 64 << 10


def _cache_base() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mmkv"


def default_store_dir(fingerprint: str) -> Path:
    """$XDG_CACHE_HOME/mmkv/<fingerprint[:16]> (default ~/.cache/mmkv/...)."""
    return _cache_base() / fingerprint[:16]


def digest_cache_path(config: StoreConfig | None) -> Path | None:
    """Where the weight digests are cached, known before the fingerprint is: the store directory,
    or for "auto" (a directory per fingerprint) the cache base above them; None without a disk tier."""
    if config is None or config.store_dir is None:
        return None
    root = _cache_base() if str(config.store_dir) == AUTO else Path(config.store_dir).expanduser()
    return root / DIGEST_FILE


@dataclass(frozen=True)
class StoreConfig:
    store_dir: Path | str | None = None  # None: no disk tier; "auto": default_store_dir(fingerprint)
    store_bytes: int = 20 << 30  # chunk KV on disk (uploads and skills are not evicted)
    redis_url: str | None = None  # redis://[user:pass@]host:port/db or rediss://...; None: no shared tier
    redis_timeout_s: float = 0.5  # also the Mooncake master's connect probe
    redis_retry_s: float = 1.0  # a degraded shared tier (either store) is tried again after this
    mooncake_master: str | None = None  # HOST:PORT: the shared tier on Mooncake Store instead of Redis
    mooncake_metadata: str | None = None  # default http://<master host>:8080/metadata
    mooncake_segment_bytes: int = 1 << 30  # RAM this server lends to the Mooncake pool
    mooncake_buffer_bytes: int = 256 << 20  # the transfer buffer: the largest value shared
    write_queue_bytes: int = 1 << 30  # chunk KV (and its encoding) held by the background writer; beyond, writes drop
    shared_kv_ttl_s: float = 7 * 86400  # Redis: chunk KV unused this long expires (records never do)
    shared_start_wait_s: float = 10.0  # how long a server waits for the shared store's tenant secret at start-up

    def __post_init__(self):
        if self.store_bytes < 0 or self.write_queue_bytes < 0:
            raise ValueError("store_bytes and write_queue_bytes must be >= 0")
        if self.redis_url is not None and self.mooncake_master is not None:
            raise ValueError("--redis-url and --mooncake-master both ask for the shared tier; pick one "
                             "(one shared store per server: Redis, the default, or Mooncake Store)")
        if self.mooncake_metadata is not None and self.mooncake_master is None:
            raise ValueError("--mooncake-metadata needs --mooncake-master")
        if self.mooncake_master is not None:
            split_address(self.mooncake_master, "--mooncake-master")
            load_store_class()  # MooncakeUnavailable naming the fix, before anything is loaded or written

    @property
    def enabled(self) -> bool:
        return self.store_dir is not None or self.redis_url is not None or self.mooncake_master is not None

    def shared_tier(self, namespace: str) -> SharedTier | None:
        if self.redis_url is not None:
            return RedisTier(self.redis_url, namespace, self.redis_timeout_s, self.redis_retry_s, self.shared_kv_ttl_s)
        if self.mooncake_master is not None:
            return MooncakeTier(self.mooncake_master, self.mooncake_metadata, namespace, self.redis_timeout_s,
                                self.redis_retry_s, self.mooncake_segment_bytes, self.mooncake_buffer_bytes)
        return None


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
    shared: SharedTier | None
    registry: DurableRegistry
    lock_fd: int | None = None  # the store directory's lock (disk_tier.lock_store_dir)
    counts: TierCounts = field(init=False)
    writer: TierWriter = field(init=False)

    def __post_init__(self):
        self.counts = TierCounts({t: TierCounters() for t in ("disk", self.shared_name)})
        # The writes queued hold what they write to, not this Tiers: collecting it (or the
        # interpreter's exit) flushes the writer and releases the lock and the client (_finish).
        self.writer = TierWriter(self.config.write_queue_bytes)
        self._finalizer = weakref.finalize(self, _finish, self.writer, self.shared, self.lock_fd)

    @property
    def shared_name(self) -> str:
        return self.shared.name if self.shared is not None else "redis"

    @classmethod
    def open(cls, config: StoreConfig | None, fingerprint: str, layers: int, dtype: torch.dtype,
             device: torch.device) -> Tiers | None:
        """The tiers `config` asks for; None when it asks for none. A store directory made for another
        model fingerprint is refused (ValueError): one store directory serves one model; one held by
        another process (or another open Tiers) is refused too (disk_tier.StoreInUseError)."""
        if config is None or not config.enabled:
            return None
        disk, root, lock_fd = None, None, None
        shared = config.shared_tier(fingerprint[:16])  # first: a missing library fails before any disk work
        try:
            if config.store_dir is not None:
                root = default_store_dir(fingerprint) if str(config.store_dir) == AUTO else Path(config.store_dir).expanduser()
                root.mkdir(parents=True, exist_ok=True)
                lock_fd = lock_store_dir(root)
                marker = root / MODEL_FILE
                if marker.exists() and marker.read_text().strip() != fingerprint:
                    raise ValueError(f"the store directory {root} belongs to another model (fingerprint "
                                     f"{marker.read_text().strip()[:16]}...); give this model its own --store-dir")
                if not marker.exists():
                    atomic_write(marker, fingerprint.encode())
                disk = DiskTier(root, config.store_bytes)
            if shared is not None and not shared.check():
                log.warning("%s at %s does not answer; starting degraded, retrying on use", shared.name, shared.url)
            elif shared is not None and (why := shared.eviction_warning()):
                log.warning(why)
            return cls(config, fingerprint, layers, dtype, device, root, disk, shared, DurableRegistry(root, shared),
                       lock_fd)
        except BaseException:
            _finish(None, shared, lock_fd)
            raise

    def close(self) -> None:
        """Write what is queued, then release the store directory and the shared client. Idempotent."""
        self._finalizer()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued chunk write has landed (tests, benchmarks, shutdown)."""
        return self.writer.flush(timeout_s)

    # ---- chunks ----------------------------------------------------------------------------------
    def _tiers(self) -> list[str]:
        return _present(self.disk, self.shared)

    def load(self, key: str, ram_key: str, kind: str) -> tuple[CachedChunk, str] | None:
        """The chunk stored under durable `key` and the tier it came from, or None (recompute)."""
        for tier in self._tiers():
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
            if tier != "disk" and self.disk is not None:  # kept on disk too, off the request path
                self.writer.submit(key, len(data), lambda: functools.partial(
                    _write, self.disk, self.shared, self.counts, "disk", key, data))
            return chunk, tier
        return None

    def store(self, key: str, chunk: CachedChunk, shared: bool = True) -> None:
        """Queue `chunk` for the background writer (never blocks; a full queue drops the write and
        counts it): to the disk unless it holds it, and when `shared` to the shared tier unless it
        holds it. Counted at the KV plus its encoded copy, both alive while it is written."""
        disk, shared_tier = self.disk, (self.shared if shared else None)
        self.writer.submit(key, 2 * encoded_nbytes(chunk) + WRITE_OVERHEAD_BYTES, lambda: functools.partial(
            _write_through, disk, shared_tier, self.fingerprint, self.counts, key, *_host_copy(chunk)))

    def purge(self, key: str) -> None:
        """Drop a chunk from every tier: the shared tier first (SharedTierUnavailableError, and the
        disk keeps it, when it does not answer)."""
        self.writer.cancel(key)  # a queued write must not bring it back after the delete
        if self.shared is not None:
            self.shared.kv_delete(key)
        self.purge_local(key)

    def purge_local(self, key: str) -> None:
        """Drop a chunk from this server's tiers (a queued write of it included)."""
        self.writer.cancel(key)
        if self.disk is not None:
            self.disk.delete(key)

    def _read(self, tier: str, key: str) -> bytes | None:
        return self.disk.get(key) if tier == "disk" else self.shared.kv_get(key)

    def _delete(self, tier: str, key: str) -> None:
        """Drop a bad entry (a shared tier that does not answer keeps it: it is checked again on load)."""
        if tier == "disk":
            self.disk.delete(key)
        else:
            self.shared.kv_discard(key)

    def _count(self, tier: str, **deltas) -> None:
        self.counts.add(tier, **deltas)

    # ---- state -----------------------------------------------------------------------------------
    def tenant_secret(self) -> bytes:
        """The secret API keys become tenants with, the same after a restart and on every server
        sharing the store. Without a shared tier: the disk's (made once, mode 0600). With one: the
        shared store's, and only it. The disk's is offered; the store keeps the first one it was
        offered, so servers agree. A store that does not answer is asked again every retry_s for
        `shared_start_wait_s`, warning each time; then SharedTierUnavailableError: a server that
        derived tenants from any other secret would hide every upload made under it from the others."""
        path = self.root / "tenant_secret" if self.root is not None else None
        local = path.read_bytes() if path is not None and path.exists() else None
        secret = local or secrets.token_bytes(32)
        if self.shared is not None:
            secret = self._shared_secret(secret)
            if local is not None and secret != local:
                log.warning("this store's tenant secret differs from the shared one; API keys now map to the shared "
                            "tenants, so uploads made here under the old secret are no longer visible to them")
        if path is not None and secret != local:
            atomic_write(path, secret, mode=0o600)
        return secret

    def _shared_secret(self, proposal: bytes) -> bytes:
        deadline = time.monotonic() + self.config.shared_start_wait_s
        while (secret := self.shared.tenant_secret(proposal)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SharedTierUnavailableError(
                    f"{self.shared.name} at {self.shared.url} did not answer within {self.config.shared_start_wait_s:g} s "
                    f"at start-up: the tenant secret every server shares lives there, and a server with another one "
                    f"would hide uploads from the rest; start {self.shared.name} (or fix the URL) and start again")
            log.warning("%s at %s does not answer: waiting up to %.0f s more for the shared tenant secret",
                        self.shared.name, self.shared.url, left)
            time.sleep(min(self.shared.retry_s, left))
        return secret

    def stats(self) -> dict:
        """Per tier: hits, misses, bytes read and written, load seconds, evictions, corrupt entries;
        the background writer's queue; the shared client's calls, errors and state."""
        out = self.counts.snapshot()
        out["disk_evictions"] = self.disk.evictions if self.disk is not None else 0
        out["disk_bytes"] = self.disk.nbytes if self.disk is not None else 0
        out["disk_entries"] = len(self.disk) if self.disk is not None else 0
        out["registry_corrupt"] = self.registry.corrupt
        w = self.writer
        out.update(tier_write_queue_bytes=w.held_bytes, tier_writes_dropped=w.dropped, tier_writes_failed=w.failed)
        if self.shared is not None:
            out.update(self.shared.stats())
        return out


@dataclass
class TierCounts:
    """The per-tier counters, shared by a Tiers and its writer's thread (one lock)."""
    by_tier: dict[str, TierCounters]
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, tier: str, **deltas) -> None:
        with self._lock:
            c = self.by_tier[tier]
            for name, value in deltas.items():
                setattr(c, name, getattr(c, name) + value)

    def snapshot(self) -> dict:
        with self._lock:
            return {f"{tier}_{name}": value for tier, c in self.by_tier.items() for name, value in vars(c).items()}


def _present(disk: DiskTier | None, shared: SharedTier | None) -> list[str]:
    return (["disk"] if disk is not None else []) + ([shared.name] if shared is not None else [])


def _write(disk: DiskTier | None, shared: SharedTier | None, counts: TierCounts, tier: str, key: str,
           data: bytes) -> None:
    ok = disk.put(key, data) if tier == "disk" else shared.kv_put(key, data)
    if ok:
        counts.add(tier, writes=1, bytes_written=len(data))


def _write_through(disk: DiskTier | None, shared: SharedTier | None, fingerprint: str, counts: TierCounts,
                   key: str, chunk: CachedChunk, copied: torch.cuda.Event | None) -> None:
    """The background writer's job: encode once (off the request path), write to every tier that
    does not hold it yet (a shared copy's time to live is renewed instead)."""
    if copied is not None:
        copied.synchronize()
    missing = [t for t in _present(disk, shared) if not (key in disk if t == "disk" else shared.kv_renew(key))]
    data = encode_chunk(chunk, key, fingerprint) if missing else b""
    for tier in missing:
        _write(disk, shared, counts, tier, key, data)


def _host_copy(chunk: CachedChunk) -> tuple[CachedChunk, torch.cuda.Event | None]:
    """`chunk` in host memory, so a queued write holds no device memory, and the event its copy
    is done at (None: nothing to wait for). CUDA KV is copied into pinned memory on the current
    stream, so the request does not wait for it; the writer waits for the event."""
    if chunk.keys[0].device.type == "cpu":
        return chunk, None
    with torch.cuda.device(chunk.keys[0].device):
        host = _map_tensors(chunk, lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
            t, non_blocking=True))
        copied = torch.cuda.Event()
        copied.record()
    return host, copied


def _map_tensors(chunk: CachedChunk, f: Callable[[torch.Tensor], torch.Tensor]) -> CachedChunk:
    features = chunk.features
    if features is not None:
        features = ImageFeatures(f(features.embeds), tuple(f(d) for d in features.deepstack))
    return dataclasses.replace(chunk, token_ids=f(chunk.token_ids), position_ids=f(chunk.position_ids),
                               keys=tuple(map(f, chunk.keys)), values=tuple(map(f, chunk.values)), features=features)


def _finish(writer: TierWriter | None, shared: SharedTier | None, lock_fd: int | None) -> None:
    """Flush the writer, close the shared client, release the store directory's lock."""
    if writer is not None:
        writer.close()
    if shared is not None:
        shared.close()
    if lock_fd is not None:
        os.close(lock_fd)
