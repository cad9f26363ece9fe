"""Train one of the tiny bundled vision-language models from scratch on the synthetic VQA task.

    python samples/train.py --family qwen2_5_vl --out samples/models/qwen2_5_vl-tiny --minutes 60 --seed 7
    python samples/train.py --family qwen3_vl   --out samples/models/qwen3_vl-tiny   --minutes 60 --seed 7
    python samples/train.py --family qwen2_5_vl --out /tmp/smoke --steps 20          # smoke run

The model is the real architecture (Qwen2.5-VL: sectioned M-RoPE; Qwen3-VL: interleaved M-RoPE and
deepstack) at a small size, built with :mod:`mmkv.testing.tiny`. Training data are conversations rendered
with the processor's chat template: a system turn, 0-3 earlier user turns (image + question) with
their answers, then a question about the image in the last user turn. The loss covers the answer
tokens (and the closing ``<|im_end|>``) of every assistant turn, so every image is supervised and
images are seen at many positions. Images come from :mod:`mmkv.vqa_eval.dataset` on the fly, with
string seeds ``"train-<seed>-<step>"`` that never meet the integer seeds of the evaluation set.

Curriculum: the share of *varied* scenes (evaluation layout) rises from 0 to ``--max-level`` over the
first half of the run; the rest are *easy* scenes (square canvas, 2 x 2 grid aligned with the vision
tokens, fixed object size). AdamW, linear warm-up, cosine decay. ``--minutes`` is a wall-clock budget:
the schedule runs on ``max(step / steps, elapsed / budget)``, so the step count depends on the
machine; ``--steps N`` alone gives a fixed, seeded schedule. Runs on one CPU thread by default.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mmkv.testing import tiny
from mmkv.request.messages import erratum_line
from mmkv.vqa_eval import dataset as D
from mmkv.vqa_eval import episodes as E

#: Token grid bounds per family: about 16 to 30 merged vision tokens per image.
GRID = {
    "qwen2_5_vl": dict(factor=28, min_pixels=112 * 112, max_pixels=154 * 154),
    "qwen3_vl": dict(factor=32, min_pixels=128 * 128, max_pixels=176 * 176),
}
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer with one word.",
    "you look at images and answer each question with one word .",
)
#: Chance of the default system prompt (the one inference uses); the others move the image.
P_DEFAULT_SYSTEM = 0.7
#: Sampling weight per question type: the types that need binding or position get more steps.
#: The tasks added later (vqa_eval/episodes.py: multi-token, two-image, text fields and errata) are
#: off by default so that the first stages' commands reproduce; ``--weight TYPE=W`` turns them on.
TYPE_WEIGHTS = {"color": 0.5, "shape": 1.0, "count": 1.0, "color_of_shape": 1.0, "shape_of_color": 1.0,
                "left_of": 2.5, "gate_plain": 1.0, "gate_logo": 1.0, "gate_scene": 1.0,
                **{t: 0.0 for t in E.ALL_TYPES if t not in D.TYPES}}
#: The only questions of the warm-up phase (``--warm-until``).
WARM_TYPES = ("color", "shape", "count")
#: Turns per conversation (one count per batch): mostly single questions, some long histories.
TURN_WEIGHTS = {1: 0.55, 2: 0.2, 3: 0.15, 4: 0.1}
IGNORE = -100
#: Types whose answer is read from a field block (``--block-focus``).
BLOCK_TYPES = ("field_gate", "field_value", "field_image_gate")
#: Types whose episodes run to several hundred tokens: batched apart from the rest (padding).
LONG_TYPES = ("erratum_gate",)


def tokenizer_corpus() -> list[str]:
    """Text the BPE is trained on: chat scaffolding, system prompts, questions, answers (weighted)."""
    scaffold = "<|im_start|>system\n{s}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"
    out: list[str] = list(tiny.DEFAULT_CORPUS)
    answers = sorted({a for ans in D.ANSWERS.values() for a in ans})
    for k in range(30):
        for s in SYSTEM_PROMPTS:
            out.append(s)
        out.append(scaffold.format(s=SYSTEM_PROMPTS[k % len(SYSTEM_PROMPTS)], q=D.all_questions()[k % 10], a=answers[k % len(answers)]))
        out.extend(D.all_questions())
        out.extend(answers)
    return out + E.corpus() * 10  # field lines, policies, errata and the new questions stay short


#: Words the bundled checkpoints' 496-token BPE (trained by the first run from scratch, before the
#: text tasks were in the corpus) spells out letter by letter (`unpaid` is `u n p a i d`, and ends in the
#: letters of `paid`; `delivered`, `shipped`, `returned` share `e d`; the JSON format splits them
#: otherwise than the plain one): a text gate then compares two letter strings across formats.
#: ``--word-tokens`` adds each as one token (whole words only, so `paid` never matches in `unpaid`);
#: the new embedding rows start as the mean of the letters' rows.
WORD_TOKENS: tuple[str, ...] = tuple(v for vs in E.FIELDS.values() for v in vs) + tuple(E.FIELDS) + ("order",)
ERRATUM_TOKEN = "[STATE UPDATE]"


def add_word_tokens(model, tokenizer) -> int:
    """Add :data:`WORD_TOKENS` and the erratum marker to ``tokenizer`` (those missing) and resize
    ``model``'s embeddings and LM head; returns how many were added."""
    from tokenizers import AddedToken

    have = set(tokenizer.get_added_vocab())
    new = [w for w in WORD_TOKENS + (ERRATUM_TOKEN,)
           if w not in have and len(tokenizer.encode(w, add_special_tokens=False)) > 1]
    if not new:
        return 0
    pieces = {w: tokenizer.encode(w, add_special_tokens=False) for w in new}
    tokenizer.add_tokens([AddedToken(w, single_word=w != ERRATUM_TOKEN, normalized=False) for w in new])
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        for w in new:
            i = tokenizer.convert_tokens_to_ids(w)
            emb[i] = emb[pieces[w]].mean(0)
            head[i] = head[pieces[w]].mean(0)
    return len(new)


