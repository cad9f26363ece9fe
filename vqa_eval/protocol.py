"""Seeded multi-turn conversations for the agreement evaluation.

Every item is asked twice, in the style the bundled models are trained on (samples/train.py): a
system turn, earlier user turns (another item's image and question) with their answers, then the
item's image and question in the last user turn.

* `earlier`: the request in which the image was uploaded, after 0-2 earlier turns;
* `later`: the same image and question asked again after 1-3 *different* earlier turns, so the
  image sits at another position after other text. Two layouts:
  - `new_chat`: a new chat of the same app (same system turn) — exact-prefix reuse can only
    share the header with `earlier`;
  - `continue`: the same chat continued — `earlier` (with its answer) is a prefix of `later`,
    so exact-prefix reuse gets its fair share; the image appears twice.

Every arm is served `earlier` first and then measured on `later` (vqa_eval/run.py), so every arm
sees the same cross-request state. A `Shape` sets the counts and the stress-grid variations
(vqa_eval/grid.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from mmkv.vqa_eval.dataset import TYPES, VQAItem

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer with one word.",
    "you look at images and answer each question with one word .",
)
#: A long text-only turn for the stress grid (about 60 tokens; the models answer it with a word).
TEXT_GAP = ("policy : refund only if the status light is green . otherwise escalate . the customer asks for a "
            "refund . answer refund or escalate . " * 2).strip()


@dataclass(frozen=True)
class Shape:
    """How a conversation is drawn. Defaults: the training layout."""

    earlier: tuple[int, int] = (0, 2)  # filler turns before the item in `earlier` (inclusive range)
    later: tuple[int, int] = (1, 3)  # filler turns before the item in `later`
    layout: str = "new_chat"  # or "continue"
    text_gaps: int = 0  # long text-only turns just before the asked turn in `later`
    image_twice: bool = False  # `later` opens with the item's image asked and answered once
    two_images: bool = False  # the asked turn shows another image first, then the item's
    systems: tuple[str, ...] = SYSTEM_PROMPTS

    def __post_init__(self):
        assert self.layout in ("new_chat", "continue"), self.layout
        assert 0 <= self.earlier[0] <= self.earlier[1] and 0 <= self.later[0] <= self.later[1]


@dataclass(frozen=True)
class Turn:
    images: tuple[str, ...]  # paths, shown before the text
    question: str
    answer: str | None  # None for the turn being asked


@dataclass(frozen=True)
class Conversation:
    item: VQAItem
    seed: int
    system: str
    earlier: tuple[Turn, ...]  # ends with the item's turn
    later: tuple[Turn, ...]  # ends with the item's turn

    @property
    def images(self) -> list[str]:
        return list(dict.fromkeys(p for t in (*self.earlier, *self.later) for p in t.images))

    @property
    def key(self) -> str:
        return f"{self.seed}/{self.item.id}"


def build_conversation(item: VQAItem, pool: Sequence[VQAItem], seed: int, shape: Shape = Shape()) -> Conversation:
    """The item's two requests; filler turns are other items of `pool` with their true answers."""
    rng = random.Random(f"vqa-agreement-{seed}-{item.id}")
    others = [p for p in pool if p.image != item.image]
    n_earlier, n_later = rng.randint(*shape.earlier), rng.randint(*shape.later)
    fillers = rng.sample(others, min(n_earlier + n_later + shape.two_images, len(others)))
    system = rng.choice(shape.systems)
    turn = lambda f: Turn((f.image,), f.question, f.answer)  # noqa: E731
    ask = Turn((fillers[-1].image, item.image) if shape.two_images else (item.image,), item.question, None)
    earlier = tuple(turn(f) for f in fillers[:n_earlier]) + (Turn((item.image,), item.question, None),)
    later = tuple(turn(f) for f in fillers[n_earlier:n_earlier + n_later])
    if shape.image_twice:
        later = (Turn((item.image,), item.question, item.answer),) + later
    later += tuple(Turn((), TEXT_GAP, "escalate") for _ in range(shape.text_gaps)) + (ask,)
    if shape.layout == "continue":
        later = earlier[:-1] + (Turn((item.image,), item.question, item.answer),) + later
    return Conversation(item, seed, system, earlier, later)


def to_messages(system: str, turns: Sequence[Turn], file_ids: dict[str, str]) -> list[dict]:
    """OpenAI-shaped messages; `file_ids` maps an image path to the engine's image id."""
    msgs: list[dict] = [{"role": "system", "content": [{"type": "text", "text": system}]}]
    for t in turns:
        parts = [{"type": "image_file", "image_file": {"file_id": file_ids[p]}} for p in t.images]
        msgs.append({"role": "user", "content": parts + [{"type": "text", "text": t.question}]})
        if t.answer is not None:
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": t.answer}]})
    return msgs


def balanced_subset(items: Sequence[VQAItem], limit: int | None) -> list[VQAItem]:
    """The first `limit` items taken round-robin over question types, so every category is present."""
    by_type: dict[str, list[VQAItem]] = {}
    for it in items:
        by_type.setdefault(it.type, []).append(it)
    order = [t for t in TYPES if t in by_type] + sorted(t for t in by_type if t not in TYPES)
    out: list[VQAItem] = []
    for i in range(max((len(v) for v in by_type.values()), default=0)):
        out.extend(by_type[t][i] for t in order if i < len(by_type[t]))
    return out if limit is None else out[:limit]
