"""The VQA agreement evaluation: how often does each fast path answer exactly like a full recompute?

Every item is asked inside seeded multi-turn conversations (vqa_eval/protocol.py), under several
conversation seeds, under each arm; `full` is the reference. Every arm sees the same
cross-request state (see `evaluate_request`). Writes report.json (every request's answers, timings and error
decomposition per arm), report.md (vqa_eval/report.py) and agreement.png. Metric names:
MECHANISM.md section 5; statistics: vqa_eval/stats.py.
"""

from __future__ import annotations

import copy
import json
import platform
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmkv.adapters import ImageFeatures
from mmkv.engine import BUNDLED_MODEL, REPO_ROOT, Engine
from mmkv.images import decode_image
from mmkv.request.messages import parse_messages
from mmkv.store.prefix_cache import common_prefix
from mmkv.vqa_eval.dataset import ANSWERS, TYPES, load_vqa_set
from mmkv.vqa_eval.decompose import answer_token_ids, decompose, oracle_logits
from mmkv.vqa_eval.metrics import logit_cosine, normalize_answer, p90
from mmkv.vqa_eval.protocol import Conversation, Shape, balanced_subset, build_conversation, to_messages
from mmkv.vqa_eval.stats import (clopper_pearson, cluster_bootstrap, flip_directions, mcnemar_exact, verdict)

DEFAULT_SET = REPO_ROOT / "samples" / "vqa"
REFERENCE = "full"
BASELINE = "splice-k1"  # the default fast path: other arms are compared with it (McNemar)
TARGET = 0.99
#: Seam sizes whose block-masked oracle runs (the default path's): the rotation / isolation split
#: is given for the arms with these seams (splice-k1, splice-temporal, no-rotate).
ORACLE_SEAMS = (1,)
MARGIN_BINS = (0.0, 0.5, 1.0, 2.0, 4.0, float("inf"))


@dataclass(frozen=True)
class Arm:
    name: str
    reuse: bool  # splice cached image KV
    seam_tokens: int = 1
    rope_policy: str = "native"
    exact_prefix: bool = False  # reuse the previous request's KV up to the common token prefix
    control: bool = False  # built to be wrong: shows the evaluation can see a broken path
    meaning: str = ""
    blend: float | None = None  # the fidelity dial's ratio (mmkv.request.blend); None: the engine's default
    blend_select: str | None = None

    def options(self) -> dict:
        """The engine's keyword arguments for this arm's splice settings."""
        dial = {} if self.blend is None else {"blend": self.blend, "blend_select": self.blend_select}
        return dict(reuse=self.reuse, seam_tokens=self.seam_tokens, rope_policy=self.rope_policy, **dial)


ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("full", False, meaning="reference: one full forward over the whole conversation, no reuse"),
    Arm("prefix", False, exact_prefix=True,
        meaning="exact-prefix reuse only (vLLM / SGLang): KV up to the first changed token, the rest recomputed"),
    Arm("splice-k0", True, 0, meaning="cached image KV, native re-rotation, no seam repair"),
    Arm("splice-k1", True, 1, meaning="cached image KV, native re-rotation, 1 seam token recomputed"),
    Arm("splice-k2", True, 2, meaning="cached image KV, native re-rotation, 2 seam tokens recomputed"),
    Arm("splice-temporal", True, 1, "temporal", meaning="cached image KV, only the temporal axis moved, k=1"),
    Arm("no-rotate", True, 1, "none", control=True,
        meaning="control: cached KV spliced where it was computed, k=1"),
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
    """What an automatic prefix cache (vLLM / SGLang) gives, token-granular: the KV of the last
    `capacity` prompts served is kept, and a request reuses the longest common token prefix with
    any of them (capped at len - 1, so the last logits are computed); every token after it, image
    pads included, is recomputed at its native position, the vision tower rerunning for them.
    Its history is the run's request history, the same one the engine's prefix cache sees."""

    def __init__(self, engine: Engine, images: dict[str, object], capacity: int = 64):
        self.engine, self.adapter = engine, engine.adapter
        self.images = images  # engine image id -> decoded RGB PIL image
        self._pixels: dict[str, tuple[torch.Tensor, tuple[int, int, int]]] = {}
        self.entries: deque[tuple[list, object]] = deque(maxlen=capacity)  # (token keys, KV cache)

    def _prompt(self, messages) -> tuple[torch.Tensor, list[str], list[tuple[int, int, int]]]:
        ids = self.engine.prompt_ids(messages)
        refs = [r.image_id for r in parse_messages(messages)[1]]
        return ids, refs, [self._preprocessed(r)[1] for r in refs]

    def _preprocessed(self, image_id: str):
        if image_id not in self._pixels:
            self._pixels[image_id] = self.adapter.preprocess_image(self.images[image_id])
        return self._pixels[image_id]

    def _longest(self, keys: list) -> tuple[int, object]:
        """Tokens reusable from the best kept prompt, and a private copy of its KV cropped to them."""
        best = max(self.entries, key=lambda e: common_prefix_length(e[0], keys), default=None)
        n = common_prefix_length(best[0], keys) if best else 0
        if n == 0:
            return 0, self.adapter.new_cache()
        cache = copy.deepcopy(best[1])
        cache.crop(n - cache.get_seq_length())
        return n, cache

    def generate(self, messages, max_new_tokens: int) -> ArmResult:
        t0 = time.perf_counter()
        ids, refs, grids = self._prompt(messages)
        positions = self.adapter.native_positions(ids, grids)
        spans = self.adapter.image_spans(ids)
        keys = token_keys(ids, spans, refs)
        n, cache = self._longest(keys)
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
        self.entries.append((keys, cache))  # extended by the decode below; reuse crops to the prompt
        out, next_pos = [], int(positions.max()) + 1
        for step in range(max_new_tokens):
            if token in self.engine.stop_ids:
                break
            out.append(token)
            if step + 1 < max_new_tokens:
                pos = torch.full((3, 1), next_pos + step, dtype=torch.long)
                token = int(self.adapter.forward(torch.tensor([token]), pos, cache)[0].argmax())
        text = self.adapter.tokenizer.decode(out, skip_special_tokens=True)
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
    return min(common_prefix(a, b), len(b) - 1)


