"""Seeded multi-turn conversations for the agreement evaluation.

Every item is asked twice, in the style the bundled models are trained on (samples/train.py): a
system turn, earlier user turns (another item's image and question) with their answers, then the
item's image and question in the last user turn.

* `earlier`: the request in which the image was uploaded, after 0-2 earlier turns;
* `later`: the same image and question asked again in the same chat app (same system turn) after
  1-3 *different* earlier turns, so the image sits at another position after other text.

The `prefix` arm reuses `earlier`'s KV for the longest common token prefix of the two prompts;
the splice arms reuse the image's cached KV wherever it lands.
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


@dataclass(frozen=True)
class Turn:
    image: str  # path
    question: str
    answer: str | None  # None for the turn being asked


@dataclass(frozen=True)
class Conversation:
    item: VQAItem
    system: str
    earlier: tuple[Turn, ...]  # ends with the item's turn
    later: tuple[Turn, ...]  # ends with the item's turn, after other earlier turns

    @property
    def images(self) -> list[str]:
        return list(dict.fromkeys(t.image for t in (*self.earlier, *self.later)))


def build_conversation(item: VQAItem, pool: Sequence[VQAItem], seed: int) -> Conversation:
    """The item's two requests; earlier turns are other items of `pool` with their true answers."""
    rng = random.Random(f"vqa-agreement-{seed}-{item.id}")
    others = [p for p in pool if p.image != item.image]
    n_earlier, n_later = rng.randint(0, 2), rng.randint(1, 3)
    fillers = rng.sample(others, min(n_earlier + n_later, len(others)))
    ask = Turn(item.image, item.question, None)
    earlier = tuple(Turn(f.image, f.question, f.answer) for f in fillers[:n_earlier]) + (ask,)
    later = tuple(Turn(f.image, f.question, f.answer) for f in fillers[n_earlier:]) + (ask,)
    return Conversation(item, rng.choice(SYSTEM_PROMPTS), earlier, later)


def to_messages(system: str, turns: Sequence[Turn], file_ids: dict[str, str]) -> list[dict]:
    """OpenAI-shaped messages; `file_ids` maps an image path to the engine's image id."""
    msgs: list[dict] = [{"role": "system", "content": [{"type": "text", "text": system}]}]
    for t in turns:
        msgs.append({"role": "user", "content": [{"type": "image_file", "image_file": {"file_id": file_ids[t.image]}},
                                                 {"type": "text", "text": t.question}]})
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