def unify_words(tokenizer) -> list[str]:
    """Mark each of :data:`WORD_TOKENS` that is already ONE base token (``tier``, ``pending``, ...) as an
    added single-word token, under its own id: the BPE then never merges it with a leading space, so a
    field name or value is the same id in a block line (``tier: pending``), an erratum, a question
    (``what is the tier now``) and an answer (``--unify-words``). Without it ``Ġtier`` / ``Ġpending``
    (after a space) and ``tier`` / ``pending`` (after a newline) are different ids, and a copy from the
    context must also learn their equivalence. No id is added; returns the words marked."""
    from tokenizers import AddedToken

    have = set(tokenizer.get_added_vocab())
    words = [w for w in WORD_TOKENS if w not in have and len(tokenizer.encode(w, add_special_tokens=False)) == 1]
    n = len(tokenizer)
    tokenizer.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in words])
    assert len(tokenizer) == n, "unify_words added an id"
    return words


#: The proxy (``--size proxy``, Qwen2.5-VL only): a real model's position scheme at a trainable size.
#: rope_theta 1e6 with head_dim 64 and mrope sections [8, 12, 12] (Qwen2.5-VL's [16, 24, 24] halved:
#: the real proportions), 8 LM layers, images of 64-256 tokens (224^2 to 448^2 pixels).
PROXY_GRID = dict(factor=28, min_pixels=224 * 224, max_pixels=448 * 448)


def proxy_overrides() -> dict:
    """LM 8 layers x 256 (4 heads of 64, 2 KV heads, MLP 768, rope_theta 1e6, mrope [8, 12, 12]);
    vision 4 blocks x 128 with windowed attention in blocks 0 and 2 (window 112 px), like the real tower."""
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [8, 12, 12]}
    vision = dict(depth=4, hidden_size=128, intermediate_size=384, num_heads=2, out_hidden_size=256,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[1, 3])
    text = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, rope_parameters=rope, max_position_embeddings=32768)
    return {"text": text, "vision": vision}


def model_overrides(family: str) -> dict:
    """LM 4 layers x 128 (head_dim 32, rope_theta 10), vision 3 blocks x 96, full attention."""
    if family == "qwen3_vl":
        rope = {"rope_type": "default", "rope_theta": 10.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True}
        vision = dict(depth=3, hidden_size=96, intermediate_size=192, num_heads=3, out_hidden_size=128,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                      num_position_embeddings=144, deepstack_visual_indexes=[0, 1])
    else:
        rope = {"rope_type": "default", "rope_theta": 10.0, "mrope_section": [4, 6, 6]}
        vision = dict(depth=3, hidden_size=96, intermediate_size=192, num_heads=3, out_hidden_size=128,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[0, 1, 2])
    text = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, rope_parameters=rope, max_position_embeddings=4096)
    return {"text": text, "vision": vision}


# ----------------------------------------------------------------------------- data


#: Symmetry breaking for the answers that depend on two things at once. A gate's answer is
#: "is the light the asked colour": with balanced data it is independent of the light's colour
#: alone and of the asked colour alone (an XOR), so there is no gradient towards reading either
#: one until both are read, and the model sits at chance. Early in training the gate and left_of
#: items are resampled so that each key colour skews the answer (P(positive | colour) below);
#: each half of the circuit then pays off on its own. The skew is annealed to zero (balanced data).
SKEW = {"red": 0.85, "green": 0.15, "blue": 0.7, "yellow": 0.3}


#: The same for the text gates, per field value: each value of a field's pool skews the answer.
SKEW_VALUE = {v: (0.85, 0.15, 0.7, 0.3, 0.6)[i] for vs in E.FIELDS.values() for i, v in enumerate(vs)}


def accept_probability(qtype: str, scene, question: str, answer: str, bias: float,
                       gate: dict[str, str] | None = None) -> float:
    """Rejection-sampling weight that makes P(positive answer | key) = 0.5 + bias * (SKEW - 0.5); the
    keys are the light's and the asked colour (image gates), the first colour (left_of), the two
    shapes' colours (same_color), the needed and the current field value (text gates, ``gate``)."""
    skew = SKEW
    if gate:
        skew = SKEW_VALUE
        keys, positive = (gate["required"], gate["value"]), answer == "refund"
    elif qtype == "same_color":  # (scene: the two images' scenes)
        keys, positive = tuple(next(o.color for o in sc.objects) for sc in scene), answer == "yes"
    elif qtype.startswith("gate"):
        light = next(o.color for o in scene.objects if o.role == "light")
        asked = next(c for c in D.COLORS if question == D.Q_GATE.format(color=c))
        keys, positive = (light, asked), answer == "refund"
    elif qtype == "left_of":
        keys, positive = (question.split()[2],), answer == "yes"
    else:
        return 1.0
    w = 1.0
    for k in keys:
        pk = 0.5 + bias * (skew[k] - 0.5)
        w *= (pk if positive else 1 - pk) / max(skew.values())
    return w


@dataclass(frozen=True)
class Style:
    """How training images are drawn: ``p`` the share drawn in a non-flat training renderer
    (``dataset.TRAIN_STYLES``; the held-out one never), ``jpeg`` the chance of a JPEG re-encode,
    ``dark`` the chance that the scene's background is first replaced by a dark one
    (:func:`dataset.dark_canvas`; ``varied`` draws its own background whatever it is given)."""

    p: float = 0.0
    jpeg: float = 0.0
    color_jitter: int = 12
    dark: float = 0.0

    def drawer(self, record: list | None = None):
        """The drawing function; with ``record``, each call first appends ``(scene, rng state)`` to it, so
        that a drawing can be made again from the same draws (:func:`count_twin`)."""
        def draw(scene, rng):
            if record is not None:
                record.append((scene, rng.getstate()))
            if self.dark > 0 and rng.random() < self.dark:  # no draw at 0: earlier runs' streams are kept
                scene = dataclasses.replace(scene, background=D.dark_canvas(rng))
            style = rng.choice(D.TRAIN_STYLES[1:]) if self.p > 0 and rng.random() < self.p else "flat"
            return D.render_styled(scene, rng, style, color_jitter=self.color_jitter, jpeg=self.jpeg)
        return draw


