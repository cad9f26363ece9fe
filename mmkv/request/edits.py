"""Automatic field-change detection and the edit policies that keep a cache hot.

When a request's prompt equals a recent prompt except for a changed field value, the engine can
answer it four ways (MECHANISM.md section 1):
- recompute: ordinary prefix reuse up to the change, prefill the rest (exact, the default);
- erratum: keep the old prompt, fully cached, and append the paper's erratum line for the new
  value before the final turn, so the cache hit covers everything;
- in_place: recompute only the changed tokens and reuse the stale KV after them (fast; the
  paper finds the model then ignores the edit unless it reasons before answering);
- selective@K: in_place plus the K later tokens whose KV changes most at one layer
  (the CacheBlend-style baseline the paper compares).

What a field change is (the detector implements exactly this rule, `detect_field_change`):
1. The new prompt N is a recent prompt C with ONE in-place substitution (at most
   `max_tokens` old and new tokens), possibly followed by new turns.
2. The substitution lies strictly inside an earlier turn: inside one turn's content, before the
   final turn of N (the final turn is the new question; a changed question is not an edit), and
   touches no chat-template token (`<|im_start|>`, `<|im_end|>`, vision tokens) and no spliced
   chunk (image or skill) in either prompt. Everything before it is identical, so the messages'
   count and roles before the change agree.
3. It is inside a value: on its line, within `label_tokens` tokens before it, stands a label
   (`name: value`, `name = value`, YAML `  name: value`, JSON `"name": "value"`); the changed
   text holds no line break (nor, in a quoted value, a quote), and the value ends on its line
   within `value_chars` characters.
4. At least `min_rest` tokens of C follow the change, so that reusing them can matter.
The field is the label (at most `label_chars` characters); the erratum line names it and the new
value. Anything else is not an edit: the policy falls back to recompute and says why.
"""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np
import torch

from mmkv.errors import InvalidRequestError
from mmkv.store.prefix_cache import read_blocks, stored_blocks, write_blocks
from mmkv.kv.rerotate import constant_delta, place_rows, reposition_keys, rotation
from mmkv.request.splice import image_features, preallocate, prefill_spliced

POLICY_NAMES = ("recompute", "erratum", "in_place", "selective")


@dataclass(frozen=True)
class EditPolicy:
    name: str
    k: int = 0  # selective@K: later tokens to recompute

    def __str__(self) -> str:
        return f"selective@{self.k}" if self.name == "selective" else self.name


def parse_edit_policy(value: str | None) -> EditPolicy:
    """'recompute' | 'erratum' | 'in_place' | 'selective@K'."""
    value = value or "recompute"
    if isinstance(value, str) and value.startswith("selective@"):
        k = value.removeprefix("selective@")
        if k.isascii() and k.isdigit() and len(k) <= 7:
            return EditPolicy("selective", int(k))
    elif value in POLICY_NAMES[:3]:
        return EditPolicy(value)
    raise InvalidRequestError("edit_policy must be recompute, erratum, in_place or selective@K (K an integer "
                              "below 10^7)", param="edit_policy")


@dataclass(frozen=True)
class EditRules:
    """The bounds of the field-change rule (module docstring)."""

    max_tokens: int = 16  # longest old or new substitution, tokens
    min_rest: int = 16  # old-prompt tokens that must follow the change
    label_tokens: int = 32  # the label and the line break or delimiter before it: within this many tokens
    label_chars: int = 64  # longest field name
    value_chars: int = 96  # longest value


# ---- token views: what detection compares ------------------------------------------------------
Span = tuple[int, int, str, str]  # (start, end, chunk key, kind) of a spliced chunk


