"""The fidelity dial: recompute a fraction of each spliced chunk's tokens in context.

A spliced chunk was prefilled alone, so its KV never attended to the context it now sits in
(re-rotation is exact; isolation is what a splice loses). With `blend` r, the splice recomputes
ceil(r x n) of the n tokens it would reuse from each chunk, in the same forward as the turn's new
tokens, their KV replacing the cached values; the rest stays reused. r = 0 is the plain splice,
r = 1 recomputes every chunk token (equal to a full recompute).

Which tokens (`blend_select`):
- `deviation` (CacheBlend's probe): the first `layer` + 1 layers run over the prompt after the
  prefix-cache hit, in context; the tokens whose K/V at `layer` deviate most from the placed
  cached K/V are chosen. Costs (layer + 1) / num_layers of a prefill of those tokens.
- `stride`: evenly spaced tokens of each chunk; no probe.

A ratio is set per chunk kind (`CHUNK_KINDS`): a chunk kind the dial knows is one more entry
there, the splice hands every placed chunk to `BlendChooser` with its kind.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch

from mmkv.errors import InvalidRequestError
from mmkv.request.splice import Placement, SlotLayer, image_features

# the spliced chunk kinds a ratio is set for: video, each temporal group; turn, a composed history turn
CHUNK_KINDS = ("image", "skill", "video", "turn")
SELECTORS = ("deviation", "stride")


@dataclass(frozen=True)
class Blend:
    """The dial's setting: a ratio per chunk kind and how tokens are chosen."""

    ratios: tuple[tuple[str, float], ...] = tuple((k, 0.0) for k in CHUNK_KINDS)
    select: str = "deviation"

    def ratio(self, kind: str) -> float:
        return dict(self.ratios).get(kind, 0.0)

    @property
    def active(self) -> bool:
        return any(r > 0 for _, r in self.ratios)

    def __str__(self) -> str:  # part of the prefix-cache salt: blended KV is only read back by the same setting
        return ",".join(f"{k}={r!r}" for k, r in self.ratios) + f"/{self.select}"


def _ratio(value, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise InvalidRequestError(f"{param} must be a number in [0, 1], got {value!r}", param=param)
    return float(value)


def parse_blend(value, select: str | None = None, default: Blend | None = None, param: str = "blend") -> Blend:
    """`value`: a ratio r in [0, 1] for every chunk kind, or {kind: r} for some of them (the
    others keep `default`'s); None keeps `default` (all zero when None). `select`: one of
    SELECTORS, None keeps `default`'s. Bad values raise InvalidRequestError naming `param`
    (or `param`_select)."""
    default = default or Blend()
    ratios = dict(default.ratios)
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in CHUNK_KINDS]
        if unknown:
            raise InvalidRequestError(f"{param} kinds must be among {', '.join(CHUNK_KINDS)}; got {unknown!r}",
                                      param=param)
        ratios.update({k: _ratio(v, f"{param}.{k}") for k, v in value.items()})
    elif value is not None:
        ratios = dict.fromkeys(CHUNK_KINDS, _ratio(value, param))
    select = default.select if select is None else select
    if select not in SELECTORS:
        raise InvalidRequestError(f"{param}_select must be one of {', '.join(SELECTORS)}, got {select!r}",
                                  param=f"{param}_select")
    return Blend(tuple((k, ratios[k]) for k in CHUNK_KINDS), select)


def parse_blend_flag(text: str) -> float | dict[str, float]:
    """`--blend`: "0.2" (every kind) or "image=0.2,skill=0.05"."""
    try:
        if "=" not in text:
            return float(text)
        pairs = (part.split("=", 1) for part in text.split(",") if part.strip())
        return {k.strip(): float(v) for k, v in pairs}
    except ValueError:
        raise InvalidRequestError(f"--blend takes a ratio or kind=ratio pairs, got {text!r}", param="blend") from None


@dataclass
class ChunkBlend:
    """One spliced chunk under the dial."""

    kind: str
    start: int  # its first prompt index
    tokens: int  # tokens the splice would have reused
    recomputed: int  # of those, recomputed in context