def conversation(rng: random.Random, level: float, easy_size: int, n_turns: int, **kw):
    """(messages, images, answers) of :func:`episode`."""
    ep = episode(rng, level, easy_size, n_turns, **kw)
    return ep.messages, ep.images, ep.answers


def episode(rng: random.Random, level: float, easy_size: int, n_turns: int,
            types: dict[str, float] | None = None, bias: float = 0.0, style: Style = Style(),
            light_focus: float = 0.0, field_weights: dict[str, float] | None = None,
            block_focus: float = 0.0, draws: list | None = None) -> E.Episode:
    """One episode (vqa_eval/episodes.py) whose asked type is drawn from ``types`` (default
    :data:`TYPE_WEIGHTS`), after ``n_turns - 1`` earlier image Q/A turns.

    ``bias`` in [0, 1] is the strength of the early answer skew (:data:`SKEW`) on the asked turn.
    ``light_focus``: the share of ``field_image_gate`` episodes redrawn until the field matches, the
    light matching or not with even odds: the answer then hangs on the image alone. (In the split's
    own mix the field matches in 4 of 6 and the light then in 3 of 4: a model that reads the field
    and answers `refund` whenever it matches scores 0.83 without looking at the light.)
    ``field_weights``: relative odds of each field (``episodes.FIELDS``) being the one a text
    episode asks about (default even); episodes are redrawn, so the split's mix is otherwise kept.
    ``block_focus``: the share of :data:`BLOCK_TYPES` episodes redrawn until the answer must be read
    from a block of two or three field lines (the asked one among others; ``field_value`` with no
    erratum after it, so the block's line holds the answer). In the split's mix a third of the
    blocks are one line, and three in four ``field_value`` answers sit in the latest erratum: the
    lookup among other fields, where the gates miss, is the rarer case.
    ``draws``: a list the drawer records each image's scene and rng state in (``Style.drawer``)."""
    types = {t: w for t, w in (TYPE_WEIGHTS if types is None else types).items() if w > 0}
    singles = {t: types.get(t, 0.0) for t in D.TYPES if types.get(t, 0.0) > 0} or None
    qtype = rng.choices(list(types), weights=list(types.values()))[0]
    want_light = None
    if qtype == "field_image_gate" and light_focus > 0 and rng.random() < light_focus:
        want_light = rng.random() < 0.5
    want_block = qtype in BLOCK_TYPES and block_focus > 0 and rng.random() < block_focus
    while True:
        ep = E.build(rng, qtype, level=level, easy_size=easy_size, draw=style.drawer(draws), before=n_turns - 1,
                     filler_types=singles)
        if want_light is not None and E.light_case(ep) != (want_light, True):
            continue
        if want_block and not block_decides(ep):
            continue
        if field_weights and "field" in ep.gate:  # (no draw when kept for sure: even weights leave the stream as before)
            keep = field_weights.get(ep.gate["field"], 1.0) / max(field_weights.values())
            if keep < 1 and rng.random() >= keep:
                continue
        if bias <= 0 or qtype in E.LOOKUP_TYPES or (qtype not in D.TYPES and qtype != "same_color" and not ep.gate):
            break
        q = ep.messages[-2]["content"][-1]["text"]
        scene = ep.scenes[-2:] if qtype == "same_color" else ep.scenes[-1] if ep.scenes else None
        if rng.random() < accept_probability(qtype, scene, q, ep.answer, bias, ep.gate):
            break
    return ep


def block_decides(ep: E.Episode) -> bool:
    """Whether the answer is read from a field block of two or more lines (``--block-focus``)."""
    return len(E.field_lines(ep)) >= 2 and not (ep.type == "field_value" and E.has_erratum(ep))


# ----------------------------------------------------------------------------- minimal pairs


def _text_parts(messages: list[dict]):
    return [(i, j) for i, m in enumerate(messages) for j, part in enumerate(m["content"]) if part.get("type") == "text"]


def _last_occurrence(messages: list[dict], needles: dict[str, object], before: tuple | None = None):
    """((message, part, offset), needle, needles[needle]) of the last occurrence of any needle in the
    messages' text parts, strictly before the ``before`` key when given; None if there is none."""
    best = None
    for i, j in _text_parts(messages):
        text = messages[i]["content"][j]["text"]
        for needle, value in needles.items():
            k = text.find(needle)
            while k >= 0:
                key = (i, j, k)
                if (before is None or key < before) and (best is None or key > best[0]):
                    best = (key, needle, value)
                k = text.find(needle, k + 1)
    return best


def _statement(target: str, value: str, form: int) -> str:
    """The target field stated in one form: a field line in ``FIELD_FORMATS[form]``, or (form -1) an erratum."""
    return erratum_line(target, value) if form < 0 else E.FIELD_FORMATS[form].format(f=target, v=value)


def _statements(target: str, value: str | None = None, forms=range(-1, len(E.FIELD_FORMATS))) -> dict[str, tuple]:
    """Every statement of the target field (of ``value`` only, when given) -> (value, form)."""
    return {_statement(target, v, f): (v, f) for v in E.FIELDS[target] if value in (None, v) for f in forms}


def _swap(ep: E.Episode, key: tuple, old: str, new: str, answer: str, **gate: str) -> E.Episode:
    """A copy of ``ep`` with ``old`` at ``key`` replaced by ``new``, the last answer ``answer``, ``gate`` updated."""
    i, j, k = key
    messages = copy.deepcopy(ep.messages)
    text = messages[i]["content"][j]["text"]
    assert text[k:k + len(old)] == old
    messages[i]["content"][j]["text"] = text[:k] + new + text[k + len(old):]
    messages[-1]["content"] = [{"type": "text", "text": answer}]
    return E.Episode(ep.type, messages, ep.images, ep.scenes, ep.answers[:-1] + [answer], {**ep.gate, **gate})


