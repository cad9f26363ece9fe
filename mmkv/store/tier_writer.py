"""`TierWriter`: writes chunks to the lower tiers off the request path (a freshly computed chunk to
disk and the shared tier, a shared hit to disk), so a request's first token never waits on
encoding, fsync or the network.

One background thread drains a queue of writes, bounded in bytes: every write is counted at the
most it holds (a chunk write: the KV and its encoded copy) from the moment it is queued until it is
done, the write in flight included, so the bytes held never exceed the bound. When a write does
not fit, it is dropped and counted, never waited for: the lower tiers are a cache, and a dropped
write costs at most a recompute later. A write that raises is logged and counted; it
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
    nbytes: int  # the most it holds until done (queued or in flight): counted against the bound
    run: Callable[[], None]  # the write itself; holds what it writes to, never the Tiers


class TierWriter:
    def __init__(self, bound_bytes: int):
        if bound_bytes < 0:
            raise ValueError("the write queue bound must be >= 0 bytes")
        self.bound_bytes = bound_bytes
        self._cv = threading.Condition()
        self._pending: OrderedDict[str, Write] = OrderedDict()  # FIFO of writes to do, by durable key
        self._held_bytes = 0  # the writes queued and the one in flight
        self._current: str | None = None  # the key being written now
        self._thread: threading.Thread | None = None
        self._closed = False
        self.written = 0
        self.dropped = 0  # queue full (or closed): not written, never waited for
        self.failed = 0  # the write raised
        self.peak_bytes = 0  # the most bytes ever held at once (queued and in flight): never above bound_bytes

    def submit(self, key: str, nbytes: int, prepare: Callable[[], Callable[[], None]]) -> bool:
        """Queue a write of durable `key` (one at a time per key) that holds at most `nbytes`;
        False (counted) when it does not fit. Only once it fits is `prepare()` called, under the
        writer's lock (keep it short), for the write itself: what it takes (a host copy of device
        KV) is then counted from the start."""
        with self._cv:
            if key in self._pending or key == self._current:
                return True
            if self._closed or self._held_bytes + nbytes > self.bound_bytes:
                self.dropped += 1
                log.warning("tier write queue full (%d of %d bytes): %s... not written to the lower tiers",
                            self._held_bytes, self.bound_bytes, key[:16])
                return False
            self._pending[key] = Write(nbytes, prepare())
            self._held_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self._held_bytes)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mmkv-tier-writer", daemon=True)
                self._thread.start()
            return True

    def cancel(self, key: str) -> None:
        """Take back a queued write of `key`, and wait for one in flight to finish."""
        with self._cv:
            write = self._pending.pop(key, None)
            if write is not None:
                self._held_bytes -= write.nbytes
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
    def held_bytes(self) -> int:
        """Bytes the writes queued and the one in flight hold (at most bound_bytes)."""
        with self._cv:
            return self._held_bytes

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._pending:
                    self._thread = None
                    self._cv.notify_all()
                    return
                key, write = self._pending.popitem(last=False)
                self._current = key
            try:
                self._execute(key, write)
                ok = True
            except Exception:  # a lower tier failing must never reach a request
                log.exception("tier write of %s... failed", key[:16])
                ok = False
            with self._cv:
                self._current = None
                self._held_bytes -= write.nbytes
                self.written += ok
                self.failed += not ok
                self._cv.notify_all()