@dataclass
class BlendReport:
    """What the dial did for one request (the response's `mmkv.blend`)."""

    ratios: dict[str, float]
    select: str
    chunks: list[ChunkBlend] = field(default_factory=list)
    recomputed_tokens: int = 0
    probe_tokens: int = 0  # tokens the probe forward ran
    probe_layers: int = 0  # layers it ran them through
    probe_ms: float = 0.0
    applied: bool = True
    reason: str = ""  # why the dial did not apply (another path placed the prompt)

    def to_json(self) -> dict:
        return asdict(self)


def count_for(ratio: float, tokens: int) -> int:
    """Tokens of a chunk's `tokens` reused ones the dial recomputes: ceil(ratio x tokens)."""
    return min(tokens, math.ceil(ratio * tokens - 1e-9)) if ratio > 0 else 0


def strided(first: int, stop: int, k: int) -> list[int]:
    """k evenly spaced indices of [first, stop), each the middle of its share."""
    n = stop - first
    return [first + (2 * j + 1) * n // (2 * k) for j in range(k)]


class BlendChooser:
    """Chooses the chunk tokens a splice recomputes; `prefill_spliced` calls it once the reused KV
    is placed (`__call__`). Keeps the request's `BlendReport`. Not thread-safe (the engine's lock)."""

    def __init__(self, adapter, input_ids: torch.Tensor, positions: torch.Tensor, placements: list[Placement],
                 blend: Blend, layer: int = 1):
        self.adapter, self.input_ids, self.positions, self.placements = adapter, input_ids, positions, placements
        self.blend, self.layer = blend, min(max(layer, 0), adapter.num_layers - 1)
        self.report = BlendReport(dict(blend.ratios), blend.select)
        self.chosen: list[int] = []  # prompt indices, ascending

    def __call__(self, layers: list[SlotLayer], reused: list[tuple[Placement, int, int]], start: int) -> list[int]:
        """Prompt indices (ascending) among `reused` (placement, first, stop) chunk tokens to recompute."""
        wanted = [(p, first, stop, count_for(self.blend.ratio(p.entry.kind), stop - first))
                  for p, first, stop in reused]
        scores = None
        partial = [w for w in wanted if 0 < w[3] < w[2] - w[1]]
        if self.blend.select == "deviation" and partial:
            scores = self._deviation(layers, start, max(p.start + stop for p, _, stop, _ in partial))
        chosen = []
        for p, first, stop, k in wanted:
            if k == stop - first:
                picked = list(range(first, stop))
            elif k == 0:
                picked = []
            elif scores is None:
                picked = strided(first, stop, k)
            else:
                a = p.start + first - start
                top = torch.topk(scores[a:a + stop - first], k).indices
                picked = sorted(first + int(i) for i in top)
            chosen += [p.start + i for i in picked]
            self.report.chunks.append(ChunkBlend(p.entry.kind, p.start, stop - first, k))
        self.chosen = sorted(chosen)
        self.report.recomputed_tokens = len(chosen)
        return self.chosen

    def _deviation(self, layers: list[SlotLayer], start: int, end: int) -> torch.Tensor:
        """Per prompt token of [start, end): squared distance between its K/V at `layer` recomputed
        in context (layers 0..layer over [start, end) after the KV of [0, start)) and the KV placed
        in `layers` (the cached chunk's, re-rotated). Text tokens score too; only chunk tokens are read."""
        t0 = time.perf_counter()
        probe = self.adapter.new_cache()
        if start:
            for i, lyr in enumerate(layers[: self.layer + 1]):
                probe.update(lyr.keys[:, :, :start], lyr.values[:, :, :start], i)
        self.adapter.forward_layers(self.input_ids[start:end], self.positions[:, start:end], probe, self.layer + 1,
                                    image_features(self.placements, [(start, end)]))
        got_k = probe.layers[self.layer].keys[0, :, start:end].float()
        got_v = probe.layers[self.layer].values[0, :, start:end].float()
        placed = layers[self.layer]
        cached_k = placed.keys[0, :, start:end].to(got_k.device).float()
        cached_v = placed.values[0, :, start:end].to(got_v.device).float()
        scores = (got_k - cached_k).pow(2).sum(dim=(0, 2)) + (got_v - cached_v).pow(2).sum(dim=(0, 2))
        self.report.probe_tokens, self.report.probe_layers = end - start, self.layer + 1
        self.report.probe_ms = round((time.perf_counter() - t0) * 1000, 3)
        return scores.cpu()