def twin(ep: E.Episode, rng: random.Random) -> E.Episode | None:
    """The same text-gate episode with one value changed so that its last answer flips: a minimal pair
    whose only difference is what decides the answer (``--contrast``). ``field_gate``: the field line's
    value; ``erratum_gate``: the last erratum's value (never to the value it overrides, so it still
    changes something); ``field_image_gate``: the field's value or the asked light colour, a half that
    holds when the other does. Earlier answers stay right (only the asked turn's deciding value moves).
    None where one change cannot flip the answer (a ``field_image_gate`` with both halves failing; an
    ``erratum_gate`` whose overridden value is the needed one and whose final value is not)."""
    g = ep.gate
    if ep.type not in E.TEXT_TYPES or not g:
        return None
    target, required, value = g["field"], g["required"], g["value"]
    others = [v for v in E.FIELDS[target] if v != required]

    def flip_field():
        """The field's current value moved across the needed one: the field line's, or the last erratum's."""
        forms = [-1] if ep.type == "erratum_gate" else range(len(E.FIELD_FORMATS))
        key, _, (_, form) = _last_occurrence(ep.messages, _statements(target, value, forms))
        prev = None
        if ep.type == "erratum_gate":  # the value that erratum overrides
            prev = _last_occurrence(ep.messages, _statements(target), before=key)[2][0]
        choices = [v for v in (others if value == required else [required]) if v != prev]
        if not choices:
            return None
        new = rng.choice(choices)  # (a field_image_gate's field is moved only while its light matches)
        return _swap(ep, key, _statement(target, value, form), _statement(target, new, form),
                     "refund" if new == required else "escalate", value=new)

    if ep.type in ("field_gate", "erratum_gate"):
        return flip_field()
    color_ok, field_ok = E.light_case(ep)
    options = (["color"] if field_ok else []) + (["field"] if color_ok else [])
    if not options:
        return None
    if rng.choice(options) == "field":
        return flip_field()
    asked = rng.choice([c for c in D.COLORS if c != g["light"]]) if color_ok else g["light"]
    old = f"status light is {g['asked']} and"
    key = _last_occurrence(ep.messages, {old: g["asked"]})[0]
    return _swap(ep, key, old, f"status light is {asked} and", "refund" if asked == g["light"] else "escalate",
                 asked=asked)


def count_twin(ep: E.Episode, draw, draws: list) -> E.Episode | None:
    """The same ``count`` episode with its asked image drawn again without one shape, the answer one lower
    (``--count-pairs``): a minimal pair for the count. The image is drawn by ``draw`` from the rng state its
    first drawing started from (``draws[-1]``, recorded by ``Style.drawer``), so canvas, background and
    renderer are the same draws; the shape taken out is the last one drawn (the scenes place shapes in a
    random order), so every other shape keeps its colour draws too. What a renderer draws after the shapes
    (noise, tint, the JPEG quality) may differ. None for another type or a single shape."""
    if ep.type != "count" or not draws:
        return None
    scene, state = draws[-1]
    assert scene is ep.scenes[-1], "the asked image is the episode's last drawing"
    n = len(scene.objects)
    if n < 2:
        return None
    fewer = dataclasses.replace(scene, objects=scene.objects[:-1])
    again = random.Random()
    again.setstate(state)
    answer = D.NUMBERS[n - 2]
    messages = copy.deepcopy(ep.messages)
    messages[-1]["content"] = [{"type": "text", "text": answer}]
    return E.Episode(ep.type, messages, ep.images[:-1] + [draw(fewer, again)], ep.scenes[:-1] + [fewer],
                     ep.answers[:-1] + [answer], ep.gate)


def find_subseq(seq: list[int], pat: list[int]) -> list[int]:
    """End indices (exclusive) of every occurrence of ``pat`` in ``seq``."""
    n = len(pat)
    return [i + n for i in range(len(seq) - n + 1) if seq[i:i + n] == pat]


