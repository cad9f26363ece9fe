"""Template text tokenized a message at a time (mmkv.request.plan.TurnTokens) gives exactly the
ids of tokenizing it whole, with Qwen's real tokenizer, and stays inside its byte budget."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mmkv.request.plan import TURN_MARK, TurnTokens

QWEN = Path(__file__).resolve().parent.parent / "samples" / "tokenizers" / "qwen"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(QWEN)


def _conversation(rng: random.Random, turns: int) -> str:
    words = ["the", " quick", "\n", "  ", "\n\n", "brown", "fox", "é", "日本", "<|im_end|>", "'s", " 123", "\t", "!!"]
    text = "<|im_start|>system\nyou are helpful<|im_end|>\n"
    for t in range(turns):
        body = "".join(rng.choice(words) for _ in range(rng.randint(0, 40)))
        text += f"<|im_start|>{'user' if t % 2 == 0 else 'assistant'}\n{body}<|im_end|>\n"
    return text + "<|im_start|>assistant\n" + rng.choice(["", " ", "\n", "x"])


def test_a_message_at_a_time_equals_the_whole(tokenizer):
    pieces = TurnTokens(tokenizer)
    assert pieces.split
    rng = random.Random(0)
    for _ in range(200):
        text = _conversation(rng, rng.randint(0, 8))
        cut = rng.randint(0, len(text))  # also text that starts or ends mid-message
        for part in (text, text[:cut], text[cut:], "no mark at all " + text[:cut].replace(TURN_MARK, "")):
            assert pieces(part) == tokenizer(part)["input_ids"], repr(part)


def test_the_next_turn_tokenizes_only_its_new_messages(tokenizer, monkeypatch):
    pieces = TurnTokens(tokenizer)
    rng = random.Random(1)
    first = _conversation(rng, 6).rsplit(TURN_MARK, 1)[0] + TURN_MARK + "assistant\n"
    pieces(first)
    seen = []
    real = pieces.tokenizer

    def counting(text, **kw):
        seen.append(text)
        return real(text, **kw)

    monkeypatch.setattr(pieces, "tokenizer", counting)
    second = first + "done<|im_end|>\n<|im_start|>user\nnext step<|im_end|>\n<|im_start|>assistant\n"
    assert pieces(second) == real(second)["input_ids"]
    assert seen == ["<|im_start|>assistant\ndone<|im_end|>\n", "<|im_start|>user\nnext step<|im_end|>\n"]


def test_the_kept_pieces_stay_inside_the_budget(tokenizer):
    pieces = TurnTokens(tokenizer, budget=20_000)
    rng = random.Random(2)
    for _ in range(100):
        text = _conversation(rng, 4)
        assert pieces(text) == tokenizer(text)["input_ids"]
        assert 0 < pieces.nbytes <= 20_000
    huge = "<|im_start|>user\n" + "word " * 10_000  # one piece over the whole budget: tokenized, not kept
    assert pieces(huge) == tokenizer(huge)["input_ids"] and pieces.nbytes <= 20_000


def test_a_tokenizer_that_does_not_split_alone_is_tokenized_whole(tokenizer, monkeypatch):
    monkeypatch.setattr(TurnTokens, "_splits_alone", lambda self: False)
    pieces = TurnTokens(tokenizer)
    text = _conversation(random.Random(3), 3)
    assert not pieces.split and pieces(text) == tokenizer(text)["input_ids"] and pieces.nbytes == 0