# ----------------------------------------------------------------------------- running the arms


def image_offset(engine: Engine, messages) -> int:
    """How far (temporal position) the asked image's chunk moves from where it was precompiled:
    what `no-rotate` leaves uncorrected. Negative: the image sits earlier than its precompile."""
    last = max(engine.splice_plan(messages, rope_policy="native").placements, key=lambda p: p.start)
    return int(last.target[0, 0] - last.entry.position_ids[0, 0])


@dataclass
class Context:
    """What every request of one run shares."""

    engine: Engine
    arms: list[Arm]
    file_ids: dict[str, str]  # path -> engine image id
    prefix: ExactPrefixReuse  # the `prefix` arm's cache, kept across requests
    answer_ids: list[int]
    max_new_tokens: int
    decomposition: bool  # run the block-masked oracles
    rng: random.Random


def serve_earlier(ctx: Context, arm: Arm, earlier) -> None:
    """Serve the conversation's earlier request under `arm` (untimed): its prompt's KV enters the
    arm's prefix cache, as it would have in a server."""
    if arm.exact_prefix:
        ctx.prefix.generate(earlier, 1)
    elif arm.reuse:
        ctx.engine.generate(earlier, max_new_tokens=1, **arm.options())


def run_arm(ctx: Context, arm: Arm, messages) -> ArmResult:
    if arm.exact_prefix:
        return ctx.prefix.generate(messages, ctx.max_new_tokens)
    r = ctx.engine.generate(messages, max_new_tokens=ctx.max_new_tokens, **arm.options())
    return ArmResult(r.text, r.first_logits, r.ttft_s, r.vision_tower_runs, r.lm_tokens_computed,
                     r.usage.cached_tokens)


