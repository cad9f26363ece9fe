"""Paired bundle-vs-candidate tallies for the rule scripts (s47-rule.py, proxy-rule.py).

A tally is [n, bundle right, candidate right, now right, now wrong]."""
from scipy.stats import binomtest


def p1(r: int, w: int) -> float:
    """One-sided sign test: the chance of r or more now-right among r + w flips if neither way is likelier."""
    return float(binomtest(r, r + w, 0.5, alternative="greater").pvalue) if r + w else 1.0


def tally(g: list, a: bool, b: bool) -> None:
    """Count one item into tally ``g``: ``a`` the bundle right, ``b`` the candidate right."""
    g[0] += 1; g[1] += a; g[2] += b; g[3] += b and not a; g[4] += a and not b


def row(k: str, g: list) -> str:
    n, a, b, r, w = g
    return f"{k:28s} n={n:4d} {a:4d} -> {b:4d}  right {r:3d} wrong {w:3d} p1={p1(r, w):.3g}"
