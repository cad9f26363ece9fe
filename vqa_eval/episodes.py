"""Conversations for every task the bundled models are trained and scored on.

An :class:`Episode` is a chat (system turn, user turns with images or text, the assistant's
answers) whose *last* answer is the one asked about. The same builder feeds training
(``samples/train.py``: every answer is supervised) and the committed conversation split
(``samples/vqa/episodes``: the last answer is scored), so both see one distribution.

Task types beyond the nine single-image ones of :mod:`mmkv.vqa_eval.dataset`:

* ``describe``: a multi-token answer, ``red circle , blue square`` (objects left to right);
* two-image, the images in different turns: ``same_color`` (is this shape the same colour as the
  one in the previous image: yes / no), ``more_shapes`` (which has more shapes: this / previous);
* text fields: ``field_gate`` (a refund policy names a field and the value it needs; a field line,
  ``order_status: pending`` / ``tier = gold`` / ``{"payment": "paid"}``, among other fields, in the
  system turn or in the asking turn; the answer is refund iff the value matches);
  ``erratum_gate`` (the same, then 1-3 of the paper's ``[STATE UPDATE]`` lines in later turns
  override the field, the latest winning; earlier turns ask and are answered with the value then
  current); ``field_image_gate`` (refund only if the status light has a colour *and* the field has
  a value: an image gate combined with a text field).

Two retrieval types, for training (not in the committed split): ``field_value`` (what is the
field's current value, after 0-2 errata: the latest wins) and ``policy_value`` (which value does
the policy need). Each is one half of a text gate with a direct answer, so the lookup the gates
need gets its own gradient instead of only the XOR of the two halves.
"""

from __future__ import annotations

import random
import re
import weakref
from dataclasses import dataclass, field
from typing import Callable

from PIL import Image

from mmkv.request.messages import ERRATUM, erratum_line
from mmkv.vqa_eval import dataset as D

#: Fields, their values, and how a policy names them.
FIELDS: dict[str, tuple[str, ...]] = {
    "order_status": ("pending", "delivered", "shipped", "cancelled", "returned"),
    "tier": ("gold", "silver", "bronze"),
    "payment": ("paid", "unpaid", "overdue"),
    "account": ("active", "locked", "closed"),
}
PHRASE = {"order_status": "order status", "tier": "tier", "payment": "payment", "account": "account"}
POLICIES = (
    "refund policy . refund only if the {phrase} is {value} . otherwise escalate .",
    "policy : refund only if {field} is {value} . otherwise escalate .",
)
FIELD_FORMATS = ("{f}: {v}", "{f} = {v}", '{{"{f}": "{v}"}}', "{f} : {v}")
FILLERS = (
    "note : the office opens at nine .",
    "the customer has written twice before .",
    "keep answers short .",
    "tickets are answered in order .",
    "the account was opened last year .",
)
Q_REFUND = "the customer asks for a refund . answer refund or escalate ."
Q_AGAIN = "the customer asks again . answer refund or escalate ."
Q_FIELD_IMAGE = ("policy : refund only if the status light is {color} and the {phrase} is {value} . "
                 "otherwise escalate . the customer asks for a refund . answer refund or escalate .")
Q_FIELD_VALUE = "what is the {phrase} now ? answer with one word ."
Q_POLICY_VALUE = "which {phrase} does the policy need ? answer with one word ."
Q_SAME_COLOR = "is the shape in this image the same color as the shape in the previous image ?"
Q_MORE_SHAPES = "which image has more shapes , this one or the previous one ? answer this or previous ."
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer with one word.",
    "you look at images and answer each question with one word .",
)

IMAGE_TYPES: tuple[str, ...] = D.TYPES + D.EXTRA_TYPES
TWO_IMAGE_TYPES: tuple[str, ...] = ("same_color", "more_shapes")
TEXT_TYPES: tuple[str, ...] = ("field_gate", "erratum_gate", "field_image_gate")
#: Retrieval halves of the text gates (training only). Appended last: the committed split's seeds
#: (episode_seed) index ALL_TYPES, so the earlier types keep their indices.
LOOKUP_TYPES: tuple[str, ...] = ("field_value", "policy_value")
ALL_TYPES: tuple[str, ...] = IMAGE_TYPES + TWO_IMAGE_TYPES + TEXT_TYPES + LOOKUP_TYPES
#: Answer vocabulary of the new one-token types.
ANSWERS = {"same_color": ("yes", "no"), "more_shapes": ("this", "previous"), "field_gate": ("refund", "escalate"),
           "erratum_gate": ("refund", "escalate"), "field_image_gate": ("refund", "escalate")}

