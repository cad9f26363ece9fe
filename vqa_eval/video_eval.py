"""`mmkv eval --task video`: synthetic clips asked about in multi-turn conversations, the clip
uploaded before the conversation and shown in an earlier turn, then asked about again later at
another position; the splice against a full recompute.

Clips (`draw_clip`, seeded, 8 frames at 2 fps: 4 temporal groups) and their questions:
- `direction`: a red square crosses the frame beside a still blue one; "which way did the red
  shape move ?" (left, right, up, down; chance 1/4);
- `first_colour`: squares of four colours appear one after another; "what colour appears first ?"
  (red, green, blue, yellow; chance 1/4);
- `count_end`: squares appear over time, one to four in the end; "how many shapes are there at the
  end ?" (one .. four; chance 1/4);
- `light_green`: a red light that turns green at a random frame, or stays red (or turns yellow);
  "did the light turn green ?" (yes, no; chance 1/2).

Arms, each on the same messages, in a seeded order, each conversation in its own tenant:
- `full` (reference): `reuse=False`, every token computed in one pass;
- `splice`: each temporal group's KV precompiled at upload, re-rotated into place, 1 seam token;
- `no-rotate` (control): the same cached KV spliced where it was computed (`rope_policy="none"`);
- `shuffled` (control): a full recompute of the clip with its temporal groups in a seeded random
  order (times unchanged): a model that reads the clip's order must lose accuracy on the
  order-dependent types.

Per type: agreement with `full` of the whole answer and of its first token, accuracy against the
label for every arm, exact 95% intervals; the chance rate beside them.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from mmkv.engine import BUNDLED_MODEL, Engine
from mmkv.vqa_eval.metrics import normalize_answer
from mmkv.vqa_eval.run import _rate, header

TYPES = ("direction", "first_colour", "count_end", "light_green")
ANSWERS = {"direction": ("left", "right", "up", "down"), "first_colour": ("red", "green", "blue", "yellow"),
           "count_end": ("one", "two", "three", "four"), "light_green": ("yes", "no")}
QUESTIONS = {"direction": "which way did the red shape move ?", "first_colour": "what colour appears first ?",
             "count_end": "how many shapes are there at the end ?", "light_green": "did the light turn green ?"}
ARMS = ("full", "splice", "no-rotate", "shuffled")
COLOURS = {"red": (220, 30, 30), "green": (30, 190, 60), "blue": (40, 70, 220), "yellow": (235, 210, 30)}
FRAMES, FPS, SIDE = 8, 2.0, 112
#: The model used when none is given: the bundled Qwen2.5-VL tiny fine-tuned on these question types
#: (samples/train_video.py; docs/models.md).
VIDEO_MODEL = BUNDLED_MODEL.parent / "qwen2_5_vl-tiny-video"
FILLERS = ("the weather was calm today .", "please keep answers short .", "we looked at several clips before .",
           "the camera sits on a shelf .", "nothing else happened in the room .")


@dataclass(frozen=True)
class Clip:
    type: str
    answer: str
    frames: tuple  # (PIL image, seconds) pairs


def _canvas(rng: random.Random) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    img = Image.new("RGB", (SIDE, SIDE), tuple(rng.randint(150, 200) for _ in range(3)))
    return img, ImageDraw.Draw(img)


def _square(draw, x: float, y: float, colour: str, size: int = 22) -> None:
    draw.rectangle([x, y, x + size, y + size], fill=COLOURS[colour])


def _direction(rng: random.Random, answer: str) -> list[Image.Image]:
    lo, hi, fixed = 6, SIDE - 28, rng.randint(10, SIDE - 32)
    blue = (rng.randint(6, SIDE - 28), rng.randint(6, SIDE - 28))
    out = []
    for i in range(FRAMES):
        s = lo + (hi - lo) * i / (FRAMES - 1)
        s = s if answer in ("right", "down") else lo + hi - s
        x, y = (s, fixed) if answer in ("left", "right") else (fixed, s)
        img, draw = _canvas(random.Random(0))
        _square(draw, *blue, "blue", 16)
        _square(draw, x, y, "red")
        out.append(img)
    return out


def _appearing(rng: random.Random, colours: list[str], starts: list[int]) -> list[Image.Image]:
    """Squares of `colours` appearing at frames `starts`, at seeded places on a 2 x 2 layout."""
    cells = rng.sample([(8, 8), (62, 8), (8, 62), (62, 62)], len(colours))
    out = []
    for i in range(FRAMES):
        img, draw = _canvas(random.Random(0))
        for colour, start, (x, y) in zip(colours, starts, cells):
            if i >= start:
                _square(draw, x, y, colour, 36)
        out.append(img)
    return out


def _light(rng: random.Random, answer: str) -> list[Image.Image]:
    turn = rng.randint(2, FRAMES - 2)
    later = "green" if answer == "yes" else rng.choice(["red", "yellow"])
    out = []
    for i in range(FRAMES):
        img, draw = _canvas(random.Random(0))
        draw.rectangle([40, 12, 72, 100], fill=(40, 40, 40))
        colour = COLOURS[later if i >= turn else "red"]
        draw.ellipse([46, 40, 66, 60], fill=colour)
        out.append(img)
    return out


def draw_clip(qtype: str, seed: int) -> Clip:
    """The clip of one item: its type, its seeded answer and 8 frames at 2 fps."""
    rng = random.Random(f"video-{qtype}-{seed}")
    answer = rng.choice(ANSWERS[qtype])
    if qtype == "direction":
        images = _direction(rng, answer)
    elif qtype == "first_colour":
        colours = [answer] + rng.sample([c for c in COLOURS if c != answer], rng.randint(1, 3))
        images = _appearing(rng, colours, sorted(rng.sample(range(1, FRAMES), len(colours))))
    elif qtype == "count_end":
        n = ANSWERS[qtype].index(answer) + 1
        images = _appearing(rng, rng.sample(list(COLOURS), n), sorted(rng.choices(range(0, FRAMES - 1), k=n)))
    else:
        images = _light(rng, answer)
    return Clip(qtype, answer, tuple((img, i / FPS) for i, img in enumerate(images)))


def shuffled(clip: Clip, seed: int) -> list:
    """The clip's temporal groups (two frames each) in a seeded order that moves at least one, each
    frame keeping the time of the place it lands in."""
    groups = [clip.frames[i:i + 2] for i in range(0, len(clip.frames), 2)]
    order = list(range(len(groups)))
    rng = random.Random(f"shuffle-{seed}")
    while order == sorted(order):
        rng.shuffle(order)
    frames = [f for g in order for f, _ in groups[g]]
    return [(f, t) for f, (_, t) in zip(frames, clip.frames)]


def conversation(video_part: dict, question: str, seed: int) -> list[dict]:
    """The clip shown in an earlier turn after seeded filler, then asked about later, after more
    filler text, at another position."""
    rng = random.Random(f"conv-{seed}")
    filler = lambda: " ".join(rng.sample(FILLERS, rng.randint(1, 3)))  # noqa: E731
    return [{"role": "system", "content": "you answer questions about short clips with one word ."},
            {"role": "user", "content": [{"type": "text", "text": filler()}, video_part,
                                         {"type": "text", "text": "here is a clip ."}]},
            {"role": "assistant", "content": "noted ."},
            {"role": "user", "content": [{"type": "text", "text": filler() + " look at it again :"}, video_part,
                                         {"type": "text", "text": question}]}]


def _sampling(engine: Engine) -> dict:
    f = engine.registry.videos.budget.factor
    return {"max_pixels": 16 * f * f}


def blend_arm(ratio: float) -> str:
    return f"blend {ratio:g}"


def serve(engine: Engine, clip: Clip, seed: int, max_new_tokens: int, blend: tuple[float, ...] = ()) -> dict:
    """Every arm on one conversation about `clip` (and the splice with the fidelity dial at each
    `blend` ratio); its record per arm."""
    sampling = _sampling(engine)
    mixed = conversation({"type": "video", "video": shuffled(clip, seed), **sampling}, QUESTIONS[clip.type], seed)
    calls = {"full": dict(reuse=False), "splice": dict(seam_tokens=1),
             "no-rotate": dict(seam_tokens=1, rope_policy="none"), "shuffled": dict(reuse=False),
             **{blend_arm(r): dict(seam_tokens=1, blend=r) for r in blend}}
    out = {}
    for arm in random.Random(f"arms-{seed}").sample(list(calls), len(calls)):
        tenant = f"video-eval/{clip.type}/{seed}/{arm}"  # no arm reads another's prefix blocks
        video_id = engine.add_video(list(clip.frames), tenant=tenant, **sampling)  # uploaded before the chat
        part = {"type": "video_file", "video_file": {"file_id": video_id}}
        msgs = mixed if arm == "shuffled" else conversation(part, QUESTIONS[clip.type], seed)
        r = engine.generate(msgs, max_new_tokens=max_new_tokens, tenant=tenant, **calls[arm])
        out[arm] = {"answer": r.text.strip(), "first_token": int(r.first_logits.argmax()), "ttft_s": r.ttft_s,
                    "vision_tower_runs": r.vision_tower_runs, "video_tokens_reused": r.video_tokens_reused}
        engine.remove_video(video_id, tenant=tenant)
    ref = out["full"]
    for rec in out.values():
        rec["agree"] = normalize_answer(rec["answer"]) == normalize_answer(ref["answer"])
        rec["first_agree"] = rec["first_token"] == ref["first_token"]
        rec["correct"] = normalize_answer(rec["answer"]) == clip.answer
    return out


def run_video_eval(model_dir: str | Path | None = None, limit: int | None = None, seeds: int = 2, seed: int = 0,
                   out: str | Path = "eval-video", max_new_tokens: int | None = None, engine: Engine | None = None,
                   progress: bool = True, blend: tuple[float, ...] = ()) -> dict:
    """`limit` clips per type (default 30), each asked in `seeds` conversations; `model_dir` None is
    VIDEO_MODEL; `blend`: one more splice arm per fidelity-dial ratio (kind video)."""
    from tqdm import tqdm

    model_dir = model_dir or VIDEO_MODEL

    engine = engine or Engine.from_pretrained(model_dir)
    budget = max_new_tokens or 4
    items = [(t, seed + i) for i in range(limit or 30) for t in TYPES]
    t0, rows = time.perf_counter(), []
    for qtype, item in tqdm(items, desc="video", unit="clip", disable=not progress):
        clip = draw_clip(qtype, item)
        for s in range(seeds):
            conv_seed = item * 1000 + s
            rows.append({"type": qtype, "item": item, "seed": conv_seed, "label": clip.answer,
                         "arms": serve(engine, clip, conv_seed, budget, blend)})
    report = {"task": "video", **header(engine, model_dir, "synthetic clips (vqa_eval/video_eval.py)", seed,
                                        limit, budget),
              "n": len(rows), "arms": [*ARMS, *map(blend_arm, blend)], "wall_s": round(time.perf_counter() - t0, 2),
              "summary": _summary(rows, [*ARMS, *map(blend_arm, blend)]), "requests": rows}
    from mmkv.vqa_eval.report import write_report_files

    write_report_files(report, out, video_markdown(report))
    return report


def _summary(rows: list[dict], arms: list[str]) -> dict:
    summary = {}
    for t in [*TYPES, "all"]:
        sel = [r for r in rows if t in ("all", r["type"])]
        chance = (float(np.mean([1 / len(ANSWERS[r["type"]]) for r in sel])) if sel else float("nan"))
        summary[t] = {"n": len(sel), "chance": chance}
        for a in arms:
            recs = [r["arms"][a] for r in sel]
            summary[t][a] = {"accuracy": _rate(sum(x["correct"] for x in recs), len(recs)),
                             "agreement": _rate(sum(x["agree"] for x in recs), len(recs)),
                             "first_token_agreement": _rate(sum(x["first_agree"] for x in recs), len(recs)),
                             "ttft_median_s": float(np.median([x["ttft_s"] for x in recs])) if recs else float("nan"),
                             "vision_tower_runs": float(np.mean([x["vision_tower_runs"] for x in recs]))
                             if recs else float("nan")}
    return summary


def video_markdown(report: dict) -> str:
    from mmkv.vqa_eval.report import rate, setup_line

    lines = [f"# Video: {report['model']}", "",
             f"n = {report['n']} conversations (clip uploaded before, shown in an earlier turn, asked about later "
             "at another position); `full`: reuse=False; `splice`: every temporal group's KV re-rotated into place "
             "(seam 1); `no-rotate`: spliced where computed; `shuffled`: full recompute of the clip with its groups "
             "reordered. " + setup_line(report), "",
             "| type | n | chance | accuracy full | accuracy splice | accuracy shuffled | splice agreement with full | "
             "first-token agreement | no-rotate agreement | shuffled agreement | TTFT splice / full |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    dials = [a for a in report["arms"] if a not in ARMS]
    if dials:
        lines[-2] += "".join(f" {a} agreement |" for a in dials)
        lines[-1] += "---|" * len(dials)
    for t, s in report["summary"].items():
        fu, sp, nr, sh = s["full"], s["splice"], s["no-rotate"], s["shuffled"]
        ratio = sp["ttft_median_s"] / fu["ttft_median_s"] if fu["ttft_median_s"] else float("nan")
        lines.append(f"| {t} | {s['n']} | {s['chance']:.2f} | {rate(fu['accuracy'])} | {rate(sp['accuracy'])} | "
                     f"{rate(sh['accuracy'])} | {rate(sp['agreement'])} | {rate(sp['first_token_agreement'])} | "
                     f"{rate(nr['agreement'])} | {rate(sh['agreement'])} | {ratio:.2f} |"
                     + "".join(f" {rate(s[a]['agreement'])} |" for a in dials))
    return "\n".join(lines) + "\n"
