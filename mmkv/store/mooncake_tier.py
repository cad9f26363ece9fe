"""The shared tier on Mooncake Store (the KV store vLLM and SGLang share KV and image embeddings
through), behind the same interface as Redis (mmkv/store/shared_tier.py: key layout, degraded mode,
counters). Optional: `pip install 'mmkv[mooncake]'` (the `mooncake-transfer-engine-non-cuda`
wheel) plus the system's libibverbs (Debian / Ubuntu: `apt-get install libibverbs1`), which the
library loads even over TCP. Without either, start-up fails with that fix (`MooncakeUnavailable`).

Every server is a Mooncake client that lends `segment_bytes` of its RAM to the pool and moves
values through a `buffer_bytes` transfer buffer (the largest value it can put or get), over TCP.
Mooncake is a cache: it may evict any key under memory pressure, and a client's segment leaves
the pool with the client, so records live on each server's disk tier as well.

Differences from Redis, each a limit of the store: cached KV has no time to live (Mooncake
evicts by its own policy); a value over `buffer_bytes` is not shared (counted in `oversize`);
with no atomic multi-key operation to count a shared blob's references, every record keeps its
own copy of its blob (`...:blob:<sha256>:<kind>:<tenant>:<id>`), written before the record and
deleted after it, so a delete never takes bytes another record still names; a tenant's id listing is a read-modify-write of one value, so two
servers adding records to one tenant at the same instant can drop one id from the listing (the
record itself stays readable by id); a call in the seconds between the master's death and the
client's heartbeat noticing it can take the library's own RPC timeout (about 4 s) before the tier
goes degraded. A master that does not answer at start-up is not waited for (its `setup` would
block for 90 s): the server starts degraded and connects on a later call.
"""

from __future__ import annotations

import json
import socket
import threading
from urllib.parse import urlsplit

from mmkv.store.shared_tier import SharedTier, SharedTierError

PIP_FIX = "pip install 'mmkv[mooncake]' (the mooncake-transfer-engine-non-cuda wheel; on a CUDA host mooncake-transfer-engine)"
APT_FIX = ("apt-get install libibverbs1 (Debian / Ubuntu; dnf install libibverbs on Fedora / RHEL): "
           "the Mooncake library loads libibverbs even when it runs over TCP")
NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND


class MooncakeUnavailable(ValueError):
    """The Mooncake library cannot be loaded; the message names the package that fixes it."""


def unavailable_message(exc: ImportError) -> str:
    """What to install, given the ImportError that `import mooncake.store` raised."""
    text = str(exc)
    if "libibverbs" in text:
        return f"--mooncake-master: the Mooncake library cannot load ({text}); fix: {APT_FIX}"
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "mooncake":
        return f"--mooncake-master: the Mooncake library is not installed; fix: {PIP_FIX}"
    return f"--mooncake-master: the Mooncake library cannot load ({text}); reinstall it: {PIP_FIX}"