@dataclass(frozen=True, eq=False)
class TokenView:
    """A prompt as detection sees it: token ids and the chunks spliced into it. Compact (4 bytes
    per token plus one tuple per chunk) and holds no tensors, so a kept prompt never keeps a
    chunk's KV alive outside the store's budget."""

    ids: np.ndarray  # int32 [L]
    spans: tuple[Span, ...]  # in order, non-overlapping

    @classmethod
    def of(cls, input_ids: torch.Tensor, placements) -> TokenView:
        spans = tuple((p.start, p.end, p.entry.key, p.entry.kind) for p in sorted(placements, key=lambda p: p.start))
        return cls(input_ids.numpy().astype(np.int32), spans)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.ids.nbytes) + 64 * len(self.spans)

    def chunk_keys(self) -> list[str | None]:
        keys: list[str | None] = [None] * len(self)
        for a, b, key, _ in self.spans:
            keys[a:b] = [key] * (b - a)
        return keys

    def spans_in(self, a: int, b: int, shift: int = 0) -> set[Span] | None:
        """Spans inside [a, b), moved by `shift`; None if a span straddles a or b."""
        out = set()
        for s, e, key, kind in self.spans:
            if e <= a or s >= b:
                continue
            if s < a or e > b:
                return None
            out.add((s + shift, e + shift, key, kind))
        return out

    def touches_chunk(self, a: int, b: int) -> bool:
        return any(s < b and e > a for s, e, _, _ in self.spans)

    def common_prefix(self, other: TokenView) -> int:
        """Tokens at the start where both ids and chunk identity agree."""
        n = min(len(self), len(other))
        diff = np.flatnonzero(self.ids[:n] != other.ids[:n])
        p = int(diff[0]) if diff.size else n
        mine, theirs = set(self.spans), set(other.spans)
        for s, _, _, _ in mine ^ theirs:  # first per-token key mismatch = earliest unshared span
            p = min(p, s)
        return p

    def same(self, a: int, other: TokenView, c: int, n: int) -> bool:
        """self[a:a+n] equals other[c:c+n], ids and chunks."""
        if a + n > len(self) or c + n > len(other) or not np.array_equal(self.ids[a:a + n], other.ids[c:c + n]):
            return False
        mine = self.spans_in(a, a + n, c - a)
        return mine is not None and mine == other.spans_in(c, c + n)

    def starts_with(self, prefix: TokenView) -> bool:
        return self.same(0, prefix, 0, len(prefix))


@dataclass(eq=False)
class RecentPrompt:
    """A prompt the engine prefilled, kept to detect in-place edits of it. `client` is what the
    request rendered to; `prefilled` is what was prefilled (they differ once the erratum policy
    rewrote it, and later turns keep extending the rewritten prompt). `salt`: the prefix-cache
    salt its blocks are stored under ('' = the exact salt of its request; an in_place /
    selective@K turn's approximate KV sits under that policy's own salt). `seq` orders prompts of
    different keys by age (set by `RecentPrompts.add`)."""

    client: TokenView
    prefilled: TokenView
    salt: str = ""
    seq: int = 0

    @property
    def rewritten(self) -> bool:
        return self.client is not self.prefilled

    @property
    def nbytes(self) -> int:
        return self.client.nbytes + (self.prefilled.nbytes if self.rewritten else 0)


class RecentPrompts:
    """The last `per_key` prompts of each (tenant, settings) key, most recently used keys last,
    inside a byte budget for all keys together (the oldest keys go first)."""

    def __init__(self, per_key: int = 16, max_keys: int = 256, budget_bytes: int = 64 << 20):
        self.per_key, self.max_keys, self.budget_bytes = per_key, max_keys, budget_bytes
        self._by_key: OrderedDict[object, deque[RecentPrompt]] = OrderedDict()
        self.nbytes = 0
        self._seq = 0

    def of(self, key) -> list[RecentPrompt]:
        prompts = self._by_key.get(key)
        if prompts is None:
            return []
        self._by_key.move_to_end(key)
        return list(prompts)

    def add(self, key, prompt: RecentPrompt) -> None:
        self._seq += 1
        prompt.seq = self._seq
        prompts = self._by_key.setdefault(key, deque())
        self._by_key.move_to_end(key)
        prompts.append(prompt)
        self.nbytes += prompt.nbytes
        if len(prompts) > self.per_key:
            self.nbytes -= prompts.popleft().nbytes
        while self._by_key and (len(self._by_key) > self.max_keys or self.nbytes > self.budget_bytes):
            oldest_key, oldest = next(iter(self._by_key.items()))
            if oldest_key == key and len(self._by_key) == 1:
                while len(oldest) > 1 and self.nbytes > self.budget_bytes:
                    self.nbytes -= oldest.popleft().nbytes
                break
            self._by_key.popitem(last=False)
            self.nbytes -= sum(p.nbytes for p in oldest)

    def __len__(self) -> int:
        return sum(len(p) for p in self._by_key.values())


