"""The VQA agreement evaluation: how often does each fast path answer exactly like a full recompute?

Every item is asked inside a seeded multi-turn conversation (vqa_eval/protocol.py) under each arm;
`full` is the reference. Writes report.json (every item's answers per arm), report.md (the
tables) and agreement.png. Metric names: MECHANISM.md section 5.
"""

from __future__ import annotations

import json
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmkv.adapters import ImageFeatures
from mmkv.engine import BUNDLED_MODEL, REPO_ROOT, Engine
from mmkv.images import decode_image
from mmkv.messages import parse_messages
from mmkv.splice import prefill_full
from mmkv.vqa_eval.dataset import VQAItem, load_vqa_set
from mmkv.vqa_eval.metrics import Estimate, accuracy_flags, agreement_flags, logit_cosine, normalize_answer, p90
from mmkv.vqa_eval.protocol import Conversation, balanced_subset, build_conversation, to_messages

DEFAULT_SET = REPO_ROOT / "samples" / "vqa"
REFERENCE = "full"


@dataclass(frozen=True)
class Arm:
    name: str
    reuse: bool  # splice cached image KV
    seam_tokens: int = 1
    rope_policy: str = "native"
    exact_prefix: bool = False  # reuse the previous request's KV up to the common token prefix
    meaning: str = ""


ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("full", False, meaning="reference: one full forward over the whole conversation, no reuse"),
    Arm("prefix", False, exact_prefix=True,
        meaning="exact-prefix reuse only (vLLM / SGLang): KV up to the first changed token, the rest recomputed"),
    Arm("splice-k0", True, 0, meaning="cached image KV, native re-rotation, no seam repair"),
    Arm("splice-k1", True, 1, meaning="cached image KV, native re-rotation, 1 seam token recomputed"),
    Arm("splice-k2", True, 2, meaning="cached image KV, native re-rotation, 2 seam tokens recomputed"),
    Arm("splice-temporal", True, 1, "temporal", meaning="cached image KV, only the temporal axis moved, k=1"),
    Arm("no-rotate", True, 1, "none", meaning="control: cached KV spliced where it was computed, k=1"),
)}
CATEGORY_ORDER = ("perception", "reasoning", "agentic")


@dataclass
class ArmResult:
    answer: str
    first_logits: torch.Tensor  # [V] float32
    ttft_s: float
    vision_tower_runs: int
    lm_tokens_computed: int
    cached_tokens: int


# ----------------------------------------------------------------------------- the prefix arm


class ExactPrefixReuse:
    """What a prefix cache gives: the previous request's KV is kept, and a new request reuses it up
    to the longest common token prefix (capped at len - 1, so the last logits are computed); every
    token after it, image pads included, is recomputed at its native position."""

    def __init__(self, engine: Engine, images: dict[str, object]):
        self.engine, self.adapter = engine, engine.adapter
        self.images = images  # engine image id -> decoded RGB PIL image
        self._pixels: dict[str, tuple[torch.Tensor, tuple[int, int, int]]] = {}
        self.prev_keys: list | None = None
        self.prev_cache = None

    def _prompt(self, messages) -> tuple[torch.Tensor, list[str], list[tuple[int, int, int]]]:
        ids = self.engine.prompt_ids(messages)
        refs = [r.image_id for r in parse_messages(messages)[1]]
        return ids, refs, [self._preprocessed(r)[1] for r in refs]

    def _preprocessed(self, image_id: str):
        if image_id not in self._pixels:
            self._pixels[image_id] = self.adapter.preprocess_image(self.images[image_id])
        return self._pixels[image_id]

    def remember(self, messages) -> None:
        """Keep the KV of an earlier request (the state a prefix cache holds after serving it)."""
        ids, refs, grids = self._prompt(messages)
        feats = ImageFeatures.concat([self.adapter.encode_image(*self._preprocessed(r)) for r in refs])
        self.prev_keys = token_keys(ids, self.adapter.image_spans(ids), refs)
        self.prev_cache = prefill_full(self.adapter, ids, self.adapter.native_positions(ids, grids), feats).cache

    def generate(self, messages, max_new_tokens: int) -> ArmResult:
        t0 = time.perf_counter()
        ids, refs, grids = self._prompt(messages)
        positions = self.adapter.native_positions(ids, grids)
        spans = self.adapter.image_spans(ids)
        n = common_prefix_length(self.prev_keys, token_keys(ids, spans, refs))
        cache = self.prev_cache
        cache.crop(n - cache.get_seq_length())
        feats, runs = [], 0
        for (start, end), ref in zip(spans, refs):
            first_pad, stop = start + 1, end - 1
            if stop > n:  # some of this image's pads are recomputed: the vision tower runs
                f = self.adapter.encode_image(*self._preprocessed(ref))
                feats.append(f.slice(max(n - first_pad, 0), stop - first_pad))
                runs += 1
        logits = self.adapter.forward(ids[n:], positions[:, n:], cache, ImageFeatures.concat(feats))[0]
        first_logits, token = logits.float().cpu(), int(logits.argmax())
        ttft = time.perf_counter() - t0
        out, next_pos = [], int(positions.max()) + 1
        for step in range(max_new_tokens):
            if token in self.engine.stop_ids:
                break
            out.append(token)
            if step + 1 < max_new_tokens:
                pos = torch.full((3, 1), next_pos + step, dtype=torch.long)
                token = int(self.adapter.forward(torch.tensor([token]), pos, cache)[0].argmax())
        text = self.adapter.tokenizer.decode(out, skip_special_tokens=True)
        self.prev_cache = None  # cropped and extended: not the earlier request's state any more
        return ArmResult(text, first_logits, ttft, runs, ids.numel() - n, n)


