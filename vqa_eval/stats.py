"""Exact statistics for agreement counts: Clopper-Pearson intervals, the one-sided pass rule,
exact McNemar and sign tests, flip directions, and an item-clustered bootstrap.

Agreement is a count of k agreeing requests out of n, so every interval here is an exact
binomial one (scipy's `binomtest`), never a normal approximation: a perfect 360/360 has the
interval [0.990, 1.000], not [1.000, 1.000].
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import binomtest

#: Numbers the count questions answer with, in order: a count flip n -> n-1 is "down".
ORDINALS: dict[str, tuple[str, ...]] = {"count": ("one", "two", "three", "four")}


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact two-sided interval for a binomial proportion (k successes of n)."""
    if n == 0:
        return float("nan"), float("nan")
    ci = binomtest(k, n).proportion_ci(confidence_level=level, method="exact")
    return float(ci.low), float(ci.high)


def lower_bound(k: int, n: int, level: float = 0.95) -> float:
    """Exact one-sided lower confidence bound: P(true rate < bound) <= 1 - level."""
    if n == 0:
        return float("nan")
    return float(binomtest(k, n, alternative="greater").proportion_ci(confidence_level=level, method="exact").low)


@dataclass(frozen=True)
class Verdict:
    """The pass rule: the exact one-sided lower bound of agreement is at least `target`.

    What a pass certifies: if the n paired requests were independent draws from the
    conversation distribution, the probability that the fast path answers like a full recompute
    on a new draw is >= target, at the stated one-sided confidence. Requests of one item under
    several conversation seeds are correlated, so the item-clustered bootstrap bound is reported
    next to it; a pass needs both bounds >= target.
    """

    k: int
    n: int
    target: float
    level: float
    exact_lower: float
    cluster_lower: float

    @property
    def passed(self) -> bool:
        return self.exact_lower >= self.target and self.cluster_lower >= self.target

    def to_json(self) -> dict:
        return {"k": self.k, "n": self.n, "target": self.target, "level": self.level,
                "exact_lower": self.exact_lower, "cluster_lower": self.cluster_lower, "passed": self.passed}


def verdict(flags: Sequence[float], clusters: Sequence[str], target: float = 0.99, level: float = 0.95,
            seed: int = 0) -> Verdict:
    x = np.asarray(flags, dtype=np.float64)
    k, n = int(x.sum()), int(x.size)
    boot_low = cluster_bootstrap(x, clusters, level=2 * level - 1, seed=seed)[0]  # one-sided at `level`
    return Verdict(k, n, target, level, lower_bound(k, n, level), boot_low)


def cluster_bootstrap(values: Sequence[float], clusters: Sequence[str], n_boot: int = 2000, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean, resampling whole clusters (items) with
    replacement: requests of one item under several seeds move together."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    keys = list(dict.fromkeys(clusters))
    index = {c: i for i, c in enumerate(keys)}
    cid = np.array([index[c] for c in clusters])
    sums = np.bincount(cid, weights=x, minlength=len(keys))
    counts = np.bincount(cid, minlength=len(keys)).astype(np.float64)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(keys), size=(n_boot, len(keys)))
    means = sums[pick].sum(axis=1) / counts[pick].sum(axis=1)
    alpha = (1 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> dict:
    """Exact McNemar test on paired outcomes: only discordant pairs count; two-sided binomial p.
    `only_a` = pairs where a holds and b does not."""
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    assert a.shape == b.shape, "paired outcomes"
    only_a, only_b = int((a & ~b).sum()), int((~a & b).sum())
    p = binomtest(only_a, only_a + only_b, 0.5).pvalue if only_a + only_b else 1.0
    return {"only_a": only_a, "only_b": only_b, "n": int(a.size), "p": float(p)}


def sign_test(down: int, up: int) -> float:
    """Two-sided exact sign test: are flips as likely to go down as up?"""
    return float(binomtest(down, down + up, 0.5).pvalue) if down + up else 1.0


def flip_directions(pairs: Sequence[tuple[str, str]], qtype: str) -> dict:
    """Disagreements (reference answer, arm answer) counted by direction. For ordinal types
    (count) also `down` (n -> smaller), `up`, and the sign test of down vs up."""
    flips = Counter(f"{ref} -> {got}" for ref, got in pairs if ref != got)
    out: dict = {"flips": sum(flips.values()), "by_direction": dict(flips.most_common())}
    order = ORDINALS.get(qtype)
    if order:
        rank = {w: i for i, w in enumerate(order)}
        steps = [rank[g] - rank[r] for r, g in pairs if r != g and r in rank and g in rank]
        down, up = sum(s < 0 for s in steps), sum(s > 0 for s in steps)
        out.update(down=down, up=up, one_step_down=sum(s == -1 for s in steps), sign_p=sign_test(down, up))
    return out
