"""`mmkv eval --task episodes`: the committed conversation split (samples/vqa/episodes) through the
engine, the splice against a full recompute.

Each episode (multi-token `describe`, two-image `same_color` / `more_shapes`, text-field
`field_gate`, `erratum_gate`, `field_image_gate`) is one request, served by two arms with the same
messages, so both see the same tokens:

- `full` (reference): `reuse=False`, every token computed in one pass;
- `splice`: every image was uploaded before (precompiled alone) and every system turn's text after
  its first line (the policy and the field lines) was added as a skill; both are spliced in at
  their places. Two-image episodes are where the paper expects split chunks to fail: neither image
  ever attended to the other.

Per type: agreement of the whole answer with `full` and of its first token (a multi-token answer
can drift after a first token that agrees), accuracy against the label for both arms, exact 95%
intervals, TTFT medians.
"""

from __future__ import annotations

import io
import random
import time
from pathlib import Path

import numpy as np

from mmkv.engine import Engine
from mmkv.vqa_eval import episodes as E
from mmkv.vqa_eval.metrics import normalize_answer
from mmkv.vqa_eval.run import _rate, header

DEFAULT_SPLIT = Path(__file__).resolve().parents[1] / "samples" / "vqa" / "episodes"
ARMS = ("full", "splice")


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def to_request(engine: Engine, ep: E.Episode, tenant: str) -> list[dict]:
    """The episode's prompt as engine messages: images by id, the system turn's body as a skill."""
    images = iter(ep.images)
    msgs = []
    for m in ep.prompt_messages():
        parts = []
        for p in m["content"]:
            if p["type"] == "image":
                parts.append({"type": "image_file", "image_file": {"file_id": engine.add_image(_png(next(images)), tenant=tenant)}})
            elif m["role"] == "system" and "\n" in p["text"]:
                first, body = p["text"].split("\n", 1)
                parts.append({"type": "text", "text": first + "\n"})
                parts.append({"type": "skill", "skill_id": engine.add_skill("system-body", body, tenant=tenant)})
            else:
                parts.append(p)
        msgs.append({"role": m["role"], "content": parts})
    return msgs


def run_episodes(model_dir: str | Path | None = None, set_dir: str | Path | None = None, limit: int | None = None,
                 seed: int = 0, out: str | Path = "eval-episodes", max_new_tokens: int | None = None,
                 engine: Engine | None = None, progress: bool = True) -> dict:
    """`limit` episodes per type (default: all 40). `max_new_tokens` None: each type's own budget
    in this model's tokenizer (`episodes.answer_budget`)."""
    from tqdm import tqdm

    engine = engine or Engine.from_pretrained(model_dir)
    eps = E.load_split(set_dir or DEFAULT_SPLIT)
    if limit:
        eps = [ep for t in E.SPLIT_TYPES for ep in [e for e in eps if e.type == t][:limit]]
    t0, rows = time.perf_counter(), []
    for ep in tqdm(eps, desc="episodes", unit="ep", disable=not progress):
        tenant = f"episodes/{ep.id}"
        msgs = to_request(engine, ep, tenant)
        res, budget = {}, max_new_tokens or E.answer_budget(engine.adapter.tokenizer, ep.type)
        for arm in random.Random(f"{seed}-{ep.id}").sample(ARMS, len(ARMS)):
            r = engine.generate(msgs, max_new_tokens=budget, reuse=arm != "full", tenant=tenant)
            res[arm] = {"answer": r.text.strip(), "first_token": int(r.first_logits.argmax()), "ttft_s": r.ttft_s,
                        "prompt_tokens": r.usage.prompt_tokens, "cached_tokens": r.usage.cached_tokens}
        ref = res["full"]
        for rec in res.values():
            rec["agree"] = normalize_answer(rec["answer"]) == normalize_answer(ref["answer"])
            rec["first_agree"] = rec["first_token"] == ref["first_token"]
            rec["correct"] = normalize_answer(rec["answer"]) == normalize_answer(ep.answer)
        rows.append({"id": ep.id, "type": ep.type, "category": E.CATEGORY[ep.type], "label": ep.answer, "arms": res})
    summary = {}
    for t in [t for t in E.SPLIT_TYPES if any(r["type"] == t for r in rows)]:
        sel = [r for r in rows if r["type"] == t]
        summary[t] = {"n": len(sel), "category": E.CATEGORY[t]}
        for a in ARMS:
            recs = [r["arms"][a] for r in sel]
            summary[t][a] = {"accuracy": _rate(sum(x["correct"] for x in recs), len(recs)),
                             "agreement": _rate(sum(x["agree"] for x in recs), len(recs)),
                             "first_token_agreement": _rate(sum(x["first_agree"] for x in recs), len(recs)),
                             "ttft_median_s": float(np.median([x["ttft_s"] for x in recs])),
                             "cached_tokens": float(np.mean([x["cached_tokens"] for x in recs]))}
    allrecs = [r["arms"]["splice"] for r in rows]
    report = {"task": "episodes", **header(engine, model_dir, set_dir or DEFAULT_SPLIT, seed, limit,
                                                   max_new_tokens or "per type"),
              "n": len(rows), "arms": list(ARMS), "wall_s": round(time.perf_counter() - t0, 2),
              "agreement": _rate(sum(x["agree"] for x in allrecs), len(allrecs)), "summary": summary,
              "requests": rows}
    from mmkv.vqa_eval.report import write_report_files

    write_report_files(report, out, episodes_markdown(report))
    return report


def episodes_markdown(report: dict) -> str:
    from mmkv.vqa_eval.report import rate, setup_line

    lines = [f"# Episodes: {report['model']}", "",
             f"n = {report['n']} episodes of the committed conversation split; `splice`: images uploaded before "
             "and the system turn's body added as a skill, spliced; `full`: reuse=False. " + setup_line(report), "",
             "| type | category | n | splice agreement with full | first-token agreement | accuracy full | "
             "accuracy splice | TTFT splice / full | cached tokens / req |",
             "|---|---|---|---|---|---|---|---|---|"]
    for t, s in report["summary"].items():
        sp, fu = s["splice"], s["full"]
        ratio = sp["ttft_median_s"] / fu["ttft_median_s"] if fu["ttft_median_s"] else float("nan")
        lines.append(f"| {t} | {s['category']} | {s['n']} | {rate(sp['agreement'])} | {rate(sp['first_token_agreement'])} "
                     f"| {rate(fu['accuracy'])} | {rate(sp['accuracy'])} | {ratio:.2f} | {sp['cached_tokens']:.0f} |")
    lines += ["", f"All types: splice agrees with full on {rate(report['agreement'])}."]
    return "\n".join(lines) + "\n"