class Batcher:
    def __init__(self, processor, family: str, factor: int | None = None):
        self.proc = processor
        self.tok = processor.tokenizer
        self.family = family
        self.easy_size = (factor or GRID[family]["factor"]) * 4
        self.asst = self.tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self.im_end = self.tok.convert_tokens_to_ids("<|im_end|>")

    def labels_for(self, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        labels = torch.full_like(ids, IGNORE)
        for b in range(ids.shape[0]):
            row = ids[b].tolist()
            starts = find_subseq(row, self.asst)
            if last_only:
                starts = starts[-1:]
            for s in starts:
                e = s
                while e < len(row) and row[e] != self.im_end:
                    e += 1
                labels[b, s:e + 1] = ids[b, s:e + 1]  # answer tokens and the closing <|im_end|>
        return labels

    def decide_mask(self, labels: torch.Tensor) -> torch.Tensor:
        """True on the answer tokens of each row's last assistant turn (not its ``<|im_end|>``): the
        tokens that answer the question the episode is about; earlier turns only set the context."""
        mask = torch.zeros_like(labels, dtype=torch.bool)
        for b in range(labels.shape[0]):
            row = labels[b].tolist()
            e = len(row) - 1
            while e >= 0 and row[e] == IGNORE:
                e -= 1
            s = e  # e: the last labelled token, the closing <|im_end|>
            while s > 0 and row[s - 1] != IGNORE:
                s -= 1
            mask[b, s:e] = True
        return mask

    def batch(self, rng: random.Random, size: int, level: float, max_turns: int = 4, bias: float = 0.0,
              types: dict[str, float] | None = None, style: Style = Style(),
              turn_weights: dict[int, float] | None = None, light_focus: float = 0.0,
              field_weights: dict[str, float] | None = None, contrast: float = 0.0, block_focus: float = 0.0,
              count_pairs: float = 0.0):
        """``size`` conversations; with ``contrast`` > 0 that share of the text-gate ones is followed
        in the batch by its :func:`twin` (the answer flipped by one value), as long as room is left;
        with ``count_pairs`` > 0 that share of the ``count`` ones by its :func:`count_twin`."""
        texts, images = [], []
        tw = TURN_WEIGHTS if turn_weights is None else turn_weights
        turns = [n for n in tw if n <= max_turns and tw[n] > 0]
        weights = [tw[n] for n in turns] if turns else [1.0]
        n_turns = rng.choices(turns or [1], weights=weights)[0]  # one count per batch: little padding
        types = TYPE_WEIGHTS if types is None else types
        long = {t: w for t, w in types.items() if t in LONG_TYPES and w > 0}
        if long:  # the long episodes get batches of their own (padding), with at most one earlier turn
            if rng.random() < sum(long.values()) / sum(types.values()):
                types, n_turns = long, min(n_turns, 2)
            else:
                types = {t: w for t, w in types.items() if t not in LONG_TYPES}
        while len(texts) < size:
            draws = [] if count_pairs > 0 else None
            ep = episode(rng, level, self.easy_size, n_turns, types=types, bias=bias, style=style,
                         light_focus=light_focus, field_weights=field_weights, block_focus=block_focus, draws=draws)
            pair = [ep]
            if contrast > 0 and ep.type in E.TEXT_TYPES and len(texts) + 1 < size and rng.random() < contrast:
                pair += [t for t in [twin(ep, rng)] if t is not None]
            if count_pairs > 0 and ep.type == "count" and len(texts) + 1 < size and rng.random() < count_pairs:
                pair += [t for t in [count_twin(ep, style.drawer(), draws)] if t is not None]
            for e in pair:
                texts.append(self.proc.apply_chat_template(e.messages, tokenize=False))
                images.extend(e.images)
        return self._encode(texts, images)

    def drill_batch(self, rng: random.Random, size: int):
        """``size`` lookup drills (:func:`episodes.drill`, text only): every answer of every turn labelled."""
        return self._encode([self.proc.apply_chat_template(E.drill(rng).messages, tokenize=False) for _ in range(size)])

    def _encode(self, texts: list[str], images: list | None = None):
        """The rendered conversations as one padded batch, every assistant answer labelled."""
        enc = self.proc(text=texts, images=images or None, return_tensors="pt", padding=True)  # (a text-only batch)
        enc["labels"] = self.labels_for(enc["input_ids"])
        return enc


@dataclass
class BatchPlan:
    """What the batch of step ``i`` holds, given the run's progress ``p`` in [0, 1] when it is built: the
    curriculum (varied-scene level, answer skew, warm-up types, single turns) and the seeded draw
    ``train-<seed>-<i>``. One function for the loop and for the worker processes, so both build alike."""

    batcher: Batcher
    seed: int
    size: int
    max_level: float
    ramp: float
    skew_until: float
    warm_until: float
    single_until: float
    warm_types: dict
    weights: dict
    style: Style
    turn_weights: dict
    light_focus: float
    field_weights: dict
    contrast: float
    block_focus: float
    drill: float
    count_pairs: float = 0.0

    def level(self, p: float) -> float:
        return self.max_level * (min(1.0, p / self.ramp) if self.ramp > 0 else 1.0)

    def bias(self, p: float) -> float:
        return min(1.0, max(0.0, (self.skew_until - p) / 0.3))  # (0 throughout with --skew-until 0)

    def build(self, i: int, p: float):
        rng = random.Random(f"train-{self.seed}-{i}")
        if self.drill > 0 and rng.random() < self.drill:  # (no draw at 0: earlier runs' streams are kept)
            return self.batcher.drill_batch(rng, self.size)
        return self.batcher.batch(rng, self.size, self.level(p), max_turns=1 if p < self.single_until else 4,
                                  bias=self.bias(p), types=self.warm_types if p < self.warm_until else self.weights,
                                  style=self.style, turn_weights=self.turn_weights, light_focus=self.light_focus,
                                  field_weights=self.field_weights, contrast=self.contrast,
                                  block_focus=self.block_focus, count_pairs=self.count_pairs)


_PLAN: BatchPlan | None = None  # a worker's copy (forked), see BatchSource


def _worker_init(plan: BatchPlan) -> None:
    global _PLAN
    _PLAN = plan
    torch.set_num_threads(1)


def _worker_build(job: tuple[int, float]):
    return _PLAN.build(*job)


class BatchSource:
    """Batches in step order. ``workers`` 0: each is built when asked for. Otherwise a pool of that many
    forked processes keeps ``2 * workers`` steps in flight, each built from the progress its step is
    expected to train at when it is submitted (``progress_at(i)``; exact for a ``--steps`` run, whose
    batches are then the loop's own, byte for byte; a ``--minutes`` run's curriculum is read up to
    ``2 * workers`` steps early)."""

    def __init__(self, plan: BatchPlan, workers: int = 0):
        import collections
        import multiprocessing

        self.plan, self.workers = plan, workers
        self.pool = multiprocessing.get_context("fork").Pool(workers, _worker_init, (plan,)) if workers else None
        self.pending: collections.deque = collections.deque()  # (step, AsyncResult)
        self.next = 0

    def get(self, i: int, progress_at):
        if self.pool is None:
            return self.plan.build(i, progress_at(i))
        self.next = max(self.next, i)  # (steps are asked for in order, from the first)
        while len(self.pending) < 2 * self.workers:
            self.pending.append((self.next, self.pool.apply_async(_worker_build, ((self.next, progress_at(self.next)),))))
            self.next += 1
        j, result = self.pending.popleft()
        assert j == i
        return result.get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def weighted_loss(model, batch, batcher: Batcher, decide_weight: float = 1.0) -> torch.Tensor:
    """Next-token cross-entropy over the labelled tokens; with ``decide_weight`` != 1 the last turn's
    answer tokens weigh that much against 1 for the rest (a weighted mean, so 1 is the model's own loss)."""
    if decide_weight == 1.0:
        return model(**batch).loss
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits[:, :-1].float()
    target = labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                           ignore_index=IGNORE, reduction="none").view_as(target)
    w = (target != IGNORE).float()
    w = w + (decide_weight - 1.0) * batcher.decide_mask(labels)[:, 1:].to(w.device).float()
    return (ce * w).sum() / w.sum().clamp(min=1.0)


# ----------------------------------------------------------------------------- quick eval


@torch.no_grad()
def quick_eval(model, processor, episodes) -> dict[str, float]:
    """Greedy exact-match accuracy per key on (key, episode) pairs (full answers, not first tokens)."""
    model.eval()
    hits: dict[str, list[int]] = {}
    for key, ep in episodes:
        hits.setdefault(key, []).append(int(E.ask(model, processor, ep) == ep.answer))
    model.train()
    return {t: sum(v) / len(v) for t, v in hits.items()}