def token_keys(ids: torch.Tensor, spans: list[tuple[int, int]], image_ids: list[str]) -> list:
    """One key per token: its id, or (image id, index) for an image pad. Pads of different images
    share a token id, so comparing ids alone would reuse one image's KV for another (vLLM keys its
    blocks by the image hash for the same reason)."""
    keys: list = ids.tolist()
    for (start, end), image_id in zip(spans, image_ids):
        keys[start + 1:end - 1] = [(image_id, k) for k in range(end - start - 2)]
    return keys


def common_prefix_length(a: list, b: list) -> int:
    """Leading keys `a` and `b` share, capped at len(b) - 1 (the last logits are needed)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return min(n, len(b) - 1)


# ----------------------------------------------------------------------------- running the arms


def run_arm(engine: Engine, arm: Arm, messages, max_new_tokens: int, prefix: ExactPrefixReuse | None) -> ArmResult:
    if arm.exact_prefix:
        return prefix.generate(messages, max_new_tokens)
    r = engine.generate(messages, max_new_tokens=max_new_tokens, reuse=arm.reuse, seam_tokens=arm.seam_tokens,
                        rope_policy=arm.rope_policy)
    return ArmResult(r.text, r.first_logits, r.ttft_s, r.vision_tower_runs, r.lm_tokens_computed,
                     r.usage.cached_tokens)


def image_offset(engine: Engine, messages) -> int:
    """How far (temporal position) the asked image's chunk moves from where it was precompiled:
    what `no-rotate` leaves uncorrected."""
    last = max(engine.splice_plan(messages, rope_policy="native").placements, key=lambda p: p.start)
    return int(last.target[0, 0] - last.entry.position_ids[0, 0])


def evaluate_item(engine: Engine, conv: Conversation, arms: list[Arm], file_ids: dict[str, str],
                  images: dict[str, object], max_new_tokens: int, rng: random.Random) -> dict:
    earlier = to_messages(conv.system, conv.earlier, file_ids)
    later = to_messages(conv.system, conv.later, file_ids)
    results: dict[str, ArmResult] = {}
    for arm in rng.sample(arms, len(arms)):  # a shuffled order per item: no arm always runs warm
        prefix = None
        if arm.exact_prefix:
            prefix = ExactPrefixReuse(engine, images)
            prefix.remember(earlier)
        results[arm.name] = run_arm(engine, arm, later, max_new_tokens, prefix)
    ref = results[REFERENCE]
    it = conv.item
    return {
        "id": it.id, "category": it.category, "type": it.type, "question": it.question, "label": it.answer,
        "earlier_turns": len(conv.earlier) - 1, "later_turns": len(conv.later) - 1,
        "prompt_tokens": int(engine.prompt_ids(later).numel()), "offset": image_offset(engine, later),
        "arms": {a.name: {
            "answer": results[a.name].answer,
            "agree": normalize_answer(results[a.name].answer) == normalize_answer(ref.answer),
            "correct": normalize_answer(results[a.name].answer) == normalize_answer(it.answer),
            "logit_cosine": logit_cosine(results[a.name].first_logits, ref.first_logits),
            "ttft_s": results[a.name].ttft_s,
            "vision_tower_runs": results[a.name].vision_tower_runs,
            "lm_tokens_computed": results[a.name].lm_tokens_computed,
            "cached_tokens": results[a.name].cached_tokens,
        } for a in arms},
    }


def summarize(rows: list[dict], arm_names: list[str], seed: int) -> dict:
    """Per arm, per category and overall: every metric with its n and bootstrap 95% interval."""
    groups = {"overall": rows, **{c: [r for r in rows if r["category"] == c] for c in CATEGORY_ORDER}}
    out: dict = {}
    for name in arm_names:
        out[name] = {}
        for group, rs in groups.items():
            if not rs:
                continue
            answers = [r["arms"][name]["answer"] for r in rs]
            col = lambda key: [r["arms"][name][key] for r in rs]  # noqa: E731
            out[name][group] = {
                "agreement": Estimate.of(agreement_flags(answers, [r["arms"][REFERENCE]["answer"] for r in rs]),
                                         seed=seed).to_json(),
                "accuracy": Estimate.of(accuracy_flags(answers, [r["label"] for r in rs]), seed=seed).to_json(),
                "logit_cosine": Estimate.of(col("logit_cosine"), seed=seed).to_json(),
                "ttft_median_s": Estimate.of(col("ttft_s"), np.median, seed=seed).to_json(),
                "ttft_p90_s": p90(col("ttft_s")),
                "vision_tower_runs": float(np.mean(col("vision_tower_runs"))),
                "lm_tokens_computed": float(np.mean(col("lm_tokens_computed"))),
                "n": len(rs),
            }
    return out


def run_eval(model_dir: str | Path | None = None, set_dir: str | Path | None = None, arms: list[str] | None = None,
             limit: int | None = None, seed: int = 0, out: str | Path = "eval-out", max_new_tokens: int = 6,
             engine: Engine | None = None, progress: bool = True) -> dict:
    """Run every arm on the same items and write report.json, report.md and agreement.png to `out`."""
    names = list(ARMS) if not arms else list(dict.fromkeys([REFERENCE, *arms]))
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    chosen = [ARMS[n] for n in names]
    torch.manual_seed(seed)
    engine = engine or Engine.from_pretrained(model_dir)
    pool = load_vqa_set(set_dir or DEFAULT_SET)
    items = balanced_subset(pool, limit)
    convs = [build_conversation(it, pool, seed) for it in items]
    file_ids, images = {}, {}
    for path in dict.fromkeys(p for c in convs for p in c.images):
        data = Path(path).read_bytes()
        file_ids[path] = engine.add_image(data)  # uploaded earlier: precompiled before any timing
        images[file_ids[path]] = decode_image(data).image
    _warm_up(engine, convs[0], file_ids, max_new_tokens)
    rng = random.Random(seed)
    rows, t0 = [], time.perf_counter()
    from tqdm import tqdm

    for conv in tqdm(convs, desc="mmkv eval", unit="item", disable=not progress):
        rows.append(evaluate_item(engine, conv, chosen, file_ids, images, max_new_tokens, rng))
    report = {
        "model": engine.model_id, "model_dir": str(model_dir) if model_dir else "bundled",
        "set": str(set_dir or DEFAULT_SET), "seed": seed, "limit": limit, "n": len(rows),
        "max_new_tokens": max_new_tokens, "reference": REFERENCE,
        "arms": {a.name: a.meaning for a in chosen},
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "device": str(engine.adapter.device), "dtype": str(engine.adapter.dtype)},
        "checkpoint": _checkpoint_state(Path(model_dir) if model_dir else BUNDLED_MODEL),
        "wall_s": round(time.perf_counter() - t0, 2),
        "summary": summarize(rows, names, seed),
        "items": rows,
    }
    write_reports(report, Path(out))
    return report


def _checkpoint_state(model_dir: Path) -> dict | None:
    """Steps and finality of a bundled tiny model (samples/train.py writes train_state.json)."""
    path = model_dir / "train_state.json"
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    return {k: state.get(k) for k in ("family", "steps", "elapsed_s", "final", "loss_ema")}


def _warm_up(engine: Engine, conv: Conversation, file_ids: dict[str, str], max_new_tokens: int) -> None:
    """One untimed request per path, so the first item's TTFT does not pay for lazy initialisation."""
    msgs = to_messages(conv.system, conv.later, file_ids)
    engine.generate(msgs, max_new_tokens=1, reuse=False)
    engine.generate(msgs, max_new_tokens=1, reuse=True)


