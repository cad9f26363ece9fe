"""Fidelity metrics of MECHANISM.md section 5 per request: answer matching, logit cosine, p90.
Counts and their intervals are in vqa_eval/stats.py (exact binomial, not a bootstrap)."""

from __future__ import annotations

import numpy as np


def normalize_answer(text: str) -> str:
    """Answers compare case- and space-insensitively: ' Red ' == 'red'."""
    return " ".join(text.strip().lower().split())


def logit_cosine(a, b) -> float:
    """Cosine of two next-token logit vectors [V] (float64 to keep 1.0 exact for equal inputs)."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    denom = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / denom) if denom > 0 else float("nan")


def p90(values) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), 90))
