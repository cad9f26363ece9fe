"""Two agreement reports of the same items and seeds (two models, or two settings): per arm, the
exact McNemar test on the paired requests. A difference in flip counts is a shown difference
only when p is small; 4 flips against 0 is not one (p = 0.125)."""

from __future__ import annotations

import json
from pathlib import Path

from mmkv.vqa_eval.stats import mcnemar_exact


def paired_flags(a: dict, b: dict, arm: str) -> tuple[list[bool], list[bool]]:
    """Agreement flags of `arm` on the requests both reports hold, matched by (seed, item, layout)."""
    key = lambda r: (r["seed"], r["id"], r["layout"])  # noqa: E731
    rb = {key(r): r for r in b["requests"]}
    pairs = [(r, rb[key(r)]) for r in a["requests"] if key(r) in rb and arm in r["arms"] and arm in rb[key(r)]["arms"]]
    return [x["arms"][arm]["agree"] for x, _ in pairs], [y["arms"][arm]["agree"] for _, y in pairs]


def _load(path: Path) -> dict:
    """An agreement report.json, or ValueError naming the file."""
    rep = json.loads(Path(path).read_text())
    if not (isinstance(rep, dict) and {"model", "summary", "reference", "requests"} <= rep.keys()):
        raise ValueError(f"{path}: not an agreement report.json (mmkv eval --task agreement writes one)")
    return rep


def compare_reports(path_a: Path, path_b: Path) -> str:
    a, b = _load(path_a), _load(path_b)
    lines = [f"# {a['model']} vs {b['model']}: exact McNemar on paired requests", "",
             f"| arm | paired requests | agree only in {a['model']} | agree only in {b['model']} | p |",
             "|---|---|---|---|---|"]
    for arm in [n for n in a["summary"] if n in b["summary"] and n != a["reference"]]:
        fa, fb = paired_flags(a, b, arm)
        if not fa:
            continue
        m = mcnemar_exact(fa, fb)
        lines.append(f"| {arm} | {m['n']} | {m['only_a']} | {m['only_b']} | {m['p']:.3g} |")
    return "\n".join(lines) + "\n"
