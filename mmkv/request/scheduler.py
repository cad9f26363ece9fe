"""Continuous batching: one loop owns the prefill and the decoding of every admitted request.

A request is waiting, then prefilling, then running (decoding in the batch). Each turn of the
loop (nano-vllm's schedule -> run -> postprocess):
1. admit: while the batch has room, the first waiting request is planned and its cached KV
   placed (`Engine.start`), one a turn; it joins the prefilling requests;
2. prefill: a budget of `prefill_chunk` prompt tokens (chunked prefill, as vLLM's and SGLang's;
   0 = every forward whole) is shared among the prefilling requests, the one with the fewest
   tokens left first (one passed over for `AGING_TURNS` turns goes first, so none starves). A
   request whose last chunk ran samples its first token and joins the batch. So a long prompt
   delays the running requests' next token by one chunk's forward, not by its whole prefill, and
   a short request that arrives behind it waits about one chunk, not the long one's prefill.
   Better: a request that arrives while a prefill forward runs preempts it before its next
   layer (`_preemptible`; the piece runs again later, no trace of it kept), so it is admitted
   next turn and, being short, prefilled first: it waits about one layer. With
   `prefill_slice_ms` a share runs as forwards of about that long instead, an arrival ending
   the turn's prefill between two of them;
3. step: one batched forward runs the last token of every running request (`DecodeBatch`); the
   prefilling requests with at most MAX_RIDE_TOKENS left (text pieces: no image pads, no
   fidelity reference) ride in it instead of running their own forwards (mmkv.kv.packed), so
   the weights are read once for all;
4. postprocess: each request's `DecodeStream` takes its row of logits; finished requests leave
   the batch and their futures get their `GenerationResult`.
The budget per turn is one chunk's tokens plus one decode step; each piece but a rider's is its
own forward. Only the turn's final forward is chunked: a cache
miss's precompile (vision tower, the chunk's isolated prefill) and an edit policy's small extra
forwards run whole in `Engine.start`. Requests keep their own sampling settings, stop strings,
callbacks and cancellation (a request cancelled mid-prefill ends before its next chunk, its KV
dropped and nothing stored from it); a failure in one request fails only its future.

Thread-safety: `submit`, `stop` and `stats` from any thread; the loop thread is the only one that
touches the batch. Model calls take the engine's lock, so other engine work (an upload's
precompile) interleaves with decode steps instead of racing them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mmkv.errors import MMKVError, fail_future
from mmkv.request.batch import DecodeBatch

log = logging.getLogger("mmkv.request.scheduler")


class SchedulerStoppedError(MMKVError):
    """The scheduler is shutting down and takes no more requests."""

    http_status = 503
    error_type = "server_error"
    code = "shutting_down"


@dataclass(eq=False)
class _Request:
    messages: object
    kwargs: dict
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    on_start: Callable[[], None] | None = None  # called as its prefill begins
    run: object = None  # mmkv.engine.Run once admitted
    token: int | None = None  # the next token to run
    passed_over: int = 0  # prefill turns in which it got no tokens (aging: see Scheduler._prefill)
    rate: float | None = None  # prompt tokens per second of its last prefill forward (slice sizing)
    preempted: int = 0  # its forwards cut short in a row by an arrival (see Scheduler._preemptible)


DEFAULT_PREFILL_CHUNK = 512  # prompt tokens prefilled per loop turn, between two decode steps
AGING_TURNS = 4  # a prefilling request passed over this many turns goes first
DEFAULT_PREFILL_SLICE_MS = 0.0  # 0: a request's share of a turn is one forward (preemption bounds the wait)
FIRST_SLICE = 64  # a request's first sliced forward, before its rate is known
MIN_SLICE = 16  # no forward is sized below this many tokens (the per-forward overhead)
MAX_RIDE_TOKENS = 64  # a prefill rides in a decode step only when this few tokens are left: a step cannot be cut short
MAX_PREEMPTIONS = 2  # a forward cut short this many times in a row runs to its end the next time


class _Preempted(BaseException):
    """A request arrived while a prefill forward ran: the forward stops before its next layer and
    its piece runs again later (mmkv.request.splice.ChunkedForward.advance leaves no trace of it).
    A BaseException, so a background build's own `except Exception` (a failed build is dropped)
    lets it through: a preempted build is not a failed one."""


class Scheduler:
    """Owns the prefill and decode loop of every admitted request (module docstring). `submit`
    returns a future of the request's GenerationResult; its keyword arguments are `Engine.start`'s.
    `prefill_chunk`: prompt tokens prefilled per turn between decode steps (0: whole prefills);
    `prefill_slice_ms`: a turn's share runs as forwards of about this long, and a request that
    arrives between two of them ends the turn's prefill (0: each share is one forward);
    `ride`: a prefill with at most MAX_RIDE_TOKENS left runs in the decode step's forward;
    `preempt`: a request that arrives while a prefill forward runs stops it at its next layer
    (the piece runs again later), so it waits about one layer, not one chunk."""

    def __init__(self, engine, max_batch: int = 8, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, shadow=None,
                 share_kv: bool = True, prefill_slice_ms: float = DEFAULT_PREFILL_SLICE_MS, ride: bool = True,
                 preempt: bool = True):
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if prefill_chunk < 0:
            raise ValueError("prefill_chunk must be >= 0 (0: prefills are not chunked)")
        if not prefill_slice_ms >= 0:
            raise ValueError("prefill_slice_ms must be >= 0 (0: a turn's share is one forward)")
        self.engine, self.max_batch, self.prefill_chunk = engine, max_batch, prefill_chunk
        self.prefill_slice_ms = prefill_slice_ms
        self.ride = ride  # a prefill's last few tokens run in the decode step's forward (mmkv.kv.packed)
        self.preempt = preempt  # an arrival cuts a prefill forward short at its next layer
        self.preemptions = 0  # prefill forwards cut short
        self._submitted = 0  # requests ever queued: a preemption waits for a new one
        self._riders: list[tuple[_Request, object]] = []  # (request, RidePiece) riding in this turn's step
        self.ridden = 0  # prefills whose last piece rode in a decode step
        self._background_rate: float | None = None  # LM tokens per second of the last idle-turn build slice
        self.shadow = shadow  # mmkv.request.shadow.ShadowMonitor or None: fidelity shadows in idle turns
        self.share_kv = share_kv  # rows keep the KV they hold bit-identical once (DecodeBatch)
        self.batch: DecodeBatch | None = None  # made on first use: building a scheduler touches no model
        self._waiting: deque[_Request] = deque()
        self._prefilling: list[_Request] = []  # admitted, their forwards not finished
        self._running: list[_Request] = []
        self._cond = threading.Condition()
        self._stopping = self._draining = False
        self._thread = threading.Thread(target=self._loop, name="mmkv-scheduler", daemon=True)
        self.decode_steps = 0
        self.decoded_tokens = 0  # rows summed over steps: decoded_tokens / decode_steps = mean batch
        self.batch_stats = {"decode_batch_rows": 0, "decode_batch_kv_bytes": 0, "decode_batch_shared_tokens": 0}

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new requests, cancel the admitted ones (they finish "cancelled") and join."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, messages, *, future: concurrent.futures.Future | None = None,
               on_start: Callable[[], None] | None = None, **kwargs) -> concurrent.futures.Future:
        """Queue a request; `future` (made here if None) gets its GenerationResult or its error.
        `on_start()` runs on the loop thread as its prefill begins."""
        req = _Request(messages, kwargs, future or concurrent.futures.Future(), on_start)
        with self._cond:
            if self._stopping or self._draining:
                raise SchedulerStoppedError("the server is shutting down")
            self._waiting.append(req)
            self._submitted += 1
            self._cond.notify()
        return req.future

    def cancel(self, future: concurrent.futures.Future) -> bool:
        """Take a waiting request out of the queue (its future is cancelled); False if it is not
        waiting (prefilling and running requests stop through their `should_stop`)."""
        with self._cond:
            for req in self._waiting:
                if req.future is future:
                    self._waiting.remove(req)
                    break
            else:
                return False
        future.cancel()
        return True

    def drain(self) -> None:
        """Shutdown begins: refuse new requests and fail the waiting ones (503); running ones go on."""
        with self._cond:
            self._draining = True
        self._fail_waiting("the server is shutting down")

    def _fail_waiting(self, why: str) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for req in waiting:
            fail_future(req.future, SchedulerStoppedError(why))

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Admitted requests: the prefilling one and those decoding."""
        return len(self._running) + len(self._prefilling)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._prefilling or self._running or self._stopping
                           or (self.shadow is not None and self.shadow.pending) or self._builds_pending()):
                    self._cond.wait()
                if self._stopping:
                    break
                admit = None
                if self._waiting and len(self._prefilling) + len(self._running) < self.max_batch:
                    admit = self._waiting.popleft()  # one a turn: an admission's precompile runs whole
            try:
                if admit is not None:
                    self._admit(admit)
                if self._prefilling:
                    self._prefill()
                self._riders = self._riders if self._running else []  # no step: they prefill next turn
                if self._running:
                    self._step()
                elif not (self._prefilling or self._waiting) and self.shadow is not None and self.shadow.pending:
                    self.shadow.step(self.engine._lock)  # idle: one chunk of a fidelity shadow
                elif not (self._prefilling or self._waiting) and self._builds_pending():
                    self._build_in_background()  # idle, lowest: a slice of a first-sight build
            except BaseException as exc:  # noqa: BLE001 - a fault outside any one request's stages
                log.exception("scheduler turn failed; failing the requests in flight")
                self._fail_in_flight(exc)
        self._shut_down()

    def _build_in_background(self) -> None:
        """The first-sight builds, `prefill_chunk` tokens (or, with `prefill_slice_ms`, one slice
        sized like a prefill slice from the rate of the last one). A request that arrives meanwhile
        preempts the build's forward at its next layer, as it would a prefill's (lowest priority:
        the build resumes in a later idle turn, its cut-short piece dropped)."""
        budget = self.prefill_chunk or None
        if budget is not None:
            budget = self._slice(self._background_rate, budget)
        try:
            with self._preemptible(0):  # never starved: it runs only when nothing else would
                done = self.engine.run_background(budget)
        except _Preempted:
            self.preemptions += 1
            return
        if done.tokens > 0 and done.seconds > 0:
            self._background_rate = done.tokens / done.seconds

    def _builds_pending(self) -> bool:
        """First-sight chunk builds wait (mmkv.request.first_sight): idle turns run them, after the
        shadows. An engine without them (one that never computes an image on first sight) has none;
        this runs in the loop's wait, outside any request's stages, so it must not raise."""
        first_sight = getattr(self.engine, "first_sight", None)
        return first_sight is not None and first_sight.builds.pending > 0

    def _fail_in_flight(self, exc: BaseException) -> None:
        """Fail the prefilling and running requests and start the batch afresh: the loop goes on
        serving the waiting ones, and no request is left without an answer."""
        for req in self._prefilling + self._running:
            fail_future(req.future, exc)
        self._prefilling, self._running, self.batch, self._riders = [], [], None, []
        self._note_batch()

    def _admit(self, req: _Request) -> None:
        """Plan the request and place its cached KV; it joins the prefilling requests."""
        if not req.future.set_running_or_notify_cancel():
            return
        try:
            if req.on_start is not None:
                req.on_start()
            req.run = self.engine.start(req.messages, **req.kwargs)
        except BaseException as exc:  # noqa: BLE001 - the request's own failure goes back to it
            fail_future(req.future, exc)
            return
        self._prefilling.append(req)

    def _prefill(self) -> None:
        """One turn's prefill: up to `prefill_chunk` prompt tokens (all with 0) shared among the
        prefilling requests, the one with the fewest tokens left first, so a short request behind
        a long prompt waits one chunk, not the whole prefill. A request passed over for
        `AGING_TURNS` turns goes first, so a stream of short requests cannot starve a long one.
        Each request's piece runs as its own forward (or slices of about `prefill_slice_ms`); a
        request that arrives meanwhile preempts it or ends the turn's prefill after the slice in
        flight (`_forward`). One with at most MAX_RIDE_TOKENS left rides in the decode step instead
        (`_take_rider`), and once one rides, or while a request waits to be admitted, the others
        wait for the next turn (aging still puts a passed-over one first), so no long forward
        delays a rider's first token or a waiting request's admission. One whose forward finishes
        samples its first token and joins the batch."""
        budget = self.prefill_chunk or None
        order = sorted(self._prefilling, key=lambda r: (r.passed_over < AGING_TURNS, r.run.pending_tokens))
        for req in order:
            if budget == 0:
                req.passed_over += 1
                continue
            before = req.run.pending_tokens
            if self._take_rider(req, budget):
                ran = before  # runs in this turn's decode step
            elif self._riders or self._arrived():  # its forward would hold the riders' first tokens, or
                req.passed_over += 1                # a waiting request's admission: the step runs next
                continue
            else:
                self._prefill_one(req, budget)
                ran = before - req.run.pending_tokens
            req.passed_over = 0
            if budget is not None:
                budget = 0 if self._arrived() else max(0, budget - ran)

    def _take_rider(self, req: _Request, budget: int | None) -> bool:
        """Make `req` one of this turn's riders when the rest of its forward fits one slice, a decode step
        runs this turn, and its tokens can ride (text, no fidelity reference): its forward then
        runs inside the step's (mmkv.kv.packed), and the weights are read once for both."""
        run = req.run
        if (not self.ride or not self._running or budget is None
                or not self.engine.adapter.can_pack()
                or (run.stream.should_stop is not None and run.stream.should_stop())):
            return False
        if run.pending_tokens > min(MAX_RIDE_TOKENS, self._slice(req.rate, budget)):
            return False
        try:
            piece = run.ride(run.pending_tokens)
        except BaseException as exc:  # noqa: BLE001 - the request's own failure goes back to it
            self._prefilling.remove(req)
            fail_future(req.future, exc)
            return True
        if piece is None:
            return False
        self._riders.append((req, piece))
        return True

    def _arrived(self) -> bool:
        """A request waits that the batch has room for: the turn's prefill ends at the next slice."""
        return bool(self._waiting) and len(self._prefilling) + len(self._running) < self.max_batch

    def _slice(self, rate: float | None, budget: int) -> int:
        """The tokens of the next forward: about `prefill_slice_ms` at `rate`, the tokens per
        second of the same work's last forward (FIRST_SLICE when there was none), a multiple of
        MIN_SLICE, within `budget`."""
        if not self.prefill_slice_ms:
            return budget
        if rate is None:
            return min(budget, FIRST_SLICE)
        tokens = int(rate * self.prefill_slice_ms / 1e3) // MIN_SLICE * MIN_SLICE
        return min(budget, max(MIN_SLICE, tokens))

    def _forward(self, req: _Request, budget: int | None) -> bool:
        """Run up to `budget` tokens of `req`'s forward (None: all) as slices; stop early when a
        request arrives. True once its forward is done."""
        run = req.run
        while True:
            piece = None if budget is None else self._slice(req.rate, budget)
            before, t0 = run.pending_tokens, time.perf_counter()
            try:
                preemptible = self._preemptible(req.preempted) if budget is not None else contextlib.nullcontext()
                with self.engine._lock, preemptible:
                    done = run.prefill(piece)
            except _Preempted:
                req.preempted += 1
                self.preemptions += 1
                return False
            req.preempted = 0
            ran, elapsed = before - run.pending_tokens, time.perf_counter() - t0
            if ran > 0 and elapsed > 0:
                req.rate = ran / elapsed
            if done or budget is None or ran <= 0:
                return done
            budget -= ran
            if budget <= 0 or self._arrived():
                return False

    @contextlib.contextmanager
    def _preemptible(self, preempted: int):
        """While a prefill forward runs, a request that arrives (and has room) stops it before its
        next decoder layer (`_Preempted`); not one that was waiting already (one is admitted a
        turn), and not after MAX_PREEMPTIONS in a row (`preempted`: the forward's count so far), so
        arrivals cannot starve a long prompt."""
        if not self.preempt or preempted >= MAX_PREEMPTIONS:
            yield
            return
        submitted = self._submitted

        def check(_module, _args):
            if self._submitted > submitted and self._arrived():
                raise _Preempted
        handles = [layer.register_forward_pre_hook(check) for layer in self.engine.adapter.language_model.layers[1:]]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _prefill_one(self, req: _Request, budget: int | None) -> None:
        """Run at most `budget` tokens of `req`'s forward; after its last, its first token and its
        place in the batch."""
        run = req.run
        try:
            if run.stream.should_stop is not None and run.stream.should_stop():
                self._prefilling.remove(req)
                run.stream.cancel()
                req.future.set_result(run.result())
                return
            if not self._forward(req, budget):
                return
            self._first_token(req)
        except BaseException as exc:  # noqa: BLE001 - the request's own failure goes back to it
            if req in self._prefilling:
                self._prefilling.remove(req)
            fail_future(req.future, exc)

    def _first_token(self, req: _Request) -> None:
        """`req`'s forward is done: it leaves the prefilling requests, samples its first token,
        stores its prefix blocks, and joins the batch (or ends there)."""
        run = req.run
        try:
            self._prefilling.remove(req)
            req.token = run.stream.step(run.first_logits)
            run.first_token_out()
            if self.shadow is not None:
                self.shadow.offer(run.report, run.first_logits, run.exact, run.replay)
            if req.token is None:
                req.future.set_result(run.result())
                return
        except BaseException as exc:  # noqa: BLE001 - the request's own failure goes back to it
            if req in self._prefilling:
                self._prefilling.remove(req)
            fail_future(req.future, exc)
            return
        self._join(req)

    def _join(self, req: _Request) -> None:
        """The prefilled request's KV becomes a row of the decode batch; if that fails (out of
        memory), the request alone fails and the batch is as it was."""
        if self.batch is None:
            self.batch = DecodeBatch(self.engine.adapter, max_rows=self.max_batch, share=self.share_kv)
        try:
            with self.engine._lock:
                self.batch.add(req.run.cache)
        except BaseException as exc:  # noqa: BLE001 - the joining request alone fails
            log.exception("a request could not join the decode batch")
            fail_future(req.future, exc)
            return
        req.run.release_prompt_kv()  # the batch holds its KV now: one copy, not two
        self._running.append(req)
        self._note_batch()

    def _step(self) -> None:
        tokens = [r.token for r in self._running]
        positions = [r.run.stream.position for r in self._running]
        riders, self._riders = self._riders, []
        lasts: list = []  # each rider's last-token logits
        try:
            with self.engine._lock:
                if not riders:
                    logits = self.batch.step(tokens, positions)
                else:
                    logits, lasts = self.batch.step(tokens, positions, riders=[piece for _, piece in riders])
        except BaseException as exc:  # noqa: BLE001 - a failed step fails every request in it
            log.exception("batched decode step failed")
            for req, _ in riders:  # their KV may be half written: they fail with the step
                self._prefilling.remove(req)
                fail_future(req.future, exc)
            self._fail_batch(exc)
            return
        self._rows_stepped(logits, len(tokens))
        for (req, piece), last in zip(riders, lasts):  # after the rows': they join last
            self._rode(req, piece, last)

    def _rows_stepped(self, logits, rows: int) -> None:
        """Each running request takes its row of the step's logits; finished ones leave the batch."""
        self.decode_steps += 1
        self.decoded_tokens += rows
        finished = set()
        for i, r in enumerate(self._running):
            try:
                r.token = r.run.stream.step(logits[i])
                if r.token is None:
                    r.future.set_result(r.run.result())
            except BaseException as exc:  # noqa: BLE001 - one request's failure is its own
                fail_future(r.future, exc)
                r.token = None
            if r.token is None:
                finished.add(i)
        if finished:
            try:
                with self.engine._lock:
                    order = self.batch.remove(finished)  # the rows' new order
            except BaseException as exc:  # noqa: BLE001 - the batch cannot shrink: its rows cannot go on
                log.exception("finished requests could not leave the decode batch")
                self._running = [r for i, r in enumerate(self._running) if i not in finished]
                self._fail_batch(exc)
                return
            self._running = [self._running[i] for i in order]
            self._note_batch()

    def _rode(self, req: _Request, piece, logits) -> None:
        """A rider's piece ran in the step: its forward is done; its first token and its row."""
        try:
            done = req.run.rode(piece, logits)
        except BaseException as exc:  # noqa: BLE001 - the request's own failure goes back to it
            self._prefilling.remove(req)
            fail_future(req.future, exc)
            return
        self.ridden += 1
        if done:
            self._first_token(req)

    def _note_batch(self) -> None:
        """What the decode batch holds, for /metrics (read from any thread: one dict swapped in)."""
        batch = self.batch
        self.batch_stats = {"decode_batch_rows": 0 if batch is None else len(batch),
                            "decode_batch_kv_bytes": 0 if batch is None else batch.nbytes,
                            "decode_batch_shared_tokens": 0 if batch is None else batch.prefix_length}

    def _fail_batch(self, exc: BaseException) -> None:
        """The batch is unusable (a failed step, a failed shrink): fail the rows it holds and start
        it afresh. Prefilling requests keep their own caches and go on."""
        for r in self._running:
            fail_future(r.future, exc)
        self._running, self.batch = [], None
        self._note_batch()

    def _shut_down(self) -> None:
        """Fail the waiting requests and end the admitted ones "cancelled" with what they have."""
        self._fail_waiting("the scheduler is shutting down")
        for r in self._prefilling + self._running:
            try:
                r.run.stream.cancel()
                r.future.set_result(r.run.result())
            except BaseException as exc:  # noqa: BLE001 - its answer failed: it gets the error instead
                fail_future(r.future, exc)
        self._prefilling, self._running, self.batch = [], [], None
