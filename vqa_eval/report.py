"""report.md and agreement.png of an agreement run (vqa_eval/run.py): exact intervals, the
verdict, per-type flips with their direction, the error decomposition, the floors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mmkv.vqa_eval.blend_report import dial_arms, table as dial_table
from mmkv.vqa_eval.dataset import TYPES


def rate(e: dict, digits: int = 3) -> str:
    """k/n value [exact 95% interval]."""
    return f"{e['k']}/{e['n']} {e['value']:.{digits}f} [{e['low']:.{digits}f}, {e['high']:.{digits}f}]"


def _g(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def setup_line(report: dict) -> str:
    m, ck, cap = report["machine"], report.get("checkpoint"), report["max_new_tokens"]
    cap = f"max {cap} new tokens" if isinstance(cap, int) else "each type's longest answer in new tokens"
    return (f"{report['model']}; set {Path(report['set']).name}; reference `{report['reference']}`; greedy, "
            f"{cap}; {m['device']} {m['dtype']}, {m['threads']} threads"
            + (f"; checkpoint {ck['steps']} steps" if ck else "") + ".")


def agreement_table(s: dict, names: list[str], controls: list[str]) -> list[str]:
    lines = ["| arm | agreement k/n [exact 95%] | one-sided 95% lower bound (exact / item-clustered) "
             f"| verdict >= {next(iter(s.values()))['verdict']['target']} | accuracy | McNemar vs splice-k1 "
             "(only arm / only k1, p) | TTFT / full (median) | cached tokens / req | LM tokens / req |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        o, v = s[name], s[name]["verdict"]
        mc = o.get("mcnemar_vs_splice-k1")
        mcs = f"{mc['only_a']} / {mc['only_b']}, p={mc['p']:.2g}" if mc else "-"
        verdict = "reference" if name == "full" else ("PASS" if v["passed"] else "not shown")
        label = f"{name} (control)" if name in controls else name
        lines.append(f"| {label} | {rate(o['agreement'])} | {v['exact_lower']:.4f} / {v['cluster_lower']:.4f} | "
                     f"{verdict} | {rate(o['accuracy'])} | {mcs} | {o['ttft_ratio_median']:.2f} | "
                     f"{o['cached_tokens']:.1f} | {o['lm_tokens_computed']:.1f} |")
    return lines


def per_type_table(s: dict, names: list[str]) -> list[str]:
    fast = [n for n in names if n != "full"]
    types = [t for t in TYPES if t in s[fast[0]]["by_type"]] if fast else []
    lines = ["| type | " + " | ".join(fast) + " |", "|---|" + "---|" * len(fast)]
    for t in types:
        lines.append(f"| {t} | " + " | ".join(rate(s[n]["by_type"][t]) for n in fast) + " |")
    return lines


def flip_lines(s: dict, names: list[str], controls: list[str]) -> list[str]:
    lines = []
    for name in [n for n in names if n != "full" and n not in controls]:
        parts = []
        for t, e in s[name]["by_type"].items():
            if not e["flips"]:
                continue
            dirs = ", ".join(f"{d} x{c}" for d, c in e["by_direction"].items())
            sign = (f"; down {e['down']} / up {e['up']} (one step down {e['one_step_down']}), sign test "
                    f"p={e['sign_p']:.2g}" if "down" in e else "")
            parts.append(f"{t} {e['flips']}: {dirs}{sign}")
        lines.append(f"- `{name}`: " + ("; ".join(parts) if parts else "no flips"))
    return lines


def decomposition_table(s: dict, names: list[str]) -> list[str]:
    lines = ["| arm | KL answer set mean / max | median margin change | median log p(answer) change | "
             "median abs rotation | median abs isolation | rotation share | flips: mean rotation / isolation |",
             "|---|---|---|---|---|---|---|---|"]
    for name in names:
        d = s[name].get("decomposition")
        if not d:
            continue
        lines.append(f"| {name} | {_g(d['kl_answer_set_mean'])} / {_g(d['kl_answer_set_max'])} | "
                     f"{_g(d['margin_change_median'])} | {_g(d['answer_logprob_change_median'])} | "
                     f"{_g(d.get('rotation_abs_median'))} | {_g(d.get('isolation_abs_median'))} | "
                     f"{_g(d.get('rotation_share'))} | {_g(d.get('flips_rotation_mean'))} / "
                     f"{_g(d.get('flips_isolation_mean'))} |")
    return lines


def margin_table(s: dict, names: list[str]) -> list[str]:
    fast = [n for n in names if s[n].get("decomposition")]
    if not fast:
        return []
    bins = s[fast[0]]["decomposition"]["flip_rate_by_margin"]
    lines = ["| full's top-2 margin | n | " + " | ".join(f"{n} flips" for n in fast) + " |",
             "|---|---|" + "---|" * len(fast)]
    for i, b in enumerate(bins):
        lo, hi = b["margin"]
        cells = [s[n]["decomposition"]["flip_rate_by_margin"][i] for n in fast]
        lines.append(f"| [{lo:g}, {hi:g}) | {b['n']} | " + " | ".join(
            f"{c['k']} [{c['low']:.3f}, {c['high']:.3f}]" if c["n"] else "-" for c in cells) + " |")
    return lines


def markdown(report: dict) -> str:
    s, names, controls = report["summary"], list(report["summary"]), report.get("controls", [])
    f = report["floors"]
    lines = [f"# VQA agreement: {report['model']}", "",
             f"n = {report['n']} paired requests: {report['items']} items x conversation seeds "
             f"{report['seeds'][0]}-{report['seeds'][-1]}, layout `{report['layout']}`. " + setup_line(report), "",
             "Intervals are exact (Clopper-Pearson) 95%. Verdict: PASS when the exact one-sided 95% lower bound "
             f"of agreement and the item-clustered bootstrap lower bound are both >= {report['target']}. "
             f"Floors (need no image, from full's answers): image-blind {f['image_blind']:.3f}, "
             f"shuffled-image {f['shuffled_image']:.3f}."
             + (f" Asked the same question about another image of its type (the position controls' own floor): "
                f"{f['shuffled_same_question']:.3f}." if "shuffled_same_question" in f else ""), ""]
    lines += agreement_table(s, names, controls)
    if dial_arms(s):
        lines += ["", "## The fidelity dial (blend)", ""] + dial_table(report)
    lines += ["", "## Agreement by question type (k/n [exact 95%])", ""] + per_type_table(s, names)
    lines += ["", "## Flips (full's answer -> arm's answer)", ""] + flip_lines(s, names, controls)
    if any(s[n].get("decomposition") for n in names):
        lines += ["", "## Error decomposition (first answer token; margin units are logits)", "",
                  "rotation = margin(arm) - margin(block-masked oracle at native positions); isolation = "
                  "margin(oracle) - margin(full); they sum to the arm's margin change.", ""]
        lines += decomposition_table(s, names)
        lines += ["", "### First-token flips by full's top-2 margin (count [exact 95% rate])", ""]
        lines += margin_table(s, names)
    lines += ["", "TTFT on these tiny models is dominated by per-request overhead (tokenising, planning, "
              "Python), not by prefill: the ratio shows no speed-up here and says nothing about large models.",
              "", "Arms: " + "; ".join(f"`{n}` {m}" for n, m in report["arms"].items()) + "."]
    return "\n".join(lines) + "\n"


def _disagreements(rates: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disagreement counts n - k and their exact 95% interval, from agreement rates."""
    dis = np.array([r["n"] - r["k"] for r in rates], dtype=float)
    low = np.array([r["n"] * (1 - r["high"]) for r in rates])
    high = np.array([r["n"] * (1 - r["low"]) for r in rates])
    return dis, low, high


