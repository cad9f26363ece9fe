"""Fine-tune a copy of a bundled tiny model on the video evaluation's question types.

    python samples/train_video.py --base samples/models/qwen2_5_vl-tiny --out /tmp/q25-video --minutes 36
    python samples/train_video.py --base samples/models/qwen3_vl-tiny   --out /tmp/q3-video  --minutes 36
    python samples/train_video.py --base samples/models/qwen2_5_vl-tiny --out /tmp/smoke --steps 4 --val-per-type 1
    python samples/train_video.py --write-expectations samples/models/qwen2_5_vl-tiny-video samples/models/qwen3_vl-tiny-video

The clips, questions and conversations are the video evaluation's own (``vqa_eval/video_eval.py``:
``draw_clip``, ``QUESTIONS``, ``conversation``), drawn from string seeds ``train-<seed>-<step>-<k>``
that never meet the evaluation's integer seeds. Each conversation is tokenized and placed by the
engine's own planner (``Engine.planner``: the chat template, each temporal group's tokens, Qwen3-VL's
``<t seconds>`` stamps, and the released models' M-RoPE rule for video positions) with the sampling
the evaluation uses (``video_eval._sampling``), so the model trains on exactly the tokens and positions
a full recompute in the evaluation feeds it; the forward is the model's own (vision tower included,
the positions passed explicitly). The loss covers the answer tokens and ``<|im_end|>`` of every
assistant turn (``train.Batcher.labels_for``). Each step also trains on a batch of the image VQA task
(``train.Batcher``, string seeds ``train-<seed>-<step>`` as ``train.py`` draws them) at
``--image-weight``, so the image skills are not forgotten.

AdamW, linear warm-up, cosine decay on ``max(step / steps, elapsed / budget)`` (as ``train.py``).
One torch thread by default; the process's CPU seconds are recorded in ``train_state.json`` (``cpu_s``).

``--write-expectations`` records what shipped video checkpoints answer (full recompute and splice)
on a few fixed evaluation clips (:data:`EXPECTATION_CLIPS`) into ``samples/models/expected_video_answers.json``,
which ``tests/test_video_models.py`` checks.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import train as T  # samples/train.py: its batcher, labels, optimizer groups and save
from mmkv.adapters import load_adapter
from mmkv.engine import Engine
from mmkv.request.messages import parse_messages
from mmkv.vqa_eval import video_eval as V
from mmkv.vqa_eval.metrics import normalize_answer

#: Sampling weight of each question type in the video batches.
VIDEO_TYPE_WEIGHTS = {t: 1.0 for t in V.TYPES}
#: The image task's types mixed in (train.py's defaults: the single-image set's nine).
IMAGE_TYPE_WEIGHTS = {t: w for t, w in T.TYPE_WEIGHTS.items() if w > 0}


#: (type, item) of the evaluation clips whose answers are stored, each asked in conversation seed item * 1000.
EXPECTATION_CLIPS = (("direction", 0), ("first_colour", 1), ("light_green", 2))
EXPECTATIONS = Path(__file__).resolve().parent / "models" / "expected_video_answers.json"


@dataclass
class VideoExample:
    input_ids: torch.Tensor  # [L]
    positions: torch.Tensor  # [3, L], the engine's native positions
    labels: torch.Tensor  # [L]
    pixel_values: list[torch.Tensor]  # one per video occurrence, in prompt order
    grids: list[tuple[int, int, int]]


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for children."""
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def prompt(engine: Engine, messages: list[dict]) -> tuple[torch.Tensor, list]:
    """The prompt's token ids and the references of its spans, as `Engine.splice_plan` builds them
    (inline videos registered for this call only; no KV precompiled)."""
    template, refs = parse_messages(messages)
    prepared = engine.registry.prepare_inline(refs)
    with engine.registry.inline_images() as held:
        ids, spans = engine.planner.prompt(template, engine.registry.resolve(refs, "train", prepared, held))
    return ids, [r for _, r in spans]