# ---- detection ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FieldChange:
    """N = C[:start] + N[start:start+new_len] + C[start+old_len:] + tail, where the substitution
    is a labelled field's value."""

    prompt: RecentPrompt  # C
    start: int
    old_len: int
    new_len: int
    field: str
    old_value: str
    new_value: str

    @property
    def rest(self) -> int:
        """Tokens of C after the change (they reappear in N shifted by new_len - old_len)."""
        return len(self.prompt.client) - self.start - self.old_len


@dataclass(frozen=True)
class TemplateTokens:
    """Token ids the detector needs from the tokenizer: the turn marker, the generation prompt,
    every id that only the template or the processor places, and a decoder."""

    turn_start: int  # <|im_start|>
    generation_prompt: tuple[int, ...]  # <|im_start|>assistant\n
    special: frozenset[int]
    decode: object  # list[int] -> str


_LABEL = re.compile(  # a label, its separator, and the start of the value up to the change
    # (anchored with \Z: `$` would also match before a line break, taking the line above's label)
    r"(?:^|[\n{,;])[ \t]*(?:- )?"
    r"(?:\"(?P<jlabel>[A-Za-z_][\w .\-]*)\"|(?P<label>[A-Za-z_][\w.\-]*(?: [A-Za-z_][\w.\-]*){0,3}))"
    r"[ \t]*[:=][ \t]*(?:(?P<quote>\")(?P<qstem>[^\n\"]*)|(?P<stem>[^\n\",;{}:=]*))\Z"
)


def _final_turn_start(ids: np.ndarray, tt: TemplateTokens) -> int:
    """Index of the final turn's <|im_start|> (the turn before the generation prompt, if any)."""
    starts = np.flatnonzero(ids == tt.turn_start)
    if not starts.size:
        return -1
    g = len(tt.generation_prompt)
    last = int(starts[-1])
    if len(starts) > 1 and g and tuple(ids[last:].tolist()) == tt.generation_prompt:
        return int(starts[-2])
    return last


def _substitution(new: TokenView, old: TokenView, max_tokens: int) -> tuple[int, int, int] | None:
    """(start, new_len, old_len): the smallest in-place substitution turning `old` into a prefix
    of `new`, or None. For each old length y, the first new length x whose tokens match; the
    smallest x + y wins (the first found among equals)."""
    start = new.common_prefix(old)
    if start >= len(old):
        return None  # `new` repeats or extends `old`: not a change
    best, widths = None, np.arange(max_tokens + 1)
    for y in range(max_tokens + 1):
        rest = len(old) - start - y
        if rest <= 0 or (best is not None and y >= best[1] + best[2]):
            break  # no later y can give a smaller x + y
        # cheap checks for every x at once (this runs on every request), then the full compare
        xs = widths[(start + widths + rest <= len(new)) & ((widths > 0) | (y > 0))]
        xs = xs[(new.ids[start + xs] == old.ids[start + y]) & (new.ids[start + xs + rest - 1] == old.ids[-1])]
        for x in xs.tolist():
            if best is not None and x + y >= best[1] + best[2]:
                break
            if new.same(start + x, old, start + y, rest):
                best = (start, x, y)
                break
    return best


def _value_end(after: str, quote: str, limit: int, ended: bool) -> int | None:
    """Length of the value's remainder at the start of `after`, or None if it does not end on
    its line within `limit` characters. `ended`: the turn ends right after `after`."""
    stops = '"\n' if quote else ",;}\n"
    for i, c in enumerate(after[: limit + 1]):
        if c in stops:
            return i
    return len(after) if ended and len(after) <= limit else None