def plot(report: dict, path: Path) -> None:
    """Disagreement counts with exact intervals, floors as bands, controls in another colour, per-type
    small multiples, TTFT as a ratio to full."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, controls = report["summary"], report.get("controls", [])
    names = [n for n in s if n != "full"]
    types = list(s[names[0]]["by_type"]) if names else []
    fig = plt.figure(figsize=(15, 10))
    grid = fig.add_gridspec(3, 5)
    ax = fig.add_subplot(grid[0, :3])
    colours = ["#c44e52" if a in controls else "#4c72b0" for a in names]
    n = report["n"]
    x = np.arange(len(names))
    dis, low, high = _disagreements([s[a]["agreement"] for a in names])
    ax.bar(x, dis, yerr=[dis - low, high - dis], capsize=4, color=colours)
    ax.axhspan(n * (1 - report["floors"]["image_blind"]), n, color="#dd8452", alpha=0.15,
               label="at or below the image-blind floor")
    ax.axhspan(n * (1 - report["floors"]["shuffled_image"]), n, color="#8172b3", alpha=0.15,
               label="at or below the shuffled-image floor")
    ax.axhline(n * (1 - report["target"]), color="k", ls="--", lw=1, label=f"agreement {report['target']}")
    ax.set_yscale("symlog", linthresh=10)
    ax.set_ylim(0, n)
    ax.set_xticks(x, names, rotation=20, ha="right")
    ax.set_ylabel(f"disagreements with full, of {n} (exact 95%)")
    ax.legend(fontsize=7, loc="upper left")
    ax2 = fig.add_subplot(grid[0, 3:])
    ax2.bar(x, [s[a]["ttft_ratio_median"] for a in names], color=colours)
    ax2.axhline(1.0, color="k", lw=1)
    ax2.set_xticks(x, names, rotation=20, ha="right")
    ax2.set_ylabel("median TTFT / full")
    ax2.set_title("overhead-dominated on tiny models: not a speed-up claim", fontsize=8)
    short = [a.replace("splice-", "") for a in names]
    for i, t in enumerate(types[:10]):
        axt = fig.add_subplot(grid[1 + i // 5, i % 5])
        dis, low, high = _disagreements([s[a]["by_type"][t] for a in names])
        axt.bar(x, dis, yerr=[dis - low, high - dis], capsize=2, color=colours)
        axt.set_ylim(0, max(high.max(), 1) * 1.05)
        axt.set_title(f"{t} (n={s[names[0]]['by_type'][t]['n']})", fontsize=8)
        axt.set_xticks(x, short, rotation=45, ha="right", fontsize=7)
    fig.suptitle(f"{report['model']}: n={n} paired requests, exact 95% intervals; red = controls")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def span(r: list[int]) -> str:
    """A half-open bin [lo, hi) as text; the open-ended outer bins as < hi and >= lo."""
    lo, hi = r
    if lo <= -10**5:
        return f"< {hi}"
    if hi >= 10**5:
        return f">= {lo}"
    return f"{lo}" if hi == lo + 1 else f"{lo} .. {hi - 1}"


def grid_markdown(report: dict) -> str:
    conds = report["by_condition"]
    arms = [n for n in report["arms"] if n != "full"]
    lines = [f"# Stress grid: {report['model']}", "",
             f"{report['items']} items x seeds {report['seeds'][0]}-{report['seeds'][-1]} per condition, "
             f"{report['n']} paired requests in all. " + setup_line(report) + " Agreement with `full`, k/n [exact 95%]; "
             "the models were trained on none of these layouts, so this is agreement, not accuracy.", "",
             "| condition | n | asked image's offset | images / prompt | " + " | ".join(arms)
             + " | cached tokens / req (prefix, splice-k1) |",
             "|---|---|---|---|" + "---|" * len(arms) + "---|"]
    for c, d in conds.items():
        s = d["summary"]
        n = s["full"]["agreement"]["n"]
        cached = f"{s['prefix']['cached_tokens']:.0f}, {s['splice-k1']['cached_tokens']:.0f}" if (
            "prefix" in s and "splice-k1" in s) else "-"
        lines.append(f"| {c} | {n} | {d['offset_range'][0]} .. {d['offset_range'][1]} | {d['images_mean']:.1f} | "
                     + " | ".join(rate(s[a]["agreement"]) for a in arms) + f" | {cached} |")
    for key, title in (("by_offset", "asked image's offset (temporal position moved)"),
                       ("by_images", "images in the prompt")):
        lines += ["", f"## Agreement by {title}, all conditions", "",
                  "| range | n | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
        for i, b in enumerate(report[key][arms[0]]):
            if b["n"]:
                lines.append(f"| {span(b['range'])} | {b['n']} | "
                             + " | ".join(rate(report[key][a][i]) for a in arms) + " |")
    flips = [f"{c}: " + ("; ".join(f"{t} {e['flips']} ({', '.join(f'{k} x{v}' for k, v in e['by_direction'].items())})"
                                   for t, e in d["summary"]["splice-k1"]["by_type"].items() if e["flips"])
                         or "no flips")
             for c, d in conds.items() if "splice-k1" in d["summary"]]
    lines += ["", "## splice-k1 flips by condition (full -> splice-k1)", ""] + [f"- {f}" for f in flips]
    return "\n".join(lines) + "\n"


def grid_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [n for n in report["arms"] if n != "full"]
    controls = report.get("controls", [])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key, label in ((axes[0], "by_offset", "asked image's offset"), (axes[1], "by_images", "images in prompt")):
        bins = [b for b in report[key][arms[0]]]
        keep = [i for i, b in enumerate(bins) if b["n"]]
        x = np.arange(len(keep))
        for j, a in enumerate(arms):
            e = [report[key][a][i] for i in keep]
            dis = np.array([v["n"] - v["k"] for v in e], dtype=float)
            lo = np.array([v["n"] * (1 - v["high"]) for v in e])
            hi = np.array([v["n"] * (1 - v["low"]) for v in e])
            ax.errorbar(x + (j - len(arms) / 2) * 0.08, dis, yerr=[dis - lo, hi - dis], fmt="o-", capsize=3,
                        label=a, color=("#c44e52" if a in controls else None), lw=1)
        ax.set_xticks(x, [f"{span(bins[i]['range'])}\nn={bins[i]['n']}" for i in keep],
                      fontsize=7)
        ax.set_yscale("symlog", linthresh=5)
        ax.set_xlabel(label)
        ax.set_ylabel("disagreements with full (exact 95%)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{report['model']} stress grid: n={report['n']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report_files(report: dict, out: str | Path, text: str) -> None:
    """report.json (every figure) and report.md (``text``) into ``out`` (made if missing)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(text)


def write_grid_reports(report: dict, out: Path) -> None:
    write_report_files(report, out, grid_markdown(report))
    grid_plot(report, out / "grid.png")


def write_reports(report: dict, out: Path) -> None:
    write_report_files(report, out, markdown(report))
    plot(report, out / "agreement.png")
