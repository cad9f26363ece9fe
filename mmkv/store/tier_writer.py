"""`TierWriter`: writes chunks to the lower tiers off the request path (a freshly computed chunk to
disk and the shared tier, a shared hit to disk), so a request's first token never waits on
encoding, fsync or the network.

One background thread drains a queue of writes, bounded in bytes (the KV each holds until it is
written). When a write does not fit, it is dropped and counted, never waited for: the lower tiers are a cache,
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
from dataclasses import dataclass

log = logging.getLogger("mmkv.store.tier_writer")


@dataclass(frozen=True)
class Write:
    nbytes: int  # what it holds until done: counted against the bound
    run: Callable[[], None]  # the write itself; holds what it writes to, never the Tiers


class TierWriter:
    def __init__(self, bound_bytes: int):
        if bound_bytes < 0:
            raise ValueError("the write queue bound must be >= 0 bytes")
        self.bound_bytes = bound_bytes
        self._cv = threading.Condition()
        self._pending: OrderedDict[str, Write] = OrderedDict()  # FIFO of writes to do, by durable key
        self._pending_bytes = 0
        self._current: str | None = None  # the key being written now
        self._thread: threading.Thread | None = None
        self._closed = False
        self.written = 0
        self.dropped = 0  # queue full (or closed): not written, never waited for
        self.failed = 0  # the write raised
        self.peak_bytes = 0  # the most bytes ever queued at once: never above bound_bytes

    def submit(self, key: str, write: Write) -> bool:
        """Queue `write` of durable `key` (one at a time per key); False (counted) when it does not fit."""
        size = write.nbytes
        with self._cv:
            if key in self._pending or key == self._current:
                return True
            if self._closed or self._pending_bytes + size > self.bound_bytes:
                self.dropped += 1
                log.warning("tier write queue full (%d of %d bytes): %s... not written to the lower tiers",
                            self._pending_bytes, self.bound_bytes, key[:16])
                return False
            self._pending[key] = write
            self._pending_bytes += size
            self.peak_bytes = max(self.peak_bytes, self._pending_bytes)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mmkv-tier-writer", daemon=True)
                self._thread.start()
            return True

    def cancel(self, key: str) -> None:
        """Take back a queued write of `key`, and wait for one in flight to finish."""
        with self._cv:
            write = self._pending.pop(key, None)
            if write is not None:
                self._pending_bytes -= write.nbytes
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

    def _execute(self, key: str, write: Write) -> None:
        write.run()

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
                key, write = self._pending.popitem(last=False)
                self._pending_bytes -= write.nbytes
                self._current = key
            try:
                self._execute(key, write)
                ok = True
            except Exception:  # a lower tier failing must never reach a request
                log.exception("tier write of %s... failed", key[:16])
                ok = False
            with self._cv:
                self._current = None
                self.written += ok
                self.failed += not ok
                self._cv.notify_all()
