"""Composed history (`history_policy: "compose"`, approximate, reported): a conversation's finished
turns kept as text chunks and spliced, re-rotated, where a client resends them at moved positions.

Agents drop things from the middle of their history (the oldest screenshot of a window, a long tool
output); the turns after it are the same text, but every position after the drop moved, so the
exact path recomputes them. Under "compose" each finished turn (a chat-template message: from its
`<|im_start|>` to the next) is kept as chunks: its runs of text between the images and skills it
holds (`TurnPiece`), each a `CachedChunk` of kind "turn" with the KV it had in the request that
computed it. A later request under "compose" whose message has the same tokens (and the same
images and skills) splices those pieces at their new positions, re-rotated by the constant per-axis
change, their first `seam_tokens` recomputed (seam repair, as skills), the message's images spliced
as usual; only the new turn, the changed message and the seams are computed.

That KV saw the context it was computed in, not the request's: the result is approximate (its
distance from full recompute is measured by `mmkv eval --task agent-window`). So every prefix block
that holds composed KV goes under the policy's own salt (`compose_salt`: no exact request reads it),
and a piece names as `sources` every chunk its KV attended to, transitively: deleting an image
purges every turn chunk (and block) that saw it. A request under "compose" that composes nothing and
loads no composed block is exact, stores its blocks under the exact salt and says so.

Not thread-safe: the engine's lock covers every call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import xxhash

from mmkv.errors import InvalidRequestError
from mmkv.kv.chunks import CachedChunk
from mmkv.request.plan import SplicePlan
from mmkv.request.splice import Placement, PrefillResult, splice_layout
from mmkv.store.kv_store import KVStore
from mmkv.store.prefix_cache import BlockKey, PrefixCache, block_keys, stored_blocks

HISTORY_POLICIES = ("exact", "compose")
#: A text run shorter than this is recomputed, not kept: its entry's per-tensor heap would cost more
#: than its KV saves, and with seam repair little of it would be reused.
MIN_PIECE_TOKENS = 4


def check_history_policy(value) -> str:
    if value is None:
        return "exact"
    if value not in HISTORY_POLICIES:
        raise InvalidRequestError(f"history_policy must be one of {', '.join(HISTORY_POLICIES)}",
                                  param="history_policy")
    return value


def compose_salt(salt: str) -> str:
    """The prefix-cache salt of blocks that hold composed (approximate) KV."""
    return f"{salt}|history=compose"


@dataclass(frozen=True)
class TurnPiece:
    """A run of text tokens [start, end) inside a finished message, keyed by the message's tokens
    and chunks and the run's index in it: the same message anywhere gives the same keys."""

    start: int
    end: int
    key: str


@dataclass
class HistoryReport:
    """What the history policy did for one request."""

    policy: str  # asked for
    applied: str = "exact"  # "compose" when the request's KV holds composed turns; else "exact"
    composed_turns: int = 0  # messages with at least one piece spliced from a turn chunk
    composed_tokens: int = 0  # prompt tokens whose KV came from turn chunks (seams excluded)
    composed_prefix_tokens: int = 0  # leading tokens from blocks of an earlier composed request
    stored_turns: int = 0  # new turn pieces kept for later requests (once the first token is out)
    reason: str = ""  # why nothing was composed


def turn_pieces(input_ids: torch.Tensor, chunk_keys: list[str | None], turn_start: int, salt: str,
                min_tokens: int = MIN_PIECE_TOKENS) -> list[TurnPiece]:
    """The text runs of every finished message of the prompt (all but the last, the generation
    prompt), cut at each image or skill, of at least `min_tokens` tokens."""
    ids = input_ids.tolist()
    starts = [i for i, t in enumerate(ids) if t == turn_start and chunk_keys[i] is None]
    pieces = []
    for a, b in zip(starts, starts[1:]):
        message = xxhash.xxh3_128(salt.encode() + input_ids[a:b].to(torch.int64).numpy().tobytes()
                                  + "\x1f".join(k or "" for k in chunk_keys[a:b]).encode()).hexdigest()
        run, index = None, 0
        for i in range(a, b + 1):
            text = i < b and chunk_keys[i] is None
            if text and run is None:
                run = i
            elif not text and run is not None:
                if i - run >= min_tokens:
                    pieces.append(TurnPiece(run, i, xxhash.xxh3_128_hexdigest(f"turn|{message}|{index}".encode())))
                run, index = None, index + 1
    return pieces


def _message_of(starts: list[int], index: int) -> int:
    """The number of the message that prompt index `index` lies in."""
    return sum(1 for s in starts if s <= index)


@dataclass
class Composition:
    """One request's composition: the plan with its turn pieces placed, the prefix blocks it loads,
    the keys its blocks go back under, and what it reports; `commit` stores its new pieces."""

    plan: SplicePlan  # with the turn pieces' placements
    blocks: list  # prefix blocks loaded
    insert_keys: list[BlockKey]  # where its blocks go (the compose salt when its KV is composed)
    insert_from: int  # blocks of `insert_keys` already stored (the hit, when under the same salt)
    report: HistoryReport
    new_pieces: list[TurnPiece] = field(default_factory=list)  # pieces with no turn chunk yet
    loaded_sources: frozenset[str] = frozenset()  # chunks the loaded blocks' KV holds