def evaluate_request(ctx: Context, conv: Conversation, layout: str = "new_chat") -> dict:
    """One paired request: `later` under every arm, in a shuffled order (no arm always runs warm).

    Cross-request state is the same for every arm: all images precompiled, and the prefix caches
    (the engine's per arm settings, the `prefix` arm's own) hold the run's earlier requests. In
    the `continue` layout every arm is first served the conversation's earlier request, whose
    prompt is a prefix of `later`."""
    engine = ctx.engine
    earlier = to_messages(conv.system, conv.earlier, ctx.file_ids)
    later = to_messages(conv.system, conv.later, ctx.file_ids)
    results: dict[str, ArmResult] = {}
    for arm in ctx.rng.sample(ctx.arms, len(ctx.arms)):
        if layout == "continue":
            serve_earlier(ctx, arm, earlier)
        results[arm.name] = run_arm(ctx, arm, later)
    ref = results[REFERENCE]
    oracles = {}
    if ctx.decomposition:
        for k in sorted({a.seam_tokens for a in ctx.arms if a.reuse} & set(ORACLE_SEAMS)):
            oracles[k] = oracle_logits(engine, later, k)
    it = conv.item
    plan = engine.splice_plan(later, rope_policy="native")
    row = {
        "id": it.id, "seed": conv.seed, "layout": layout, "category": it.category, "type": it.type,
        "question": it.question, "label": it.answer,
        "earlier_turns": len(conv.earlier) - 1, "later_turns": len(conv.later) - 1,
        "prompt_tokens": int(plan.input_ids.numel()), "images": len(plan.placements),
        "offset": image_offset(engine, later), "arms": {},
    }
    for a in ctx.arms:
        r = results[a.name]
        rec = {
            "answer": r.answer,
            "agree": normalize_answer(r.answer) == normalize_answer(ref.answer),
            "correct": normalize_answer(r.answer) == normalize_answer(it.answer),
            "logit_cosine": logit_cosine(r.first_logits, ref.first_logits),
            "ttft_s": r.ttft_s, "ttft_ratio": r.ttft_s / ref.ttft_s,
            "vision_tower_runs": r.vision_tower_runs, "lm_tokens_computed": r.lm_tokens_computed,
            "cached_tokens": r.cached_tokens,
        }
        if a.name != REFERENCE:
            rec["error"] = decompose(ref.first_logits, r.first_logits,
                                     oracles.get(a.seam_tokens) if a.reuse else None, ctx.answer_ids)
        row["arms"][a.name] = rec
    return row


# ----------------------------------------------------------------------------- summaries


def _rate(k: int, n: int) -> dict:
    low, high = clopper_pearson(k, n)
    return {"k": k, "n": n, "value": k / n if n else float("nan"), "low": low, "high": high}


def _collision(answers: list[str]) -> float | None:
    """The chance that two different requests of ``answers`` agree (unbiased: a request is never
    paired with itself); None for fewer than two."""
    n = len(answers)
    if n < 2:
        return None
    counts = np.unique(answers, return_counts=True)[1]
    return float(((counts ** 2).sum() - n) / (n * (n - 1)))


def floors(rows: list[dict]) -> dict:
    """Agreement that needs no image, from `full`'s answers per type: *image-blind* answers each
    type's most common answer; *shuffled-image* answers as for a random other image of the same
    type (sum over answers of P(answer)^2). The splice arms must sit far above both.

    *shuffled_same_question* is the tighter floor for an arm that still reads the question but
    not its own image, as the position controls do: the chance that another request of the same
    type *and question text* got the same answer from `full` (unbiased; a question asked only once
    takes its type's figure). A question such as ``what shape is the red one ?`` narrows the
    answers, so this floor is at least as high as the per-type one in expectation."""
    blind = shuffled = same_q = 0.0
    for t in {r["type"] for r in rows}:
        of_type = [r for r in rows if r["type"] == t]
        answers = [normalize_answer(r["arms"][REFERENCE]["answer"]) for r in of_type]
        counts = np.unique(answers, return_counts=True)[1]
        blind += counts.max()
        shuffled += (counts ** 2).sum() / len(answers)
        by_q: dict[str, list[str]] = {}
        for r, a in zip(of_type, answers):
            by_q.setdefault(r.get("question", ""), []).append(a)
        fallback = _collision(answers) or 0.0
        for group in by_q.values():
            c = _collision(group)
            same_q += len(group) * (fallback if c is None else c)
    return {"image_blind": blind / len(rows), "shuffled_image": shuffled / len(rows),
            "shuffled_same_question": same_q / len(rows)}


