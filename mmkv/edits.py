"""Automatic field-change detection and the edit policies that keep a cache hot.

When a request's prompt equals a recent prompt except for a short in-place substitution (a
changed field value), the engine can answer it four ways (MECHANISM.md section 1):
- recompute: ordinary prefix reuse up to the change, prefill the rest (exact, the default);
- erratum: keep the old prompt, fully cached, and append the paper's erratum line for the new
  value before the final turn, so the cache hit covers everything;
- in_place: recompute only the changed tokens and reuse the stale KV after them (fast; the
  paper finds the model then ignores the edit unless it reasons before answering);
- selective@K: in_place plus the K later tokens whose KV changes most at one layer
  (the CacheBlend-style baseline the paper compares).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmkv.adapters import ImageFeatures
from mmkv.errors import InvalidRequestError
from mmkv.rerotate import reposition_keys
from mmkv.splice import pad_features, prefill_spliced

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
        if k.isdigit():
            return EditPolicy("selective", int(k))
    elif value in POLICY_NAMES[:3]:
        return EditPolicy(value)
    raise InvalidRequestError("edit_policy must be recompute, erratum, in_place or selective@K (K an integer)",
                              param="edit_policy")


@dataclass
class RecentPrompt:
    """A prompt the engine prefilled, kept to detect in-place edits of it. `client_*` is what
    the request rendered to; the rest is what was prefilled (they differ once the erratum policy
    rewrote it, and later turns keep extending the rewritten prompt)."""

    client_ids: list[int]
    client_keys: list[str | None]
    token_ids: list[int]
    chunk_keys: list[str | None]
    block_keys: list[str]
    spans: list  # (start, CachedChunk) of its chunks, in token_ids

    def __post_init__(self):
        self.client_pairs = list(zip(self.client_ids, self.client_keys))  # what edit detection compares

    @property
    def rewritten(self) -> bool:
        return self.client_ids != self.token_ids


@dataclass(frozen=True)
class FieldChange:
    """N = C[:start] + N[start:start+new_len] + C[start+old_len:] + tail."""

    prompt: RecentPrompt  # C
    start: int
    old_len: int
    new_len: int

    @property
    def rest(self) -> int:
        """Tokens of C after the change (they reappear in N shifted by new_len - old_len)."""
        return len(self.prompt.client_ids) - self.start - self.old_len


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def extended_prompt(ids: list[int], keys: list[str | None], recent: list[RecentPrompt]) -> RecentPrompt | None:
    """The most recent rewritten prompt whose client tokens `ids` repeat and extend."""
    pairs = list(zip(ids, keys))
    for prompt in reversed(recent):
        n = len(prompt.client_ids)
        if prompt.rewritten and n <= len(ids) and pairs[:n] == prompt.client_pairs:
            return prompt
    return None


def find_change(ids: list[int], keys: list[str | None], recent: list[RecentPrompt],
                max_tokens: int) -> FieldChange | None:
    """The smallest in-place substitution (at most `max_tokens` old and new tokens) that turns a
    recent prompt into a prefix of `ids`; None if there is none, or if `ids` simply continues a
    recent prompt (a later turn of a conversation whose change was already handled)."""
    pairs = list(zip(ids, keys))
    if any(pairs[:len(p.client_pairs)] == p.client_pairs for p in recent):
        return None
    for prompt in reversed(recent):
        old = prompt.client_pairs
        start = _common_prefix(pairs, old)
        if start >= len(old):
            continue  # a plain extension: the prefix cache covers it
        best = None
        for y in range(max_tokens + 1):
            rest = len(old) - start - y
            if rest <= 0:
                break
            for x in range(max_tokens + 1):
                end = start + x + rest
                if not (x or y) or end > len(pairs) or pairs[start + x] != old[start + y] or pairs[end - 1] != old[-1]:
                    continue  # cheap checks first: this runs on every request
                if pairs[start + x:end] == old[start + y:]:
                    if any(k for _, k in pairs[start:start + x]) or any(k for _, k in old[start:start + y]):
                        continue  # a changed chunk (image, skill) is not a field edit
                    if best is None or x + y < best[0] + best[1]:
                        best = (x, y)
                    break
        if best is not None:
            return FieldChange(prompt, start, old_len=best[1], new_len=best[0])
    return None


def _is_word(c: str) -> bool:
    return c.isalnum() or c in "_-."


def describe_change(tokenizer, ids: list[int], change: FieldChange) -> tuple[str, str, str]:
    """(field, old value, new value) as text, widened to whole words. The field is the label on
    the changed line before the value ('order_status: pending' -> 'order_status')."""
    line = tokenizer.decode(ids[:change.start]).rsplit("\n", 1)[-1]
    cut = len(line)
    while cut and _is_word(line[cut - 1]):
        cut -= 1
    label, stem = line[:cut], line[cut:]
    after = tokenizer.decode(ids[change.start + change.new_len:change.start + change.new_len + 8])
    tail = after[: next((i for i, c in enumerate(after) if not _is_word(c)), len(after))]
    old_ids = change.prompt.client_ids[change.start:change.start + change.old_len]
    new = stem + tokenizer.decode(ids[change.start:change.start + change.new_len]) + tail
    old = stem + tokenizer.decode(old_ids) + tail
    return label.strip().rstrip(":=").strip() or "the field", old.strip(), new.strip()


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


def _gather(blocks, start: int, stop: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Per-layer K and V [kv_heads, n, head_dim] and positions [3, n] of tokens [start, stop)
    from consecutive prefix blocks."""
    size = blocks[0].positions.shape[1]
    first, last = start // size, (stop - 1) // size
    chosen = blocks[first:last + 1]
    lo, hi = start - first * size, stop - first * size
    keys = [torch.cat([b.keys[i] for b in chosen], dim=-2)[:, lo:hi] for i in range(len(chosen[0].keys))]
    values = [torch.cat([b.values[i] for b in chosen], dim=-2)[:, lo:hi] for i in range(len(chosen[0].values))]
    return keys, values, torch.cat([b.positions for b in chosen], dim=1)[:, lo:hi]


