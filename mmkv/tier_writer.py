"""`TierWriter`: writes freshly computed chunks to the lower tiers (disk, shared) off the request
path, so a request's first token never waits on encoding, fsync or the network.

One background thread drains a queue bounded in bytes (the chunks' KV held until written). When
a chunk does not fit, it is dropped and counted, never waited for: the lower tiers are a cache,
and a dropped write costs at most a recompute later. A write that raises is logged and counted; it
never reaches a request. `cancel(key)` takes a queued write back and waits out one in flight, so
a delete cannot be undone by a write landing after it. `flush()` waits until everything queued is
written; `close()` flushes and stops taking work (called at shutdown and at interpreter exit).

Thread-safe. The thread starts when work arrives and ends when the queue is empty, so an idle
writer holds no thread and nothing keeps its owner alive.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from mmkv.chunks import CachedChunk

log = logging.getLogger("mmkv.tier_writer")


class TierWriter:
    def __init__(self, write: Callable[[str, CachedChunk], None], bound_bytes: int):
        if bound_bytes < 0:
            raise ValueError("the write queue bound must be >= 0 bytes")
        self._write = write
        self.bound_bytes = bound_bytes
        self._cv = threading.Condition()
        self._pending: OrderedDict[str, CachedChunk] = OrderedDict()  # FIFO of writes to do
        self._pending_bytes = 0
        self._current: str | None = None  # the key being written now
        self._thread: threading.Thread | None = None
        self._closed = False
        self.written = 0
        self.dropped = 0  # queue full (or closed): not written, never waited for
        self.failed = 0  # the write raised
        self.peak_bytes = 0  # the most bytes ever queued at once: never above bound_bytes

    def submit(self, key: str, chunk: CachedChunk) -> bool:
        """Queue `chunk` for writing under durable `key`; False (counted) when it does not fit."""
        size = chunk.nbytes
        with self._cv:
            if key in self._pending or key == self._current:
                return True
            if self._closed or self._pending_bytes + size > self.bound_bytes:
                self.dropped += 1
                log.warning("tier write queue full (%d of %d bytes): %s... not written to the lower tiers",
                            self._pending_bytes, self.bound_bytes, key[:16])
                return False
            self._pending[key] = chunk
            self._pending_bytes += size
            self.peak_bytes = max(self.peak_bytes, self._pending_bytes)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mmkv-tier-writer", daemon=True)
                self._thread.start()
            return True

    def cancel(self, key: str) -> None:
        """Take back a queued write of `key`, and wait for one in flight to finish."""
        with self._cv:
            chunk = self._pending.pop(key, None)
            if chunk is not None:
                self._pending_bytes -= chunk.nbytes
            while self._current == key:
                self._cv.wait()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write is done; False if `timeout_s` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending and self._current is None, timeout_s)

    def close(self) -> None:
        """Flush, then refuse (drop and count) later writes."""
        self.flush()
        with self._cv:
            self._closed = True

    @property
    def pending_bytes(self) -> int:
        with self._cv:
            return self._pending_bytes

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._pending:
                    self._thread = None
                    self._cv.notify_all()
                    return
                key, chunk = self._pending.popitem(last=False)
                self._pending_bytes -= chunk.nbytes
                self._current = key
            try:
                self._write(key, chunk)
                ok = True
            except Exception:  # a lower tier failing must never reach a request
                log.exception("tier write of %s... failed", key[:16])
                ok = False
            with self._cv:
                self._current = None
                self.written += ok
                self.failed += not ok
                self._cv.notify_all()
