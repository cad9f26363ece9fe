"""The shared tier on Redis (or Valkey): chunk KV, file and skill records and their blobs, shared
by every server pointed at the same database.

Keys: `mmkv:<namespace>:kv:<durable key>` (the durable key is SHA-256 over content, model
fingerprint, grid settings, anchor and tenant salt; the namespace is the fingerprint's first 16
hex digits, so models stay apart even to a human browsing the store), `...:rec:<kind>:<tenant>`
(a hash: id -> record JSON with its checksum), `...:blob:<sha256>` (content-addressed bytes) and
`...:blobref:<sha256>` (the records that use it). Chunk values carry their checksum in their
header; blobs are checked against their digest.

Failure behaviour: every call has a short timeout; an error marks the tier degraded and skips it
for `retry_s`, after which the next call tries again (redis-py reconnects by itself), so a
request never waits on a dead Redis longer than one timeout and the server uses Redis again
without a restart once it is back. The URL's credentials are never logged (`redacted_url`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

log = logging.getLogger("mmkv.redis_tier")
SECRET_KEY = "mmkv:tenant-secret"  # shared by every model: a tenant is an API key, whatever the model


def redacted_url(url: str) -> str:
    """`url` without user name or password, for logs and errors."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def check_url(url: str) -> str:
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"--redis-url must be redis://, rediss:// or unix://, got {redacted_url(url)!r}")
    return url


class RedisTier:
    """Thread-safe (redis-py's connection pool is; the counters take a lock)."""

    def __init__(self, url: str, namespace: str, timeout_s: float = 0.5, retry_s: float = 1.0):
        self.url = redacted_url(check_url(url))
        self.prefix = f"mmkv:{namespace}:"
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry_on_timeout=False)
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.degraded = False
        self.errors = 0
        self.skipped = 0  # calls not tried while degraded
        self.calls = 0
        self.call_s = 0.0  # total latency of the calls that answered

    def call(self, op: str, fn: Callable[[redis.Redis], Any], default: Any = None) -> Any:
        """fn(client), or `default` when Redis fails or is being skipped after a failure."""
        if self.degraded and time.monotonic() < self._down_until:
            with self._lock:
                self.skipped += 1
            return default
        t0 = time.perf_counter()
        try:
            result = fn(self.client)
        except (redis.RedisError, OSError) as exc:
            with self._lock:
                self.errors += 1
                self.degraded, self._down_until = True, time.monotonic() + self.retry_s
            log.warning("redis %s failed (%s at %s); using the lower tiers for %.1fs", op, type(exc).__name__,
                        self.url, self.retry_s)
            return default
        with self._lock:
            if self.degraded:
                log.info("redis at %s answers again", self.url)
            self.degraded = False
            self.calls += 1
            self.call_s += time.perf_counter() - t0
        return result

    def check(self) -> bool:
        """True when Redis answers (a PING, at most once per retry_s while degraded)."""
        return bool(self.call("ping", lambda c: c.ping(), False))

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def tenant_secret(self, proposal: bytes) -> bytes | None:
        """The secret every server sharing this Redis derives tenants with: the first server's
        `proposal` (None while Redis does not answer)."""
        def get_or_set(c: redis.Redis) -> bytes:
            c.set(SECRET_KEY, proposal, nx=True)
            return c.get(SECRET_KEY)
        return self.call("tenant secret", get_or_set)
