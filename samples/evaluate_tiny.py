"""Accuracy of the bundled models on the committed VQA set: full recompute, greedy decoding.

    python samples/evaluate_tiny.py                                  # every bundled model, markdown table
    python samples/evaluate_tiny.py --model samples/models/qwen2_5_vl-tiny --json /tmp/r.json
    python samples/evaluate_tiny.py --write-expectations             # refresh samples/models/expected_answers.json

Every item is asked in a fresh conversation (system turn, then the image and the question in one
user turn) through plain transformers: ``AutoProcessor`` + ``AutoModelForImageTextToText`` and
``model.generate`` with greedy decoding. The *shuffled* control asks each question about a foreign
image of the same type: one drawn by the same generator and renderer from an independent seed
(``--shuffle-rounds`` draws, averaged), so the question's form stays right but the picture is
wrong; a model whose answer comes from the image falls to chance there. The foreign images come
from outside the set on purpose: another item's image of the same set is not independent of this
item's answer where the set, by the luck of its draw, pairs a question with some answers more often
(in the committed set, a perfect reader asked `what shape is the <colour> one ?` about another
item's image answers this item's shape 0.41 of the time where that colour is there, not 1/3).
*chance* is the accuracy that answers independent of the right image would score: sum over
answers c of P(truth = c) * P(shuffled answer = c) on this type (Cohen's expected agreement), so a
model that says yes and no evenly about a wrong picture is at chance even where the set's answers
are unbalanced. *majority* is the best constant answer, for comparison. The
control passes when the shuffled accuracy is within 0.10 of chance.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from mmkv.vqa_eval import dataset as D  # noqa: E402
from mmkv.vqa_eval import episodes as E  # noqa: E402
from mmkv.vqa_eval.dataset import ANSWERS, CATEGORIES, TYPES, VQAItem, load_vqa_set  # noqa: E402
from mmkv.vqa_eval.stats import mcnemar_exact  # noqa: E402

MODELS = [ROOT / "samples" / "models" / n for n in ("qwen2_5_vl-tiny", "qwen3_vl-tiny", "qwen2_5_vl-proxy")]
SET = ROOT / "samples" / "vqa"
HELDOUT_STYLE = SET / "heldout_style"  # the nine types drawn in the renderer kept out of training
HELDOUT_DARK = SET / "heldout_dark"  # the same in the second held-out renderer (panel inverted, canvas rescaled)
EPISODES = SET / "episodes"  # multi-token, two-image, text-field and erratum conversations
EXPECTATIONS = ROOT / "samples" / "models" / "expected_answers.json"
SYSTEM = "You are a helpful assistant."


def load(model_dir: str | Path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    model.eval()
    return model, processor


@torch.no_grad()
def answer(model, processor, image, question: str, system: str = SYSTEM, max_new_tokens: int = 6) -> tuple[str, float]:
    """Greedy answer and the first token's logit margin (top-1 minus top-2)."""
    msgs = [{"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    enc = processor(text=[text], images=[image], return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    new = out.sequences[0, enc["input_ids"].shape[1]:]
    top2 = out.scores[0][0].float().topk(2).values
    return processor.tokenizer.decode(new, skip_special_tokens=True).strip(), float(top2[0] - top2[1])


def foreign_round(items: list[VQAItem], seed: int, style: str = "flat") -> dict[str, tuple[D.Scene, D.Image.Image]]:
    """For each item, a (scene, image) of its type from an independent draw of the set's generator
    (seed ``seed``, the set's renderer ``style``): the k-th item of a type gets that draw's k-th
    item of the type. One round of the shuffled control; built a round at a time to bound memory."""
    groups = {t: [it for it in items if it.type == t] for t in TYPES}
    per_type = max((len(g) for g in groups.values()), default=0)
    drawn = {(qtype, iid): (scene, img) for iid, qtype, scene, img, _, _ in D.generate_items(seed, per_type, style=style)}
    return {it.id: drawn[(t, f"{t}-{k:03d}")] for t, g in groups.items() for k, it in enumerate(g)}


def set_style(set_path: str | Path) -> str:
    """The renderer a set directory was drawn with (its meta.json ``style``; flat if none)."""
    meta = Path(set_path) / "meta.json"
    return json.loads(meta.read_text()).get("style", "flat") if meta.is_file() else "flat"


def foreign_seed(shuffle_seed: int, r: int) -> int:
    """The generator seed of round ``r`` of the shuffled control (far from the committed sets' seeds)."""
    return shuffle_seed * 1000 + r


#: The bar: the shuffled control's accuracy stays within this of chance.
CONTROL_BAR = 0.10


def majority(items: list[VQAItem], qtype: str) -> float:
    """Accuracy of the best constant answer on this type (at least 1 / number of possible answers)."""
    ans = [it.answer for it in items if it.type == qtype]
    best = max(ans.count(a) for a in set(ans)) / len(ans)
    return max(best, 1 / len(ANSWERS[qtype]))


def independent_chance(truth: list[str], predicted: list[str]) -> float:
    """Expected accuracy of answers drawn independently of the truth with the predictions' own
    frequencies: sum_c P(truth = c) * P(predicted = c)."""
    if not truth or not predicted:
        return 0.0
    return sum(truth.count(c) / len(truth) * predicted.count(c) / len(predicted) for c in set(truth))


def evaluate(model_dir: Path, items: list[VQAItem], shuffle_seed: int = 4321, shuffle_rounds: int = 10,
             style: str = "flat") -> dict:
    model, processor = load(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    images = {it.id: it.load_image() for it in items}
    t0 = time.time()
    preds = {it.id: answer(model, processor, images[it.id], it.question) for it in items}
    t_full = time.time() - t0
    # shuffled control: each question about a foreign image of its type, several independent draws
    # averaged (one draw of 40 items moves the rate by +-0.08 on its own)
    groups = {t: [it for it in items if it.type == t] for t in TYPES}
    rounds = []  # one {item id: answer} per draw
    for r in range(max(1, shuffle_rounds)):
        foreign = foreign_round(items, foreign_seed(shuffle_seed, r), style)
        rounds.append({it.id: answer(model, processor, foreign[it.id][1], it.question)[0] for it in items if it.id in foreign})

    def shuffled_rate(group: list[VQAItem]) -> float:
        return sum(r[it.id] == it.answer for r in rounds for it in group) / (len(group) * len(rounds))

    table = {}
    for t, group in groups.items():
        if not group:
            continue
        rate = shuffled_rate(group)
        ch = independent_chance([it.answer for it in group for _ in rounds], [r[it.id] for it in group for r in rounds])
        table[t] = {
            "n": len(group),
            "accuracy": sum(preds[it.id][0] == it.answer for it in group) / len(group),
            "shuffled": rate,
            "chance": ch,
            "majority": majority(items, t),
            "control_ok": abs(rate - ch) <= CONTROL_BAR,
        }
    cats = {}
    for c, ts in CATEGORIES.items():
        group = [it for it in items if it.type in ts]
        cats[c] = {"n": len(group), "accuracy": sum(preds[it.id][0] == it.answer for it in group) / len(group),
                   "shuffled": shuffled_rate(group)}
    state = {}
    if (model_dir / "train_state.json").exists():
        st = json.loads((model_dir / "train_state.json").read_text())
        state = {k: st.get(k) for k in ("steps", "elapsed_s", "command", "batch", "threads")}
    size = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())
    return {"model": model_dir.name, "params": n_params, "dir_bytes": size, "seconds_full": round(t_full, 1),
            "types": table, "categories": cats, "train": state,
            "predictions": {k: {"answer": v[0], "margin": round(v[1], 3)} for k, v in preds.items()},
            "shuffle_rounds": len(rounds), "shuffled_predictions": rounds}


def evaluate_extra(model_dir: Path, heldout: dict[str, list[VQAItem]], episodes: list) -> dict:
    """Exact-match accuracy per type on each held-out-style split (key: the split's name) and on
    the committed episodes."""
    model, processor = load(model_dir)
    out: dict = {name: {} for name in heldout}
    out["episodes"] = {}
    for name, items in heldout.items():
        for t in TYPES:
            group = [it for it in items if it.type == t]
            if group:
                hits = [answer(model, processor, it.load_image(), it.question)[0] == it.answer for it in group]
                out[name][t] = {"n": len(group), "accuracy": sum(hits) / len(group)}
    for t in E.SPLIT_TYPES:
        group = [ep for ep in episodes if ep.type == t]
        if group:
            got = [E.ask(model, processor, ep) for ep in group]
            hits = [g == ep.answer for g, ep in zip(got, group)]
            out["episodes"][t] = {"n": len(group), "category": E.CATEGORY[t], "accuracy": sum(hits) / len(group),
                                  "predictions": {ep.id: g for g, ep in zip(got, group)}}
            cases: dict[str, list[bool]] = {}
            for hit, ep in zip(hits, group):
                if (name := E.case_name(ep)) is not None:
                    cases.setdefault(name, []).append(hit)
            if cases:  # field_image_gate: which half of the conjunction the misses sit on
                out["episodes"][t]["cases"] = {c: {"n": len(h), "accuracy": sum(h) / len(h)} for c, h in sorted(cases.items())}
    return out


def markdown_extra(results: list[dict], splits: list[str]) -> str:
    """One row per (split, type): `splits` names the held-out splits scored, then "episodes"; a type
    scored per case (``field_image_gate``: which halves of its conjunction hold) adds a row per case."""
    lines = ["| split | type | category | n | " + " | ".join(f"{r['model']} acc" for r in results) + " |",
             "|" + "---|" * (4 + len(results))]
    for split in splits:
        for t, v in results[0].get(split, {}).items():
            cat = v.get("category") or next(c for c, ts in CATEGORIES.items() if t in ts)
            lines.append(f"| {split} | {t} | {cat} | {v['n']} | "
                         + " | ".join(f"{r[split][t]['accuracy']:.3f}" for r in results) + " |")
            for c, cv in v.get("cases", {}).items():  # the same items again, split by case
                lines.append(f"| {split} | {t}: {c} | {cat} | {cv['n']} | "
                             + " | ".join(f"{r[split][t]['cases'][c]['accuracy']:.3f}" for r in results) + " |")
    return "\n".join(lines)


def markdown(results: list[dict]) -> str:
    lines = []
    head = "| type | category | n | " + " | ".join(f"{r['model']} acc | shuffled / chance" for r in results) + " | majority |"
    lines.append(head)
    lines.append("|" + "---|" * (4 + 2 * len(results)))

    def control(v: dict) -> str:
        mark = "" if v["control_ok"] else " (!)"
        return f"{v['shuffled']:.3f} / {v['chance']:.3f}{mark}"

    for t in TYPES:
        if t not in results[0]["types"]:
            continue
        cat = next(c for c, ts in CATEGORIES.items() if t in ts)
        row = f"| {t} | {cat} | {results[0]['types'][t]['n']} | "
        row += " | ".join(f"{r['types'][t]['accuracy']:.3f} | {control(r['types'][t])}" for r in results)
        row += f" | {results[0]['types'][t]['majority']:.3f} |"
        lines.append(row)
    for c in CATEGORIES:
        row = f"| **all {c}** | {c} | {results[0]['categories'][c]['n']} | "
        row += " | ".join(f"{r['categories'][c]['accuracy']:.3f} | {r['categories'][c]['shuffled']:.3f}" for r in results)
        row += " | |"
        lines.append(row)
    lines.append("")
    lines.append(f"shuffled: mean of {results[0].get('shuffle_rounds', 1)} draws of foreign images; (!) marks a shuffled "
                 f"accuracy more than {CONTROL_BAR} from chance.")
    lines.append("")
    for r in results:
        tr = r.get("train") or {}
        lines.append(f"- `{r['model']}`: {r['params'] / 1e6:.2f}M parameters, checkpoint dir {r['dir_bytes'] / 1e6:.1f} MB, "
                     f"{tr.get('steps')} steps of batch {tr.get('batch')} in {((tr.get('elapsed_s') or 0) / 60):.0f} min "
                     f"on {tr.get('threads')} CPU thread(s); full-recompute eval of {sum(v['n'] for v in r['types'].values())} items "
                     f"took {r['seconds_full']} s.")
    return "\n".join(lines)


def paired(names: list[str], hits: list[dict[str, list[bool]]]) -> str:
    """Markdown table: each checkpoint after the first against the first, item by item on the same
    items: hits of each, the items now right and now wrong, and the exact McNemar p of the change.
    A ``text gates`` row pools the three text gates (the rule that chooses a bundle), a ``<style>:
    all`` row each held-out style's rows."""
    def pool(h: dict[str, list[bool]]) -> dict[str, list[bool]]:
        out = {**h, "text gates": [x for t in E.TEXT_TYPES if t in h for x in h[t]]}
        for style in D.HELDOUT_STYLES:
            out[f"{style}: all"] = [x for t in TYPES for x in h.get(f"{style}:{t}", [])]
        return out
    pooled = [pool(h) for h in hits]
    lines = ["| type | n | " + names[0] + " | checkpoint | hits | now right | now wrong | McNemar p |",
             "|---|---|---|---|---|---|---|---|"]
    for name, h in zip(names[1:], pooled[1:]):
        for t, a in pooled[0].items():
            if not a or t not in h:
                continue
            m = mcnemar_exact(a, h[t])  # only_a: right before, wrong now
            lines.append(f"| {t} | {len(a)} | {sum(a)} | {name} | {sum(h[t])} | {m['only_b']} | {m['only_a']} | {m['p']:.2f} |")
    return "\n".join(lines)


def episode_hits(result: dict, episodes: list) -> dict[str, list[bool]]:
    """Per committed episode type, the hits of one :func:`evaluate_extra` result, in split order."""
    out = {}
    for t, v in result.get("episodes", {}).items():
        out[t] = [v["predictions"][ep.id] == ep.answer for ep in episodes if ep.type == t]
    return out


RESERVED_PREFIXES = ("train", "val", "valh", "vqa")  # seed prefixes of training, the monitor and the eval tasks


def validation_types(prefix: str = "sel", types: list[str] | None = None) -> list[str]:
    """The question types of a validation set drawn with seed ``prefix`` (every evaluated type, or
    those in ``types``, which may also name the training-only lookups ``field_value`` and
    ``policy_value``); a reserved or non-alphanumeric prefix and an unknown type are refused with
    ValueError."""
    if not prefix.isalnum() or prefix in RESERVED_PREFIXES:
        raise ValueError(f"validation seed prefix {prefix!r}: want letters and digits, not one of {RESERVED_PREFIXES}")
    every = [*TYPES, *E.SPLIT_TYPES]
    known = [*every, *(t for t in E.ALL_TYPES if t not in every)]
    unknown = sorted(set(types or []) - set(known))
    if unknown:
        raise ValueError(f"unknown question type(s) {unknown}; known: {known}")
    return every if types is None else [t for t in known if t in types]


def validation_episodes(n: int, prefix: str = "sel", types: list[str] | None = None,
                        image_free: bool = False) -> dict[str, list]:
    """Fresh validation conversations for choosing between checkpoints: ``n`` per type from string
    seeds ``<prefix>-<type>-<i>`` (never a training, monitor or committed seed), with 0-2 earlier
    image turns as in the committed conversation split, and ``n // 2`` per image type in each
    held-out style (keys ``shadow:<type>`` and ``dark:<type>``, single questions; neither style is
    ever trained on). ``types`` keeps only those types (and their held-out rows). ``image_free``: no image turns before the task's own (the probe for
    a checkpoint trained on text only: ``field_gate`` and the lookups then hold no image;
    ``erratum_gate`` keeps the filler image turns it draws between errata). A set that has already chosen
    between checkpoints is a selection set: confirm the final choice on a new ``prefix``."""
    kept = validation_types(prefix, types)
    before = 0 if image_free else None
    eps = {t: [E.build(random.Random(f"{prefix}-{t}-{i}"), t, before=before) for i in range(n)] for t in kept}
    for style in D.HELDOUT_STYLES:
        draw = functools.partial(D.render_styled, style=style)
        for t in (t for t in TYPES if t in kept):
            eps[f"{style}:{t}"] = [E.build(random.Random(f"{prefix}-{style}-{t}-{i}"), t, before=0, draw=draw)
                                   for i in range(n // 2)]
    return eps


#: Types whose prompt holds a field block (the asked field's line among 0-2 others; for
#: ``erratum_gate`` the block the errata override).
BLOCK_READ = ("field_gate", "field_image_gate", "erratum_gate", "field_value")


def by_block(eps: dict[str, list], hits: list[dict[str, list[bool]]], names: list[str]) -> str:
    """Markdown table: the block-read types' hits split by the number of field lines in the prompt
    (:func:`vqa_eval.episodes.field_lines`), where the text gates' misses concentrate."""
    lines = ["| type | field lines | n | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for t in (t for t in BLOCK_READ if t in eps):
        sizes = [len(E.field_lines(ep)) for ep in eps[t]]
        for k in sorted(set(sizes)):
            idx = [i for i, s in enumerate(sizes) if s == k]
            lines.append(f"| {t} | {k} | {len(idx)} | " + " | ".join(str(sum(h[t][i] for i in idx)) for h in hits) + " |")
    return "\n".join(lines)


def same_objects(answer: str, label: str) -> bool:
    """Whether a ``describe`` answer names the label's objects (as a multiset), in any order."""
    def objects(text: str) -> list[str]:
        return sorted(" ".join(o.split()) for o in text.split(","))
    return objects(answer) == objects(label)


def validate(dirs: list[Path], n: int, prefix: str = "sel", types: list[str] | None = None,
             block_sizes: bool = False, image_free: bool = False, record: dict | None = None) -> str:
    """Markdown table: each checkpoint's exact-match hits per type on :func:`validation_episodes`
    (with ``block_sizes``, also the block-read types by field-block size: :func:`by_block`).
    ``record``, when given, receives every item: its label and each checkpoint's answer (``--json``)."""
    eps = validation_episodes(n, prefix, types, image_free)
    hits, answers = [], []
    for d in dirs:
        model, processor = load(d)
        answers.append({t: [E.ask(model, processor, ep) for ep in group] for t, group in eps.items()})
        hits.append({t: [a == ep.answer for a, ep in zip(answers[-1][t], eps[t])] for t in eps})
    if record is not None:
        record.update(prefix=prefix, n=n, models=[str(d) for d in dirs],
                      items={t: [{"label": ep.answer, "answers": [a[t][i] for a in answers]} for i, ep in enumerate(g)]
                             for t, g in eps.items()})
    lines = ["| type | n | " + " | ".join(d.name for d in dirs) + " |", "|---|---|" + "---|" * len(dirs)]
    lines += [f"| {t} | {len(g)} | " + " | ".join(str(sum(h[t])) for h in hits) + " |" for t, g in eps.items()]
    if "describe" in eps:  # a miss that names the right objects in the wrong order is a placement error
        lines.append(f"| describe: objects in any order | {len(eps['describe'])} | " + " | ".join(
            str(sum(same_objects(x, ep.answer) for x, ep in zip(a["describe"], eps["describe"]))) for a in answers) + " |")
    if len(dirs) > 1:
        lines += ["", paired([str(d) for d in dirs], hits)]
    if block_sizes:
        lines += ["", by_block(eps, hits, [d.name for d in dirs])]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="accuracy table of the bundled models")
    ap.add_argument("--model", action="append", default=None, help="checkpoint dir (repeatable)")
    ap.add_argument("--set", default=str(SET))
    ap.add_argument("--shuffle-seed", type=int, default=4321)
    ap.add_argument("--shuffle-rounds", type=int, default=10, help="foreign-image draws averaged in the shuffled control")
    ap.add_argument("--limit", type=int, default=None, help="only the first N items of each type (a quick look)")
    ap.add_argument("--heldout-set", action="append", default=None,
                    help="a held-out drawing style split, repeatable (default: heldout_style and heldout_dark; '' skips them)")
    ap.add_argument("--episodes", default=str(EPISODES), help="committed conversation split ('' skips it)")
    ap.add_argument("--json", default=None, help="write the full results here (with --validation: every item's label and answers)")
    ap.add_argument("--write-expectations", action="store_true",
                    help=f"store the answers to the fixed test items in {EXPECTATIONS.relative_to(ROOT)}")
    ap.add_argument("--validation", type=int, default=0, metavar="N",
                    help="instead: compare the --model checkpoints on N fresh validation conversations per type "
                         "(seeds sel-..., never a committed split: the check before bundling)")
    ap.add_argument("--validation-seed", default="sel", metavar="PREFIX",
                    help="seed prefix of the --validation set (a new one confirms a choice made on 'sel')")
    ap.add_argument("--validation-types", default=None, metavar="T1,T2",
                    help="only these question types in the --validation set (may add field_value, policy_value)")
    ap.add_argument("--by-block", action="store_true",
                    help="with --validation: also the types with a field block (field_gate, field_image_gate, "
                         "erratum_gate, field_value) by field-block size")
    ap.add_argument("--image-free", action="store_true",
                    help="with --validation: no image turns before the task's own (a text-only checkpoint's probe)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch (default: torch's own, every core; 1 beside a training run)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.threads is not None:
        if args.threads < 1:
            ap.error("--threads N wants N >= 1")
        torch.set_num_threads(args.threads)
    if args.validation < 0:
        ap.error("--validation N wants N >= 0")
    if args.by_block and not args.validation:
        ap.error("--by-block splits a --validation set: give --validation N")
    if args.image_free and not args.validation:
        ap.error("--image-free shapes a --validation set: give --validation N")
    if args.validation:
        dirs = [Path(m) for m in args.model] if args.model else [m for m in MODELS if m.exists()]
        types = [t for t in args.validation_types.split(",") if t] if args.validation_types else None
        try:
            validation_types(args.validation_seed, types)  # refuses a bad prefix or type before any model loads
        except ValueError as e:
            ap.error(str(e))
        record = {}
        print(validate(dirs, args.validation, args.validation_seed, types, args.by_block, args.image_free, record))
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=1))
        return
    items = load_vqa_set(args.set)
    if args.limit:
        items = [it for t in TYPES for it in [i for i in items if i.type == t][: args.limit]]
    dirs = [Path(m) for m in args.model] if args.model else [m for m in MODELS if m.exists()]
    results = [evaluate(d, items, args.shuffle_seed, args.shuffle_rounds, set_style(args.set)) for d in dirs]
    print(markdown(results))
    sets = [Path(p) for p in (args.heldout_set or [str(HELDOUT_STYLE), str(HELDOUT_DARK)]) if p]
    heldout = {p.name: load_vqa_set(p) for p in sets}
    episodes = E.load_split(args.episodes) if args.episodes else []
    if args.limit:
        heldout = {k: [it for t in TYPES for it in [i for i in v if i.type == t][: args.limit]] for k, v in heldout.items()}
        episodes = [ep for t in E.SPLIT_TYPES for ep in [e for e in episodes if e.type == t][: args.limit]]
    if heldout or episodes:
        for d, r in zip(dirs, results):
            r.update(evaluate_extra(d, heldout, episodes))
        print()
        print(markdown_extra(results, [*heldout, "episodes"]))
        if len(results) > 1 and episodes:
            print()
            print(paired([str(d) for d in dirs], [episode_hits(r, episodes) for r in results]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write_expectations:
        keep, skipped = bundled_only(dirs)
        for d in skipped:  # e.g. a copy of the previous bundle, scored beside the new one for the paired table
            print(f"expectations not written for {d}: not a bundled checkpoint ({', '.join(m.name for m in MODELS)})")
        write_expectations([dirs[i] for i in keep], [results[i] for i in keep], items, Path(args.set))


def bundled_only(dirs: list[Path]) -> tuple[list[int], list[Path]]:
    """Indices of the ``dirs`` that are bundled checkpoints (samples/models/<name>), and the rest:
    expected_answers.json holds only what the bundled-model tests load."""
    bundled = {m.resolve() for m in MODELS}
    keep = [i for i, d in enumerate(dirs) if Path(d).resolve() in bundled]
    return keep, [Path(d) for i, d in enumerate(dirs) if i not in keep]


def write_expectations(dirs: list[Path], results: list[dict], items: list[VQAItem], set_path: Path = SET) -> None:
    """Store each model's answers to the 20 fixed test items (18 synthetic, 2 photos)."""
    photos = set_path / "photos" / "photos.jsonl"
    exp = json.loads(EXPECTATIONS.read_text()) if EXPECTATIONS.exists() else {}
    extra_all = load_vqa_set(photos) if photos.exists() else []
    for d, r in zip(dirs, results):
        model, processor = load(d)
        # per type the first two items whose first-token margin is clear (no near-ties that could
        # flip on another CPU)
        fixed = []
        for t in TYPES:
            group = [it for it in items if it.type == t]
            clear = [it for it in group if r["predictions"][it.id]["margin"] >= 0.2]
            fixed += clear[:2]
        photo_answers = {it.id: answer(model, processor, it.load_image(), it.question) for it in extra_all}
        extra = [it for it in extra_all if photo_answers[it.id][1] >= 0.2][: 20 - len(fixed)]
        # fill up to 20 with further clear-margin synthetic items (photos are near-ties for tiny models)
        more = [it for it in items if it not in fixed and r["predictions"][it.id]["margin"] >= 0.2]
        fixed += more[: 20 - len(fixed) - len(extra)]
        entry = {}
        for it in fixed:
            entry[it.id] = {"question": it.question, "image": str(Path(it.image).relative_to(ROOT)),
                            "answer": r["predictions"][it.id]["answer"], "margin": r["predictions"][it.id]["margin"]}
        for it in extra:
            a, m = photo_answers[it.id]
            entry[it.id] = {"question": it.question, "image": str(Path(it.image).relative_to(ROOT)),
                            "answer": a, "margin": round(m, 3)}
        exp[d.name] = entry
    EXPECTATIONS.write_text(json.dumps(exp, indent=1, sort_keys=True) + "\n")
    print(f"wrote {EXPECTATIONS}")

if __name__ == "__main__":
    main()
