"""Which feature of the held-out ``dark`` renderer costs accuracy (session 51).

    python samples/wip/dark-ablation.py MODEL_DIR [N] [VARIANT,...]

Each variant redraws the ``dark`` renderer (``dataset._render_dark``) with one feature switched off; ``flat_darkbg`` is the
plain ``flat`` renderer with only its background swapped for one of ``dark``'s. N items per image
type (default 40), seeds ``abl-<type>-<i>``: never a training, validation or committed seed. One
thread; prints hits of N * 9 per variant and per type."""
from __future__ import annotations

import dataclasses
import functools
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "samples")]

import torch  # noqa: E402

import evaluate_tiny as ET  # noqa: E402
from vqa_eval import dataset as D, episodes as E  # noqa: E402


def flat_darkbg(scene, rng):
    return D.render(dataclasses.replace(scene, background=rng.choice(D.DARK_BACKGROUNDS)), rng)


VARIANTS = {  # dataset._render_dark's switches, one off at a time
    "dark": D._render_dark,
    "no_ring": functools.partial(D._render_dark, ring=False),
    "no_rim": functools.partial(D._render_dark, rim=False),
    "no_invert": functools.partial(D._render_dark, invert=False),
    "no_rescale": functools.partial(D._render_dark, rescale=False),
    "light_bg": functools.partial(D._render_dark, dark_bg=False),
    "flat": lambda s, r: D.render_styled(s, r, "flat"),
    "flat_darkbg": flat_darkbg,
    "varied": lambda s, r: D.render_styled(s, r, "varied"),
}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    model_dir, n = argv[0], int(argv[1]) if len(argv) > 1 else 40
    chosen = argv[2].split(",") if len(argv) > 2 else list(VARIANTS)
    model, processor = ET.load(model_dir)
    for name in chosen:
        t0, row = time.time(), {}
        for t in D.TYPES:
            eps = [E.build(random.Random(f"abl-{t}-{i}"), t, before=0, draw=VARIANTS[name]) for i in range(n)]
            row[t] = sum(E.ask(model, processor, ep) == ep.answer for ep in eps)
        print(f"{name:12s} {sum(row.values())}/{n * len(row)} {row} {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