def margin_strata(rows: list[dict], name: str) -> list[dict]:
    """First-token flip rate against full's top-2 margin, with exact intervals."""
    out = []
    for lo, hi in zip(MARGIN_BINS, MARGIN_BINS[1:]):
        sel = [r["arms"][name]["error"] for r in rows if lo <= r["arms"][name]["error"]["full_margin"] < hi]
        out.append({"margin": [lo, hi], **_rate(sum(e["first_token_flip"] for e in sel), len(sel))})
    return out


def decomposition_summary(rows: list[dict], name: str) -> dict:
    errs = [r["arms"][name]["error"] for r in rows]
    out = {
        "kl_answer_set_mean": float(np.mean([e["kl_answer_set"] for e in errs])),
        "kl_answer_set_max": float(np.max([e["kl_answer_set"] for e in errs])),
        "margin_change_median": float(np.median([e["margin_change"] for e in errs])),
        "answer_logprob_change_median": float(np.median([e["answer_logprob_change"] for e in errs])),
        "flip_rate_by_margin": margin_strata(rows, name),
    }
    if "rotation" in errs[0]:
        rot = np.abs([e["rotation"] for e in errs])
        iso = np.abs([e["isolation"] for e in errs])
        flips = [e for e in errs if e["first_token_flip"]]
        out.update(rotation_abs_median=float(np.median(rot)), isolation_abs_median=float(np.median(iso)),
                   rotation_share=float(rot.sum() / max(rot.sum() + iso.sum(), 1e-30)),
                   rotation_max_abs=float(np.max([e["rotation_max_abs"] for e in errs])),
                   flips_rotation_mean=float(np.mean([e["rotation"] for e in flips])) if flips else None,
                   flips_isolation_mean=float(np.mean([e["isolation"] for e in flips])) if flips else None)
    return out


def summarize_arm(rows: list[dict], name: str, seed: int) -> dict:
    agree = [bool(r["arms"][name]["agree"]) for r in rows]
    clusters = [r["id"] for r in rows]
    col = lambda key: [r["arms"][name][key] for r in rows]  # noqa: E731
    k = sum(agree)
    out = {
        "agreement": {**_rate(k, len(rows)), "cluster_ci": list(cluster_bootstrap(agree, clusters, seed=seed))},
        "verdict": verdict(agree, clusters, TARGET, seed=seed).to_json(),
        "accuracy": _rate(sum(col("correct")), len(rows)),
        "logit_cosine_mean": float(np.mean(col("logit_cosine"))),
        "ttft_median_s": float(np.median(col("ttft_s"))), "ttft_p90_s": p90(col("ttft_s")),
        "ttft_ratio_median": float(np.median(col("ttft_ratio"))),
        "vision_tower_runs": float(np.mean(col("vision_tower_runs"))),
        "lm_tokens_computed": float(np.mean(col("lm_tokens_computed"))),
        "cached_tokens": float(np.mean(col("cached_tokens"))),
        "by_category": {c: _rate(sum(a for a, r in zip(agree, rows) if r["category"] == c),
                                 sum(r["category"] == c for r in rows)) for c in CATEGORY_ORDER
                        if any(r["category"] == c for r in rows)},
        "by_type": {},
    }
    for t in [t for t in TYPES if any(r["type"] == t for r in rows)]:
        rs = [r for r in rows if r["type"] == t]
        pairs = [(normalize_answer(r["arms"][REFERENCE]["answer"]), normalize_answer(r["arms"][name]["answer"]))
                 for r in rs]
        out["by_type"][t] = {**_rate(sum(r["arms"][name]["agree"] for r in rs), len(rs)),
                             **flip_directions(pairs, t)}
    if name != REFERENCE and "error" in rows[0]["arms"][name]:
        out["decomposition"] = decomposition_summary(rows, name)
        out["confident"] = _rate(*_confident(rows, name))
    return out


