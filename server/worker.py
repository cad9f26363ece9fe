"""The engine's two threads and the bounded queue in front of them.

Generations go to the scheduler (mmkv.request.scheduler: continuous batching, prefills run a chunk at a
time between batched decode steps); every other engine call (add an image, add a skill, drop one) is
a `Job` run on the worker thread, one at a time, in arrival order. Both take the engine's lock
for model work, so they interleave rather than race. Async handlers submit and await the job's
future; a full queue (waiting jobs and waiting generations together) refuses at once (429)
instead of letting latency grow without bound. Cancelling a job takes it out of its queue, or,
if it runs, makes its `should_stop` return True so a generation ends at the next token.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mmkv.errors import MMKVError, fail_future, settleable

log = logging.getLogger("mmkv.server")

# fn(engine, should_stop) -> result; should_stop() turns True once the job is cancelled.
JobFn = Callable[[Any, Callable[[], bool]], Any]


class QueueFullError(MMKVError):
    """The engine queue is at its bound; the client should retry later."""

    http_status = 429
    error_type = "rate_limit_error"
    code = "queue_full"


class WorkerStoppedError(MMKVError):
    """The server is shutting down and takes no more engine work."""

    http_status = 503
    error_type = "server_error"
    code = "shutting_down"


class JobCancelledError(MMKVError):
    """The job was cancelled (its client went away) before it ran."""

    http_status = 499
    error_type = "invalid_request_error"
    code = "cancelled"


@dataclass(eq=False)
class Job:
    fn: JobFn
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None  # perf_counter seconds, set by the worker
    finished_at: float | None = None


class EngineWorker:
    """Runs jobs on one thread. `submit` and `cancel` are thread-safe; `stats` is the engine's
    `stats()` as of the last finished job (read without touching the engine)."""

    def __init__(self, engine, max_queue: int = 64, max_batch: int = 8, prefill_chunk: int = 512, shadow=None,
                 prefill_slice_ms: float = 0.0, ride_prefill: bool = True, preempt_prefill: bool = True):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        from mmkv.request.scheduler import Scheduler  # here: importing the server must not import torch

        self.scheduler = Scheduler(engine, max_batch, prefill_chunk, shadow, prefill_slice_ms=prefill_slice_ms,
                                   ride=ride_prefill, preempt=preempt_prefill)
        self.stats: dict[str, Any] = {}
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="mmkv-engine", daemon=True)

    def start(self) -> None:
        self.stats = dict(self.engine.stats())
        self._thread.start()
        self.scheduler.start()
        grammars = getattr(self.engine, "grammars", None)
        if grammars is not None:  # the structured-output vocabulary (1-2 s for 150k tokens), off the loop
            threading.Thread(target=_warm_grammars, args=(grammars,), name="mmkv-grammar-warmup", daemon=True).start()

    def drain(self) -> None:
        """Refuse new jobs and fail the queued ones (503 `shutting_down`); the running one goes on."""
        with self._cond:
            self._stopping = True
            dropped = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        self.scheduler.drain()
        for job in dropped:
            fail_future(job.future, WorkerStoppedError("the server is shutting down"))

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, fail queued ones, cancel the running one and join the thread."""
        self.drain()
        with self._cond:
            if self._running is not None:
                self._running.cancelled.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.scheduler.stop(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.scheduler.alive

    @property
    def queue_depth(self) -> int:
        """Jobs and generations waiting, not counting the running ones."""
        return len(self._pending) + self.scheduler.waiting

    @property
    def busy(self) -> bool:
        return self._running is not None or self.scheduler.running > 0

    def submit_generation(self, messages, kwargs: dict) -> Job:
        """Queue one generation (`Engine.start`'s keyword arguments) on the scheduler; the job's
        future gets its GenerationResult. QueueFullError when `max_queue` already wait."""
        job = Job(fn=None)
        with self._cond:
            self._check_room()

        def started() -> None:
            job.started_at = time.perf_counter()

        def finished(_) -> None:
            job.finished_at = time.perf_counter()
            self._refresh_stats()

        job.future.add_done_callback(finished)
        self.scheduler.submit(messages, future=job.future, on_start=started, should_stop=job.cancelled.is_set,
                              **kwargs)
        return job

    def submit(self, fn: JobFn) -> Job:
        """Queue `fn`; raises QueueFullError when `max_queue` jobs already wait."""
        job = Job(fn)
        with self._cond:
            self._check_room()
            self._pending.append(job)
            self._cond.notify()
        return job

    def _check_room(self) -> None:
        """Under `_cond`: refuse when stopping (503) or when `max_queue` jobs and generations
        together already wait (429)."""
        if self._stopping:
            raise WorkerStoppedError("the server is shutting down")
        if self.queue_depth >= self.max_queue:
            raise QueueFullError(f"the engine queue is full ({self.max_queue} requests waiting); retry shortly")

    def cancel(self, job: Job) -> None:
        """Stop `job`: dequeue it if it waits, signal it if it runs; no-op once it finished."""
        job.cancelled.set()
        if job.fn is None:  # a generation: the scheduler's
            self.scheduler.cancel(job.future)
            return
        with self._cond:
            try:
                self._pending.remove(job)
            except ValueError:
                return
        fail_future(job.future, JobCancelledError("the request was cancelled"))

    def _next(self) -> Job | None:
        with self._cond:
            while not self._pending and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            self._running = self._pending.popleft()
            return self._running

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            if not job.future.set_running_or_notify_cancel():  # its future was cancelled while queued
                with self._cond:
                    self._running = None
                continue
            job.started_at = time.perf_counter()
            try:
                result, error = job.fn(self.engine, job.cancelled.is_set), None
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to its request
                result, error = None, settleable(exc)
            job.finished_at = time.perf_counter()
            # Stats first, then release: whoever the result wakes sees counters that include it.
            self._refresh_stats()
            with self._cond:
                self._running = None
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)

    def live_stats(self) -> dict:
        """The engine's stats as of its last job, with the store tiers' read now: their counters have
        locks of their own, and the background tier writer finishes between jobs."""
        out = dict(self.stats)
        out.update(self.scheduler.batch_stats)
        tiers = getattr(self.engine, "tiers", None)
        if tiers is not None:
            try:
                out.update(tiers.stats())
            except Exception:  # noqa: BLE001 - metrics must never fail a scrape
                log.exception("tiers.stats() failed")
        return out

    def _refresh_stats(self) -> None:
        try:
            self.stats = dict(self.engine.stats())
        except Exception:  # noqa: BLE001 - metrics must never take the worker down
            log.exception("engine.stats() failed")


def _warm_grammars(grammars) -> None:
    """Build the grammar vocabulary before the first structured request needs it, so that request
    does not stall the scheduler's loop while it is built."""
    try:
        grammars.vocab
    except Exception:  # noqa: BLE001 - a failure here shows again, as a request's error, when one needs it
        log.exception("building the structured-output vocabulary failed")
