"""The shared tier on Redis (or Valkey): the default shared store (mmkv/store/shared_tier.py has the key
layout, degraded mode and counters). Every call has a short socket timeout; redis-py reconnects by
itself once Redis is back. The URL's credentials are never logged (`redacted_url`).
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis

from mmkv.store.shared_tier import SharedTier


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


class RedisTier(SharedTier):
    """Thread-safe (redis-py's connection pool is)."""

    name = "redis"
    failures = (redis.RedisError, OSError)

    def __init__(self, url: str, namespace: str, timeout_s: float = 0.5, retry_s: float = 1.0):
        super().__init__(redacted_url(check_url(url)), namespace, retry_s)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry_on_timeout=False)

    def _get(self, key: str) -> bytes | None:
        return self.client.get(key)

    def _set(self, key: str, value: bytes) -> None:
        self.client.set(key, value)

    def _set_if_absent(self, key: str, value: bytes) -> None:
        self.client.set(key, value, nx=True)

    def _delete(self, *keys: str) -> None:
        self.client.delete(*keys)

    def _exists(self, key: str) -> bool:
        return bool(self.client.exists(key))

    def _index_add(self, key: str, member: str) -> None:
        self.client.sadd(key, member)

    def _index_remove(self, key: str, member: str) -> int:
        pipe = self.client.pipeline()  # MULTI: the count is the one right after this removal
        pipe.srem(key, member)
        pipe.scard(key)
        return pipe.execute()[1]

    def _index_members(self, key: str) -> list[str]:
        return sorted(m.decode() for m in self.client.smembers(key))

    def _ping(self) -> None:
        self.client.ping()

    def close(self) -> None:
        self.client.close()