CONFIDENT_MARGIN = 1.0  # logits: requests whose full top-2 margin exceeds it are not near ties


def _confident(rows: list[dict], name: str) -> tuple[int, int]:
    """Agreement (k, n) on the requests whose full recompute's top-2 margin exceeds CONFIDENT_MARGIN."""
    sel = [r["arms"][name]["agree"] for r in rows if r["arms"][name]["error"]["full_margin"] > CONFIDENT_MARGIN]
    return sum(sel), len(sel)


def summarize(rows: list[dict], arm_names: list[str], seed: int) -> dict:
    """Per arm: exact intervals, the verdict, per-type flips, decomposition; McNemar vs the baseline."""
    out = {name: summarize_arm(rows, name, seed) for name in arm_names}
    if BASELINE in arm_names:
        base = [r["arms"][BASELINE]["agree"] for r in rows]
        for name in arm_names:
            if name not in (REFERENCE, BASELINE):
                out[name]["mcnemar_vs_" + BASELINE] = mcnemar_exact([r["arms"][name]["agree"] for r in rows], base)
    return out


# ----------------------------------------------------------------------------- the run


def choose_arms(arms: list[str] | None, extra: list[Arm] = ()) -> list[Arm]:
    """The named arms (all when none is named, unless `extra` arms are given: then only the
    reference), the reference first, then `extra` (the fidelity dial's)."""
    names = (list(ARMS) if not extra else [REFERENCE]) if not arms else list(dict.fromkeys([REFERENCE, *arms]))
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    return [ARMS[n] for n in names] + [a for a in extra if a.name not in names]


def blend_arms(ratios: list[float], selects: list[str]) -> list[Arm]:
    """One arm per dial setting: `blend-R` (the deviation probe) or `blend-R-SELECT`, seam 1."""
    bad = [r for r in ratios if not 0.0 <= r <= 1.0]
    if bad:
        raise ValueError(f"--blend ratios must be in [0, 1], got {bad}")
    arms, seen = [], set()
    for select in selects:
        for r in ratios:
            if r in (0.0, 1.0) and r in seen:  # the plain splice and the full recompute whatever the selector
                continue
            seen.add(r)
            name = f"blend-{r:g}" + ("" if select == "deviation" else f"-{select}")
            arms.append(Arm(name, True, 1, blend=r, blend_select=select,
                            meaning=f"cached chunk KV, a share {r:g} of each chunk recomputed in context ({select}), k=1"))
    return arms


def make_context(engine: Engine, convs: list[Conversation], arms: list[Arm], max_new_tokens: int,
                 decomposition: bool, seed: int) -> Context:
    file_ids, images = {}, {}
    for path in dict.fromkeys(p for c in convs for p in c.images):
        data = Path(path).read_bytes()
        file_ids[path] = engine.add_image(data)  # uploaded earlier: precompiled before any timing
        images[file_ids[path]] = decode_image(data).image
    answers = [a for t in ANSWERS.values() for a in t]
    return Context(engine, arms, file_ids, ExactPrefixReuse(engine, images), answer_token_ids(engine, answers),
                   max_new_tokens,
                   decomposition, random.Random(seed))


def run_requests(ctx: Context, convs: list[Conversation], layout: str, progress: bool, desc: str) -> list[dict]:
    from tqdm import tqdm

    _warm_up(ctx, convs[0])
    return [evaluate_request(ctx, c, layout) for c in tqdm(convs, desc=desc, unit="req", disable=not progress)]


