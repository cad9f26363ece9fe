"""`mmkv eval --task errata`: a field changes between two requests of a chat; how does each edit
policy (mmkv/request/edits.py) answer, against recomputing?

Each conversation (seeded) has a labelled field line in its system turn (`order_status: pending`,
`tier = gold` or a JSON object `{"region": "north", ...}`), one earlier image turn with its answer,
and a final VQA question. Request C carries the old value; request N is C with the value changed
in place, which is exactly a field edit by the engine's rule (inside an earlier turn, after a
label, short, with the rest of C after it). Every arm is first served C, then measured on N:

- `recompute` (reference): the engine's exact path, prefix reuse up to the change;
- `erratum`, `in_place`, `selective@K`: the edit policies;
- `stale` (control): C asked again, the update never sent.

Every arm runs in its own tenant namespace (its own prefix cache and recent prompts), so no arm
sees another's requests. The final question is an image question whose answer does not depend on
the field (`stale` shows it), so this task shows whether a policy keeps the answer a recompute
gives and what it costs (prefix hit-rate, TTFT, what `applied`), not whether a model follows the
update. The bundled tiny models learned fields and errata only in front of a refund question;
whether they follow an update is `--task episodes`' `erratum_gate`.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmkv.engine import Engine
from mmkv.vqa_eval.dataset import VQAItem, load_vqa_set
from mmkv.vqa_eval.metrics import logit_cosine, normalize_answer
from mmkv.vqa_eval.protocol import SYSTEM_PROMPTS, Turn, balanced_subset, to_messages
from mmkv.vqa_eval.run import DEFAULT_SET, _rate, header

REFERENCE = "recompute"
DEFAULT_KS = (1, 4, 16)
#: (field, old value, new value)
FIELDS = (("order_status", "pending", "shipped"), ("tier", "gold", "silver"), ("region", "north", "south"),
          ("priority", "low", "urgent"))
FORMATS = ("colon", "equals", "json")


def field_line(fmt: str, name: str, value: str) -> str:
    if fmt == "colon":
        return f"{name}: {value}"
    if fmt == "equals":
        return f"{name} = {value}"
    return json.dumps({name: value, "currency": "eur"})


@dataclass(frozen=True)
class ErrataConversation:
    item: VQAItem
    seed: int
    field: str
    format: str
    old: str
    new: str
    system: str  # without the field line
    turns: tuple[Turn, ...]  # one earlier image turn with its answer, then the asked turn

    def messages(self, value: str, file_ids: dict[str, str]) -> list[dict]:
        return to_messages(f"{self.system}\n{field_line(self.format, self.field, value)}", self.turns, file_ids)


def build_errata(item: VQAItem, pool: list[VQAItem], seed: int) -> ErrataConversation:
    rng = random.Random(f"vqa-errata-{seed}-{item.id}")
    filler = rng.choice([p for p in pool if p.image != item.image])
    name, old, new = rng.choice(FIELDS)
    turns = (Turn((filler.image,), filler.question, filler.answer), Turn((item.image,), item.question, None))
    return ErrataConversation(item, seed, name, rng.choice(FORMATS), old, new, rng.choice(SYSTEM_PROMPTS), turns)


def _add_images(engine: Engine, conv: ErrataConversation, images: dict[str, bytes], tenant: str) -> None:
    """The conversation's images uploaded in `tenant` (an arm's own namespace)."""
    for t in conv.turns:
        for p in t.images:
            engine.add_image(images[p], tenant=tenant)


def serve(engine: Engine, arm: str, conv: ErrataConversation, file_ids: dict[str, str], tenant: str,
          max_new_tokens: int) -> dict:
    """C then N (or C twice for `stale`) under one arm; the second request is measured."""
    policy = "recompute" if arm == "stale" else arm
    old, new = conv.messages(conv.old, file_ids), conv.messages(conv.new, file_ids)
    engine.generate(old, max_new_tokens=1, reuse=True, tenant=tenant, edit_policy=policy)
    r = engine.generate(old if arm == "stale" else new, max_new_tokens=max_new_tokens, reuse=True, tenant=tenant,
                        edit_policy=policy)
    edit = r.edit
    return {"answer": r.text, "first_logits": r.first_logits, "ttft_s": r.ttft_s,
            "prompt_tokens": r.usage.prompt_tokens, "cached_tokens": r.usage.cached_tokens,
            "lm_tokens_computed": r.lm_tokens_computed,
            "detected": bool(edit and edit.detected), "applied": edit.applied if edit else "recompute",
            "reason": edit.reason if edit else "", "field": edit.field if edit else ""}


def chain_value(conv: ErrataConversation, step: int) -> str:
    """The field's value at step `step` of a chained loop: the old value, then a new one each step."""
    return conv.old if step == 0 else f"{(conv.new, conv.old)[(step - 1) % 2]}-{step}"


