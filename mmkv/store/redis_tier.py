"""The shared tier on Redis (or Valkey): the default shared store (mmkv/store/shared_tier.py has the key
layout, degraded mode and counters). Every call has a short socket timeout; redis-py reconnects by
itself once Redis is back. The URL's credentials are never logged (`redacted_url`).

A record's write and delete are each one Lua script, so they are atomic across servers: a blob
that several records name (uploads are content-addressed) is deleted by the delete that removes
its last reference, and a write that adds a reference at the same moment either comes before it
(the blob stays) or after it (the blob is written again).
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis

from mmkv.store.shared_tier import SharedTier

# KEYS: blob, blobref, rec, ids, gone. ARGV: has a blob ("1"/"0"), blob, member of blobref, sealed record, id.
_RECORD_WRITE = """
if ARGV[1] == '1' then
  if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SET', KEYS[1], ARGV[2]) end
  redis.call('SADD', KEYS[2], ARGV[3])
end
redis.call('SET', KEYS[3], ARGV[4])
redis.call('SADD', KEYS[4], ARGV[5])
redis.call('DEL', KEYS[5])
"""
# KEYS: gone, rec, ids, blobref, blob. ARGV: id, member of blobref, has a blob ("1"/"0").
_RECORD_DELETE = """
redis.call('SET', KEYS[1], '1')
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[1])
if ARGV[3] == '1' then
  redis.call('SREM', KEYS[4], ARGV[2])
  if redis.call('SCARD', KEYS[4]) == 0 then redis.call('DEL', KEYS[5], KEYS[4]) end
end
"""
SAFE_POLICIES = ("noeviction", "volatile-lru", "volatile-lfu", "volatile-ttl", "volatile-random")


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

    def __init__(self, url: str, namespace: str, timeout_s: float = 0.5, retry_s: float = 1.0,
                 kv_ttl_s: float = 7 * 86400):
        super().__init__(redacted_url(check_url(url)), namespace, retry_s)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry_on_timeout=False)
        self._write_record = self.client.register_script(_RECORD_WRITE)
        self._delete_record = self.client.register_script(_RECORD_DELETE)
        self._ttl_ms = max(1, int(kv_ttl_s * 1000))

    def _get(self, key: str) -> bytes | None:
        return self.client.get(key)

    def _set(self, key: str, value: bytes) -> None:
        self.client.set(key, value)

    def _set_if_absent(self, key: str, value: bytes) -> None:
        self.client.set(key, value, nx=True)

    def _set_cache(self, key: str, value: bytes) -> None:
        self.client.set(key, value, px=self._ttl_ms)

    def _get_cache(self, key: str) -> bytes | None:
        return self.client.getex(key, px=self._ttl_ms)

    def _renew_cache(self, key: str) -> bool:
        return bool(self.client.pexpire(key, self._ttl_ms))

    def _blob_key(self, kind: str, tenant: str, id_: str, digest: str) -> str:
        return self.key("blob", digest)  # content-addressed: one copy however many records name it

    def _record_write(self, kind: str, tenant: str, id_: str, sealed: bytes, digest: str | None,
                      blob: bytes | None) -> None:
        keys = [self.key("blob", digest or "-"), self.key("blobref", digest or "-"), self.key("rec", kind, tenant, id_),
                self.key("ids", kind, tenant), self.key("gone", kind, tenant, id_)]
        self._write_record(keys=keys, args=["1" if digest else "0", blob or b"", f"{kind}:{tenant}:{id_}", sealed, id_])

    def _record_delete(self, kind: str, tenant: str, id_: str, digest: str | None) -> None:
        keys = [self.key("gone", kind, tenant, id_), self.key("rec", kind, tenant, id_), self.key("ids", kind, tenant),
                self.key("blobref", digest or "-"), self.key("blob", digest or "-")]
        self._delete_record(keys=keys, args=[id_, f"{kind}:{tenant}:{id_}", "1" if digest else "0"])

    def eviction_warning(self) -> str | None:
        try:
            policy = self.client.config_get("maxmemory-policy").get("maxmemory-policy")
        except self.failures:  # CONFIG may be disabled (managed Redis): nothing to tell
            return None
        if policy is None or policy in SAFE_POLICIES:
            return None
        return (f"Redis at {self.url} has maxmemory-policy {policy}: under memory pressure it may evict uploads' "
                f"records and bytes, tombstones of deleted files and the tenant secret, not only cached KV; "
                f"set maxmemory-policy volatile-lru (only the KV has a time to live)")

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
