"""Next-token choice with OpenAI's sampling parameters, and the logprobs reported for each token.

Order of the logit processing (as OpenAI and vLLM apply it): presence / frequency penalties over
the tokens generated so far, `logit_bias`, the mask of tokens only the processor may place, then
greedy argmax or temperature -> top-k -> top-p (nucleus) -> one seeded draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mmkv.errors import InvalidRequestError

GREEDY_BELOW = 1e-5  # temperatures under this are greedy: logits / 1e-40 overflow to inf and NaN
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_TOP_LOGPROBS = 20
SEED_RANGE = (-(2**63), 2**63 - 1)  # int64, what torch.Generator.manual_seed takes


@dataclass
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]


@dataclass
class TokenLogprob:
    """One generated token's logprob and the `top_logprobs` most likely alternatives (OpenAI's shape)."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters; each bad value raises InvalidRequestError naming its param."""

    vocab_size: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    @classmethod
    def build(cls, vocab_size: int, temperature=0.0, top_p=1.0, top_k=0, presence_penalty=0.0,
              frequency_penalty=0.0, logit_bias=None, seed=None, logprobs=False, top_logprobs=0) -> SamplingParams:
        if not isinstance(logprobs, bool):
            raise InvalidRequestError("logprobs must be a boolean", param="logprobs")
        top_logprobs = _int(top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top_logprobs and not logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        if seed is not None:
            seed = _int(seed, "seed", *SEED_RANGE)
        return cls(vocab_size=vocab_size, temperature=_number(temperature, "temperature", 0.0, 2.0),
                   top_p=_number(top_p, "top_p", 0.0, 1.0, open_low=True), top_k=_int(top_k, "top_k", 0, None),
                   presence_penalty=_number(presence_penalty, "presence_penalty", -2.0, 2.0),
                   frequency_penalty=_number(frequency_penalty, "frequency_penalty", -2.0, 2.0),
                   logit_bias=_logit_bias(logit_bias, vocab_size), seed=seed, logprobs=logprobs,
                   top_logprobs=top_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _number(value, param: str, low: float, high: float, open_low: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (low < value if open_low else low <= value) or value > high:
        interval = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise InvalidRequestError(f"{param} must be a number in {interval}", param=param)
    return float(value)


def _int(value, param: str, low: int, high: int | None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise InvalidRequestError(f"{param} must be an integer {bound}", param=param)
    return value


def _logit_bias(bias, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """{token id (int, or its decimal string as JSON sends it): bias in [-100, 100]}, at most 300."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias must be an object mapping token ids to numbers", param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise InvalidRequestError(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})",
                                      param="logit_bias")
        out[token] = _number(value, "logit_bias", -100.0, 100.0)
    return tuple(sorted(out.items()))


class Sampler:
    """Per-request state: the generated-token counts the penalties need, the seeded generator,
    the logit bias as a vector and the mask of banned token ids."""

    def __init__(self, params: SamplingParams, banned_ids: list[int], device: torch.device | str = "cpu"):
        self.params = params
        v = params.vocab_size
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.counts = torch.zeros(v, dtype=torch.float32, device=device)
        self.offset = torch.zeros(v, dtype=torch.float32, device=device)  # logit_bias, -inf on banned ids
        for token, bias in params.logit_bias:
            self.offset[token] = bias
        self.offset[[t for t in banned_ids if 0 <= t < v]] = -math.inf

    def processed(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] logits after penalties, bias, the mask and temperature (1 when greedy)."""
        p = self.params
        x = logits.float()[: p.vocab_size] + self.offset
        if p.presence_penalty or p.frequency_penalty:
            x = x - p.frequency_penalty * self.counts - p.presence_penalty * (self.counts > 0).float()
        return x if p.greedy else x / p.temperature

    def choose(self, x: torch.Tensor) -> int:
        """One token id from processed logits `x` [V]."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(x))
        if p.top_k and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, -math.inf)
        probs = torch.softmax(x, dim=-1).cpu()
        if p.top_p >= 1.0:
            return draw(probs, self.generator)
        kept, ids = nucleus(probs, p.top_p)
        return int(ids[draw(kept, self.generator)])

    def step(self, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Choose the next token; returns it and the processed logits it was chosen from."""
        x = self.processed(logits)
        token = self.choose(x)
        self.counts[token] += 1
        return token, x


NUCLEUS_TRIES = (512, 16384)  # top-p looks among this many most likely tokens, then sorts all


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most likely tokens whose mass reaches `top_p` (a token is kept while the
    mass before it is under top_p; the most likely always): (their probabilities, their ids), most
    likely first. The top k by `topk` (k in NUCLEUS_TRIES) settle it once they hold top_p: the
    same set as a full sort (a token past them has at least their mass before it) at a fraction of
    its 12 ms over a 152k vocabulary on a CPU."""
    n = probs.numel()
    for k in NUCLEUS_TRIES:
        if k < n:
            values, order = torch.topk(probs, k)
            if float(values.sum()) >= top_p:
                break
    else:
        values, order = torch.sort(probs, descending=True)
    keep = torch.cumsum(values, dim=-1) - values < top_p  # always keeps the top token
    return values[keep], order[keep]


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn with probability proportional to `probs` [N] (CPU, >= 0, some > 0): one
    uniform from `generator` (None: torch's global one) against the float64 cumulative sum, the
    first index whose running total exceeds it. A zero-probability index is never drawn. Costs a
    cumulative sum, not `torch.multinomial`'s 3 ms per row at a 152k vocabulary on a CPU."""
    cdf = torch.cumsum(probs.double(), dim=0)
    u = torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    if i >= probs.numel():  # u rounded up to the total: the last index with mass
        i = int(torch.nonzero(probs > 0)[-1])
    return i


def logprobs_of(x: torch.Tensor, token: int, top: int, text_of) -> TokenLogprob:
    """OpenAI-shaped logprobs of `token` under log-softmax(`x`), with the `top` most likely tokens
    among those that could be sampled (a masked token, logprob -inf, is no alternative: fewer
    than `top` where a grammar allows fewer). `text_of(id)` -> (token text, its UTF-8 bytes)."""
    logp = torch.log_softmax(x.float(), dim=-1)
    text, raw = text_of(token)
    alts = []
    if top:
        values, ids = torch.topk(logp, min(top, logp.numel()))
        for value, tid in zip(values.tolist(), ids.tolist()):
            if value == -math.inf:
                break
            t, b = text_of(tid)
            alts.append(TopLogprob(t, value, b))
    return TokenLogprob(text, float(logp[token]), raw, alts)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Token id -> (text, UTF-8 bytes) for logprobs, cached. Byte-level BPE pieces map back to their
    raw bytes (a piece may be part of a multi-byte character: its text then shows U+FFFD)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoder = _byte_decoder()
        self.special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            piece = self.tokenizer.convert_ids_to_tokens(token) or ""
            if token not in self.special and all(c in self.decoder for c in piece):
                raw = bytes(self.decoder[c] for c in piece)
            else:
                raw = piece.encode("utf-8")
            hit = self._cache[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit
