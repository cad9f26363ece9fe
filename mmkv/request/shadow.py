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

The dial's recommendation (`blend`: ratios, `target`): a shadowed request whose fast path spliced
chunks (kind image or skill) is also spliced again at each listed blend r (mmkv.request.blend, r for
every chunk kind, from a cold cache, stored nowhere), a chunk a turn like the recompute, one forward
at a time, and its first token compared with the recompute's. Per (kind, r): the agreement and its
exact one-sided lower bound (Clopper-Pearson, `CONFIDENCE`); the recommendation is the smallest r
whose bound meets `target`, or none yet with the fewest further agreeing shadows any r needs.

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
BLEND_KINDS = ("image", "skill")  # the fast paths that splice chunks: the ones the dial applies to
MAX_BLEND_RATIOS = 8  # each ratio is one more prompt-length prefill per shadow
CONFIDENCE = 0.95  # of the one-sided lower bounds the recommendation reads
GAP_BUCKETS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)  # upper bounds of the largest |logit gap|


def parse_shadow_blend(text: str) -> tuple[float, ...]:
    """`--shadow-blend`: distinct ratios in [0, 1], comma-separated ("0,0.1,0.2,0.4"), at most
    MAX_BLEND_RATIOS; ascending. "" or "none": off. A bad list raises ValueError saying why."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        ratios = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--shadow-blend takes comma-separated ratios in [0, 1], got {text!r}") from None
    return check_blend_ratios(ratios)


def check_blend_ratios(ratios) -> tuple[float, ...]:
    bad = [r for r in ratios if not 0.0 <= r <= 1.0]  # NaN fails both comparisons
    if bad:
        raise ValueError(f"--shadow-blend ratios must be in [0, 1], got {bad!r}")
    if len(set(ratios)) != len(ratios):
        raise ValueError(f"--shadow-blend lists a ratio twice: {list(ratios)!r}")
    if len(ratios) > MAX_BLEND_RATIOS:
        raise ValueError(f"--shadow-blend takes at most {MAX_BLEND_RATIOS} ratios (each is a prefill per shadow), "
                         f"got {len(ratios)}")
    return tuple(sorted(float(r) for r in ratios))


def lower_bound(agreed: int, n: int, confidence: float = CONFIDENCE) -> float:
    """The exact (Clopper-Pearson) one-sided lower bound on agreement after `agreed` of `n`."""
    from scipy.stats import beta

    return float(beta.ppf(1 - confidence, agreed, n - agreed + 1)) if agreed else 0.0


def agreeing_needed(agreed: int, n: int, target: float, confidence: float = CONFIDENCE) -> int:
    """The fewest further shadows, all agreeing, after which the lower bound meets `target` (< 1);
    0 when it already does."""
    if lower_bound(agreed, n, confidence) >= target:
        return 0
    hi = 1
    while lower_bound(agreed + hi, n + hi, confidence) < target:  # the bound rises to 1 as agreeing ones come
        hi *= 2
    lo = hi // 2  # lower_bound(agreed + lo, n + lo) < target <= lower_bound(agreed + hi, n + hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if lower_bound(agreed + mid, n + mid, confidence) >= target else (mid, hi)
    return hi


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
    replay: Callable[[float], object] | None = None  # r -> PrefillResult pending: the splice at blend r
    ratios: list[float] = field(default_factory=list)  # the blend ratios still to replay
    exact_logits: torch.Tensor | None = None  # [V] the recompute's, once done (its cache dropped)
    replaying: object = None  # the PrefillResult of ratios[0] once started


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


@dataclass
class _Replayed:
    shadowed: int = 0
    agreed: int = 0
    gap_sum: float = 0.0


class ShadowMonitor:
    def __init__(self, rate: float, alert: float = 0.9, window: int = 100, max_pending: int = 4, chunk: int = 64,
                 seed: int | None = None, blend: tuple[float, ...] = (), target: float | None = None,
                 select: str = "deviation"):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"shadow rate must be in [0, 1], got {rate}")
        if not 0.0 <= alert <= 1.0:
            raise ValueError(f"shadow alert must be in [0, 1], got {alert}")
        if window < 1 or max_pending < 1 or chunk < 1:
            raise ValueError("shadow window, max_pending and chunk must be >= 1")
        if target is not None and not blend:
            raise ValueError("--shadow-target needs --shadow-blend (the ratios whose agreement it is checked on)")
        if target is not None and not 0.0 < target < 1.0:  # no finite count of shadows bounds agreement at 1
            raise ValueError(f"--shadow-target must be in (0, 1), got {target}")
        self.rate, self.alert, self.window, self.max_pending, self.chunk = rate, alert, window, max_pending, chunk
        self.blend, self.select = check_blend_ratios(list(blend)), select
        self.target = 0.99 if target is None and blend else target
        self._replayed = {(k, r): _Replayed() for k in BLEND_KINDS for r in self.blend}
        self.replays_failed = 0
        self._random = random.Random(seed)
        self._pending: deque[_Job] = deque()
        self._kinds = {k: _Kind(window=deque(maxlen=window)) for k in KINDS}
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def offer(self, report: dict, first_logits: torch.Tensor | None, exact: Callable[[], object] | None,
              replay: Callable[[float], object] | None = None) -> bool:
        """A request's first token is out: sample it for a shadow. True when queued; a sampled
        request that finds the queue full is dropped and counted. `replay` (r -> its splice at
        blend r, pending) is run at each `blend` ratio when the fast path spliced chunks."""
        kind = shadow_kind(report)
        if kind is None or exact is None or first_logits is None or self._random.random() >= self.rate:
            return False
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self._kinds[kind].dropped += 1
                return False
            replays = list(self.blend) if replay is not None and kind in BLEND_KINDS else []
            self._pending.append(_Job(kind, first_logits.detach().float().cpu(), exact, replay=replay, ratios=replays))
        return True

    def step(self, lock) -> None:
        """Run the next `chunk` tokens of the oldest shadow under `lock` (the engine's): its
        recompute, then each blend replay in turn; each compared and recorded once done. A shadow
        that fails is dropped and logged, a replay that fails ends the shadow's replays: neither
        ever fails a request."""
        job = self._pending[0]
        if job.exact_logits is None and not self._step_exact(job, lock):
            return
        if job.ratios and not self._step_replay(job, lock):
            return
        with self._lock:
            self._pending.popleft()

    def _step_exact(self, job: _Job, lock) -> bool:
        """A chunk of the recompute; True once it is recorded and the replays may run."""
        try:
            with lock:
                if job.reference is None:
                    job.reference = job.exact()
                if not job.reference.advance(self.chunk):
                    return False
            job.exact_logits, job.reference = job.reference.logits[0].float().cpu(), None  # its cache goes
            self._record(job.kind, job.got, job.exact_logits)
            return not job.ratios  # any replays start in the next idle turn
        except Exception:  # noqa: BLE001 - the monitor never takes a request or the loop down
            log.exception("a fidelity shadow failed; dropped")
            with self._lock:
                self._kinds[job.kind].dropped += 1
            job.ratios.clear()
            return True

    def _step_replay(self, job: _Job, lock) -> bool:
        """A chunk of the replay at `job.ratios[0]`; True once no replay is left."""
        try:
            with lock:
                if job.replaying is None:
                    job.replaying = job.replay(job.ratios[0])
                if not job.replaying.advance(self.chunk):
                    return False
            got = job.replaying.logits[0].float().cpu()
            job.replaying = None
            self._record_replay(job.kind, job.ratios.pop(0), got, job.exact_logits)
        except Exception:  # noqa: BLE001 - as above
            log.exception("a fidelity shadow's blend replay failed; its remaining replays dropped")
            with self._lock:
                self.replays_failed += 1
            job.ratios.clear()
        return not job.ratios

    def _record_replay(self, kind: str, ratio: float, got: torch.Tensor, ref: torch.Tensor) -> None:
        agreed = bool(got.argmax() == ref.argmax())
        gap = (got - ref).abs().max().item()
        with self._lock:
            counts = self._replayed[kind, ratio]
            counts.shadowed += 1
            counts.agreed += agreed
            counts.gap_sum += gap

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
        if self.blend:
            out["blend"] = self._blend_snapshot()
        return out

    def _blend_snapshot(self) -> dict:
        """Per spliced kind and ratio: replays compared, agreed, the one-sided lower bound and the
        further agreeing shadows it needs to meet the target; the recommended ratio per kind."""
        with self._lock:
            counts = {key: (c.shadowed, c.agreed, c.gap_sum) for key, c in self._replayed.items()}
            failed = self.replays_failed
        kinds = {}
        for kind in BLEND_KINDS:
            ratios = {}
            for r in self.blend:
                n, agreed, gap_sum = counts[kind, r]
                ratios[repr(r)] = {"ratio": r, "shadowed": n, "agreed": agreed,
                                   "agreement": agreed / n if n else None,
                                   "lower_bound": lower_bound(agreed, n), "gap_sum": gap_sum,
                                   "agreeing_needed": agreeing_needed(agreed, n, self.target)}
            kinds[kind] = {"ratios": ratios, **self._recommend(list(ratios.values()))}
        return {"ratios": list(self.blend), "select": self.select, "target": self.target, "confidence": CONFIDENCE,
                "replays_failed": failed, "kinds": kinds}

    @staticmethod
    def _recommend(rows: list[dict]) -> dict:
        """The smallest ratio whose bound meets the target; else none yet, and the ratio that needs
        the fewest further agreeing shadows (the smaller on a tie) with that count."""
        met = [row["ratio"] for row in rows if row["agreeing_needed"] == 0]
        if met:
            return {"recommended": met[0], "closest": met[0], "agreeing_needed": 0}
        closest = min(rows, key=lambda row: (row["agreeing_needed"], row["ratio"]))
        return {"recommended": None, "closest": closest["ratio"], "agreeing_needed": closest["agreeing_needed"]}