def video_example(engine: Engine, batcher: T.Batcher, qtype: str, seed: str) -> VideoExample:
    """One evaluation-shaped conversation about a fresh clip, its answer appended and labelled."""
    clip = V.draw_clip(qtype, seed)
    part = {"type": "video", "video": list(clip.frames), **V._sampling(engine)}
    ids, refs = prompt(engine, V.conversation(part, V.QUESTIONS[qtype], seed))
    answer = batcher.tok(clip.answer, add_special_tokens=False)["input_ids"] + [batcher.im_end]
    ids = torch.cat([ids, torch.tensor(answer)])
    positions = engine.planner.native_positions(ids, refs)
    # each video occurrence's pixels, in prompt order (a video's groups are consecutive refs from index 0)
    encoded = [engine.adapter.preprocess_video(r.video.video.frames) for r in refs if r.index == 0]
    return VideoExample(ids, positions, batcher.labels_for(ids.view(1, -1))[0],
                        [pv for pv, _ in encoded], [g for _, g in encoded])


def collate(examples: list[VideoExample], pad_id: int) -> dict:
    """Right-padded batch with explicit M-RoPE positions [3, B, L] (the model's forward then uses them as
    they are)."""
    n = max(e.input_ids.numel() for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), T.IGNORE, dtype=torch.long)
    positions = torch.zeros(3, len(examples), n, dtype=torch.long)
    mask = torch.zeros(len(examples), n, dtype=torch.long)
    for b, e in enumerate(examples):
        k = e.input_ids.numel()
        ids[b, :k], labels[b, :k], positions[:, b, :k], mask[b, :k] = e.input_ids, e.labels, e.positions, 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels,
            "pixel_values_videos": torch.cat([p for e in examples for p in e.pixel_values]),
            "video_grid_thw": torch.tensor([g for e in examples for g in e.grids], dtype=torch.long)}


def video_batch(engine: Engine, batcher: T.Batcher, rng: random.Random, size: int, step: int, seed: int,
                weights: dict[str, float]) -> dict:
    types = rng.choices(list(weights), weights=list(weights.values()), k=size)
    examples = [video_example(engine, batcher, t, f"train-{seed}-{step}-{k}") for k, t in enumerate(types)]
    return collate(examples, batcher.tok.convert_tokens_to_ids("<|endoftext|>"))


@torch.no_grad()
def validate(engine: Engine, per_type: int, seed: int) -> dict[str, float]:
    """Greedy full-recompute accuracy per type on validation clips (seeds ``val-<seed>-<i>``), in the
    evaluation's conversation, on the clip and (key ``shuffled:<type>``) on its groups reordered."""
    engine.adapter.model.eval()
    hits: dict[str, list[int]] = {}
    sampling = V._sampling(engine)
    for qtype in V.TYPES:
        for i in range(per_type):
            s = f"val-{seed}-{i}"
            clip = V.draw_clip(qtype, s)
            for key, frames in ((qtype, list(clip.frames)), (f"shuffled:{qtype}", V.shuffled(clip, s))):
                msgs = V.conversation({"type": "video", "video": frames, **sampling}, V.QUESTIONS[qtype], s)
                r = engine.generate(msgs, max_new_tokens=4, reuse=False, tenant="val")
                hits.setdefault(key, []).append(int(normalize_answer(r.text.strip()) == clip.answer))
    engine.adapter.model.train()
    return {k: round(sum(v) / len(v), 3) for k, v in hits.items()}


def copy_base(base: Path, out: Path) -> None:
    """The base checkpoint's files in `out` (the bundled one is never written)."""
    if out.resolve() == base.resolve():
        raise SystemExit("--out must differ from --base: the base checkpoint is never overwritten")
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)


#: The arms whose answers are stored: the controls' answers sit on small margins that may flip between CPUs.
EXPECTATION_ARMS = ("full", "splice")


def answers_on(engine: Engine, qtype: str, item: int) -> dict[str, str]:
    """The full recompute's and the splice's greedy answers to one evaluation clip, as `mmkv eval --task
    video` asks it."""
    record = V.serve(engine, V.draw_clip(qtype, item), item * 1000, max_new_tokens=4)
    return {arm: record[arm]["answer"] for arm in EXPECTATION_ARMS}


def write_expectations(model_dirs: list[str]) -> None:
    stored = {}
    for d in map(Path, model_dirs):
        engine = Engine.from_pretrained(d)
        stored[d.name] = [{"type": t, "item": i, "answers": answers_on(engine, t, i)} for t, i in EXPECTATION_CLIPS]
    EXPECTATIONS.write_text(json.dumps(stored, indent=2, sort_keys=True) + "\n")
    print(f"wrote {EXPECTATIONS}")


