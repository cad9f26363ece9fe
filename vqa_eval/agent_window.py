"""`mmkv eval --task agent-window`: agents whose client drops the oldest screenshots or tool outputs;
how often does `history_policy: "compose"` (mmkv/request/compose.py) answer as a full recompute?

Each conversation (seeded) is an agent loop over items of the VQA set: a step shows a screenshot
(the item's image) and asks the item's question; the agent's reply is the item's answer. Two kinds:

- `screenshots`: the client keeps the last `SCREENSHOT_WINDOW` images, the oldest dropped first (a
  dropped screenshot's text stays), as UI-TARS and Anthropic's computer-use loop do;
- `tool outputs`: each step also carries a tool's output (a text block); the client keeps the last
  `TOOL_WINDOW` outputs and only the current screenshot, as agents that send past steps as text.

The conversation is served turn by turn under "compose" in its own tenant, so each turn composes
the turns earlier requests computed; every turn from the second on is measured against a full
recompute of the same prompt (`reuse=False`): answer agreement with its exact interval, flips per
question type, first-token logit cosine, tokens composed. The no-compounding check (the paper's,
for errata) runs `LONG_TURNS`-turn screenshot conversations and reports agreement per turn index,
the first third against the last third, and the slope of agreement over turns with a
conversation-clustered bootstrap interval: composed KV built on composed KV must not drift.
"""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmkv.engine import Engine
from mmkv.vqa_eval.dataset import VQAItem, load_vqa_set
from mmkv.vqa_eval.metrics import logit_cosine, normalize_answer
from mmkv.vqa_eval.protocol import SYSTEM_PROMPTS, balanced_subset
from mmkv.vqa_eval.run import DEFAULT_SET, _rate, header
from mmkv.vqa_eval.stats import flip_directions

KINDS = ("screenshots", "tool outputs")
SCREENSHOT_WINDOW, TOOL_WINDOW = 3, 2
TURNS, LONG_TURNS = 8, 28
BOOTSTRAP = 2000
TOOL_OUTPUT = ("tool output {n} : the page lists {a} rows ; row one says {b} . the button on the left is {c} . "
               "nothing else changed on the page .")


@dataclass(frozen=True)
class Step:
    item: VQAItem
    tool: str | None  # the step's tool output (`tool outputs` conversations)


@dataclass(frozen=True)
class WindowConversation:
    kind: str
    seed: int
    system: str
    steps: tuple[Step, ...]

    def messages(self, upto: int, file_ids: dict[str, str]) -> list[dict]:
        """The request of step `upto`: every step so far, the oldest screenshots (and tool outputs)
        outside the window dropped; the last step's question unanswered."""
        keep_images = SCREENSHOT_WINDOW if self.kind == "screenshots" else 1
        first_image, first_tool = upto + 1 - keep_images, upto + 1 - TOOL_WINDOW
        msgs: list[dict] = [{"role": "system", "content": self.system}]
        for i, step in enumerate(self.steps[:upto + 1]):
            parts = [{"type": "text", "text": step.tool}] if step.tool and i >= first_tool else []
            if i >= first_image:
                parts.append({"type": "image_file", "image_file": {"file_id": file_ids[step.item.image]}})
            msgs.append({"role": "user", "content": parts + [{"type": "text", "text": step.item.question}]})
            if i < upto:
                msgs.append({"role": "assistant", "content": step.item.answer})
        return msgs


def build_conversation(kind: str, pool: list[VQAItem], seed: int, turns: int) -> WindowConversation:
    rng = random.Random(f"agent-window-{kind}-{seed}")
    items = rng.sample(pool, turns)
    words = ("green", "red", "grey", "pending", "shipped", "open", "closed")
    steps = tuple(Step(it, TOOL_OUTPUT.format(n=i, a=rng.randint(2, 9), b=rng.choice(words), c=rng.choice(words))
                       if kind == "tool outputs" else None) for i, it in enumerate(items))
    return WindowConversation(kind, seed, rng.choice(SYSTEM_PROMPTS), steps)