def run_eval(model_dir: str | Path | None = None, set_dir: str | Path | None = None, arms: list[str] | None = None,
             limit: int | None = None, seed: int = 0, out: str | Path = "eval-out", max_new_tokens: int = 6,
             engine: Engine | None = None, progress: bool = True, seeds: int = 6, layout: str = "new_chat",
             decomposition: bool = True, extra_arms: list[Arm] = ()) -> dict:
    """Every arm on every item under `seeds` conversation seeds (seed .. seed + seeds - 1); writes
    report.json, report.md and agreement.png to `out`. `extra_arms`: the fidelity dial's (`blend_arms`)."""
    from mmkv.vqa_eval.report import write_reports

    chosen = choose_arms(arms, extra_arms)
    if seeds < 1:
        raise ValueError("seeds must be >= 1")
    torch.manual_seed(seed)
    engine = engine or Engine.from_pretrained(model_dir)
    pool = load_vqa_set(set_dir or DEFAULT_SET)
    items = balanced_subset(pool, limit)
    shape = Shape(layout=layout)
    convs = [build_conversation(it, pool, s, shape) for s in range(seed, seed + seeds) for it in items]
    ctx = make_context(engine, convs, chosen, max_new_tokens, decomposition, seed)
    t0 = time.perf_counter()
    rows = run_requests(ctx, convs, layout, progress, "mmkv eval")
    report = {
        "task": "agreement", **header(engine, model_dir, set_dir, seed, limit, max_new_tokens),
        "seeds": list(range(seed, seed + seeds)), "layout": layout, "n": len(rows), "items": len(items),
        "arms": {a.name: a.meaning for a in chosen}, "controls": [a.name for a in chosen if a.control],
        "wall_s": round(time.perf_counter() - t0, 2),
        "floors": floors(rows), "summary": summarize(rows, [a.name for a in chosen], seed),
        "requests": rows,
    }
    write_reports(report, Path(out))
    return report


def merge_reports(paths: list[Path], out: str | Path) -> dict:
    """One report from runs of the same model and settings over disjoint conversation seeds (a
    long run split into shards that each finish): requests pooled, every statistic recomputed."""
    from mmkv.vqa_eval.report import write_reports

    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]
    for p in parts[1:]:
        if (p["model"], p["layout"], list(p["arms"]), p["limit"]) != (first["model"], first["layout"],
                                                                       list(first["arms"]), first["limit"]):
            raise ValueError("merge needs runs of one model, layout, arm set and item limit")
    seeds = sorted(s for p in parts for s in p["seeds"])
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"the runs share conversation seeds: {seeds}")
    rows = [r for p in parts for r in p["requests"]]
    report = {**first, "seeds": seeds, "n": len(rows), "wall_s": round(sum(p["wall_s"] for p in parts), 2),
              "floors": floors(rows), "summary": summarize(rows, list(first["arms"]), first["seed"]),
              "requests": rows}
    write_reports(report, Path(out))
    return report


def header(engine: Engine, model_dir, set_dir, seed: int, limit: int | None, max_new_tokens: int) -> dict:
    return {
        "model": engine.model_id, "model_dir": str(model_dir) if model_dir else "bundled",
        "set": str(set_dir or DEFAULT_SET), "seed": seed, "limit": limit, "max_new_tokens": max_new_tokens,
        "reference": REFERENCE, "target": TARGET,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "device": str(engine.adapter.device), "dtype": str(engine.adapter.dtype)},
        "checkpoint": _checkpoint_state(Path(model_dir) if model_dir else BUNDLED_MODEL),
        "code": _code_state(),
    }


def _code_state() -> dict:
    """The commit the engine code came from, and whether it had uncommitted changes (a run's
    figures belong to the code that produced them)."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD").strip(), "dirty": bool(git("status", "--porcelain", "mmkv", "adapters"))}


def _checkpoint_state(model_dir: Path) -> dict | None:
    """Steps and finality of a bundled tiny model (samples/train.py writes train_state.json)."""
    path = model_dir / "train_state.json"
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    return {k: state.get(k) for k in ("family", "steps", "elapsed_s", "final", "loss_ema")}


def _warm_up(ctx: Context, conv: Conversation) -> None:
    """One untimed request per path, so the first request's TTFT does not pay for lazy initialisation."""
    msgs = to_messages(conv.system, conv.later, ctx.file_ids)
    ctx.engine.generate(msgs, max_new_tokens=1, reuse=False)
    ctx.engine.generate(msgs, max_new_tokens=1, reuse=True)