#: A drawing function: scene -> image (the style and jitter are the caller's).
Drawer = Callable[[D.Scene, random.Random], Image.Image]


def flat(scene: D.Scene, rng: random.Random) -> Image.Image:
    return D.render(scene, rng)


@dataclass
class Episode:
    """A chat whose last assistant answer is the one asked about."""

    type: str
    messages: list[dict]  # chat-template messages; the last one is the assistant's answer
    images: list[Image.Image] = field(default_factory=list)
    scenes: list[D.Scene] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)  # every assistant answer, in order
    #: text gates: the field, the value the policy needs and the value current at the last question;
    #: ``field_image_gate`` also the light's colour and the colour the question asks for
    gate: dict[str, str] = field(default_factory=dict)
    id: str = ""  # the committed split's item id (load_split)

    @property
    def answer(self) -> str:
        return self.answers[-1]

    def prompt_messages(self) -> list[dict]:
        """The chat up to the asked question (render with ``add_generation_prompt=True``)."""
        return self.messages[:-1]


class _Chat:
    def __init__(self, system: str, draw: Drawer, rng: random.Random):
        self.ep_msgs: list[dict] = [{"role": "system", "content": [{"type": "text", "text": system}]}]
        self.images: list[Image.Image] = []
        self.scenes: list[D.Scene] = []
        self.answers: list[str] = []
        self.draw, self.rng = draw, rng

    def turn(self, text: str, answer: str, scene: D.Scene | None = None) -> None:
        content: list[dict] = []
        if scene is not None:
            self.scenes.append(scene)
            self.images.append(self.draw(scene, self.rng))
            content.append({"type": "image"})
        content.append({"type": "text", "text": text})
        self.ep_msgs.append({"role": "user", "content": content})
        self.ep_msgs.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
        self.answers.append(answer)

    def episode(self, qtype: str, **gate: str) -> Episode:
        return Episode(qtype, self.ep_msgs, self.images, self.scenes, self.answers, gate)


def light_case(ep: Episode) -> tuple[bool, bool]:
    """A ``field_image_gate`` episode's (light matches the asked colour, field matches the needed value)."""
    g = ep.gate
    return g["asked"] == g["light"], g["value"] == g["required"]


_FIELD_LINE = re.compile(r'^\{?"?(?:%s)"?\s?[:=]\s' % "|".join(map(re.escape, FIELDS)))
_ERRATUM_MARK = ERRATUM.split("{", 1)[0].strip()  # "[STATE UPDATE]"


def _prompt_texts(ep: Episode):
    """The text parts of the prompt (every message before the asked answer), in order."""
    return (part["text"] for m in ep.prompt_messages() for part in m["content"] if part.get("type") == "text")


def field_lines(ep: Episode) -> list[str]:
    """The field lines (any of :data:`FIELD_FORMATS`, any field) in the prompt, in order: a text
    gate's block is the asked field's line among 0-2 others."""
    return [line for text in _prompt_texts(ep) for line in text.split("\n") if _FIELD_LINE.match(line)]


def has_erratum(ep: Episode) -> bool:
    """Whether any ``[STATE UPDATE]`` line is in the prompt."""
    return any(_ERRATUM_MARK in text for text in _prompt_texts(ep))


def case_name(ep: Episode) -> str | None:
    """The ``field_image_gate`` case an episode tests (``light+field``, ``light only``, ``field only``,
    ``neither``: which halves of the conjunction hold); None for other types or without a gate record."""
    if ep.type != "field_image_gate" or not ep.gate:
        return None
    light, fld = light_case(ep)
    return "light+field" if light and fld else "light only" if light else "field only" if fld else "neither"


def _field_block(rng: random.Random, target: str, value: str) -> str:
    """The target field line among 0-2 other fields, one format for the block."""
    fmt = rng.choice(FIELD_FORMATS)
    others = rng.sample([f for f in FIELDS if f != target], rng.randint(0, 2))
    lines = [(target, value)] + [(f, rng.choice(FIELDS[f])) for f in others]
    rng.shuffle(lines)
    return "\n".join(fmt.format(f=f, v=v) for f, v in lines)