def _describe(new: TokenView, old: TokenView, start: int, x: int, y: int, tt: TemplateTokens,
              rules: EditRules) -> tuple[str, str, str] | None:
    """(field, old value, new value) if the substitution is a labelled field's value (rule 3)."""
    starts = np.flatnonzero(new.ids[:start] == tt.turn_start)
    if not starts.size:
        return None
    turn_start = int(starts[-1])
    lo = max(turn_start + 1, start - rules.label_tokens)
    before = tt.decode(new.ids[lo:start].tolist())
    if lo == turn_start + 1:  # the window starts at the turn: drop the role line
        before = "\n" + (before.split("\n", 1)[1] if "\n" in before else "")
    else:  # mid-line: the label must follow a line break or a delimiter inside the window
        before = "\x00" + before
    old_text, new_text = tt.decode(old.ids[start:start + y].tolist()), tt.decode(new.ids[start:start + x].tolist())
    k = 0  # the text both share at the start of the substitution belongs to the label side
    while k < min(len(old_text), len(new_text)) and old_text[k] == new_text[k]:
        k += 1
    before, old_text, new_text = before + new_text[:k], old_text[k:], new_text[k:]
    m = _LABEL.search(before)
    if m is None:
        return None
    label = (m.group("jlabel") or m.group("label")).strip()
    quote, stem = m.group("quote") or "", m.group("qstem") if m.group("quote") else m.group("stem")
    if not label or len(label) > rules.label_chars:
        return None
    forbidden = '"\n' if quote else "\n"
    if any(c in t for t in (old_text, new_text) for c in forbidden):
        return None
    window = new.ids[start + x:start + x + rules.value_chars].tolist()
    cut = next((i for i, t in enumerate(window) if t in tt.special), None)  # the turn ends there
    follow = tt.decode(window[:cut])
    tail = _value_end(follow, quote, rules.value_chars, ended=cut is not None)
    if tail is None:
        return None
    old_value = (stem + old_text + follow[:tail]).strip()
    new_value = (stem + new_text + follow[:tail]).strip()
    if not new_value or len(new_value) > rules.value_chars or len(old_value) > rules.value_chars:
        return None
    return label, old_value, new_value


def detect_field_change(new: TokenView, recent: list[RecentPrompt], tt: TemplateTokens,
                        rules: EditRules) -> FieldChange | None:
    """The field change (module docstring) that turns a recent prompt into the start of `new`,
    the most recent first; None if there is none, or if `new` simply continues a recent prompt
    (a later turn of a conversation whose change was already handled)."""
    if any(new.starts_with(p.client) for p in recent):
        return None
    final_turn = _final_turn_start(new.ids, tt)
    for prompt in reversed(recent):
        old = prompt.client
        sub = _substitution(new, old, rules.max_tokens)
        if sub is None:
            continue
        start, x, y = sub
        if start + x >= final_turn or len(old) - start - y < rules.min_rest:
            continue  # rule 2 (the final turn is the question) and rule 4
        changed = np.concatenate((new.ids[start:start + x], old.ids[start:start + y]))
        if any(int(t) in tt.special for t in changed) or new.touches_chunk(start, start + x) \
                or old.touches_chunk(start, start + y):
            continue
        described = _describe(new, old, start, x, y, tt, rules)
        if described is not None:
            return FieldChange(prompt, start, y, x, *described)
    return None


def extended_prompt(new: TokenView, recent: list[RecentPrompt]) -> RecentPrompt | None:
    """The most recent rewritten prompt whose client tokens `new` repeats and extends."""
    for prompt in reversed(recent):
        if prompt.rewritten and new.starts_with(prompt.client):
            return prompt
    return None


def insert_before_final_turn(ids: list[int], user_turn: list[int], erratum: list[int], close: list[int],
                             generation_prompt: list[int], from_index: int) -> tuple[list[int], int]:
    """Insert `erratum` at the start of the last user turn at or after `from_index`; if there is
    none, as a user turn of its own before the generation prompt. Returns (ids, insert index)."""
    n = len(user_turn)
    for i in range(len(ids) - n, from_index - 1, -1):
        if ids[i:i + n] == user_turn:
            at = i + n
            return ids[:at] + erratum + ids[at:], at
    g = len(generation_prompt)
    at = len(ids) - g if g and ids[-g:] == generation_prompt else len(ids)
    return ids[:at] + user_turn + erratum + close + ids[at:], at