def base_run(base: Path) -> dict:
    """What trained the base checkpoint: its last command and its totals over every run."""
    state = json.loads((base / "train_state.json").read_text())
    return {k: state.get(k) for k in ("command", "total_steps", "total_elapsed_s")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="fine-tune a copy of a tiny Qwen-VL on the video evaluation's types")
    ap.add_argument("--base", help="the checkpoint to start from (read only)")
    ap.add_argument("--out")
    ap.add_argument("--write-expectations", nargs="+", metavar="MODEL_DIR",
                    help="store these checkpoints' answers on EXPECTATION_CLIPS (no training)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--minutes", type=float, default=None, help="wall-clock budget")
    ap.add_argument("--steps", type=int, default=None, help="step budget (the schedule's length)")
    ap.add_argument("--batch", type=int, default=12, help="video conversations per step")
    ap.add_argument("--image-batch", type=int, default=6, help="image VQA conversations per step (0: none)")
    ap.add_argument("--image-weight", type=float, default=0.5, help="loss weight of the image batch")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--val-every", type=int, default=150)
    ap.add_argument("--val-per-type", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.write_expectations:
        return write_expectations(args.write_expectations)
    if not (args.base and args.out):
        ap.error("give --base and --out")
    if args.minutes is None and args.steps is None:
        ap.error("give --minutes and/or --steps")
    cpu0, t0 = cpu_seconds(), time.time()
    torch.manual_seed(args.seed)
    base, out = Path(args.base), Path(args.out)
    copy_base(base, out)
    adapter = load_adapter(out)
    engine = Engine(adapter)
    model, processor = adapter.model, adapter.processor
    batcher = T.Batcher(processor, model.config.model_type)
    opt = torch.optim.AdamW(T.param_groups(model), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    budget_s = args.minutes * 60 if args.minutes else None
    history: list[dict] = []
    step, ema = 0, None

    def progress() -> float:
        return min(1.0, max(step / args.steps if args.steps else 0.0,
                            (time.time() - t0) / budget_s if budget_s else 0.0))

    def evaluate() -> None:
        acc = validate(engine, args.val_per_type, args.seed)
        history.append({"step": step, "t": round(time.time() - t0), "loss_ema": round(ema or 0, 4), **acc})
        print("val", json.dumps(history[-1]), flush=True)

    model.train()
    while progress() < 1.0:
        p = progress()
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_mult"]
        rng = random.Random(f"train-video-{args.seed}-{step}")
        loss = model(**video_batch(engine, batcher, rng, args.batch, step, args.seed, VIDEO_TYPE_WEIGHTS)).loss
        total = loss
        if args.image_batch:
            images = batcher.batch(random.Random(f"train-{args.seed}-{step}"), args.image_batch, 0.85,
                                         types=IMAGE_TYPE_WEIGHTS)
            total = total + args.image_weight * model(**images).loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0 or step <= 3:
            print(f"step {step} p={p:.3f} lr={lr:.2e} video_loss={loss.item():.4f} ema={ema:.4f} "
                  f"t={time.time() - t0:.0f}s cpu={cpu_seconds() - cpu0:.0f}s", flush=True)
        if step % args.val_every == 0:
            evaluate()
    evaluate()
    state = {"base": str(base), "seed": args.seed, "steps": step, "batch": args.batch,
             "image_batch": args.image_batch, "image_weight": args.image_weight, "lr": args.lr,
             "minutes_budget": args.minutes, "steps_budget": args.steps, "threads": args.threads,
             "elapsed_s": round(time.time() - t0, 1), "cpu_s": round(cpu_seconds() - cpu0, 1),
             "video_type_weights": VIDEO_TYPE_WEIGHTS, "image_type_weights": IMAGE_TYPE_WEIGHTS,
             "loss_ema": ema, "command": "python samples/train_video.py " + " ".join(sys.argv[1:] if argv is None else argv),
             "base_run": base_run(base), "history": history}
    T.save(model, processor, out, state)
    print(f"done: {step} steps in {state['elapsed_s']:.0f}s wall, {state['cpu_s']:.0f}s CPU -> {out}", flush=True)


if __name__ == "__main__":
    main()