def _policy(rng: random.Random, target: str, value: str) -> str:
    return rng.choice(POLICIES).format(phrase=PHRASE[target], field=target, value=value)


def _system_with(rng: random.Random, parts: list[str]) -> str:
    fill = rng.sample(FILLERS, rng.randint(0, 2))
    body = parts[:]
    for f in fill:
        body.insert(rng.randint(0, len(body)), f)
    base = SYSTEM_PROMPTS[0] if rng.random() < 0.6 else rng.choice(SYSTEM_PROMPTS[1:])
    return base + "".join("\n" + b for b in body)


def build(rng: random.Random, qtype: str, *, level: float = 1.0, easy_size: int = 112, draw: Drawer = flat,
          before: int | None = None, filler_types: dict[str, float] | None = None) -> Episode:
    """One episode whose last answer is a ``qtype`` question.

    ``before``: image Q/A turns drawn before the task's own turns (default 0-2); ``filler_types``
    weights their question types (default: the nine single-image types evenly)."""
    if qtype not in ALL_TYPES:
        raise ValueError(f"unknown task type {qtype!r}; expected one of {ALL_TYPES}")
    n_before = rng.randint(0, 2) if before is None else before
    fillers = filler_types or {t: 1.0 for t in D.TYPES}
    if qtype in TEXT_TYPES + LOOKUP_TYPES:  # no other refund policy (an image gate's) between the policy and its question
        fillers = {t: w for t, w in fillers.items() if not t.startswith("gate")} or {"color": 1.0}

    def filler(chat: _Chat) -> None:
        t = rng.choices(list(fillers), weights=list(fillers.values()))[0]
        scene, q, a = D.make_item(rng, t, level=level, easy_size=easy_size)
        chat.turn(q, a, scene)

    def item(t: str):
        return D.make_item(rng, t, level=level, easy_size=easy_size)

    if qtype in IMAGE_TYPES:
        chat = _Chat(SYSTEM_PROMPTS[0] if rng.random() < 0.7 else rng.choice(SYSTEM_PROMPTS[1:]), draw, rng)
        for _ in range(n_before):
            filler(chat)
        scene, q, a = item(qtype)
        chat.turn(q, a, scene)
        return chat.episode(qtype)

    if qtype in TWO_IMAGE_TYPES:
        chat = _Chat(SYSTEM_PROMPTS[0] if rng.random() < 0.7 else rng.choice(SYSTEM_PROMPTS[1:]), draw, rng)
        for _ in range(n_before):
            filler(chat)
        want = rng.random() < 0.5
        if qtype == "same_color":
            first, q1, a1 = item("color")
            while True:
                second, _, a2 = item("color")
                if (a2 == a1) == want:
                    break
            chat.turn(q1, a1, first)
            chat.turn(Q_SAME_COLOR, "yes" if want else "no", second)
        else:
            while True:  # (a first image of four shapes cannot be outnumbered: draw both again)
                first, q1, a1 = item("count")
                second, _, a2 = item("count")
                n1, n2 = D.NUMBERS.index(a1), D.NUMBERS.index(a2)
                if n1 != n2 and (n2 > n1) == want:
                    break
            chat.turn(q1, a1, first)
            chat.turn(Q_MORE_SHAPES, "this" if want else "previous", second)
        return chat.episode(qtype)

    target = rng.choice(list(FIELDS))
    values = FIELDS[target]
    required = rng.choice(values)

    if qtype in LOOKUP_TYPES:
        actual = rng.choice(values)
        block = _field_block(rng, target, actual)
        in_system = rng.random() < 0.65
        parts = [_policy(rng, target, required)] + ([block] if in_system else [])
        rng.shuffle(parts)
        chat = _Chat(_system_with(rng, parts), draw, rng)
        for _ in range(n_before):
            filler(chat)
        if qtype == "policy_value":
            q = Q_POLICY_VALUE.format(phrase=PHRASE[target])
            chat.turn(q if in_system else block + "\n" + q, required)
            return chat.episode(qtype, field=target, required=required, value=actual)
        q = Q_FIELD_VALUE.format(phrase=PHRASE[target])
        asked = not in_system or rng.random() < 0.5
        if asked:
            chat.turn(q if in_system else block + "\n" + q, actual)
        for _ in range(rng.randint(0 if asked else 1, 2)):  # errata, each asked about
            actual = rng.choice([v for v in values if v != actual])
            lines = [erratum_line(target, actual)]
            if rng.random() < 0.2:  # another field's erratum changes nothing here
                other = rng.choice([f for f in FIELDS if f != target])
                lines.insert(rng.randint(0, 1), erratum_line(other, rng.choice(FIELDS[other])))
            chat.turn("\n".join(lines) + "\n" + q, actual)
        return chat.episode(qtype, field=target, required=required, value=actual)

    if qtype == "field_gate":
        actual = required if rng.random() < 0.5 else rng.choice([v for v in values if v != required])
        block = _field_block(rng, target, actual)
        in_system = rng.random() < 0.65
        parts = [_policy(rng, target, required)] + ([block] if in_system else [])
        if rng.random() < 0.3:
            parts.reverse()
        chat = _Chat(_system_with(rng, parts), draw, rng)
        for _ in range(n_before):
            filler(chat)
        q = Q_REFUND if in_system else block + "\n" + Q_REFUND
        chat.turn(q, "refund" if actual == required else "escalate")
        return chat.episode(qtype, field=target, required=required, value=actual)

    if qtype == "erratum_gate":
        k = rng.randint(1, 3)
        final = required if rng.random() < 0.5 else rng.choice([v for v in values if v != required])
        seq = [final]  # values from the last back to the first; each differs from the next
        for _ in range(k):
            seq.append(rng.choice([v for v in values if v != seq[-1]]))
        seq.reverse()  # seq[0]: the field line; seq[1:]: the errata in order
        parts = [_policy(rng, target, required), _field_block(rng, target, seq[0])]
        chat = _Chat(_system_with(rng, parts), draw, rng)
        for _ in range(n_before):
            filler(chat)

        def verdict(v: str) -> str:
            return "refund" if v == required else "escalate"

        if rng.random() < 0.6:
            chat.turn(Q_REFUND, verdict(seq[0]))
        i = 1
        while i < len(seq):
            lines = [erratum_line(target, seq[i])]
            if i + 1 < len(seq) and rng.random() < 0.3:  # two errata in one turn: the later one wins
                i += 1
                lines.append(erratum_line(target, seq[i]))
            if rng.random() < 0.2:  # an erratum of another field changes nothing here
                other = rng.choice([f for f in FIELDS if f != target])
                lines.insert(rng.randint(0, len(lines)), erratum_line(other, rng.choice(FIELDS[other])))
            if rng.random() < 0.25 and i < len(seq) - 1:
                filler(chat)
            chat.turn("\n".join(lines) + "\n" + rng.choice((Q_AGAIN, Q_REFUND)), verdict(seq[i]))
            i += 1
        return chat.episode(qtype, field=target, required=required, value=final)

    # field_image_gate: the light's colour and the field's value must both match
    case = rng.choice(("both", "both", "both", "light", "field", "neither"))
    color_ok, field_ok = case in ("both", "field"), case in ("both", "light")
    gate = rng.choice(("gate_plain", "gate_logo", "gate_scene"))
    scene, _, _ = item(gate)
    light = next(o.color for o in scene.objects if o.role == "light")
    asked = light if color_ok else rng.choice([c for c in D.COLORS if c != light])
    actual = required if field_ok else rng.choice([v for v in values if v != required])
    block = _field_block(rng, target, actual)
    in_system = rng.random() < 0.65
    chat = _Chat(_system_with(rng, [block] if in_system else []), draw, rng)
    for _ in range(n_before):
        filler(chat)
    q = Q_FIELD_IMAGE.format(color=asked, phrase=PHRASE[target], value=required)
    chat.turn(q if in_system else block + "\n" + q, "refund" if case == "both" else "escalate", scene)
    return chat.episode(qtype, field=target, required=required, value=actual, light=light, asked=asked)