def load_store_class() -> type:
    """mooncake.store.MooncakeDistributedStore, or MooncakeUnavailable naming the fix."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise MooncakeUnavailable(unavailable_message(exc)) from None
    return MooncakeDistributedStore


def split_address(address: str, flag: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{flag} must be HOST:PORT, got {address!r}")
    return host, int(port)


def default_metadata_url(master: str) -> str:
    """The HTTP metadata server a master started with --enable_http_metadata_server=true serves (port 8080)."""
    return f"http://{split_address(master, '--mooncake-master')[0]}:8080/metadata"


class MooncakeTier(SharedTier):
    """Thread-safe: the Mooncake client is; connecting and the id listings take a lock."""

    name = "mooncake"

    def __init__(self, master: str, metadata_url: str | None, namespace: str, timeout_s: float = 0.5,
                 retry_s: float = 1.0, segment_bytes: int = 1 << 30, buffer_bytes: int = 256 << 20):
        self.master = split_address(master, "--mooncake-master")
        self.metadata_url = metadata_url or default_metadata_url(master)
        if urlsplit(self.metadata_url).scheme not in ("http", "etcd") and self.metadata_url != "P2PHANDSHAKE":
            raise ValueError(f"--mooncake-metadata must be http://HOST:PORT/metadata, etcd://... or P2PHANDSHAKE, "
                             f"got {self.metadata_url!r}")
        if segment_bytes <= 0 or buffer_bytes <= 0:
            raise ValueError("the Mooncake segment and buffer sizes must be positive")
        self._store_class = load_store_class()
        super().__init__(f"mooncake://{master}", namespace, retry_s)
        self.timeout_s, self.segment_bytes, self.buffer_bytes = timeout_s, segment_bytes, buffer_bytes
        self._store = None
        self._connect_lock = threading.Lock()
        self._index_lock = threading.Lock()
        self.oversize = 0  # values larger than the transfer buffer, not shared

    # ---- the client ------------------------------------------------------------------------------
    def _probe(self, host: str, port: int, what: str) -> None:
        try:
            socket.create_connection((host, port), self.timeout_s).close()
        except OSError as exc:
            raise SharedTierError(f"the Mooncake {what} at {host}:{port} does not answer") from exc

    def _client(self):
        """The connected client; connects first when needed (probing the master and the metadata
        server, because `setup` against a dead master blocks for 90 s)."""
        with self._connect_lock:
            if self._store is None:
                self._probe(*self.master, "master")
                meta = urlsplit(self.metadata_url)
                if meta.scheme == "http":
                    self._probe(meta.hostname or "", meta.port or 80, "metadata server")
                store = self._store_class()
                rc = store.setup(self._local_host(), self.metadata_url, self.segment_bytes, self.buffer_bytes, "tcp",
                                 "", f"{self.master[0]}:{self.master[1]}")
                if rc != 0:
                    raise SharedTierError(f"Mooncake setup returned {rc}")
                self._store = store
        store = self._store
        if store.health_check() != 0:  # 1: closed, 2: master unreachable (the heartbeat noticed)
            raise SharedTierError("the Mooncake master does not answer")
        return store

    def _local_host(self) -> str:
        """The address other clients reach this server's segment at: the one that routes to the master."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(self.master)  # UDP: no packet is sent
            return s.getsockname()[0]

    @staticmethod
    def _ok(rc: int, op: str) -> None:
        if rc != 0:
            raise SharedTierError(f"Mooncake {op} returned {rc}")

    # ---- the primitives (mmkv/store/shared_tier.py) ----------------------------------------------------
    def _get(self, key: str) -> bytes | None:
        return self._client().get(key) or None  # b"": no such key (values are never empty)

    def _set(self, key: str, value: bytes) -> None:
        self._ok(self._client().upsert(key, value), "upsert")

    def _set_cache(self, key: str, value: bytes) -> None:
        self._set(key, value)

    def _get_cache(self, key: str) -> bytes | None:
        return self._get(key)

    def _renew_cache(self, key: str) -> bool:
        return self._exists(key)

    def _blob_key(self, kind: str, tenant: str, id_: str, digest: str) -> str:
        return self.key("blob", digest, kind, tenant, id_)  # one copy per record: no shared count to race on

    def _record_write(self, kind: str, tenant: str, id_: str, sealed: bytes, digest: str | None,
                      blob: bytes | None) -> None:
        if digest is not None:
            self._set(self._blob_key(kind, tenant, id_, digest), blob)
        self._set(self.key("rec", kind, tenant, id_), sealed)
        self._index_add(self.key("ids", kind, tenant), id_)
        self._delete(self.key("gone", kind, tenant, id_))

    def _record_delete(self, kind: str, tenant: str, id_: str, digest: str | None) -> None:
        self._set(self.key("gone", kind, tenant, id_), b"1")
        self._delete(self.key("rec", kind, tenant, id_))
        self._index_remove(self.key("ids", kind, tenant), id_)
        if digest is not None:
            self._delete(self._blob_key(kind, tenant, id_, digest))

    def _set_if_absent(self, key: str, value: bytes) -> None:
        # put leaves an existing key as it is (its code for that differs between versions, so it is
        # not checked: the caller reads the key back)
        self._client().put(key, value)

    def _delete(self, *keys: str) -> None:
        store = self._client()
        for key in keys:
            rc = store.remove(key, True)  # force: a fresh read's lease must not keep a deleted key
            if rc != NOT_FOUND:
                self._ok(rc, "remove")

    def _exists(self, key: str) -> bool:
        rc = self._client().is_exist(key)
        if rc < 0:
            raise SharedTierError(f"Mooncake is_exist returned {rc}")
        return rc == 1

    def _index_members(self, key: str) -> list[str]:
        raw = self._get(key)
        return json.loads(raw) if raw else []

    def _index_add(self, key: str, member: str) -> None:
        with self._index_lock:
            members = self._index_members(key)
            if member not in members:
                self._set(key, json.dumps(sorted({*members, member})).encode())

    def _index_remove(self, key: str, member: str) -> int:
        with self._index_lock:
            members = [m for m in self._index_members(key) if m != member]
            if members:
                self._set(key, json.dumps(members).encode())
            else:
                self._delete(key)
            return len(members)

    def _ping(self) -> None:
        self._client()

    def kv_put(self, key: str, data: bytes) -> bool:
        if len(data) > self.buffer_bytes:
            with self._lock:
                self.oversize += 1
            return False
        return super().kv_put(key, data)

    def stats(self) -> dict:
        return {**super().stats(), "mooncake_oversize": self.oversize}

    def close(self) -> None:
        with self._connect_lock:
            if self._store is not None:
                self._store.close()
                self._store = None