class Composer:
    """Finds a request's stored turn pieces, plans their splice, and keeps its new ones."""

    def __init__(self, store: KVStore, prefix: PrefixCache, turn_start: int, num_layers: int):
        self.store, self.prefix, self.turn_start, self.num_layers = store, prefix, turn_start, num_layers

    def compose(self, plan, salt: str, seam: int, use_prefix: bool) -> Composition:
        """Place every piece of the prompt that has a turn chunk; take the longer prefix hit of the
        exact and the compose salt (exact KV serves a composed request; never the reverse)."""
        report = HistoryReport("compose")
        pieces = turn_pieces(plan.input_ids, plan.chunk_keys, self.turn_start, salt)
        found, new = {}, []
        for piece in pieces:
            entry = self.store.get(piece.key, "turn")
            if entry is not None and torch.equal(entry.token_ids, plan.input_ids[piece.start:piece.end]):
                found[piece] = entry
            else:
                new.append(piece)
        placements = sorted(plan.placements + [Placement(p.start, e, plan.positions[:, p.start:p.end])
                                               for p, e in found.items()], key=lambda p: p.start)
        chunk_keys = list(plan.chunk_keys)
        for p, e in found.items():
            chunk_keys[p.start:p.end] = [e.key] * (p.end - p.start)
        composed = SplicePlan(plan.input_ids, plan.positions, plan.native_positions, placements, chunk_keys)
        n = plan.input_ids.numel()
        if not use_prefix:
            return Composition(composed, [], [], 0, self._counted(report, composed, plan.chunk_keys, found, 0, seam,
                                                                  False), new)
        exact = block_keys(plan.input_ids, plan.chunk_keys, salt)  # hashed as text: the same chain every turn
        own = self._with_sources(block_keys(plan.input_ids, plan.chunk_keys, compose_salt(salt)), found)
        cap = (n - 1) // self.prefix.block
        hits = stored_blocks(self.store, exact[:cap]), stored_blocks(self.store, own[:cap])
        from_own = len(hits[1]) > len(hits[0])
        blocks = hits[from_own]
        self.prefix.query_tokens += n
        self.prefix.hit_tokens += len(blocks) * self.prefix.block
        report = self._counted(report, composed, plan.chunk_keys, found, len(blocks) * self.prefix.block, seam,
                               from_own)
        approximate = report.applied == "compose"
        keys, have = (own, len(blocks) if from_own else 0) if approximate else (exact, len(blocks))
        loaded = frozenset(s for b in blocks for s in b.sources)
        return Composition(composed, blocks, keys, have, report, new, loaded)

    def _with_sources(self, keys: list[BlockKey], found: dict) -> list[BlockKey]:
        """The compose salt's block keys, each naming also the turn chunks its tokens come from and
        everything those saw: a delete of any of them purges the block."""
        out = []
        for i, key in enumerate(keys):
            a, b = i * self.prefix.block, (i + 1) * self.prefix.block
            extra = {s for p, e in found.items() if p.start < b and a < p.end for s in (e.key, *e.sources)}
            out.append(BlockKey(key, key.sources | extra) if extra else key)
        return out

    def _counted(self, report: HistoryReport, plan, original_keys: list, found: dict, hit: int, seam: int,
                 from_own: bool) -> HistoryReport:
        """The report's counts: turn-chunk tokens placed past the prefix hit (seams computed, not
        counted), the messages they lie in, the tokens loaded from composed blocks."""
        turns = [p for p in plan.placements if p.entry.kind == "turn"]
        reused = splice_layout(turns, plan.input_ids.numel(), hit, seam).reused
        starts = [i for i, t in enumerate(plan.input_ids.tolist()) if t == self.turn_start and original_keys[i] is None]
        report.composed_tokens = sum(stop - first for _, first, stop in reused)
        report.composed_turns = len({_message_of(starts, p.start) for p, first, stop in reused if stop > first})
        report.composed_prefix_tokens = hit if from_own else 0
        if report.composed_tokens or from_own:
            report.applied = "compose"
        else:
            report.reason = ("the prefix cache holds every stored turn of the prompt" if found
                             else "no earlier turn of the prompt is stored")
        return report

    def commit(self, comp: Composition, result: PrefillResult, insert: Callable[[], object] | None
               ) -> Callable[[], object]:
        """What runs once the first token is out: the prefix blocks (`insert`), then a turn chunk of
        every new piece, its KV as this request left it, naming every chunk before it as a source."""
        plan, cache = comp.plan, result.cache

        def store() -> None:
            if insert is not None:
                insert()
            for piece in comp.new_pieces:
                if piece.key in self.store:
                    continue
                a, b = piece.start, piece.end
                sources = set(comp.loaded_sources)
                for p in plan.placements:
                    if p.start < b:
                        sources.add(p.entry.key)
                        sources.update(p.entry.sources)
                layers = cache.layers[:self.num_layers]
                chunk = CachedChunk(key=piece.key, kind="turn", token_ids=plan.input_ids[a:b].clone(),
                                    position_ids=plan.positions[:, a:b].clone(),
                                    keys=tuple(x.keys[0, :, a:b].clone() for x in layers),
                                    values=tuple(x.values[0, :, a:b].clone() for x in layers),
                                    sources=frozenset(sources))
                if self.store.put(chunk):
                    comp.report.stored_turns += 1
        return store
