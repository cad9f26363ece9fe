"""Fidelity metrics of MECHANISM.md section 5: agreement, logit cosine, accuracy, each with its n and
a seeded percentile-bootstrap 95% interval; TTFT median and p90.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


def normalize_answer(text: str) -> str:
    """Answers compare case- and space-insensitively: ' Red ' == 'red'."""
    return " ".join(text.strip().lower().split())


def agreement_flags(answers: Sequence[str], reference: Sequence[str]) -> np.ndarray:
    """1.0 where the arm's greedy answer equals the reference arm's answer, per item."""
    assert len(answers) == len(reference), "one reference answer per item"
    return np.array([float(normalize_answer(a) == normalize_answer(r)) for a, r in zip(answers, reference)])


def accuracy_flags(answers: Sequence[str], labels: Sequence[str]) -> np.ndarray:
    """1.0 where the answer equals the ground-truth label, per item."""
    return agreement_flags(answers, labels)


def logit_cosine(a, b) -> float:
    """Cosine of two next-token logit vectors [V] (float64 to keep 1.0 exact for equal inputs)."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    denom = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / denom) if denom > 0 else float("nan")


def p90(values) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), 90))


def bootstrap_ci(values, stat: Callable[[np.ndarray], float] = np.mean, n_boot: int = 2000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of `stat` over items, resampled with replacement (seeded)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    stats = np.array([stat(x[row]) for row in idx])
    alpha = (1 - level) / 2
    return float(np.quantile(stats, alpha)), float(np.quantile(stats, 1 - alpha))


@dataclass
class Estimate:
    """A statistic over n items and its bootstrap 95% interval."""

    value: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values, stat: Callable[[np.ndarray], float] = np.mean, seed: int = 0) -> Estimate:
        x = np.asarray(values, dtype=np.float64)
        value = float(stat(x)) if x.size else float("nan")
        return cls(value, *bootstrap_ci(x, stat, seed=seed), n=int(x.size))

    def to_json(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high, "n": self.n}
