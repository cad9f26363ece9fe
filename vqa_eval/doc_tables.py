"""Keep docs/eval.md's results tables in step with the reports they quote.

docs/eval.md quotes the tables of each bundled model's `mmkv eval` reports (the tiny models and the proxy) in
docs/eval-runs/<model>/ (agreement, episodes, grid, errata). After a rerun, this rewrites every
quoted table (and the floors in its section header, and the "All types" line) from the reports;
`--check` only says which tables differ and exits 1. Prose and the flip bullets are not tables:
they stay for a person to update.

    python -m vqa_eval.doc_tables            # rewrite docs/eval.md from docs/eval-runs
    python -m vqa_eval.doc_tables --check    # exit 1 when a quoted table is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "eval.md"
RUNS = ROOT / "docs" / "eval-runs"
MODELS = {"Qwen2.5-VL tiny": "qwen2_5_vl-tiny", "Qwen3-VL tiny": "qwen3_vl-tiny",  # section name -> report dir
          "Proxy": "qwen2_5_vl-proxy"}
REPORTS = ("agreement", "episodes", "grid", "errata")
FLOORS = re.compile(r"image-blind ([0-9]+\.[0-9]+), shuffled-image ([0-9]+\.[0-9]+)")


def table_end(lines: list[str], i: int) -> int | None:
    """End (exclusive) of the markdown table starting at line ``i`` (a `|` row followed by a `|---`
    row, up to the first non-`|` line), or None when no table starts there."""
    if not (lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---")):
        return None
    j = i
    while j < len(lines) and lines[j].startswith("|"):
        j += 1
    return j


def table_spans(lines: list[str]) -> list[tuple[int, int]]:
    """(start, end) of each markdown table (:func:`table_end`)."""
    out, i = [], 0
    while i < len(lines):
        j = table_end(lines, i)
        if j is None:
            i += 1
        else:
            out.append((i, j))
            i = j
    return out


def embed(doc: str, reports: dict[str, str]) -> tuple[str, list[str]]:
    """``doc`` with each model section's tables replaced by its reports' tables (``reports``: section
    name -> the reports' text, concatenated). A section is a ``#### <name>...`` header up to the next
    ``####`` of another model, or a ``##``/``###`` header; each of its tables takes the first unused
    report table with the same header row. Returns the new text and the headers of the tables that
    changed. A doc table no report holds is a ValueError naming it."""
    lines = doc.split("\n")
    changed: list[str] = []
    for name, text in reports.items():
        rep = text.split("\n")
        rep_tables = [rep[a:b] for a, b in table_spans(rep)]
        used = [False] * len(rep_tables)
        floors = FLOORS.search(text)
        all_types = next((x for x in rep if x.startswith("All types: splice agrees")), None)
        in_model, i = False, 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("#### "):
                in_model = line[5:].startswith(name)
                if in_model and floors and "floors: image-blind" in line:
                    new = FLOORS.sub(f"image-blind {floors[1]}, shuffled-image {floors[2]}", line)
                    if new != line:
                        changed.append(f"{name}: {line[:80]}")
                    lines[i] = new
            elif line.startswith("## ") or (line.startswith("### ") and "First-token flips" not in line):
                in_model = False
            if in_model and all_types and line.startswith("All types: splice agrees") and line != all_types:
                lines[i] = all_types
                changed.append(f"{name}: All types")
            j = table_end(lines, i) if in_model else None
            if j is not None:
                k = next((k for k, t in enumerate(rep_tables) if not used[k] and t[0] == line), None)
                if k is None:
                    raise ValueError(f"{name}: docs table {line[:80]!r} is in no report")
                used[k] = True
                if lines[i:j] != rep_tables[k]:
                    changed.append(f"{name}: {line[:80]}")
                lines[i:j] = rep_tables[k]
                i += len(rep_tables[k])
                continue
            i += 1
    return "\n".join(lines), changed


def load_reports(runs: Path = RUNS) -> dict[str, str]:
    """Section name -> the model's report texts joined (a missing report is skipped)."""
    out = {}
    for name, d in MODELS.items():
        texts = [(runs / d / f"{r}.md").read_text() for r in REPORTS if (runs / d / f"{r}.md").exists()]
        if texts:
            out[name] = "\n".join(texts)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="rewrite docs/eval.md's quoted tables from docs/eval-runs")
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--runs", default=str(RUNS))
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a quoted table is stale")
    args = ap.parse_args(argv)
    doc = Path(args.doc)
    new, changed = embed(doc.read_text(), load_reports(Path(args.runs)))
    for c in changed:
        print(("stale: " if args.check else "updated: ") + c)
    if args.check:
        return 1 if changed else 0
    doc.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