def prefill_edited(adapter, store, plan, change: FieldChange, old_block_keys: list[str], seam: int, k: int,
                   layer: int, rotate: bool, defer: bool = False):
    """in_place (k = 0) or selective@k: the old prompt's KV before the change, the changed tokens
    recomputed, the old KV after the change reused (re-rotated by the length difference) with the
    k tokens whose KV at `layer` moved most recomputed, then the rest of the prompt prefilled (at
    least its last token, so the logits come from the model). The old KV is written into the
    prompt-length slots and every computed token (changed, chosen, rest) runs in one forward,
    causal by prompt index; with `defer` that forward is left pending, as `prefill_spliced`
    documents. None when the old prompt's KV is no longer cached far enough (the caller recomputes)."""
    blocks = stored_blocks(store, old_block_keys)
    covered = len(blocks) * (blocks[0].positions.shape[1] if blocks else 0)
    ids, pos = plan.input_ids, plan.positions
    a, x, y = change.start, change.new_len, change.old_len
    # old tokens after the change whose KV we hold, leaving the prompt's last token to compute
    stale = min(covered, len(change.prompt.prefilled)) - a - y
    stale = min(stale, ids.numel() - 1 - a - x)
    if a == 0 or covered < a or stale <= 0:
        return None
    cache = adapter.new_cache()
    layers = preallocate(adapter, cache, 0, ids.numel())
    dst_keys, dst_values = [lyr.keys for lyr in layers], [lyr.values for lyr in layers]
    write_blocks(blocks, 0, a, dst_keys, dst_values, 0)
    s_keys, s_values, s_pos = read_blocks(blocks, a + y, a + y + stale)
    new_pos = pos[:, a + x:a + x + stale] if rotate else s_pos
    shift = constant_delta(s_pos, new_pos)
    if shift is None:  # positions that do not move together (a length change moves all three axes alike)
        for lyr, kk, vv in zip(layers, s_keys, s_values):
            moved = reposition_keys(kk.to(adapter.device), s_pos, new_pos, adapter.rope)
            lyr.keys[0, :, a + x:a + x + stale].copy_(moved)
            lyr.values[0, :, a + x:a + x + stale].copy_(vv)
    else:
        place_rows(dst_keys, dst_values, a + x, s_keys, s_values, 0, stale,
                   rotation(shift, adapter.rope) if any(shift) else None)
    chosen = _most_changed(adapter, layers, plan, a, x, stale, k, layer) if k else []
    return prefill_spliced(adapter, ids, pos, plan.placements, seam, rotate=rotate, cache=cache, start=a + x + stale,
                           defer=defer, recompute=list(range(a, a + x)) + [a + x + j for j in chosen], prefix_tokens=a)


def _most_changed(adapter, layers, plan, a, x, stale, k, layer) -> list[int]:
    """Indices (into the stale span) of the k tokens whose layer-`layer` KV differs most between
    the stale KV placed in the slot `layers` and a recompute of layers 0..layer over the changed
    and stale tokens."""
    probe = adapter.new_cache()
    for i, lyr in enumerate(layers[: layer + 1]):
        probe.update(lyr.keys[:, :, :a].clone(), lyr.values[:, :, :a].clone(), i)
    lo, hi = a, a + x + stale
    adapter.forward_layers(plan.input_ids[lo:hi], plan.positions[:, lo:hi], probe, layer + 1,
                           image_features(plan.placements, [(lo, hi)]))
    span = slice(a + x, a + x + stale)
    true_k, true_v = probe.layers[layer].keys[0, :, span], probe.layers[layer].values[0, :, span]
    stale_k = layers[layer].keys[0, :, span].to(true_k.device)  # where the model is
    stale_v = layers[layer].values[0, :, span].to(true_v.device)
    delta = (true_k - stale_k).float().pow(2).sum(dim=(0, 2)) + (true_v - stale_v).float().pow(2).sum(dim=(0, 2))
    return sorted(torch.topk(delta, min(k, stale)).indices.tolist())