def serve_chain(engine: Engine, arm: str, conv: ErrataConversation, file_ids: dict[str, str], tenant: str,
                steps: int, max_new_tokens: int) -> list[dict]:
    """C, then `steps` requests each with a new value and one more turn (the earlier answer, the
    final question again), under one arm; the records of the `steps` later requests."""
    turns, out = list(conv.turns), []
    for step in range(steps + 1):
        msgs = to_messages(f"{conv.system}\n{field_line(conv.format, conv.field, chain_value(conv, step))}", turns,
                           file_ids)
        r = engine.generate(msgs, max_new_tokens=max_new_tokens if step else 1, reuse=True, tenant=tenant,
                            edit_policy=arm)
        if step:
            out.append({"answer": r.text, "first_logits": r.first_logits, "lm_tokens_computed": r.lm_tokens_computed,
                        "cached_tokens": r.usage.cached_tokens, "prompt_tokens": r.usage.prompt_tokens,
                        "applied": r.edit.applied if r.edit else "recompute"})
        last = turns[-1]
        turns = turns[:-1] + [Turn(last.images, last.question, conv.item.answer), Turn((), last.question, None)]
    return out


def summarize_chain(chains: list[dict], arms: list[str], steps: int) -> dict:
    """Per arm and step: agreement with the recompute arm's answer at that step, logit cosine
    (mean, min), LM tokens, how often the arm's policy ran."""
    out = {}
    for a in arms:
        per_step = []
        for s in range(steps):
            recs = [(c[a][s], c[REFERENCE][s]) for c in chains]
            cos = [x["logit_cosine"] for x, _ in recs]
            per_step.append({
                "step": s + 1,
                "agreement": _rate(sum(normalize_answer(x["answer"]) == normalize_answer(ref["answer"])
                                       for x, ref in recs), len(recs)),
                "logit_cosine_mean": float(np.mean(cos)), "logit_cosine_min": float(np.min(cos)),
                "lm_tokens_computed": float(np.mean([x["lm_tokens_computed"] for x, _ in recs])),
                "applied": sum(x["applied"] == a for x, _ in recs),
            })
        out[a] = per_step
    return out


def summarize_errata(rows: list[dict], arms: list[str]) -> dict:
    out = {}
    for a in arms:
        recs = [r["arms"][a] for r in rows]
        out[a] = {
            "agreement": _rate(sum(x["agree"] for x in recs), len(recs)),
            "accuracy": _rate(sum(x["correct"] for x in recs), len(recs)),
            "logit_cosine_mean": float(np.mean([x["logit_cosine"] for x in recs])),
            "hit_rate": float(np.sum([x["cached_tokens"] for x in recs]) / np.sum([x["prompt_tokens"] for x in recs])),
            "ttft_median_s": float(np.median([x["ttft_s"] for x in recs])),
            "lm_tokens_computed": float(np.mean([x["lm_tokens_computed"] for x in recs])),
            "detected": sum(x["detected"] for x in recs),
            "applied": dict(Counter(x["applied"] for x in recs)),
            "reasons": dict(Counter(x["reason"] for x in recs if x["reason"])),
            "field_named_right": sum(x["field"] == r["field"] for x, r in zip(recs, rows)),
        }
    return out


