"""The shared tier's logic, whatever store holds it (Redis: mmkv/store/redis_tier.py, Mooncake Store:
mmkv/store/mooncake_tier.py): key names, degraded mode, counters, and the records of uploads and skills
written as plain keys, so a backend only supplies a few primitives.

Two key spaces, so a store that must evict can be told what it may drop:
- cache: `mmkv:<namespace>:kv:<durable key>` (chunk KV; the durable key is SHA-256 over content,
  model fingerprint, grid settings, anchor and tenant salt; the namespace is the fingerprint's
  first 16 hex digits, so models stay apart even to a human browsing the store). On Redis written
  with a time to live (renewed on every read and re-share), and the only keys that have one.
- durable, never expiring: `mmkv:tenant-secret`, `...:rec:<kind>:<tenant>:<id>` (a record's JSON
  with its checksum), `...:ids:<kind>:<tenant>` (the ids of a tenant's records), `...:blob:...`
  (an upload's bytes), `...:blobref:<sha256>` (the records that use a blob, where blobs are
  shared) and `...:gone:<kind>:<tenant>:<id>` (a delete's tombstone).
On Redis, `maxmemory-policy volatile-lru` (or `volatile-ttl`) then evicts chunk KV only; an
`allkeys-*` policy could evict records, blobs and tombstones (uploads lost, deleted files back),
so `check_eviction_policy` warns about it at start-up. Chunk values carry their checksum in their
header, records their own, blobs are checked against their digest.

Failure behaviour: every call has a short timeout (the backend's); an error marks the tier
degraded and skips it for `retry_s`, after which the next call tries again, so a request never
waits on a dead store longer than one timeout and the server uses the store again without a
restart once it is back. A delete is the exception: it is always tried and a failure raises
SharedTierUnavailableError (HTTP 503), because a delete that skipped the shared tier would be
undone by the next read from it. Thread-safe when the backend's client is (both are); counters
take a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from mmkv.errors import MMKVError

log = logging.getLogger("mmkv.store.shared_tier")
SECRET_KEY = "mmkv:tenant-secret"  # shared by every model: a tenant is an API key, whatever the model


class SharedTierError(Exception):
    """A shared-store call that failed (backends raise it, or their own `failures`)."""


class SharedTierUnavailableError(MMKVError):
    """An operation that must reach the shared store (a delete) could not; nothing it would have
    made inconsistent was changed, so the client can retry it."""

    http_status = 503
    error_type = "server_error"
    code = "shared_tier_unavailable"


class SharedTier(ABC):
    name: str  # "redis" / "mooncake": the tier's label in stats, metrics and logs
    failures: tuple[type[BaseException], ...] = (SharedTierError, OSError)

    def __init__(self, url: str, namespace: str, retry_s: float):
        self.url = url  # without credentials: the only form ever logged
        self.prefix = f"mmkv:{namespace}:"
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.degraded = False
        self.errors = 0
        self.skipped = 0  # calls not tried while degraded
        self.calls = 0
        self.call_s = 0.0  # total latency of the calls that answered

    # ---- what a backend supplies (each may raise one of `failures`) ------------------------------
    @abstractmethod
    def _get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def _set(self, key: str, value: bytes) -> None: ...

    @abstractmethod
    def _set_cache(self, key: str, value: bytes) -> None:
        """Store a cache value (evictable; on Redis with a time to live)."""

    @abstractmethod
    def _get_cache(self, key: str) -> bytes | None:
        """A cache value, its time to live renewed."""

    @abstractmethod
    def _renew_cache(self, key: str) -> bool:
        """Renew a cache value's time to live; False when the store does not hold it."""

    @abstractmethod
    def _record_write(self, kind: str, tenant: str, id_: str, sealed: bytes, digest: str | None,
                      blob: bytes | None) -> None:
        """Store a record, its blob and its listing, and drop its tombstone."""

    @abstractmethod
    def _record_delete(self, kind: str, tenant: str, id_: str, digest: str | None) -> None:
        """Leave the record's tombstone, then drop the record, its listing and its blob unless
        another record still uses it."""

    @abstractmethod
    def _blob_key(self, kind: str, tenant: str, id_: str, digest: str) -> str:
        """Where the blob a record names is kept."""

    @abstractmethod
    def _set_if_absent(self, key: str, value: bytes) -> None:
        """Store `value` unless `key` holds one already (the first writer wins)."""

    @abstractmethod
    def _delete(self, *keys: str) -> None: ...

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abstractmethod
    def _index_add(self, key: str, member: str) -> None:
        """Add `member` to the set stored at `key`."""

    @abstractmethod
    def _index_remove(self, key: str, member: str) -> int:
        """Remove `member` from the set at `key`; returns how many members are left."""

    @abstractmethod
    def _index_members(self, key: str) -> list[str]: ...

    @abstractmethod
    def _ping(self) -> None: ...

    def close(self) -> None:
        """Release the client (nothing to do for a pooled one)."""

    # ---- degraded mode ---------------------------------------------------------------------------
    def call(self, op: str, fn: Callable[[], Any], default: Any = None) -> Any:
        """fn(), or `default` when the store fails or is being skipped after a failure."""
        if self.degraded and time.monotonic() < self._down_until:
            with self._lock:
                self.skipped += 1
            return default
        try:
            return self._counted(op, fn)
        except self.failures:
            return default

    def strict(self, op: str, fn: Callable[[], Any]) -> Any:
        """fn(), tried even while degraded; a failure raises SharedTierUnavailableError."""
        try:
            return self._counted(op, fn)
        except self.failures:
            raise SharedTierUnavailableError(
                f"the shared store ({self.name}) does not answer, so the {op} could not reach every tier and "
                f"was not done; retry it once the store is back") from None

    def _counted(self, op: str, fn: Callable[[], Any]) -> Any:
        """fn() with its latency counted; a failure is counted, starts the degraded window and is
        raised again."""
        t0 = time.perf_counter()
        try:
            result = fn()
        except self.failures as exc:
            with self._lock:
                self.errors += 1
                self.degraded, self._down_until = True, time.monotonic() + self.retry_s
            log.warning("%s %s failed (%s at %s); using the lower tiers for %.1fs", self.name, op,
                        type(exc).__name__, self.url, self.retry_s)
            raise
        with self._lock:
            if self.degraded:
                log.info("%s at %s answers again", self.name, self.url)
            self.degraded = False
            self.calls += 1
            self.call_s += time.perf_counter() - t0
        return result

    def check(self) -> bool:
        """True when the store answers (at most one try per retry_s while degraded)."""
        return bool(self.call("ping", lambda: self._ping() or True, False))

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def stats(self) -> dict:
        return {f"{self.name}_errors": self.errors, f"{self.name}_skipped": self.skipped,
                f"{self.name}_calls": self.calls, f"{self.name}_call_s": self.call_s,
                f"{self.name}_up": 0 if self.degraded else 1}

    # ---- chunk KV (the cache key space) ----------------------------------------------------------
    def kv_get(self, key: str) -> bytes | None:
        return self.call("kv read", lambda: self._get_cache(self.key("kv", key)))

    def kv_put(self, key: str, data: bytes) -> bool:
        return bool(self.call("kv write", lambda: self._set_cache(self.key("kv", key), data) or True, False))

    def kv_renew(self, key: str) -> bool:
        """True when the store holds `key` (its time to live renewed): no need to write it again."""
        return bool(self.call("kv renew", lambda: self._renew_cache(self.key("kv", key)), False))

    def kv_discard(self, key: str) -> None:
        """Drop a bad value, if the store answers (it is checked again on every load)."""
        self.call("kv discard", lambda: self._delete(self.key("kv", key)))

    def kv_delete(self, key: str) -> None:
        """Drop `key` (SharedTierUnavailableError when the store does not answer)."""
        self.strict("delete", lambda: self._delete(self.key("kv", key)))

    # ---- records of uploads and skills (mmkv/store/durable_registry.py seals and checks them) ----------
    def record_put(self, kind: str, tenant: str, id_: str, sealed: bytes, digest: str | None,
                   blob: bytes | None) -> None:
        self.call("record write", lambda: self._record_write(kind, tenant, id_, sealed, digest, blob))

    def record_get(self, kind: str, tenant: str, id_: str) -> bytes | None:
        return self.call("record read", lambda: self._get(self.key("rec", kind, tenant, id_)))

    def record_drop(self, kind: str, tenant: str, id_: str) -> None:
        """Forget a record found bad (no tombstone: it was never validly deleted)."""
        def drop():
            self._delete(self.key("rec", kind, tenant, id_))
            self._index_remove(self.key("ids", kind, tenant), id_)
        self.call("record drop", drop)

    def blob_get(self, kind: str, tenant: str, id_: str, digest: str) -> bytes | None:
        return self.call("blob read", lambda: self._get(self._blob_key(kind, tenant, id_, digest)))

    def record_remove(self, kind: str, tenant: str, id_: str, blob_of: Callable[[bytes], str | None]) -> None:
        """Leave a tombstone (other servers drop their copies), drop the record and its blob when no
        other record uses it. `blob_of(sealed record)`: the digest it names, if any (ids are content
        hashes, so a record's digest never changes). SharedTierUnavailableError when the store
        does not answer."""
        def drop():
            raw = self._get(self.key("rec", kind, tenant, id_))
            self._record_delete(kind, tenant, id_, blob_of(raw) if raw else None)
        self.strict("delete", drop)

    def gone(self, kind: str, tenant: str, id_: str) -> bool:
        """True when the store holds a tombstone for this record (False while it does not answer)."""
        return bool(self.call("tombstone read", lambda: self._exists(self.key("gone", kind, tenant, id_)), False))

    def record_ids(self, kind: str, tenant: str) -> list[str]:
        return self.call("record list", lambda: self._index_members(self.key("ids", kind, tenant)), []) or []

    def eviction_warning(self) -> str | None:
        """Why this store may evict durable records, if it can tell (None: it cannot, or it will not)."""
        return None

    def tenant_secret(self, proposal: bytes) -> bytes | None:
        """The secret every server sharing this store derives tenants with: the first server's
        `proposal` (None while the store does not answer)."""
        def get_or_set() -> bytes | None:
            self._set_if_absent(SECRET_KEY, proposal)
            return self._get(SECRET_KEY)
        return self.call("tenant secret", get_or_set)
