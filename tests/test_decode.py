"""Incremental detokenization in `DecodeStream`: every streamed delta, joined, is the returned text,
and that text is the tokenizer's own decode of the generated ids (transformers' `decode` with
`skip_special_tokens=True`, the setting the engine uses), cut at the first stop string. Checked on
Qwen's released byte-level BPE tokenizer and on tokenizers whose decoders insert or strip spaces
(WordLevel, WordPiece, Metaspace with byte fallback), built here with the `tokenizers` library."""

from __future__ import annotations

import gzip

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mmkv.request.decode import DecodeStream
from mmkv.request.sampling import SamplingParams
from mmkv.testing.realshape import TOKENIZER_DIR


def _wrap(backend: Tokenizer, **special) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


def qwen_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer.from_str(gzip.decompress((TOKENIZER_DIR / "tokenizer.json.gz").read_bytes()).decode())
    return _wrap(backend, eos_token="<|im_end|>")


def wordlevel_tokenizer() -> PreTrainedTokenizerFast:
    words = ["[UNK]", "<eos>", "with", "red", "else", ".", ",", "héllo", "世界", "stop"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # no decoder: tokens are joined with spaces
    backend.add_special_tokens(["<eos>"])
    return _wrap(backend, eos_token="<eos>", unk_token="[UNK]")


def wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    words = ["[UNK]", "[SEP]", "[CLS]", "with", "red", "##dish", "else", ".", ",", "do", "##n", "'", "t", "é", "##é"]
    backend = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(["[SEP]", "[CLS]"])
    return _wrap(backend, sep_token="[SEP]", cls_token="[CLS]", unk_token="[UNK]")


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-style unigram: "▁" marks a word start, bytes of unknown characters fall back to
    <0xXX> tokens (é and 世 are split across two and three tokens)."""
    pieces = [("<unk>", 0.0), ("</s>", 0.0), ("▁with", -1.0), ("▁red", -1.0), ("▁else", -1.0), ("▁", -2.0)]
    pieces += [(c, -4.0) for c in "abcdefghijklmnopqrstuvwxyz."]
    pieces += [(f"<0x{b:02X}>", -8.0) for b in range(256)]
    backend = Tokenizer(models.Unigram(pieces, 0, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["</s>"])
    return _wrap(backend, eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"qwen": qwen_tokenizer, "wordlevel": wordlevel_tokenizer, "wordpiece": wordpiece_tokenizer,
              "metaspace": metaspace_tokenizer}
TEXTS = {
    "qwen": "héllo 世界 🎉🎉 naïve — with red else, <tool_call>ok</tool_call> 🇫🇷 done",
    "wordlevel": "with red else else . héllo , 世界 stop red",
    "wordpiece": "with reddish , else . do ' t é éé red",
    "metaspace": "with red else elsé 世 red.",
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def case(request):
    tok = TOKENIZERS[request.param]()
    ids = tok(TEXTS[request.param], add_special_tokens=False)["input_ids"]
    return request.param, tok, ids


def run(tok, ids: list[int], stops: list[str] = (), max_new_tokens: int | None = None, logprobs: bool = False):
    """Drive a DecodeStream with logits that force `ids` one by one; (stream, streamed deltas, events)."""
    vocab = len(tok)
    deltas, events = [], []
    on_text = lambda d: (deltas.append(d), events.append(("text", d)))  # noqa: E731
    stream = DecodeStream(
        tokenizer=tok, token_texts=lambda t: (tok.convert_ids_to_tokens(t), []), stop_ids={tok.eos_token_id or 0},
        banned_ids=[], sampling=SamplingParams.build(vocab, logprobs=logprobs), stops=list(stops),
        max_new_tokens=max_new_tokens or len(ids) + 1, first_position=0, on_text=on_text,
        on_logprobs=lambda lps: events.append(("lp", lps)))
    for token in ids:
        logits = torch.full((vocab,), -1e9)
        logits[token] = 0.0
        if stream.step(logits) is None:
            break
    else:
        stream.cancel()
    return stream, deltas, events


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def test_tokenizers_under_test_split_words_and_characters(case):
    """The cases are the hard ones: some character spans several tokens (byte-level or byte
    fallback), or the decoder puts spaces between tokens that the tokens do not hold."""
    name, tok, ids = case
    pieces = [decode(tok, [t]) for t in ids]
    assert any("\ufffd" in p for p in pieces) or "".join(pieces) != decode(tok, ids)


def test_streamed_text_is_the_decode_of_the_ids(case):
    """issue finding 10: the deltas, joined, are the returned text and the tokenizer's decode of
    the same ids (the old detokenizer decoded each piece alone: WordLevel's 'with red else else'
    came back as 'withredelseelse')."""
    name, tok, ids = case
    stream, deltas, _ = run(tok, ids)
    want = decode(tok, ids)
    assert stream.ids == ids
    assert "".join(deltas) == stream.text == want
    assert all(deltas)  # no empty delta is sent


def test_every_prefix_decodes_to_its_text(case):
    """Cut after any token (max_tokens), even inside a multi-byte character: the text is the
    decode of the ids generated so far (an unfinished character as U+FFFD, as decode gives it)."""
    name, tok, ids = case
    for n in range(1, len(ids) + 1):
        stream, deltas, _ = run(tok, ids, max_new_tokens=n)
        assert stream.finish_reason == "length" and stream.ids == ids[:n]
        assert "".join(deltas) == stream.text == decode(tok, ids[:n]), n


def _stops_of(text: str) -> list[str]:
    """Stop strings across word and character boundaries: around each space, each non-ASCII
    character, and the last word."""
    found = {text[max(i - 2, 0):i + 3] for i, c in enumerate(text) if c == " " or ord(c) > 127}
    return sorted(s for s in found | {text.split()[-1]} if s.strip())


def test_stop_strings_cut_the_decoded_text(case):
    """A stop string (spanning a space the decoder inserts, or a character split across tokens)
    ends the answer where it first occurs in the decoded text; no delta holds any of it."""
    name, tok, ids = case
    full = decode(tok, ids)
    for stop in _stops_of(full):
        stream, deltas, _ = run(tok, ids, stops=[stop, "\x00never"])
        assert stream.finish_reason == "stop", stop
        assert "".join(deltas) == stream.text == full[:full.index(stop)], stop
        # it stopped at the first token that completed the stop and its last character
        assert ids[:len(stream.ids)] == stream.ids and stop in decode(tok, stream.ids)
        earlier = (decode(tok, ids[:k]) for k in range(len(stream.ids)))
        assert not any(stop in t and not t.endswith("\ufffd") for t in earlier), stop


def test_logprobs_come_before_their_text_once_each(case):
    name, tok, ids = case
    stream, _, events = run(tok, ids, logprobs=True)
    streamed = [lp for kind, x in events if kind == "lp" for lp in x]
    assert streamed == stream.lps and len(streamed) == len(ids)
    for i, (kind, _) in enumerate(events):
        if kind == "lp" and i + 1 < len(events):
            assert events[i + 1][0] == "text"  # logprobs come right before the delta they belong to
