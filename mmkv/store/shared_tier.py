"""The shared tier's logic, whatever store holds it (Redis: mmkv/store/redis_tier.py, Mooncake Store:
mmkv/store/mooncake_tier.py): key names, degraded mode, counters, and the records of uploads and skills
written as plain keys, so a backend only supplies a few primitives.

Keys: `mmkv:<namespace>:kv:<durable key>` (chunk KV; the durable key is SHA-256 over content,
model fingerprint, grid settings, anchor and tenant salt; the namespace is the fingerprint's
first 16 hex digits, so models stay apart even to a human browsing the store),
`...:rec:<kind>:<tenant>:<id>` (a record's JSON with its checksum), `...:ids:<kind>:<tenant>` (the
ids of a tenant's records), `...:blob:<sha256>` (content-addressed bytes), `...:blobref:<sha256>`
(the records that use it) and `...:gone:<kind>:<tenant>:<id>` (a delete's tombstone). Chunk values
carry their checksum in their header, records their own, blobs are checked against their digest.

Failure behaviour: every call has a short timeout (the backend's); an error marks the tier
degraded and skips it for `retry_s`, after which the next call tries again, so a request never
waits on a dead store longer than one timeout and the server uses the store again without a
restart once it is back. Thread-safe when the backend's client is (both are); counters take a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

log = logging.getLogger("mmkv.store.shared_tier")
SECRET_KEY = "mmkv:tenant-secret"  # shared by every model: a tenant is an API key, whatever the model


class SharedTierError(Exception):
    """A shared-store call that failed (backends raise it, or their own `failures`)."""


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
        t0 = time.perf_counter()
        try:
            result = fn()
        except self.failures as exc:
            with self._lock:
                self.errors += 1
                self.degraded, self._down_until = True, time.monotonic() + self.retry_s
            log.warning("%s %s failed (%s at %s); using the lower tiers for %.1fs", self.name, op,
                        type(exc).__name__, self.url, self.retry_s)
            return default
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

    # ---- chunk KV --------------------------------------------------------------------------------
    def kv_get(self, key: str) -> bytes | None:
        return self.call("kv read", lambda: self._get(self.key("kv", key)))

    def kv_put(self, key: str, data: bytes) -> bool:
        return bool(self.call("kv write", lambda: self._set(self.key("kv", key), data) or True, False))

    def kv_delete(self, key: str) -> None:
        self.call("kv delete", lambda: self._delete(self.key("kv", key)))

    # ---- records of uploads and skills (mmkv/store/durable_registry.py seals and checks them) ----------
    def record_put(self, kind: str, tenant: str, id_: str, sealed: bytes, digest: str | None,
                   blob: bytes | None) -> None:
        """The blob first, then the record naming it, then its listing: a failure half-way leaves
        at worst an unnamed blob."""
        def write():
            if digest is not None:
                self._set(self.key("blob", digest), blob)
                self._index_add(self.key("blobref", digest), f"{kind}:{tenant}:{id_}")
            self._set(self.key("rec", kind, tenant, id_), sealed)
            self._index_add(self.key("ids", kind, tenant), id_)
            self._delete(self.key("gone", kind, tenant, id_))
        self.call("record write", write)

    def record_get(self, kind: str, tenant: str, id_: str) -> bytes | None:
        return self.call("record read", lambda: self._get(self.key("rec", kind, tenant, id_)))

    def record_drop(self, kind: str, tenant: str, id_: str) -> None:
        """Forget a record found bad (no tombstone: it was never validly deleted)."""
        def drop():
            self._delete(self.key("rec", kind, tenant, id_))
            self._index_remove(self.key("ids", kind, tenant), id_)
        self.call("record drop", drop)

    def blob_get(self, digest: str) -> bytes | None:
        return self.call("blob read", lambda: self._get(self.key("blob", digest)))

    def record_remove(self, kind: str, tenant: str, id_: str, blob_of: Callable[[bytes], str | None]) -> None:
        """Drop the record, leave a tombstone (other servers drop their copies), and drop its blob
        when no other record uses it. `blob_of(sealed record)`: the digest it names, if any."""
        def drop():
            raw = self._get(self.key("rec", kind, tenant, id_))
            self._delete(self.key("rec", kind, tenant, id_))
            self._set(self.key("gone", kind, tenant, id_), b"1")
            self._index_remove(self.key("ids", kind, tenant), id_)
            digest = blob_of(raw) if raw else None
            if digest and not self._index_remove(self.key("blobref", digest), f"{kind}:{tenant}:{id_}"):
                self._delete(self.key("blob", digest), self.key("blobref", digest))
        self.call("record delete", drop)

    def gone(self, kind: str, tenant: str, id_: str) -> bool:
        """True when the store holds a tombstone for this record (False while it does not answer)."""
        return bool(self.call("tombstone read", lambda: self._exists(self.key("gone", kind, tenant, id_)), False))

    def record_ids(self, kind: str, tenant: str) -> list[str]:
        return self.call("record list", lambda: self._index_members(self.key("ids", kind, tenant)), []) or []

    def tenant_secret(self, proposal: bytes) -> bytes | None:
        """The secret every server sharing this store derives tenants with: the first server's
        `proposal` (None while the store does not answer)."""
        def get_or_set() -> bytes | None:
            self._set_if_absent(SECRET_KEY, proposal)
            return self._get(SECRET_KEY)
        return self.call("tenant secret", get_or_set)
