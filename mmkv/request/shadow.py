"""The online fidelity monitor: a sampled share of fast-path requests (an image or skill spliced, an
erratum, an in-place edit) is recomputed exactly when the scheduler has nothing else to do, and the
first next-token logits the request got are compared with the full recompute's: the same first
token or not, and the largest logit gap. Per kind: how many were shadowed, agreed and dropped (the
queue was full: the server was busy), a gap histogram, the agreement with an exact (Clopper-Pearson)
interval, and an alert when agreement over the last `window` shadows falls below `alert`.

Bounded: at most `max_pending` shadows wait (each holds the request's first logits and what its
prompt's recompute needs); one runs at a time, `chunk` tokens a scheduler turn, and only in a turn
with no request waiting, prefilling or decoding, so a request that arrives waits at most one such
chunk. A shadow's KV is never stored: the recompute's cache goes when it is compared.

Thread-safety: `offer` and `step` from the scheduler's loop; `snapshot` from any thread.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("mmkv.shadow")

KINDS = ("image", "skill", "erratum", "edit")
GAP_BUCKETS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)  # upper bounds of the largest |logit gap|


def shadow_kind(report: dict) -> str | None:
    """Which fast path a request's result took (a `Run.report`), or None for an exact request: a
    full recompute, or a turn that reused only exact prefix-cache blocks."""
    edit = report.get("edit")
    if edit is not None and edit.applied == "erratum":
        return "erratum"
    if edit is not None and (edit.applied == "in_place" or edit.applied.startswith("selective")):
        return "edit"
    if not report.get("reuse", True):
        return None
    if report.get("image_tokens_reused", 0) > 0:
        return "image"
    if report.get("skill_tokens_reused", 0) > 0:
        return "skill"
    return None


@dataclass
class _Job:
    kind: str
    got: torch.Tensor  # [V] float32 on the CPU: the request's first next-token logits
    exact: Callable[[], object]  # -> PrefillResult, its forward pending: the full recompute
    reference: object = None  # the PrefillResult once started


@dataclass
class _Kind:
    shadowed: int = 0
    agreed: int = 0
    dropped: int = 0
    alerts: int = 0
    alerting: bool = False
    gaps: list[int] = field(default_factory=lambda: [0] * (len(GAP_BUCKETS) + 1))  # the last: above the top
    gap_sum: float = 0.0
    window: deque = field(default_factory=deque)


class ShadowMonitor:
    def __init__(self, rate: float, alert: float = 0.9, window: int = 100, max_pending: int = 4, chunk: int = 64,
                 seed: int | None = None):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"shadow rate must be in [0, 1], got {rate}")
        if not 0.0 <= alert <= 1.0:
            raise ValueError(f"shadow alert must be in [0, 1], got {alert}")
        if window < 1 or max_pending < 1 or chunk < 1:
            raise ValueError("shadow window, max_pending and chunk must be >= 1")
        self.rate, self.alert, self.window, self.max_pending, self.chunk = rate, alert, window, max_pending, chunk
        self._random = random.Random(seed)
        self._pending: deque[_Job] = deque()
        self._kinds = {k: _Kind(window=deque(maxlen=window)) for k in KINDS}
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def offer(self, report: dict, first_logits: torch.Tensor | None, exact: Callable[[], object] | None) -> bool:
        """A request's first token is out: sample it for a shadow. True when queued; a sampled
        request that finds the queue full is dropped and counted."""
        kind = shadow_kind(report)
        if kind is None or exact is None or first_logits is None or self._random.random() >= self.rate:
            return False
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self._kinds[kind].dropped += 1
                return False
            self._pending.append(_Job(kind, first_logits.detach().float().cpu(), exact))
        return True

    def step(self, lock) -> None:
        """Run the next `chunk` tokens of the oldest shadow's recompute under `lock` (the engine's);
        once it is done, compare and record. A shadow that fails is dropped and logged: it never
        fails a request."""
        job = self._pending[0]
        try:
            with lock:
                if job.reference is None:
                    job.reference = job.exact()
                if not job.reference.advance(self.chunk):
                    return
            self._record(job.kind, job.got, job.reference.logits[0].float().cpu())
        except Exception:  # noqa: BLE001 - the monitor never takes a request or the loop down
            log.exception("a fidelity shadow failed; dropped")
            with self._lock:
                self._kinds[job.kind].dropped += 1
        with self._lock:
            self._pending.popleft()

    def _record(self, kind: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        agreed = bool(got.argmax() == ref.argmax())
        gap = (got - ref).abs().max().item()
        with self._lock:
            k = self._kinds[kind]
            k.shadowed, k.agreed, k.gap_sum = k.shadowed + 1, k.agreed + agreed, k.gap_sum + gap
            k.gaps[next((i for i, b in enumerate(GAP_BUCKETS) if gap <= b), len(GAP_BUCKETS))] += 1
            k.window.append(agreed)
            rate = sum(k.window) / len(k.window)
            low = len(k.window) == self.window and rate < self.alert
            if low and not k.alerting:
                k.alerts += 1
                log.warning("fidelity alert: %s splices agreed with a full recompute on %d of the last %d "
                            "shadowed requests (%.3f < --shadow-alert %.3f)", kind, sum(k.window), len(k.window),
                            rate, self.alert)
            k.alerting = low

    def snapshot(self) -> dict:
        """Per kind: shadowed, agreed, dropped, agreement with its exact 95% interval, the window's
        agreement, alerts, the gap histogram (cumulative counts per upper bound) and sum."""
        from scipy.stats import binomtest  # exact interval; scipy is only needed when someone asks

        with self._lock:
            kinds = {name: (k.shadowed, k.agreed, k.dropped, k.alerts, k.alerting, list(k.gaps), k.gap_sum,
                            list(k.window)) for name, k in self._kinds.items()}
            pending = len(self._pending)
        out = {"rate": self.rate, "alert": self.alert, "window": self.window, "pending": pending, "kinds": {}}
        for name, (n, agreed, dropped, alerts, alerting, gaps, gap_sum, window) in kinds.items():
            interval = list(binomtest(agreed, n).proportion_ci(0.95, method="exact")) if n else None
            cumulative, total = [], 0
            for count in gaps:
                total += count
                cumulative.append(total)
            out["kinds"][name] = {
                "shadowed": n, "agreed": agreed, "dropped": dropped, "agreement": agreed / n if n else None,
                "interval_95": interval, "window_agreement": sum(window) / len(window) if window else None,
                "window_size": len(window), "alerts": alerts, "alerting": alerting,
                "gap_buckets": dict(zip([*map(str, GAP_BUCKETS), "+Inf"], cumulative)), "gap_sum": gap_sum}
        return out