def heldout(n_per_type: int, seed: int, types, level: float = 1.0, n_style: int = 0, history: bool = False):
    """Validation episodes from string seeds ``val-<seed>-...`` (never the training seeds nor the
    committed splits' integer seeds): ``n_per_type`` of each of ``types`` (flat drawing), and ``n_style``
    of each single-image type among them drawn in the held-out style (key ``style:<type>``).

    The typed episodes are single questions, or with ``history`` (seeds ``valh-...``) preceded by
    0-2 image Q/A turns as in the committed conversation split: the text gates fail there far more
    often than on single questions, which a single-question validation never shows."""
    out = []
    for t in types:
        for i in range(n_per_type):
            rng = random.Random(f"valh-{seed}-{t}-{i}" if history else f"val-{seed}-{t}-{i}")
            out.append((t, E.build(rng, t, level=level, before=None if history else 0)))
    for t in [t for t in D.TYPES if t in types] if n_style else ():
        for i in range(n_style):
            rng = random.Random(f"val-{seed}-style-{t}-{i}")
            out.append((f"style:{t}", E.build(rng, t, level=level, before=0, draw=D.render_heldout)))
    return out


# ----------------------------------------------------------------------------- save


def save(model, processor, out: Path, state: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = processor.tokenizer
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config.do_sample = False
    model.save_pretrained(out)  # (safetensors from any device)
    processor.save_pretrained(out)
    tok_cfg = out / "tokenizer_config.json"  # a processor loaded offline (--resume) writes its load flags
    cfg = json.loads(tok_cfg.read_text())
    flags = [cfg.pop(k) for k in ("is_local", "local_files_only") if k in cfg]
    if flags:
        tok_cfg.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "train_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- main


_LM_LAYER = re.compile(r"(?:^|\.)language_model\.layers\.(\d+)\.")


def param_groups(model, layer_lr: dict[int, float] | None = None) -> list[dict]:
    """AdamW groups: weight decay 0.01 on matrices (not embeddings), none on the rest; an LM decoder
    layer named in ``layer_lr`` (``--layer-lr``) trains at that multiple of the schedule's lr, e.g.
    the identity layers ``samples/grow.py`` inserted, which start at zero and must catch up."""
    layer_lr = layer_lr or {}
    groups: dict[tuple[bool, float], list] = {}
    for name, p in model.named_parameters():
        m = _LM_LAYER.search(name)
        mult = layer_lr.get(int(m.group(1)), 1.0) if m else 1.0
        groups.setdefault((p.ndim >= 2 and "embed" not in name, mult), []).append(p)
    return [{"params": ps, "weight_decay": 0.01 if decay else 0.0, "lr_mult": mult}
            for (decay, mult), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]


def weight_options(ap: argparse.ArgumentParser, flag: str, items: list[str], key_name: str, key=str):
    """(item, key, weight) of each repeatable ``flag KEY=W`` option; one that is not KEY=NUMBER is refused
    (exit 2) naming the flag. The caller checks the key and the weight's range."""
    out = []
    for item in items:
        name, _, value = item.partition("=")
        try:
            out.append((item, key(name), float(value)))
        except ValueError:
            ap.error(f"{flag} wants {key_name}=NUMBER, got {item!r}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="train a tiny Qwen-VL on the synthetic VQA task")
    ap.add_argument("--family", choices=sorted(GRID), required=True)
    ap.add_argument("--size", choices=("tiny", "proxy"), default="tiny",
                    help="proxy: Qwen2.5-VL with a real position scheme (PROXY_GRID, proxy_overrides)")
    ap.add_argument("--rope-theta", type=float, default=None,
                    help="the LM's rope_theta for a fresh model (default: model_overrides' or proxy_overrides')")
    ap.add_argument("--rebase-theta", type=float, default=None,
                    help="with --resume: give the trained model's LM this rope_theta before training (not "
                         "function-preserving: every position the model learned turns differently, and the run "
                         "must re-learn them; recorded as rope_theta_from in train_state.json)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--minutes", type=float, default=None, help="wall-clock budget")
    ap.add_argument("--steps", type=int, default=None, help="step budget (the schedule's length)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-level", type=float, default=0.85, help="final share of varied scenes")
    ap.add_argument("--ramp", type=float, default=0.5, help="share of the run over which varied scenes phase in")
    ap.add_argument("--skew-until", type=float, default=0.45,
                    help="share of the run at which the answer skew (SKEW) reaches zero; it is full until 0.3 before")
    ap.add_argument("--warm-until", type=float, default=0.1,
                    help="share of the run that asks only the perception questions (WARM_TYPES): the vision "
                         "tower learns shape there; mixed in with the binding questions from the start it does not")
    ap.add_argument("--single-until", type=float, default=0.35,
                    help="share of the run with one question per conversation: shape is only learned once "
                         "each answer looks at its own image; longer histories come after")
    ap.add_argument("--save-every-min", type=float, default=8.0)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="e.g. cuda, where a GPU is lent (data stay on the CPU)")
    ap.add_argument("--resume", action="store_true", help="start from the weights in --out")
    ap.add_argument("--workers", type=int, default=0,
                    help="processes that build batches ahead of the step that trains on them (BatchSource; for a "
                         "lent GPU, where one process cannot feed it); 0 builds each batch in the training loop")
    ap.add_argument("--style-p", type=float, default=0.0,
                    help="share of training images drawn in a non-flat training renderer (never the held-out one)")
    ap.add_argument("--jpeg", type=float, default=0.0, help="chance of a JPEG re-encode of a training image")
    ap.add_argument("--val-per-type", type=int, default=12, help="validation episodes per trained type")
    ap.add_argument("--dark-canvas", type=float, default=0.0,
                    help="share of training images whose background is first replaced by a dark one "
                         "(any renderer but varied, which draws its own)")
    ap.add_argument("--val-style", type=int, default=0,
                    help="validation episodes per single-image type in the held-out style")
    ap.add_argument("--val-history", action="store_true",
                    help="validation episodes with 0-2 earlier image turns, like the committed conversation split")
    ap.add_argument("--turn-weight", action="append", default=[], metavar="N=W",
                    help="override the sampling weight of N-question conversations (TURN_WEIGHTS); repeatable")
    ap.add_argument("--word-tokens", action="store_true",
                    help="add the field names, values and the erratum marker as whole tokens (WORD_TOKENS)")
    ap.add_argument("--unify-words", action="store_true",
                    help="make each field name and value one id wherever it stands (unify_words; no new ids)")
    ap.add_argument("--light-focus", type=float, default=0.0,
                    help="share of field_image_gate episodes redrawn so that the field matches and the "
                         "light decides (even odds): the image half of the question (see conversation)")
    ap.add_argument("--block-focus", type=float, default=0.0,
                    help="share of field_gate, field_value and field_image_gate episodes redrawn so that the "
                         "answer is read from a block of 2-3 field lines (see episode)")
    ap.add_argument("--field-weight", action="append", default=[], metavar="FIELD=W",
                    help="relative odds of a field being the one a text episode asks about (default 1 each; "
                         "episodes.FIELDS); repeatable")
    ap.add_argument("--contrast", type=float, default=0.0,
                    help="share of text-gate episodes followed in their batch by their minimal pair (twin: the "
                         "same episode with the deciding value changed and the answer flipped)")
    ap.add_argument("--count-pairs", type=float, default=0.0,
                    help="share of count episodes followed in their batch by their minimal pair (count_twin: the "
                         "same picture drawn again with one shape taken out, the answer one lower)")
    ap.add_argument("--drill", type=float, default=0.0,
                    help="share of steps whose batch is lookup drills (episodes.drill: 4-8 text questions per "
                         "conversation, each read from a field block, errata or the policy) instead of --weight's mix")
    ap.add_argument("--decide-weight", type=float, default=1.0,
                    help="loss weight of the last turn's answer tokens (decide_mask) against 1 for the earlier "
                         "answers and every <|im_end|>; 1 is the plain token mean")
    ap.add_argument("--layer-lr", action="append", default=[], metavar="I=M",
                    help="LM decoder layer I trains at M times the lr (repeatable; e.g. the layers samples/grow.py inserted)")
    ap.add_argument("--best", default=None,
                    help="also save to this dir whenever the validation mean (over trained types and the "
                         "held-out style) is at least the best so far: weights chosen on validation only")
    ap.add_argument("--weight", action="append", default=[], metavar="TYPE=W",
                    help="override one question type's sampling weight (TYPE_WEIGHTS); repeatable")
    args = ap.parse_args(argv)
    if args.minutes is None and args.steps is None:
        ap.error("give --minutes and/or --steps")
    if args.rope_theta is not None and (args.resume or args.rope_theta <= 0):
        ap.error("--rope-theta sets a fresh model's rope_theta (> 0); a resumed model keeps its own (--rebase-theta)")
    if args.rebase_theta is not None and (not args.resume or not 0 < args.rebase_theta < float("inf")):
        ap.error("--rebase-theta changes a resumed model's rope_theta (> 0): use it with --resume")
    weights = dict(TYPE_WEIGHTS)
    for item, name, w in weight_options(ap, "--weight", args.weight, "TYPE"):
        if name not in TYPE_WEIGHTS:
            ap.error(f"--weight {item!r}: the types are {', '.join(TYPE_WEIGHTS)}")
        if w < 0:
            ap.error(f"--weight {item!r}: weights are >= 0")
        weights[name] = w
    turn_weights = dict(TURN_WEIGHTS)
    for item, n, w in weight_options(ap, "--turn-weight", args.turn_weight, "N", key=int):
        if n not in TURN_WEIGHTS or w < 0:
            ap.error(f"--turn-weight {item!r}: N is one of {', '.join(map(str, TURN_WEIGHTS))}, the weight >= 0")
        turn_weights[n] = w
    field_weights = {f: 1.0 for f in E.FIELDS}
    for item, name, w in weight_options(ap, "--field-weight", args.field_weight, "FIELD"):
        if name not in E.FIELDS or not 0 < w < float("inf"):
            ap.error(f"--field-weight {item!r}: FIELD is one of {', '.join(E.FIELDS)}, the weight > 0")
        field_weights[name] = w
    layer_lr = {}
    for item, i, m in weight_options(ap, "--layer-lr", args.layer_lr, "I", key=int):
        if not 0 < m < float("inf"):
            ap.error(f"--layer-lr {item!r}: the multiple is > 0")
        layer_lr[i] = m
    for share in ("light_focus", "block_focus", "contrast", "count_pairs", "drill", "dark_canvas"):
        if not 0 <= getattr(args, share) <= 1:  # (NaN fails it too)
            ap.error(f"--{share.replace('_', '-')} is a share in [0, 1]")
    if not 0 <= args.workers <= 64:
        ap.error("--workers is 0 (build in the loop) to 64")
    if not args.decide_weight > 0:
        ap.error("--decide-weight is a loss weight > 0")
    if not any(turn_weights.values()):
        ap.error("--turn-weight: at least one conversation length needs a weight above 0")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    if args.size == "proxy" and args.family != "qwen2_5_vl":
        ap.error("--size proxy is a Qwen2.5-VL model: use --family qwen2_5_vl")
    grid = PROXY_GRID if args.size == "proxy" else GRID[args.family]
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    out = Path(args.out)
    theta_from = None  # the rope_theta --rebase-theta replaced (train_state.json: rope_theta_from)
    if args.resume:  # the checkpoint's own tokenizer: a rebuilt one could merge differently
        processor = AutoProcessor.from_pretrained(out, local_files_only=True)
        tokenizer = processor.tokenizer
        config = AutoConfig.from_pretrained(out, local_files_only=True)
        rope = config.get_text_config().rope_parameters
        if args.rebase_theta is not None:  # built with the new theta: the rotary tables follow the config
            theta_from, rope["rope_theta"] = rope["rope_theta"], args.rebase_theta
            print(f"rope_theta {theta_from} -> {args.rebase_theta} (rebased: positions turn differently)", flush=True)
        model = AutoModelForImageTextToText.from_pretrained(out, config=config, local_files_only=True)
    else:
        tokenizer = tiny.build_tokenizer(tokenizer_corpus(), vocab_size=512)
        processor = tiny.build_processor(args.family, tokenizer, grid["min_pixels"], grid["max_pixels"])
        over = proxy_overrides() if args.size == "proxy" else model_overrides(args.family)
        if args.rope_theta is not None:
            over["text"]["rope_parameters"]["rope_theta"] = args.rope_theta
        config = tiny.tiny_config(args.family, tokenizer, **over)
        model = AutoModelForImageTextToText.from_config(config)
    if args.word_tokens:
        print(f"word tokens: {add_word_tokens(model, tokenizer)} added", flush=True)
    if args.unify_words:
        print(f"unified words: {', '.join(unify_words(tokenizer)) or 'none left'}", flush=True)
    model.to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.family}: {n_params / 1e6:.2f}M params, vocab {len(tokenizer)}", flush=True)

    n_layers = model.config.text_config.num_hidden_layers
    if any(not 0 <= i < n_layers for i in layer_lr):
        ap.error(f"--layer-lr: the model's LM layers are 0-{n_layers - 1}")
    opt = torch.optim.AdamW(param_groups(model, layer_lr), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    batcher = Batcher(processor, args.family, grid["factor"])
    warm_types = {t: weights[t] for t in WARM_TYPES}
    style = Style(p=args.style_p, jpeg=args.jpeg, dark=args.dark_canvas)
    # the monitor scores what this run trains: a run that never leaves the warm-up (--warm-until 1) only
    # the perception questions, or its --best save would follow the types it lets decay
    trained = warm_types if args.warm_until >= 1 else weights
    val = heldout(args.val_per_type, args.seed, [t for t, w in trained.items() if w > 0], n_style=args.val_style,
                  history=args.val_history)
    best = {"score": -1.0, "step": None}
    budget_s = args.minutes * 60 if args.minutes else None
    t0 = time.time()
    last_save = t0
    step, ema = 0, None
    history = []
    earlier = []  # the runs this one continues (--resume), oldest first
    if args.resume and (out / "train_state.json").exists():
        prior = json.loads((out / "train_state.json").read_text())
        earlier = prior.get("earlier_runs", []) + [{k: prior.get(k) for k in ("command", "steps", "elapsed_s", "history")}]

    def progress_at(i: int) -> float:
        """The progress step ``i`` will train at, as far as it is known now (exact for a --steps run)."""
        return min(1.0, max(i / args.steps if args.steps else 0.0,
                            (time.time() - t0) / budget_s if budget_s else 0.0))

    def progress() -> float:
        return progress_at(step)

    def state(final: bool) -> dict:
        return {"family": args.family, "size": args.size, "seed": args.seed, "steps": step, "batch": args.batch, "lr": args.lr,
                "minutes_budget": args.minutes, "steps_budget": args.steps, "elapsed_s": round(time.time() - t0, 1),
                "threads": args.threads, "workers": args.workers, "device": args.device, "type_weights": weights, "turn_weights": turn_weights, "params": n_params, "final": final, "loss_ema": ema,
                "max_pixels": grid["max_pixels"], "min_pixels": grid["min_pixels"],
                "command": "python samples/train.py " + " ".join(sys.argv[1:] if argv is None else argv),
                "earlier_runs": earlier,
                "total_steps": step + sum(r.get("steps") or 0 for r in earlier),
                "total_elapsed_s": round(time.time() - t0 + sum(r.get("elapsed_s") or 0 for r in earlier), 1),
                "style_p": args.style_p, "jpeg": args.jpeg, "dark_canvas": args.dark_canvas, "light_focus": args.light_focus, "block_focus": args.block_focus, "field_weights": field_weights, "contrast": args.contrast, "count_pairs": args.count_pairs, "drill": args.drill, "word_tokens": args.word_tokens, "unify_words": args.unify_words, "decide_weight": args.decide_weight, "layer_lr": layer_lr, "best": best,
                "rope_theta": model.config.get_text_config().rope_parameters["rope_theta"],
                "rope_theta_from": theta_from,
                "history": history[-50:]}

    def evaluate() -> None:
        acc = quick_eval(model, processor, val)
        score = sum(acc.values()) / len(acc)
        history.append({"step": step, "t": round(time.time() - t0), "loss_ema": round(ema or 0, 4),
                        "val_mean": round(score, 4), **{k: round(v, 3) for k, v in acc.items()}})
        print("eval", json.dumps(history[-1]), flush=True)
        if args.best and score >= best["score"]:
            best.update(score=round(score, 4), step=step)
            save(model, processor, Path(args.best), state(final=False))
            print(f"best {score:.4f} at step {step} -> {args.best}", flush=True)

    plan = BatchPlan(batcher, args.seed, args.batch, args.max_level, args.ramp, args.skew_until, args.warm_until,
                     args.single_until, warm_types, weights, style, turn_weights, args.light_focus, field_weights,
                     args.contrast, args.block_focus, args.drill, args.count_pairs)
    source = BatchSource(plan, args.workers)

    model.train()
    while progress() < 1.0:
        p = progress()
        level = plan.level(p)
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_mult"]
        bias = plan.bias(p)
        batch = source.get(step, progress_at)
        loss = weighted_loss(model, batch.to(args.device), batcher, args.decide_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 10 == 0 or step <= 3:
            print(f"step {step} p={p:.3f} level={level:.2f} skew={bias:.2f} warm={int(p < args.warm_until)} lr={lr:.2e} loss={loss.item():.4f} ema={ema:.4f} "
                  f"t={time.time() - t0:.0f}s", flush=True)
        if step % args.eval_every == 0:
            evaluate()
        if time.time() - last_save > args.save_every_min * 60:
            save(model, processor, out, state(final=False))
            last_save = time.time()
            print(f"saved {out} at step {step}", flush=True)
    source.close()
    if step >= args.eval_every:  # (smoke runs skip it)
        evaluate()
    save(model, processor, out, state(final=True))
    print(f"done: {step} steps in {time.time() - t0:.0f}s -> {out}", flush=True)


if __name__ == "__main__":
    main()