def run_errata(model_dir: str | Path | None = None, set_dir: str | Path | None = None, ks: list[int] | None = None,
               limit: int | None = None, seed: int = 0, out: str | Path = "eval-errata", max_new_tokens: int = 6,
               engine: Engine | None = None, progress: bool = True, seeds: int = 1, chain: int = 0) -> dict:
    """`limit` items (default 90: 10 per type) x `seeds` conversation seeds, every arm; with
    `chain` > 0 also each conversation as a loop of `chain` edits under recompute, in_place and
    selective@K (`serve_chain`), each in its own tenant."""
    from tqdm import tqdm

    ks = list(ks or DEFAULT_KS)
    if any(k < 0 for k in ks):
        raise ValueError("selective@K needs K >= 0")
    arms = [REFERENCE, "erratum", "in_place", *[f"selective@{k}" for k in ks], "stale"]
    engine = engine or Engine.from_pretrained(model_dir)
    pool = load_vqa_set(set_dir or DEFAULT_SET)
    convs = [build_errata(it, pool, s) for s in range(seed, seed + seeds) for it in balanced_subset(pool, limit or 90)]
    images = {p: Path(p).read_bytes() for c in convs for t in c.turns for p in t.images}
    file_ids = {p: engine.add_image(b) for p, b in images.items()}
    t0, rows, chains = time.perf_counter(), [], []
    chain_arms = [REFERENCE, "in_place", *[f"selective@{k}" for k in ks]]
    for conv in tqdm(convs, desc="errata", unit="conv", disable=not progress):
        res = {}
        for arm in random.Random(f"{seed}-{conv.item.id}").sample(arms, len(arms)):
            tenant = f"errata/{conv.seed}/{conv.item.id}/{arm}"  # each arm alone: its own caches
            _add_images(engine, conv, images, tenant)
            res[arm] = serve(engine, arm, conv, file_ids, tenant, max_new_tokens)
        ref = res[REFERENCE]
        for rec in res.values():
            rec["agree"] = normalize_answer(rec["answer"]) == normalize_answer(ref["answer"])
            rec["correct"] = normalize_answer(rec["answer"]) == normalize_answer(conv.item.answer)
            rec["logit_cosine"] = logit_cosine(rec.pop("first_logits"), ref["first_logits"]) if rec is not ref else 1.0
        ref.pop("first_logits")
        rows.append({"id": conv.item.id, "seed": conv.seed, "type": conv.item.type, "label": conv.item.answer,
                     "field": conv.field, "format": conv.format, "old": conv.old, "new": conv.new, "arms": res})
        if chain:
            looped = {}
            for arm in chain_arms:
                tenant = f"errata-chain/{conv.seed}/{conv.item.id}/{arm}"
                _add_images(engine, conv, images, tenant)
                looped[arm] = serve_chain(engine, arm, conv, file_ids, tenant, chain, max_new_tokens)
            for arm in chain_arms:  # the cosine now: a real model's logits are 0.6 MB a request
                for rec, ref in zip(looped[arm], looped[REFERENCE]):
                    rec["logit_cosine"] = logit_cosine(rec["first_logits"], ref["first_logits"])
            for recs in looped.values():
                for rec in recs:
                    rec.pop("first_logits")
            chains.append(looped)
    report = {
        "task": "errata", **header(engine, model_dir, set_dir, seed, limit, max_new_tokens), "reference": REFERENCE,
        "seeds": list(range(seed, seed + seeds)), "n": len(rows), "arms": arms, "ks": ks,
        "wall_s": round(time.perf_counter() - t0, 2), "summary": summarize_errata(rows, arms), "requests": rows,
    }
    if chain:
        report["chain"] = {"steps": chain, "arms": chain_arms, "summary": summarize_chain(chains, chain_arms, chain)}
    from mmkv.vqa_eval.report import write_report_files

    write_report_files(report, out, errata_markdown(report))
    return report


def errata_markdown(report: dict) -> str:
    from mmkv.vqa_eval.report import rate, setup_line

    s = report["summary"]
    lines = [f"# Errata: {report['model']}", "",
             f"n = {report['n']} conversations (seeds {report['seeds'][0]}-{report['seeds'][-1]}); a labelled field in "
             "the system turn changes between request C and request N; every arm is served C, then measured on N "
             "(`stale`: C again). " + setup_line(report).replace("reference `full`", "reference `recompute`"), "",
             "| arm | agreement with recompute | accuracy (label) | logit cosine | prefix hit-rate | TTFT median ms | "
             "LM tokens / req | detected | applied | fallback reasons |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for a in report["arms"]:
        e = s[a]
        applied = ", ".join(f"{k} x{v}" for k, v in e["applied"].items())
        reasons = ", ".join(f"{k} x{v}" for k, v in e["reasons"].items()) or "-"
        lines.append(f"| {a} | {rate(e['agreement'])} | {rate(e['accuracy'])} | {e['logit_cosine_mean']:.4f} | "
                     f"{e['hit_rate']:.3f} | {e['ttft_median_s'] * 1000:.1f} | {e['lm_tokens_computed']:.1f} | "
                     f"{e['detected']}/{report['n']} | {applied} | {reasons} |")
    lines += ["", "The final question does not depend on the field: `stale` agreeing with `recompute` shows it, so "
              "agreement here says a policy keeps the recompute's answer, not that the model follows the update "
              "(`--task episodes`' `erratum_gate` asks that)."]
    if "chain" in report:
        c = report["chain"]
        lines += ["", f"## Chained edits: {c['steps']} per conversation", "",
                  "Each conversation as a loop: C, then each step a new value of the field and one more turn (the "
                  "earlier answer, the final question again); `in_place` and `selective@K` edit the previous step's "
                  "own (approximate) KV, so their errors can carry over. Agreement with `recompute` at the same step.",
                  "", "| arm | step | agreement with recompute | logit cosine mean / min | LM tokens / req "
                  "(recompute) | applied |", "|---|---|---|---|---|---|"]
        ref = c["summary"][REFERENCE]
        for a in c["arms"][1:]:
            for e, r in zip(c["summary"][a], ref):
                lines.append(f"| {a} | {e['step']} | {rate(e['agreement'])} | {e['logit_cosine_mean']:.4f} / "
                             f"{e['logit_cosine_min']:.4f} | {e['lm_tokens_computed']:.1f} ({r['lm_tokens_computed']:.1f}) "
                             f"| {e['applied']}/{e['agreement']['n']} |")
    return "\n".join(lines) + "\n"
