"""The fidelity dial's trade from `mmkv eval --blend` reports: per arm (ratio r, selector) the
agreement with full recompute (exact interval, the exact one-sided lower bound, the agreement on
requests whose full top-2 margin exceeds 1 logit, flips by type) against the TTFT ratio; the
smallest r the one-sided bound certifies; the grid's multi-image conditions; a Pareto plot.

`python -m vqa_eval.blend_report REPORT.json... [--grid GRID.json...] [--plot PATH]` prints the
markdown and writes one plot with a panel per model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mmkv.vqa_eval.stats import lower_bound

PREFIX = "blend-"


def dial_of(name: str) -> tuple[float, str] | None:
    """(r, selector) of a `blend-R[-SELECT]` arm, None for any other arm."""
    if not name.startswith(PREFIX):
        return None
    ratio, _, select = name.removeprefix(PREFIX).partition("-")
    return float(ratio), select or "deviation"


def dial_arms(summary: dict) -> list[tuple[str, float, str]]:
    """(arm, r, selector) of every dial arm, by selector then r."""
    arms = [(n, *dial_of(n)) for n in summary if dial_of(n)]
    return sorted(arms, key=lambda a: (a[2], a[1]))


def _rate(r: dict) -> str:
    return f"{r['k']}/{r['n']} {r['value']:.3f} [{r['low']:.3f}, {r['high']:.3f}]" if r["n"] else "-"


def _flips(by_type: dict, top: int = 3) -> str:
    flips = sorted(((v["flips"], t) for t, v in by_type.items() if v["flips"]), reverse=True)
    return ", ".join(f"{t} {n}" for n, t in flips[:top]) + (" ..." if len(flips) > top else "") if flips else "none"


def certified(summary: dict, target: float) -> dict[str, float | None]:
    """Per selector: the smallest r whose exact one-sided 95% lower bound reaches `target` (None: none)."""
    out: dict[str, float | None] = {}
    for name, r, select in dial_arms(summary):
        out.setdefault(select, None)
        if out[select] is None and summary[name]["verdict"]["exact_lower"] >= target:
            out[select] = r
    return out


def table(report: dict) -> list[str]:
    """The agreement run's dial table, one row per arm, and the certification line."""
    s, target = report["summary"], report["target"]
    lines = ["| r | select | agreement k/n [exact 95%] | one-sided 95% lower (exact) | agreement, full margin > 1 "
             "logit | flips (top types) | TTFT / full (median) | LM tokens / req | cached tokens / req |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r, select in dial_arms(s):
        a = s[name]
        lines.append(f"| {r:g} | {select} | {_rate(a['agreement'])} | {a['verdict']['exact_lower']:.4f} | "
                     f"{_rate(a['confident']) if 'confident' in a else '-'} | {_flips(a['by_type'])} | "
                     f"{a['ttft_ratio_median']:.2f} | {a['lm_tokens_computed']:.1f} | {a['cached_tokens']:.1f} |")
    n = report["n"]
    need = next((k for k in range(n + 1) if lower_bound(k, n) >= target), None)
    cert = certified(s, target)
    lines += ["", f"Smallest r whose exact one-sided 95% lower bound reaches {target}: "
              + "; ".join(f"{sel}: {'r = ' + format(r, 'g') if r is not None else 'none'}" for sel, r in cert.items())
              + (f" (with n = {n} that needs at least {need} agreements)" if need is not None
                 else f" (with n = {n} no count can: even {n}/{n} has a lower bound of {lower_bound(n, n):.4f})")
              + "."]
    return lines


def grid_table(grid: dict, conditions: tuple[str, ...] = ("two-images", "image-twice")) -> list[str]:
    """The grid's multi-image conditions and agreement by images in the prompt, per dial arm."""
    by = grid["by_condition"]
    shown = [c for c in conditions if c in by]
    bins = [b for b in next(iter(grid["by_images"].values())) if b["n"]] if grid["by_images"] else []
    head = ["r", "select", *shown, *[f"{b['range'][0]}+ images" if b["range"][1] > 100 else
                                     f"{b['range'][0]} image{'s' if b['range'][0] > 1 else ''}" for b in bins]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r, select in dial_arms(grid["by_images"]):
        cells = [_rate(by[c]["summary"][name]["agreement"]) for c in shown]
        cells += [_rate(b) for b in grid["by_images"][name] if b["n"]]
        lines.append(f"| {r:g} | {select} | " + " | ".join(cells) + " |")
    return lines


def plot(reports: list[dict], path: Path) -> None:
    """Agreement (exact 95% interval) against TTFT / full, one panel per model, a line per selector."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(5 * len(reports), 4), squeeze=False)
    for ax, report in zip(axes[0], reports):
        s = report["summary"]
        for select, marker in (("deviation", "o"), ("stride", "s")):
            arms = [(n, r) for n, r, sel in dial_arms(s) if sel == select]
            if not arms:
                continue
            ends = [(n, r) for n, r, _ in dial_arms(s) if r in (0.0, 1.0) and (n, r) not in arms]
            arms = sorted(arms + ends, key=lambda a: a[1])  # r = 0 and 1 do not depend on the selector
            x = [s[n]["ttft_ratio_median"] for n, _ in arms]
            y = [s[n]["agreement"]["value"] for n, _ in arms]
            err = [[v - s[n]["agreement"]["low"] for (n, _), v in zip(arms, y)],
                   [s[n]["agreement"]["high"] - v for (n, _), v in zip(arms, y)]]
            ax.errorbar(x, y, yerr=err, marker=marker, capsize=3, label=select)
            for (n, r), xi, yi in zip(arms, x, y):
                ax.annotate(f"{r:g}", (xi, yi), textcoords="offset points", xytext=(4, -10), fontsize=7)
        ax.axhline(report["target"], color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{Path(report['model']).name} (n = {report['n']})", fontsize=9)
        ax.set_xlabel("TTFT / full recompute (median)")
        ax.set_ylabel("agreement with full recompute")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--grid", nargs="*", type=Path, default=[])
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    reports = [json.loads(p.read_text()) for p in args.reports]
    for report in reports:
        print(f"#### {Path(report['model']).name}: n = {report['n']}\n")
        print("\n".join(table(report)) + "\n")
    for path in args.grid:
        grid = json.loads(path.read_text())
        print(f"#### {Path(grid['model']).name}: grid, n = {grid['n']}\n")
        print("\n".join(grid_table(grid)) + "\n")
    if args.plot:
        plot(reports, args.plot)


if __name__ == "__main__":
    main()