# ----------------------------------------------------------------------------- reports


def _ci(e: dict, scale: float = 1.0, digits: int = 3) -> str:
    return f"{e['value'] * scale:.{digits}f} [{e['low'] * scale:.{digits}f}, {e['high'] * scale:.{digits}f}]"


def markdown(report: dict) -> str:
    s = report["summary"]
    names = list(s)
    lines = [f"# VQA agreement: {report['model']}", "",
             f"n = {report['n']} items (set {Path(report['set']).name}, seed {report['seed']}), reference arm "
             f"`{report['reference']}`, greedy, max {report['max_new_tokens']} new tokens; "
             f"{report['machine']['device']} {report['machine']['dtype']}, {report['machine']['threads']} threads. "
             f"Intervals: bootstrap 95%."
             + (f" Checkpoint: {report['checkpoint']['steps']} training steps"
                f"{'' if report['checkpoint']['final'] else ' (an intermediate save)'}."
                if report.get("checkpoint") else ""), "",
             "| arm | n | agreement | accuracy | logit cosine | TTFT median ms | TTFT p90 ms | vision runs / item "
             "| LM tokens / item |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        o = s[name]["overall"]
        lines.append(f"| {name} | {o['n']} | {_ci(o['agreement'])} | {_ci(o['accuracy'])} | "
                     f"{_ci(o['logit_cosine'], digits=4)} | {_ci(o['ttft_median_s'], 1000, 1)} | "
                     f"{o['ttft_p90_s'] * 1000:.1f} | {o['vision_tower_runs']:.2f} | {o['lm_tokens_computed']:.1f} |")
    cats = [c for c in CATEGORY_ORDER if c in s[names[0]]]
    for metric in ("agreement", "accuracy"):
        lines += ["", f"## {metric} by category", "",
                  "| arm | " + " | ".join(f"{c} (n={s[names[0]][c]['n']})" for c in cats) + " |",
                  "|---|" + "---|" * len(cats)]
        for name in names:
            lines.append(f"| {name} | " + " | ".join(_ci(s[name][c][metric]) for c in cats) + " |")
    missing = [n for n in names if n != report["reference"] and s[n]["overall"]["agreement"]["value"] < 0.99]
    lines += ["", "Arms below agreement 0.99: " + (", ".join(f"`{n}`" for n in missing) if missing else "none"), "",
              "Arms: " + "; ".join(f"`{n}` {m}" for n, m in report["arms"].items()) + "."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    names = list(s)
    x = np.arange(len(names))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, scale, label in ((ax1, "agreement", 1.0, "agreement with full"),
                                  (ax2, "ttft_median_s", 1000.0, "TTFT median (ms)")):
        e = [s[n]["overall"][key] for n in names]
        val = np.array([v["value"] for v in e]) * scale
        err = np.array([[v["value"] - v["low"] for v in e], [v["high"] - v["value"] for v in e]]) * scale
        ax.bar(x, val, yerr=err, capsize=4, color="#4c72b0")
        ax.set_xticks(x, names, rotation=30, ha="right")
        ax.set_ylabel(label)
    ax1.axhline(0.99, color="#c44e52", ls="--", lw=1)
    ax1.set_ylim(0, 1.05)
    fig.suptitle(f"{report['model']}: n={report['n']}, bootstrap 95% intervals")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown(report))
    plot(report, out / "agreement.png")