#: Questions per :func:`drill` conversation (inclusive range).
DRILL_TURNS = (4, 8)


def drill(rng: random.Random, n_questions: int | None = None) -> Episode:
    """A dense lookup drill, for training only (``samples/train.py --drill``; never in a split).

    One refund policy and a block of 2-4 field lines (system turn, or the first user turn), then
    4-8 text questions, each the asked field's current value (``Q_FIELD_VALUE``), the value the
    policy needs (``Q_POLICY_VALUE``) or the refund verdict; before a question, 1-2 errata of any
    block field may change its value (the latest wins). Every answer is read from the context, so
    the in-context copy that every text gate needs is supervised several times per conversation
    instead of once. The asked field is the policy's at even odds of holding the needed value."""
    fields = rng.sample(list(FIELDS), rng.randint(2, 4))
    target = rng.choice(fields)
    required = rng.choice(FIELDS[target])

    def draw_value(f: str, old: str | None = None) -> str:
        choices = [v for v in FIELDS[f] if v != old]
        if f == target:  # even odds of the needed value, so the verdict is no majority answer
            others = [v for v in choices if v != required]
            return required if required in choices and (not others or rng.random() < 0.5) else rng.choice(others)
        return rng.choice(choices)

    state = {f: draw_value(f) for f in fields}
    fmt = rng.choice(FIELD_FORMATS)
    block = "\n".join(fmt.format(f=f, v=state[f]) for f in rng.sample(fields, len(fields)))
    in_system = rng.random() < 0.65
    parts = [_policy(rng, target, required)] + ([block] if in_system else [])
    rng.shuffle(parts)
    chat = _Chat(_system_with(rng, parts), flat, rng)
    lines = [] if in_system else [block]
    for i in range(n_questions or rng.randint(*DRILL_TURNS)):
        if i and rng.random() < 0.4:
            for _ in range(rng.randint(1, 2)):
                f = rng.choice(fields)
                state[f] = draw_value(f, state[f])
                lines.append(erratum_line(f, state[f]))
        kind = rng.choices(("value", "policy", "verdict"), weights=(0.5, 0.15, 0.35))[0]
        if kind == "value":
            f = rng.choice(fields)
            q, a = Q_FIELD_VALUE.format(phrase=PHRASE[f]), state[f]
        elif kind == "policy":
            q, a = Q_POLICY_VALUE.format(phrase=PHRASE[target]), required
        else:
            q, a = (Q_AGAIN if i else Q_REFUND), ("refund" if state[target] == required else "escalate")
        chat.turn("\n".join(lines + [q]), a)
        lines = []
    return chat.episode("drill", field=target, required=required, value=state[target])


