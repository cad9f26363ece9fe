"""One request's decoding, step by step: sampling, incremental detokenization, stop strings,
logprobs and the text / logprob callbacks. The engine's single-request loop and the scheduler's
batched loop drive the same `DecodeStream`, so a request decodes identically either way.

Text is detokenized incrementally by `Detokenizer` (each token decoded in the context of the one
before it, never the whole answer again) and stop strings are searched only in the new text plus
the longest stop's overlap, so a token costs the same at the end of a long answer as at its start.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from tokenizers.decoders import DecodeStream as TokenizersDecodeStream

from mmkv.request.grammar import GrammarMatcher
from mmkv.request.sampling import Sampler, SamplingParams, TokenLogprob, logprobs_of


class Detokenizer:
    """The text of a growing list of token ids, one piece per token, whose concatenation is the
    tokenizer's decode of the whole list with special tokens skipped (`tokenizer.decode(ids,
    skip_special_tokens=True)`; a rewrite of the decoded text as a whole, transformers'
    `clean_up_tokenization_spaces`, is not applied, as no stream can: Qwen's byte-level BPE never
    uses it).

    The tokenizers library's `DecodeStream` decodes each new token together with the tokens of the
    last piece, so a decoder that joins words with spaces (WordLevel, WordPiece) or strips the
    first word's leading space (Metaspace) gives each piece the text it has inside the whole; a
    token that ends inside a multi-byte character gives no piece until the character completes.
    Each step decodes a few tokens, whatever the length of the answer."""

    def __init__(self, tokenizer):
        self.backend = tokenizer.backend_tokenizer  # the `tokenizers.Tokenizer` of a transformers tokenizer
        self.stream = TokenizersDecodeStream(skip_special_tokens=True)
        self.context: list[int] = []  # the last token whose text is out (the context of a final flush)
        self.pending: list[int] = []  # tokens whose text is not out yet

    def step(self, token: int) -> str | None:
        """The text `token` completes (possibly with held tokens before it), or None while it ends
        inside a character."""
        self.pending.append(token)
        piece = self.stream.step(self.backend, token)
        if piece is not None:
            self.context, self.pending = self.pending[-1:], []
        return piece

    def flush(self) -> str:
        """The text of the held tokens, as the whole decode has it (an unfinished character as U+FFFD)."""
        if not self.pending:
            return ""
        head = self.backend.decode(self.context, skip_special_tokens=True)
        whole = self.backend.decode(self.context + self.pending, skip_special_tokens=True)
        self.context, self.pending = self.pending[-1:], []
        return whole[len(head):]


class DecodeStream:
    """Feed it the next-token logits with `step`; it returns the token to run next, or None once
    the request is done (stop token or string, max tokens, cancellation, a grammar completed). With
    a `grammar`, the tokens it does not allow next are masked before sampling (a stop token only
    where it accepts) and the answer ends as soon as it is complete. Not thread-safe: one driver at
    a time."""

    def __init__(self, *, tokenizer, token_texts, stop_ids: set[int], banned_ids: list[int],
                 sampling: SamplingParams, stops: list[str], max_new_tokens: int, first_position: int,
                 on_text: Callable[[str], None] | None = None,
                 on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, t0: float | None = None,
                 device: torch.device | str = "cpu", grammar: GrammarMatcher | None = None):
        self.detokenizer, self.token_texts, self.stop_ids = Detokenizer(tokenizer), token_texts, stop_ids
        self.sampling, self.stops, self.max_new_tokens = sampling, stops, max_new_tokens
        self.on_text, self.on_logprobs, self.should_stop = on_text, on_logprobs, should_stop
        self.sampler = Sampler(sampling, banned_ids, device)
        self.grammar = grammar
        self.t0 = time.perf_counter() if t0 is None else t0
        self.first_position = first_position  # where the first generated token sits
        self.ids: list[int] = []
        self.lps: list[TokenLogprob] = []
        self.starts: list[int] = []  # per token whose text is final: where that text starts in `text`
        self.text, self.done, self.emitted, self.delivered = "", 0, 0, 0  # `text` is the text of ids[:done]
        self.finish_reason, self.ttft = "length", None
        self.finished = False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def step(self, logits: torch.Tensor) -> int | None:
        """Consume next-token logits [V]; the token to run next (at `position`), or None when done."""
        if self.grammar is not None:
            logits = self.grammar.constrain(logits)
        token, processed = self.sampler.step(logits)
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.t0
        if token in self.stop_ids:
            return self._end("stop")
        if self.grammar is not None:
            self.grammar.advance(token)
        self.ids.append(token)
        if self.sampling.logprobs:
            self.lps.append(logprobs_of(processed, token, self.sampling.top_logprobs, self.token_texts))
        self._take_text(self.detokenizer.step(token))
        if self.finish_reason == "stop" or (self.grammar is not None and self.grammar.complete):
            return self._end("stop")
        self._emit(len(self.text) - self.hold)
        if self.should_stop is not None and self.should_stop():
            return self._end("cancelled")
        if len(self.ids) >= self.max_new_tokens:
            return self._end("length")
        return token

    @property
    def position(self) -> int:
        """Where the last returned token sits (all three M-RoPE axes: text after the prompt)."""
        return self.first_position + len(self.ids) - 1

    def cancel(self) -> None:
        """End now (the client went away or the server stops)."""
        if not self.finished:
            self._end("cancelled")

    def _end(self, reason: str) -> None:  # returns None: "no token to run"
        self.finish_reason, self.finished = reason, True
        if self.done < len(self.ids):
            self._take_text(self.detokenizer.flush())
        self._emit(len(self.text))
        if self.on_logprobs and self.sampling.logprobs and self.delivered < len(self.lps):
            self.on_logprobs(self.lps[self.delivered:])
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.t0
        return None

    def _take_text(self, piece: str | None) -> None:
        """Append the text of ids[done:] (None: not complete yet) to `text`; cut at a stop."""
        if piece is None:
            return
        self.starts.extend([len(self.text)] * (len(self.ids) - self.done))
        search_from = max(len(self.text) - self.hold, 0)
        self.text, self.done = self.text + piece, len(self.ids)
        cut = min((i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.finish_reason = self.text[:cut], "stop"

    def _emit(self, upto: int) -> None:
        """Pass text[emitted:upto] to on_text, preceded by the logprobs of the tokens it comes from."""
        if upto <= self.emitted:
            return
        n = self.delivered
        while n < len(self.starts) and self.starts[n] < upto:
            n += 1
        if self.on_logprobs and self.sampling.logprobs and n > self.delivered:
            self.on_logprobs(self.lps[self.delivered:n])
        self.delivered = n
        if self.on_text:
            self.on_text(self.text[self.emitted:upto])
        self.emitted = upto

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.lps if self.sampling.logprobs else None