def _features_in(plan, start: int, stop: int):
    """Visual features of the image pads among prompt tokens [start, stop)."""
    parts = []
    for p in plan.placements:
        a, b = max(start, p.start), min(stop, p.end)
        if a < b and p.entry.features is not None:
            parts.append(pad_features(p.entry, a - p.start, b - p.start))
    return ImageFeatures.concat([f for f in parts if f is not None])


def prefill_edited(adapter, store, plan, change: FieldChange, seam: int, k: int, layer: int, rotate: bool):
    """in_place (k = 0) or selective@k: the old prompt's KV before the change, the changed tokens
    recomputed, the old KV after the change reused (re-rotated by the length difference) with the
    k tokens whose KV at `layer` moved most recomputed, then the rest of the prompt prefilled.
    None when the old prompt's KV is no longer cached far enough (the caller recomputes)."""
    old = change.prompt
    if old.rewritten:
        return None
    blocks = []
    for key in old.block_keys:
        blk = store.get(key, "prefix")
        if blk is None:
            break
        blocks.append(blk)
    covered = len(blocks) * (blocks[0].positions.shape[1] if blocks else 0)
    a, x, y = change.start, change.new_len, change.old_len
    stale = min(covered, len(old.token_ids)) - a - y  # old tokens after the change whose KV we hold
    if a == 0 or stale <= 0:
        return None
    ids, pos = plan.input_ids, plan.positions
    cache = adapter.new_cache()
    keys, values, _ = _gather(blocks, 0, a)
    for i, (kk, vv) in enumerate(zip(keys, values)):
        cache.update(kk[None].to(adapter.device), vv[None].to(adapter.device), i)
    if x:
        adapter.forward(ids[a:a + x], pos[:, a:a + x], cache, _features_in(plan, a, a + x))
    s_keys, s_values, s_pos = _gather(blocks, a + y, a + y + stale)
    new_pos = pos[:, a + x:a + x + stale]
    s_keys = [reposition_keys(kk, s_pos, new_pos if rotate else s_pos, adapter.rope) for kk in s_keys]
    chosen = _most_changed(adapter, cache, plan, a, x, stale, s_keys, s_values, k, layer) if k else []
    keep = sorted(set(range(stale)) - set(chosen))
    for i, (kk, vv) in enumerate(zip(s_keys, s_values)):
        cache.update(kk[None, :, keep].to(adapter.device), vv[None, :, keep].to(adapter.device), i)
    if chosen:
        _recompute_scattered(adapter, cache, plan, a + x, keep, chosen)
    start = a + x + stale
    result = prefill_spliced(adapter, ids, pos, plan.placements, seam, rotate=rotate, cache=cache, start=start)
    result.computed_tokens += x + len(chosen)
    result.reused_tokens = a + len(keep) + sum(e - b for b, e in result.reused_ranges[1:])
    result.reused_ranges = [(0, a)] + [(a + x + j, a + x + j + 1) for j in keep] + result.reused_ranges[1:]
    result.prefix_tokens = a
    return result


def _most_changed(adapter, cache, plan, a, x, stale, s_keys, s_values, k, layer) -> list[int]:
    """Indices (into the stale span) of the k tokens whose layer-`layer` KV differs most between
    the stale cache and a recompute of layers 0..layer over the changed and stale tokens."""
    probe = adapter.new_cache()
    for i, lyr in enumerate(cache.layers[: layer + 1]):
        probe.update(lyr.keys[:, :, :a].clone(), lyr.values[:, :, :a].clone(), i)
    lo, hi = a, a + x + stale
    adapter.forward_layers(plan.input_ids[lo:hi], plan.positions[:, lo:hi], probe, layer + 1,
                           _features_in(plan, lo, hi))
    true_k = probe.layers[layer].keys[0, :, a + x:a + x + stale].cpu()
    true_v = probe.layers[layer].values[0, :, a + x:a + x + stale].cpu()
    delta = (true_k - s_keys[layer]).float().pow(2).sum(dim=(0, 2)) + \
        (true_v - s_values[layer]).float().pow(2).sum(dim=(0, 2))
    return sorted(torch.topk(delta, min(k, stale)).indices.tolist())


def _recompute_scattered(adapter, cache, plan, base: int, keep: list[int], chosen: list[int]) -> None:
    """Recompute the chosen stale tokens at every layer, each seeing everything before it: the
    cache holds tokens [0, base) then the kept stale tokens; a 4D mask restores causality."""
    past = cache.get_seq_length()
    order = torch.tensor(list(range(base)) + [base + j for j in keep])  # original index per cache slot
    q_index = torch.tensor([base + j for j in chosen])
    mask = torch.full((len(chosen), past + len(chosen)), float("-inf"))
    mask[:, :past] = torch.where(order[None, :] < q_index[:, None], 0.0, float("-inf"))
    mask[:, past:] = torch.where(q_index[None, :] <= q_index[:, None], 0.0, float("-inf"))
    ids = plan.input_ids[q_index]
    pos = plan.positions[:, q_index]
    feats = ImageFeatures.concat([f for f in (_features_in(plan, int(i), int(i) + 1) for i in q_index)
                                  if f is not None])
    adapter.forward(ids, pos, cache, feats, attention_mask=mask[None, None].to(adapter.dtype))