def corpus() -> list[str]:
    """Text of the new tasks (for a tokenizer built from scratch)."""
    out = [Q_REFUND, Q_AGAIN, Q_SAME_COLOR, Q_MORE_SHAPES, D.Q_DESCRIBE, *FILLERS]
    for f, vs in FIELDS.items():
        out += [Q_FIELD_VALUE.format(phrase=PHRASE[f]), Q_POLICY_VALUE.format(phrase=PHRASE[f])]
        for v in vs:
            out += [p.format(phrase=PHRASE[f], field=f, value=v) for p in POLICIES]
            out += [fmt.format(f=f, v=v) for fmt in FIELD_FORMATS]
            out.append(erratum_line(f, v))
            out.append(Q_FIELD_IMAGE.format(color="red", phrase=PHRASE[f], value=v))
    return out


#: ask()'s least answer lengths (new tokens): a small tokenizer spells "previous" in six pieces.
ANSWER_TOKENS, DESCRIBE_TOKENS = 8, 16
MAX_DESCRIBED = 3  # objects a describe scene holds at most (dataset.py)


def answer_budget(tokenizer, qtype: str) -> int:
    """New tokens that hold the type's longest answer as ``tokenizer`` spells it, with the closing
    <|im_end|>, and never fewer than ANSWER_TOKENS / DESCRIBE_TOKENS. A fixed 16 cut `describe`
    short for a BPE that spells `triangle` in five pieces: its three-object answers take 25 tokens
    (the rope_theta 1e4 chain's tokenizer; every such answer was scored wrong). Computed once per
    tokenizer and type (it encodes a dozen strings; ask() runs per episode)."""
    try:
        cache = _BUDGETS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference: computed each time
        cache = {}
    if qtype not in cache:
        cache[qtype] = _answer_budget(tokenizer, qtype)
    return cache[qtype]


_BUDGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {type: budget}


