"""The disk tier for chunk KV: one safetensors file per chunk (mmkv/store/chunk_codec.py), kept within a
byte budget by LRU, and `atomic_write`, the one way anything reaches a store directory.

Crash safety: a file is written to a temporary name in its directory, fsync'd, renamed over its
final name and the directory fsync'd, so a kill -9 at any moment leaves either the old state or
the whole new file; temporaries left by a crash are removed when the tier opens. Content is still
checked on every load (a disk can lie): see chunk_codec.decode_chunk.

Thread-safe (one lock). One server per store directory (`lock_store_dir`): servers share through
the shared tier.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("mmkv.store.disk_tier")
TMP_SUFFIX = ".tmp"
KV_SUFFIX = ".safetensors"
LOCK_FILE = "LOCK"


class StoreInUseError(ValueError):
    """Another process holds the store directory."""


def lock_store_dir(root: Path) -> int:
    """Hold `root` for this process: an exclusive advisory lock (flock) on root/LOCK, which names
    the holder's pid. Returns the lock's file descriptor (closing it releases the lock; the kernel
    releases it when the process ends, kill -9 included). StoreInUseError when another process, or
    another open store in this one, holds it: two servers on one directory would undo each
    other's LRU index and evictions."""
    path = Path(root) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        who = ("another open engine in this process (close it first: Engine.close())" if holder == str(os.getpid())
               else f"another mmkv process (pid {holder})")
        raise StoreInUseError(f"the store directory {root} is in use by {who}; give each server its own "
                              f"--store-dir (servers share through --redis-url or --mooncake-master)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Write `data` to `path` so that no reader, and no restart after a crash, sees half of it.
    The file is created with `mode` (less the umask) from its first byte: a secret written with
    0o600 is never readable by others, not even for a moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{TMP_SUFFIX}")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def remove_temporaries(root: Path) -> int:
    """Delete what interrupted writes left under `root`; returns how many."""
    count = 0
    for p in root.rglob(f"*{TMP_SUFFIX}"):
        p.unlink(missing_ok=True)
        count += 1
    return count


class DiskTier:
    """Chunk KV bytes by durable key under `root`/kv, at most `budget_bytes` in all (LRU: a load
    or a write makes a file the most recent; the order survives a restart through mtimes)."""

    def __init__(self, root: Path, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError("store budget must be >= 0 bytes")
        self.dir = Path(root) / "kv"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self.evictions = 0
        remove_temporaries(self.dir)
        files = sorted(self.dir.glob(f"*/*{KV_SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)
        self._index: OrderedDict[str, int] = OrderedDict((p.name[:-len(KV_SUFFIX)], p.stat().st_size) for p in files)
        self.nbytes = sum(self._index.values())
        with self._lock:
            self._fit(0)

    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}{KV_SUFFIX}"

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            if key not in self._index:
                return None
            path = self._path(key)
            try:
                data = path.read_bytes()
                os.utime(path)
            except OSError as exc:
                log.warning("disk tier: cannot read %s: %s", path.name, exc.strerror)
                self._forget(key)
                return None
            self._index.move_to_end(key)
            return data

    def put(self, key: str, data: bytes) -> bool:
        """Store `data` under `key`, evicting least recently used files to fit. False when it cannot fit."""
        with self._lock:
            if len(data) > self.budget_bytes:
                return False
            self._drop(key)
            self._fit(len(data))
            try:
                atomic_write(self._path(key), data)
            except OSError as exc:
                log.warning("disk tier: cannot write %s: %s", key, exc.strerror)
                return False
            self._index[key] = len(data)
            self.nbytes += len(data)
            return True

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._drop(key)

    def _fit(self, incoming: int) -> None:
        while self._index and self.nbytes + incoming > self.budget_bytes:
            self._drop(next(iter(self._index)))
            self.evictions += 1

    def _drop(self, key: str) -> bool:
        if key not in self._index:
            return False
        self._path(key).unlink(missing_ok=True)
        self._forget(key)
        return True

    def _forget(self, key: str) -> None:
        self.nbytes -= self._index.pop(key)

    def check_integrity(self) -> None:
        """AssertionError unless the index matches the files on disk and the budget holds."""
        with self._lock:
            on_disk = {p.name[:-len(KV_SUFFIX)]: p.stat().st_size for p in self.dir.glob(f"*/*{KV_SUFFIX}")}
            assert on_disk == dict(self._index), "disk index out of step with the files"
            assert self.nbytes == sum(on_disk.values()) <= self.budget_bytes, "disk bytes over budget or miscounted"
            assert not list(self.dir.rglob(f"*{TMP_SUFFIX}")), "a temporary file is visible"