def serve(engine: Engine, conv: WindowConversation, images: dict[str, bytes], max_new_tokens: int) -> list[dict]:
    """The conversation under compose, turn by turn, in its own tenant; each turn from the second
    on against a full recompute of its prompt."""
    tenant = f"agent-window/{conv.kind}/{conv.seed}"
    file_ids = {s.item.image: engine.add_image(images[s.item.image], tenant=tenant) for s in conv.steps}
    rows = []
    for t in range(len(conv.steps)):
        msgs = conv.messages(t, file_ids)
        got = engine.generate(msgs, max_new_tokens=max_new_tokens, tenant=tenant, history_policy="compose")
        if not t:
            continue
        ref = engine.generate(msgs, max_new_tokens=max_new_tokens, tenant=tenant, reuse=False)
        item = conv.steps[t].item
        rows.append({"turn": t + 1, "type": item.type, "id": item.id, "reference": normalize_answer(ref.text),
                     "answer": normalize_answer(got.text), "first_token": got.token_ids[:1] == ref.token_ids[:1],
                     "logit_cosine": logit_cosine(got.first_logits, ref.first_logits),
                     "prompt_tokens": got.usage.prompt_tokens, "cached_tokens": got.usage.cached_tokens,
                     "lm_tokens_computed": got.lm_tokens_computed, "applied": got.history.applied,
                     "composed_turns": got.history.composed_turns, "composed_tokens": got.history.composed_tokens})
    return rows