def _answer_budget(tokenizer, qtype: str) -> int:
    def pieces(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    if qtype == "describe":
        color, shape = max(((c, s) for c in D.COLORS for s in D.SHAPES), key=lambda p: pieces(f"{p[0]} {p[1]}"))
        longest = D.describe_answer([D.Obj(color, shape, x, 0, 1) for x in range(MAX_DESCRIBED)])
        return max(DESCRIBE_TOKENS, pieces(longest) + 1)
    answers = ANSWERS.get(qtype) or D.ANSWERS.get(qtype) or tuple(v for vs in FIELDS.values() for v in vs)
    return max(ANSWER_TOKENS, max(pieces(a) for a in answers) + 1)


def ask(model, processor, ep: Episode, max_new_tokens: int | None = None) -> str:
    """The model's greedy answer to the episode's last question (plain transformers, full recompute)."""
    import torch

    text = processor.apply_chat_template(ep.prompt_messages(), tokenize=False, add_generation_prompt=True)
    enc = processor(text=[text], images=ep.images or None, return_tensors="pt").to(model.device)
    n = max_new_tokens or answer_budget(processor.tokenizer, ep.type)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False)
    return processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


# ----------------------------------------------------------------------------- the committed split

#: The committed conversation split's types: what the single-image set (dataset.py) cannot ask.
SPLIT_TYPES: tuple[str, ...] = ("describe",) + TWO_IMAGE_TYPES + TEXT_TYPES
CATEGORY = {"describe": "multi_token", "same_color": "two_image", "more_shapes": "two_image",
            "field_gate": "text_field", "erratum_gate": "erratum", "field_image_gate": "text_field"}


def episode_seed(seed: int, qtype: str, index: int) -> int:
    """Integer seeds, like the single-image set's (training uses string seeds: they never meet)."""
    return seed * 1_000_003 + 500_000 + ALL_TYPES.index(qtype) * 10_007 + index


def write_split(out, seed: int, per_type: int) -> list[dict]:
    """Write ``episodes.jsonl`` and exact palette PNGs; each line holds the chat with image paths."""
    import json
    from pathlib import Path

    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for qtype in SPLIT_TYPES:
        for i in range(per_type):
            ep = build(random.Random(episode_seed(seed, qtype, i)), qtype)
            eid = f"{qtype}-{i:03d}"
            paths = []
            for k, img in enumerate(ep.images):
                rel = f"images/{eid}-{k}.png"
                D.to_palette_png(img, out / rel)
                paths.append(rel)
            msgs, it = [], iter(paths)
            for m in ep.prompt_messages():
                parts = [{"type": "image", "image": next(it)} if p["type"] == "image" else p for p in m["content"]]
                msgs.append({"role": m["role"], "content": parts})
            rows.append({"id": eid, "type": qtype, "category": CATEGORY[qtype], "messages": msgs,
                         "answer": ep.answer, "scenes": [s.to_json() for s in ep.scenes],
                         **({"gate": ep.gate} if ep.gate else {})})
    with open(out / "episodes.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    meta = {"seed": seed, "per_type": per_type, "n": len(rows), "types": list(SPLIT_TYPES),
            "generator": f"python -m mmkv.vqa_eval.episodes --out samples/vqa/{out.name} --seed {seed} --per-type {per_type}"}
    (out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return rows


def load_split(path) -> list[Episode]:
    """The committed episodes (images loaded as RGB), each ending with its asked question's answer
    (text gates keep their ``gate`` record)."""
    import json
    from pathlib import Path

    p = Path(path)
    p = p / "episodes.jsonl" if p.is_dir() else p
    eps = []
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        images, msgs = [], []
        for m in r["messages"]:
            parts = []
            for part in m["content"]:
                if part["type"] == "image":
                    with Image.open(p.parent / part["image"]) as im:
                        images.append(im.convert("RGB"))
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            msgs.append({"role": m["role"], "content": parts})
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": r["answer"]}]})
        eps.append(Episode(r["type"], msgs, images, [], [r["answer"]], r.get("gate", {}), id=r["id"]))
    return eps


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="write the committed conversation split (multi-token, two-image, "
                                             "text-field and erratum episodes)")
    ap.add_argument("--out", default="samples/vqa/episodes")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--per-type", type=int, default=40)
    args = ap.parse_args(argv)
    rows = write_split(args.out, args.seed, args.per_type)
    print(f"wrote {len(rows)} episodes to {args.out}")


if __name__ == "__main__":
    main()
