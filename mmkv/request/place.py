"""Place cached KV: the stage between the plan and the forward. Edit detection against recent
prompts, then the edit policy (mmkv.request.edits), then the exact reuse path: the longest cached prompt
prefix and the splice of every cached chunk (mmkv.request.splice). Its prefix blocks are stored
once the request's first token is out: `prefill` hands the insert back to its caller (the
request's Run runs it), never through shared state, so a request that fails before its first
token stores nothing. The turn's final forward is left pending in the result
(`PrefillResult.advance`): the scheduler runs it, whole or a chunk at a time between decode steps
(chunked prefill).

Not thread-safe: the engine's lock covers every call.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mmkv.request.edits import (
    EditPolicy,
    EditRules,
    FieldChange,
    RecentPrompt,
    RecentPrompts,
    TemplateTokens,
    TokenView,
    detect_field_change,
    extended_prompt,
    insert_before_final_turn,
    prefill_edited,
)
from mmkv.request.compose import Composer, HistoryReport
from mmkv.request.messages import erratum_line
from mmkv.store.kv_store import PurgeWatch
from mmkv.store.prefix_cache import ChunkSpan, block_keys
from mmkv.kv.rerotate import constant_delta
from mmkv.request.blend import Blend, BlendChooser, BlendReport
from mmkv.request.splice import (PrefillResult, SlotLayer, hold_for_next_turn, prefill_spliced, prefix_slots,
                                 ranges_less, splice_layout)

if TYPE_CHECKING:
    from mmkv.request.plan import Planner, SplicePlan

Insert = Callable[[], object]  # a prefix-cache insert, run once the request's first token is out

log = logging.getLogger("mmkv.engine")
RECENT_PROMPTS = 16  # per tenant and settings, for edit detection
RECENT_KEYS = 256  # (tenant, settings) pairs whose recent prompts are kept
RECENT_BYTES = 64 << 20  # all recent prompts together (4 bytes a token, no tensors)


@dataclass
class EditReport:
    """What an edit policy did with a detected field change."""

    policy: str  # asked for
    detected: bool
    applied: str = "recompute"  # what ran: the policy, or recompute when it had nothing to act on
    field: str = ""
    old_value: str = ""
    new_value: str = ""
    changed_tokens: int = 0  # new value's tokens
    recomputed_tokens: int = 0  # LM tokens computed for the prompt
    reused_tokens: int = 0  # prompt tokens whose KV came from a cache
    erratum: str = ""  # the erratum line appended (erratum policy)
    reason: str = ""  # why the policy asked for did not apply (then `applied` is recompute)
    continued: bool = False  # in_place / selective@K, no change: the prompt continues this policy's earlier
    #                          turn and reuses its (approximate) KV


@dataclass(frozen=True)
class Placed:
    """What `KVPlacer.prefill` hands back: the prefill (its final forward pending), the plan it
    prefills (an erratum rewrites the prompt), the edit report, and the prefix-cache insert that the
    request runs once its first token is out (None: nothing to store). The insert is returned, never
    kept by the placer: a request that fails before its first token drops it and stores nothing."""

    prefill: PrefillResult
    plan: SplicePlan
    report: EditReport | None
    insert: Insert | None
    history: HistoryReport | None = None  # history_policy "compose": what it composed
    blend: BlendReport | None = None  # what the fidelity dial recomputed (None: the dial is off)


#: An added token that is markup (`<|im_start|>`, `<tool_call>`, `<think>`), special or not.
_MARKUP = re.compile(r"<[^<>\s]+>")


def template_tokens_of(tokenizer) -> TemplateTokens:
    """What edit detection needs to know of the chat template: turn markers and the ids that
    only the template or the processor places: every special token and every added token that is
    markup. Added tokens that are plain words (a fine-tune's vocabulary, field values) are text: a
    value spelled by one is a field like any other."""
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special or _MARKUP.fullmatch(t.content)}
    return TemplateTokens(
        turn_start=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        generation_prompt=tuple(tokenizer("<|im_start|>assistant\n")["input_ids"]),
        special=frozenset(special),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )


def approx_salt(salt: str, edit: EditPolicy) -> str:
    """The prefix-cache salt of the approximate KV an in_place / selective@K turn leaves."""
    return f"{salt}|edit={edit}"


class KVPlacer:
    """Owns the recent prompts and the edit rules; `prefill` places a request's cached KV and
    runs its one forward (module docstring)."""

    def __init__(self, adapter, store, prefix, settings, planner: Planner, max_context: int):
        self.adapter, self.store, self.prefix, self.settings = adapter, store, prefix, settings
        self.planner = planner  # plans a rewritten prompt; tokenizes an erratum line as client text
        self.max_context = max_context
        self.recent = RecentPrompts(RECENT_PROMPTS, RECENT_KEYS, RECENT_BYTES)
        self.template_tokens = template_tokens_of(adapter.tokenizer)
        self.edit_rules = EditRules(max_tokens=settings.edit_max_tokens)
        self.composer = Composer(store, prefix, adapter.tokenizer.convert_tokens_to_ids("<|im_start|>"),
                                 adapter.num_layers)

    def prefill(self, plan: SplicePlan, tenant: str, salt: str, seam: int, policy: str, edit: EditPolicy,
                max_new_tokens: int, history: str = "exact", blend: Blend | None = None) -> Placed:
        """Edit detection, then the edit policy, then prefix cache + splice. Returns the prefill
        (its final forward pending), the plan actually prefilled (the erratum policy rewrites the
        prompt), the edit report and what to store once the first token is out (`Placed.insert`: the
        prefix blocks and the recent prompt). `blend` (active) recomputes a share of each spliced
        chunk in context on the splice path (mmkv.request.blend); an edit policy's own placement
        does not blend, and the blend report says so. A policy that cannot apply, or fails before that
        forward, falls back to the exact path (recompute) and the report says why: a policy never
        turns an answerable request into an error."""
        watch = self.store.watch()  # a delete before the first token is out cancels what this request stores
        recent = self.recent.of((tenant, salt))
        approximate = edit.name in ("in_place", "selective")
        if approximate:  # and this policy's own earlier turns, oldest first
            recent = sorted(recent + self.recent.of((tenant, approx_salt(salt, edit))), key=lambda p: p.seq)
        client = TokenView.of(plan.input_ids, plan.placements)
        change = detect_field_change(client, recent, self.template_tokens, self.edit_rules)
        report = None
        if change is not None:
            report = EditReport(str(edit), True, field=change.field, old_value=change.old_value,
                                new_value=change.new_value, changed_tokens=change.new_len)
        elif edit.name != "recompute":
            report = EditReport(str(edit), False)
        result = insert = remember = composed = None
        chooser = self._chooser(plan, blend)
        chain = self._continued_chain(client, recent) if change is None and approximate else None
        if chain is not None:  # a later turn of a conversation this policy edited: stay on its KV
            result, insert = self._prefill_prefix(plan, chain.salt, seam, policy, chooser)
            if self.settings.prefix_cache:
                remember = ((tenant, chain.salt), RecentPrompt(client, client, salt=chain.salt))
            report.applied, report.continued = str(edit), True
        elif edit.name != "recompute":
            try:
                result, plan, insert, remember = self._apply_edit_policy(
                    edit, plan, client, change, report, recent, tenant, salt, seam, policy, max_new_tokens)
            except Exception as exc:  # noqa: BLE001 - the exact path below answers instead
                log.warning("edit policy %s failed, recomputing: %r", edit, exc)
                result = None  # `plan` is still the client's: the exception came before any rewrite
                report.applied, report.reason = "recompute", f"{edit} failed ({type(exc).__name__}); recomputed"
        if result is None and history == "compose":  # the spec refuses it beside an edit policy
            result, plan, insert, composed, chooser = self._prefill_composed(plan, salt, seam, policy, blend)
        elif result is None:
            chooser = self._chooser(plan, blend)  # an erratum rewrote the plan
            result, insert = self._prefill_prefix(plan, salt, seam, policy, chooser)
            if self.settings.prefix_cache:  # the edit policies build on the prefix cache
                rewritten = report is not None and report.applied == "erratum"
                prefilled = TokenView.of(plan.input_ids, plan.placements) if rewritten else client
                remember = ((tenant, salt), RecentPrompt(client, prefilled))
        elif chooser is not None and chain is None:
            chooser.report.applied, chooser.report.reason = False, f"the {report.applied} policy placed the prompt"
        if report is not None:
            report.recomputed_tokens, report.reused_tokens = result.computed_tokens, result.reused_tokens
        return Placed(result, plan, report, self._commit(insert, remember, watch, plan),
                      history=composed, blend=chooser.report if chooser is not None else None)

    def replay(self, plan: SplicePlan, seam: int, policy: str, blend: Blend) -> PrefillResult:
        """`plan` spliced again under `blend` for the fidelity monitor (mmkv.request.shadow): the
        splice path's own placement and dial, from a cold cache (no prefix block read) and nothing
        stored; its forward pending."""
        result, _ = self._prefill_blocks(plan, [], [], 0, seam, policy, self._chooser(plan, blend))
        return result

    def _chooser(self, plan: SplicePlan, blend: Blend | None) -> BlendChooser | None:
        if blend is None or not blend.active:
            return None
        return BlendChooser(self.adapter, plan.input_ids, plan.positions, plan.placements, blend,
                            self.settings.blend_layer)

    def _commit(self, insert: Insert | None, remember: tuple | None, watch: PurgeWatch,
                plan: SplicePlan) -> Insert | None:
        """What the request leaves for later ones once its first token is out: its prefix blocks
        and its place among the recent prompts (edit detection). Nothing before: a request that
        fails earlier leaves no block and no recent prompt whose KV was never stored. Nothing at
        all when a chunk it placed was purged (deleted) in between: its KV must not come back."""
        if insert is None and remember is None:
            return None
        sources = {key for key in plan.chunk_keys if key is not None}
        sources.update(s for p in plan.placements for s in p.entry.sources)  # what composed turns saw

        def commit() -> None:
            if watch.touches(sources):
                return
            if remember is not None:
                self.recent.add(*remember)
            if insert is not None:
                insert()
        return commit

    @staticmethod
    def _continued_chain(client: TokenView, recent: list[RecentPrompt]) -> RecentPrompt | None:
        """The most recent prompt `client` continues (`recent` oldest first), when it is an
        in_place / selective@K turn's (its KV approximate, under that policy's salt); else None."""
        continued = [p for p in recent if client.starts_with(p.client)]
        return continued[-1] if continued and continued[-1].salt else None

    def _apply_edit_policy(self, edit: EditPolicy, plan: SplicePlan, client: TokenView, change: FieldChange | None,
                           report: EditReport, recent: list[RecentPrompt], tenant: str, salt: str, seam: int,
                           policy: str, max_new_tokens: int) -> tuple[PrefillResult | None, SplicePlan, Insert | None,
                                                                      tuple | None]:
        """Run `edit`: the erratum policy returns the rewritten plan (prefilled by the caller);
        in_place / selective@K return their prefill, edited from the most recent prompt that
        matches, exact or an earlier turn of the same policy. Their KV is approximate, so its
        blocks go under the policy's own salt (`approx_salt`: no exact request ever reads them)
        and the prompt joins the policy's recent prompts: a loop that edits every turn edits the
        previous turn, not the last exact one. Sets report.applied and, when the policy cannot
        apply, report.reason (the caller then recomputes `plan`)."""
        if edit.name == "erratum":
            rewritten = self._erratum_plan(plan, client, change, recent, policy)
            if rewritten is None:
                report.reason = "no field change" if change is None else "a chunk of the earlier prompt was evicted"
                return None, plan, None, None
            new_plan, line = rewritten
            if new_plan.input_ids.numel() + max_new_tokens > self.max_context:
                report.reason = "the prompt with its erratum would exceed the context"
                return None, plan, None, None
            report.applied, report.erratum = "erratum", line
            return None, new_plan, None, None
        if change is None:
            report.reason = "no field change"
            return None, plan, None, None
        if change.prompt.rewritten:
            report.reason = "the earlier prompt was rewritten by an erratum"
            return None, plan, None, None
        old = change.prompt.prefilled
        old_keys = block_keys(torch.from_numpy(old.ids).long(), old.chunk_keys(), change.prompt.salt or salt)
        result = prefill_edited(self.adapter, self.store, plan, change, old_keys, seam, edit.k,
                                self.settings.selective_layer, rotate=policy != "none", defer=True)
        if result is None:
            report.reason = "the earlier prompt's KV is no longer cached past the change"
            return None, plan, None, None
        report.applied = str(edit)
        insert = None
        if self.settings.prefix_cache:
            own = approx_salt(salt, edit)
            keys, cache, n = block_keys(plan.input_ids, plan.chunk_keys, own), result.cache, plan.input_ids.numel()
            insert = lambda: self.prefix.insert(keys, cache, plan.positions, 0, n)  # noqa: E731
            return result, plan, insert, ((tenant, own), RecentPrompt(client, client, salt=own))
        return result, plan, insert, None

    def _prefill_prefix(self, plan: SplicePlan, salt: str, seam: int, policy: str,
                        chooser: BlendChooser | None = None) -> tuple[PrefillResult, Insert | None]:
        """The exact reuse path: the longest cached prompt prefix, written straight into the
        prompt-length cache, then splice (blended by `chooser`); full blocks go back (those inside
        a spliced chunk's body as references to it, but for the tokens the dial recomputed)."""
        keys = block_keys(plan.input_ids, plan.chunk_keys, salt) if self.settings.prefix_cache else []
        blocks = self.prefix.lookup(keys, plan.input_ids.numel()) if keys else []
        return self._prefill_blocks(plan, blocks, keys, len(blocks), seam, policy, chooser)

    def _prefill_composed(self, plan: SplicePlan, salt: str, seam: int, policy: str, blend: Blend | None
                          ) -> tuple[PrefillResult, SplicePlan, Insert, HistoryReport, BlendChooser | None]:
        """History policy "compose" (mmkv.request.compose): the stored turns placed as chunks, the
        longer prefix hit of the exact and the compose salt, then the splice (blended by the dial:
        composed turns are chunks of kind "turn"); once the first token is out, the blocks and the
        new turns are stored."""
        comp = self.composer.compose(plan, salt, seam, self.settings.prefix_cache)
        chooser = self._chooser(comp.plan, blend)
        result, insert = self._prefill_blocks(comp.plan, comp.blocks, comp.insert_keys, comp.insert_from, seam, policy,
                                              chooser)
        return result, comp.plan, self.composer.commit(comp, result, insert), comp.report, chooser

    def _prefill_blocks(self, plan: SplicePlan, blocks: list, keys: list, have: int, seam: int,
                        policy: str, chooser: BlendChooser | None = None) -> tuple[PrefillResult, Insert | None]:
        """`blocks` loaded, the splice (blended by `chooser`), and the insert of the prompt's
        blocks `have`.. under `keys`."""
        n, block = plan.input_ids.numel(), self.prefix.block
        cache = self.adapter.new_cache()
        start = len(blocks) * block
        if blocks:  # a conversation's buffer from its last turn may hold the first blocks already, and after them
            after = text_run(plan, start, min(start + block, n - 1))  # the tokens its last prompt ended with
            layers, in_place, tail = prefix_slots(self.adapter, cache, n, owner=self.prefix,
                                                  want=[b.key for b in blocks], block=block, after=after)
            self.prefix.load(blocks, layers, in_place)
            start += tail
        rotate = policy != "none"
        result = prefill_spliced(self.adapter, plan.input_ids, plan.positions, plan.placements, seam,
                                 rotate=rotate, cache=cache, start=start, defer=True, blend=chooser)
        if not keys:
            return result, None
        # stored once the first token is out (Run.first_token_out): off the TTFT path
        cache, rope = result.cache, self.adapter.rope
        spans = chunk_spans(plan, n, start, seam, rotate, chooser.chosen if chooser is not None else [])

        def insert() -> int:
            stored = self.prefix.insert(keys, cache, plan.positions, have, n, spans, rope)
            if cache.layers and isinstance(cache.layers[0], SlotLayer):  # its front, for the next turn
                hold_for_next_turn(self.adapter, cache.layers[:self.adapter.num_layers], self.prefix, keys,
                                   text_run(plan, len(keys) * block, n), block)
            return stored
        return result, insert

    def _erratum_plan(self, plan: SplicePlan, client: TokenView, change: FieldChange | None,
                      recent: list[RecentPrompt], policy: str) -> tuple[SplicePlan, str] | None:
        """Keep the old prompt whole and append: with a detected change, the new prompt's tail
        with the erratum line at the start of its final user turn; when the prompt extends an
        earlier rewritten one, that rewrite plus the new tail. None when neither applies, or a
        chunk of the old prompt is no longer cached."""
        if change is not None:
            base, tail_from = change.prompt, change.start + change.new_len + change.rest
        else:
            base = extended_prompt(client, recent)
            if base is None:
                return None
            tail_from = len(base.client)
        old = base.prefilled
        spans = []
        for s, _, key, kind in old.spans:
            entry = self.store.get(key, kind)
            if entry is None:
                return None
            spans.append((s, entry))
        client_ids = client.ids.tolist()
        old_ids = old.ids.tolist()
        ids, at, line = old_ids + client_ids[tail_from:], len(old_ids) + len(client_ids) - tail_from, ""
        if change is not None:
            line = erratum_line(change.field, change.new_value)
            tok = self.adapter.tokenizer  # the turn markers are mmkv's; the line is client text
            ids, at = insert_before_final_turn(
                ids, tok("<|im_start|>user\n")["input_ids"], self.planner.text_ids(line + "\n"),
                tok("<|im_end|>\n")["input_ids"], tok("<|im_start|>assistant\n")["input_ids"], len(old_ids))
        inserted = len(ids) - len(old_ids) - (len(client_ids) - tail_from)
        for p in plan.placements:
            if p.start >= tail_from:
                start = p.start - tail_from + len(old_ids)
                spans.append((start + inserted if start >= at else start, p.entry))
        return self.planner.plan(torch.tensor(ids, dtype=torch.long), spans, policy), line


def text_run(plan: SplicePlan, start: int, stop: int) -> tuple[int, ...]:
    """The prompt's token ids from `start`, before `stop` and its first token spliced from a chunk:
    the text whose KV depends only on the tokens and chunks before it (what a block key hashes)."""
    end = next((i for i in range(start, stop) if plan.chunk_keys[i] is not None), stop)
    return tuple(plan.input_ids[start:end].tolist())


def chunk_spans(plan: SplicePlan, total: int, start: int, seam: int, rotate: bool,
                recomputed: list[int] = ()) -> list[ChunkSpan]:
    """The prompt ranges whose KV `prefill_spliced` placed from a chunk's cached body, with the
    constant per-axis shift it turned the keys by (none with `rotate` off): the same layout and
    shift as `splice.place_chunk`, so a block inside one can reference the chunk exactly. The
    `recomputed` prompt indices (the fidelity dial's) are computed KV, not the chunk's."""
    spans = []
    for p, first, stop in splice_layout(plan.placements, total, start, seam).reused:
        shift = constant_delta(p.entry.position_ids[:, first:stop], p.target[:, first:stop]) if rotate else (0, 0, 0)
        if shift is not None:  # positions that do not move together are copied into blocks instead
            for a, b in ranges_less([(p.start + first, p.start + stop)], list(recomputed)):
                spans.append(ChunkSpan(a, b, p.entry, a - p.start, shift))
    return spans
