"""`DecodeBatch`: the running requests' KV side by side, one batched decode step at a time.

Per layer the batch keeps key and value buffers [row capacity, kv_heads, slot capacity, head_dim];
the live rows are the first `len(batch)` rows and the live slots one window [start, end) that every
row shares, row b left-padded by `pad[b]` slots that its mask hides. A decode step writes each row's
new key and value into slot `end` in place (the attention reads views of the window), so a step
copies no cache; a join writes the new row into a spare row, a leave moves the last row into the
hole, and the padding every remaining row shares is dropped by moving `start`: none of them copies
the other rows. Only growth copies the live window, geometrically, so its cost per token stays
constant.

Memory: the live window, plus `spare_slots(length)` slots each side (at least `MIN_SPARE_SLOTS`,
1/16 of the length above that) and spare rows up to the next power of two (at most `max_rows`);
the rows shrink by half while three quarters of them are idle, the slots to fit when more than
half of them are idle (after the longest row left), and the buffers are freed when the last row
leaves: at most 4x the live rows and twice their window with its spare slots. Spare slots hold
zeros or an earlier row's finite KV, always masked: a masked slot contributes exactly nothing, so
each row's logits are those of its own tokens alone.

Shared prefix: the leading slots every row holds bit-identical (eight requests that loaded one
policy from the prefix cache) are kept once, `prefix` [1, kv_heads, P, head_dim] per layer, and
the window holds only each row's own slots; a step attends to both by cascade attention
(mmkv.kv.cascade), reading the prefix once for all rows. A joining row that shares less gives the
rows back the slots they no longer share; a lone row gives its leading slots to the prefix when
the next row holds them too (mmkv.request.shared_kv, docs/structure.md).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from mmkv.request.shared_kv import common_prefix_length

MIN_SPARE_SLOTS = 32
MIN_SHARED_SLOTS = 64  # a shorter common prefix (a chat template's header) is not worth the cascade step


def spare_slots(length: int) -> int:
    """Room kept beyond a window of `length` slots, on each side."""
    return max(MIN_SPARE_SLOTS, length // 16)


class _WindowLayer(DynamicLayer):
    """One layer of the batch for the model's forward: `update` writes the new slots in place at
    the window's end and returns views of the rows' window plus those slots."""

    def __init__(self, batch: DecodeBatch, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.batch, self.key_buffer, self.value_buffer = batch, keys, values
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.refresh()

    def refresh(self) -> None:
        """Point `keys` / `values` at the live rows' window (what `get_seq_length` reads)."""
        b = self.batch
        self.keys = self.key_buffer[: len(b), :, b.start:b.end]
        self.values = self.value_buffer[: len(b), :, b.start:b.end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        b, n = self.batch, key_states.shape[-2]
        if b.end + n > self.key_buffer.shape[2] or key_states.shape[0] != len(b):
            raise RuntimeError("decode batch step outside the batch's buffers")  # DecodeBatch.step grows first
        self.key_buffer[: len(b), :, b.end:b.end + n] = key_states
        self.value_buffer[: len(b), :, b.end:b.end + n] = value_states
        return (self.key_buffer[: len(b), :, b.start:b.end + n], self.value_buffer[: len(b), :, b.start:b.end + n])


class DecodeBatch:
    """The running requests' KV in one cache (module docstring). `add` a prefilled request's cache
    as the last row, `step` every row one token, `remove` finished rows (it returns the rows' new
    order). Every change is all or nothing: new buffers are built before any is swapped in, so a
    failure (out of memory on a GPU) leaves the batch as it was."""

    def __init__(self, adapter, max_rows: int | None = None, share: bool = True):
        self.adapter, self.max_rows, self.share = adapter, max_rows, share
        self.prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer [1, kv_heads, P, head_dim]
        self.layers: list[_WindowLayer] = []
        self.cache: Cache | None = None
        self.pad: list[int] = []
        self.start = self.end = 0

    def __len__(self) -> int:
        return len(self.pad)

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def row_capacity(self) -> int:
        return self.layers[0].key_buffer.shape[0] if self.layers else 0

    @property
    def slot_capacity(self) -> int:
        return self.layers[0].key_buffer.shape[2] if self.layers else 0

    @property
    def prefix_length(self) -> int:
        """Leading slots every row holds bit-identical, kept once in `prefix`."""
        return 0 if self.prefix is None else self.prefix[0][0].shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes the buffers (live and spare) and the shared prefix hold."""
        held = sum(t.nbytes for layer in self.layers for t in (layer.key_buffer, layer.value_buffer))
        return held + sum(k.nbytes + v.nbytes for k, v in self.prefix or ())

    def add(self, cache) -> None:
        """Append a request's prefilled cache (batch 1, its own length n) as the last row: into a
        spare row, right-aligned at the window's end, its padding zeroed. A longer row widens the
        window to the left (the other rows' new slots zeroed and masked)."""
        rows = [(layer.keys, layer.values) for layer in cache.layers[: self.adapter.num_layers]]
        if self.layers and self.share:
            shared = self._reshare(rows)
            rows = [(keys[:, :, shared:], values[:, :, shared:]) for keys, values in rows]
        n = rows[0][0].shape[-2]
        if not self.layers:
            self._reallocate(1, n, rows[0][0])
        elif len(self) == self.row_capacity or n > self.end:
            self._reallocate(self._grown_rows(len(self) + 1), max(n, self.length), rows[0][0])
        widen = max(0, n - self.length)
        b, lo = len(self), self.end - n
        for layer, (keys, values) in zip(self.layers, rows):
            for buffer, new in ((layer.key_buffer, keys), (layer.value_buffer, values)):
                buffer[:b, :, self.start - widen:self.start] = 0
                buffer[b, :, self.start - widen:lo] = 0
                buffer[b, :, lo:self.end] = new[0]
        self.start -= widen
        self.pad = [p + widen for p in self.pad] + [lo - self.start]
        self._refresh()

    def remove(self, rows: set[int]) -> list[int]:
        """Drop `rows`: the last live rows move into their places (or, when three quarters of the
        row capacity would be idle, the kept rows go into buffers half as large), then the padding
        every remaining row shares goes. Returns the old index of each row in its new order."""
        size = len(self) - len(rows)
        if size == 0:
            self.layers, self.cache, self.pad, self.start, self.end, self.prefix = [], None, [], 0, 0, None
            return []
        holes = sorted(i for i in rows if i < size)
        movers = [i for i in range(size, len(self)) if i not in rows]
        order = list(range(len(self)))
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        order = order[:size]
        pad = [self.pad[i] for i in order]
        trim = min(pad)
        capacity = self.row_capacity
        while size <= capacity // 4:
            capacity //= 2
        narrow = self.slot_capacity > 2 * self._slots_for(self.length - trim)
        if capacity < self.row_capacity or narrow:
            self._reallocate(capacity, self.length - trim, self.layers[0].key_buffer, order, trim)
        else:
            for hole, mover in zip(holes, movers):
                for layer in self.layers:
                    for buffer in (layer.key_buffer, layer.value_buffer):
                        buffer[hole, :, self.start:self.end] = buffer[mover, :, self.start:self.end]
            self.start += trim
        self.pad = [p - trim for p in pad]
        self._refresh()
        return order

    def step(self, tokens: list[int], positions: list[int], riders: list | None = None) -> torch.Tensor:
        """Run token b at position b for every row; logits [B, V]. Each row's new key and value go
        into slot `end` in place; the window grows (a copy, geometrically) only when the buffers
        have no slot left. With `riders` (mmkv.request.splice.RidePiece) prefilling requests' text
        pieces run in the same forward (mmkv.kv.packed); then (logits [B, V], each piece's
        last-token logits [1, V])."""
        if self.end == self.slot_capacity:
            self._reallocate(self.row_capacity, self.length + 1, self.layers[0].key_buffer)
        slots = torch.arange(self.length + 1)
        visible = slots[None, :] >= torch.tensor(self.pad)[:, None]
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[:, None, None, :]
        if not riders:
            logits = self.adapter.forward_decode(torch.tensor(tokens), torch.tensor(positions), self.cache, mask,
                                                 shared_prefix=self.prefix)
        else:
            logits = self.adapter.forward_packed(torch.tensor(tokens), torch.tensor(positions), self.layers, mask,
                                                 riders, shared_prefix=self.prefix)
        self.end += 1
        self._refresh()
        return logits

    # ---- the shared prefix --------------------------------------------------------------------
    def _reshare(self, row: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Set the prefix to what every row, the joining one included, holds bit-identical (at
        least `MIN_SHARED_SLOTS`, else nothing); returns its length. The rows' KV is unchanged:
        slots leave a lone row for the prefix, or come back from it to every row."""
        shared = self._shareable(row)
        shared = shared if shared >= MIN_SHARED_SLOTS else 0
        if shared > self.prefix_length:
            self._grow_prefix(shared - self.prefix_length)
        elif shared < self.prefix_length:
            self._shrink_prefix(shared)
        return shared

    def _shareable(self, row: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """How many leading slots the joining row holds bit-identical to the first row (the
        prefix, then that row's own slots); never more than every row already shares."""
        p = self.prefix_length
        if p == 0 and len(self) > 1:
            return 0  # the rows already share nothing
        if p:
            same = common_prefix_length(self.prefix, row)
            if same < p or len(self) > 1:
                return min(same, p)
        first = self.start + self.pad[0]
        own = [(layer.key_buffer[:1, :, first:self.end], layer.value_buffer[:1, :, first:self.end])
               for layer in self.layers]
        return p + common_prefix_length(own, [(keys[:, :, p:], values[:, :, p:]) for keys, values in row])

    def _grow_prefix(self, take: int) -> None:
        """A lone row's first `take` own slots join the prefix; the window drops them."""
        first = self.start + self.pad[0]
        grown = []
        for i, layer in enumerate(self.layers):
            more = [buffer[:1, :, first:first + take].clone() for buffer in (layer.key_buffer, layer.value_buffer)]
            grown.append(tuple(more) if self.prefix is None else
                         tuple(torch.cat((old, new), dim=-2) for old, new in zip(self.prefix[i], more)))
        trim = self.pad[0] + take
        self._reallocate(self.row_capacity, self.length - trim, self.layers[0].key_buffer, None, trim)
        self.prefix, self.pad = grown, [0]
        self._refresh()

    def _shrink_prefix(self, shared: int) -> None:
        """The prefix keeps its first `shared` slots; the rest go back to every row, between its
        padding and its own slots (the window widens by as many slots to the left)."""
        n = self.prefix_length - shared
        if self.start < n:
            self._reallocate(self.row_capacity, self.length + n, self.layers[0].key_buffer)
        for layer, (keys, values) in zip(self.layers, self.prefix):
            for buffer, part in ((layer.key_buffer, keys), (layer.value_buffer, values)):
                for b, pad in enumerate(self.pad):
                    buffer[b, :, self.start - n + pad:self.start + pad] = part[0, :, shared:]
        self.start -= n
        self.prefix = [(k[:, :, :shared], v[:, :, :shared]) for k, v in self.prefix] if shared else None
        self._refresh()

    def _grown_rows(self, need: int) -> int:
        cap = 1 << (need - 1).bit_length()
        return min(cap, self.max_rows) if self.max_rows is not None else cap

    @staticmethod
    def _slots_for(length: int) -> int:
        return spare_slots(length) + length + spare_slots(length)

    def _reallocate(self, row_capacity: int, length: int, like: torch.Tensor, rows: list[int] | None = None,
                    trim: int = 0) -> None:
        """New zeroed buffers of `row_capacity` rows with room for a window of `length` slots and
        `spare_slots(length)` each side. The live window of `rows` (old indices in their new order;
        default all) less its first `trim` slots is copied to the right end of the new window (a
        window wider than the copied one leaves room in front for a longer row)."""
        spare, kept = spare_slots(length), self.length - trim
        _, heads, _, dim = like.shape
        shape = (row_capacity, heads, self._slots_for(length), dim)
        end = spare + length
        fresh = []
        for layer in self.layers or [None] * self.adapter.num_layers:
            keys, values = (torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(2))
            if layer is not None:
                pick = slice(0, len(self)) if rows is None else torch.tensor(rows, device=like.device)
                count = len(self) if rows is None else len(rows)
                keys[:count, :, end - kept:end] = layer.key_buffer[pick, :, self.start + trim:self.end]
                values[:count, :, end - kept:end] = layer.value_buffer[pick, :, self.start + trim:self.end]
            fresh.append((keys, values))
        self.start, self.end = end - kept, end
        self.layers = [_WindowLayer(self, keys, values) for keys, values in fresh]
        self.cache = Cache(layers=self.layers)

    def _refresh(self) -> None:
        for layer in self.layers:
            layer.refresh()