def summarize(rows: list[dict]) -> dict:
    """Agreement (answer and first token) with exact intervals, flips per question type, cosine,
    the share of the prompt composed and computed."""
    by_type = defaultdict(list)
    for r in rows:
        by_type[r["type"]].append(r)
    return {
        "agreement": _rate(sum(r["answer"] == r["reference"] for r in rows), len(rows)),
        "first_token": _rate(sum(r["first_token"] for r in rows), len(rows)),
        "logit_cosine_mean": float(np.mean([r["logit_cosine"] for r in rows])),
        "logit_cosine_min": float(np.min([r["logit_cosine"] for r in rows])),
        "composed_share": sum(r["composed_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "computed_share": sum(r["lm_tokens_computed"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "applied": dict(Counter(r["applied"] for r in rows)),
        "by_type": {t: {"agreement": _rate(sum(r["answer"] == r["reference"] for r in rs), len(rs)),
                        "flips": flip_directions([(r["reference"], r["answer"]) for r in rs], t)}
                    for t, rs in sorted(by_type.items())},
    }


def compounding(convs: list[list[dict]], seed: int) -> dict:
    """Agreement per turn index over the long conversations, the first third against the last,
    and the least-squares slope of agreement over turns with a conversation-clustered bootstrap
    95% interval."""
    turns = sorted({r["turn"] for rows in convs for r in rows})
    per_turn = [_rate(sum(r["answer"] == r["reference"] for rows in convs for r in rows if r["turn"] == t),
                      sum(1 for rows in convs for r in rows if r["turn"] == t)) for t in turns]
    third = len(turns) // 3
    first, last = set(turns[:third]), set(turns[-third:])

    def slope(sample: list[list[dict]]) -> float:
        x = np.array([r["turn"] for rows in sample for r in rows], dtype=float)
        y = np.array([r["answer"] == r["reference"] for rows in sample for r in rows], dtype=float)
        return float(np.polyfit(x, y, 1)[0]) if np.ptp(x) else 0.0

    rng = np.random.default_rng(seed)
    boot = [slope([convs[i] for i in rng.integers(len(convs), size=len(convs))]) for _ in range(BOOTSTRAP)]
    agree = lambda chosen: _rate(*(lambda rs: (sum(r["answer"] == r["reference"] for r in rs), len(rs)))(  # noqa: E731
        [r for rows in convs for r in rows if r["turn"] in chosen]))
    return {"conversations": len(convs), "turns": turns, "per_turn": per_turn, "first_third": agree(first), "last_third": agree(last),
            "cosine_first_third": float(np.mean([r["logit_cosine"] for rows in convs for r in rows if r["turn"] in first])),
            "cosine_last_third": float(np.mean([r["logit_cosine"] for rows in convs for r in rows if r["turn"] in last])),
            "slope_per_turn": slope(convs), "slope_low": float(np.percentile(boot, 2.5)),
            "slope_high": float(np.percentile(boot, 97.5))}


def run_agent_window(model_dir: str | Path | None = None, set_dir: str | Path | None = None, limit: int | None = None,
                     seed: int = 0, out: str | Path = "eval-agent-window", max_new_tokens: int = 6,
                     engine: Engine | None = None, progress: bool = True, long_conversations: int = 4) -> dict:
    """`limit` conversations of each kind (default 6) of `TURNS` turns, then `long_conversations`
    screenshot conversations of `LONG_TURNS` turns for the no-compounding check."""
    from tqdm import tqdm

    engine = engine or Engine.from_pretrained(model_dir)
    pool = balanced_subset(load_vqa_set(set_dir or DEFAULT_SET), None)
    convs = [build_conversation(k, pool, seed + i, TURNS) for k in KINDS for i in range(limit or 6)]
    long = [build_conversation("screenshots", pool, 10_000 + seed + i, LONG_TURNS) for i in range(long_conversations)]
    images = {s.item.image: Path(s.item.image).read_bytes() for c in convs + long for s in c.steps}
    t0 = time.perf_counter()
    served = [serve(engine, c, images, max_new_tokens) for c in tqdm(convs + long, desc="agent-window",
                                                                    unit="conv", disable=not progress)]
    rows = [dict(r, kind=c.kind, seed=c.seed) for c, rs in zip(convs, served) for r in rs]
    report = {
        "task": "agent-window", **header(engine, model_dir, set_dir, seed, limit, max_new_tokens),
        "reference": "full recompute", "windows": {"screenshots": SCREENSHOT_WINDOW, "tool outputs": TOOL_WINDOW},
        "turns": TURNS, "long_turns": LONG_TURNS, "n": len(rows), "wall_s": round(time.perf_counter() - t0, 2),
        "summary": {k: summarize([r for r in rows if r["kind"] == k]) for k in KINDS} | {"all": summarize(rows)},
        "compounding": compounding(served[len(convs):], seed), "requests": rows,
    }
    from mmkv.vqa_eval.report import write_report_files

    write_report_files(report, out, agent_window_markdown(report))
    return report


def agent_window_markdown(report: dict) -> str:
    from mmkv.vqa_eval.report import rate, setup_line

    lines = [f"# Agent window: {report['model']}", "",
             f"{report['n']} measured turns: conversations of {report['turns']} turns whose client keeps the last "
             f"{report['windows']['screenshots']} screenshots, or the last {report['windows']['tool outputs']} tool "
             "outputs and the current screenshot; every turn from the second on under history_policy compose "
             "against a full recompute of the same prompt. " + setup_line(report).replace(
                 "reference `full`", "reference full recompute"), "",
             "| conversations | agreement | first token | logit cosine mean / min | composed share of prompt | "
             "computed share | applied |", "|---|---|---|---|---|---|---|"]
    for kind, s in report["summary"].items():
        applied = ", ".join(f"{k} x{v}" for k, v in s["applied"].items())
        lines.append(f"| {kind} | {rate(s['agreement'])} | {rate(s['first_token'])} | {s['logit_cosine_mean']:.4f} / "
                     f"{s['logit_cosine_min']:.4f} | {s['composed_share']:.3f} | {s['computed_share']:.3f} | {applied} |")
    lines += ["", "| question type | agreement | flips (full recompute -> composed) |", "|---|---|---|"]
    for t, e in report["summary"]["all"]["by_type"].items():
        flips = ", ".join(f"{k} x{v}" for k, v in e["flips"]["by_direction"].items()) or "-"
        lines.append(f"| {t} | {rate(e['agreement'])} | {flips} |")
    c = report["compounding"]
    lines += ["", f"No compounding over {report['long_turns']} turns ({c['conversations']} screenshot "
              "conversations): agreement per turn index",
              "", "| turn | " + " | ".join(str(t) for t in c["turns"]) + " |", "|---" * (len(c["turns"]) + 1) + "|",
              "| agree | " + " | ".join(f"{e['k']}/{e['n']}" for e in c["per_turn"]) + " |", "",
              f"first third {rate(c['first_third'])}, last third {rate(c['last_third'])}; logit cosine "
              f"{c['cosine_first_third']:.4f} -> {c['cosine_last_third']:.4f}; slope {c['slope_per_turn']:+.4f} / turn "
              f"(bootstrap 95% {c['slope_low']:+.4f} to {c['slope_high']:+.4f})."]
    return "\n".join(lines) + "\n"
