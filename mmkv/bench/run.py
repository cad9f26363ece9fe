"""The arms and modes of `mmkv bench` (mmkv/bench/command.py is the command): models built from config,
turns timed interleaved, one table per case."""

from __future__ import annotations

import io
import itertools
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from mmkv.adapters.cpu_kernels import parameter_count
from mmkv.bench import CONFIGS
from mmkv.request.first_sight import kv_bytes_per_token
from mmkv.store.prefix_cache import common_prefix

FAST_SAMPLES = 5  # per round, for the arms that compute only the new tokens
DECODE_STEPS = 16  # greedy decode steps timed after a prefill
BLOCK = 16  # exact-prefix caching reuses whole blocks of this many tokens (vLLM's default)
SEAM = 1


class BenchError(Exception):
    """The bench cannot run as asked (model too large for the device, unknown config)."""


# ---- models -----------------------------------------------------------------------------------------
def _configs() -> dict[str, tuple[str, dict, dict]]:
    """family, text and vision overrides of each built-in config (random weights)."""
    bench_text = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=32768,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    bench_vision = dict(depth=8, hidden_size=640, intermediate_size=1536, num_heads=10, out_hidden_size=1024,
                        window_size=112, fullatt_block_indexes=[3, 7])
    q25_text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                    num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    q25_vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                      window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
    q3_text = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                   rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                    "mrope_interleaved": True})
    q3_vision = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                     num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])
    return {"bench": ("qwen2_5_vl", bench_text, bench_vision), "tiny": ("qwen2_5_vl", {}, {}),
            "qwen2.5-vl-7b": ("qwen2_5_vl", q25_text, q25_vision), "qwen3-vl-8b": ("qwen3_vl", q3_text, q3_vision)}


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def build_engine(config: str, model_dir: Path | None, device: str, dtype: str | None, max_image_tokens: int,
                 cpu_linear: str = "onednn"):
    """An Engine over a local checkpoint, or over a random model of a built-in config, built in
    memory (nothing written), its CPU linear layers on `cpu_linear` (EngineSettings.cpu_linear).
    Refuses clearly when the weights would not fit the device."""
    from transformers import AutoModelForImageTextToText

    from mmkv.adapters import adapter_class
    from mmkv.engine import Engine, EngineSettings
    from mmkv.testing.tiny import build_processor, build_tokenizer, tiny_config

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda but no CUDA device is visible")
    max_pixels = max_image_tokens * 32 * 32 * 2  # room for the largest case at either patch size
    if model_dir is not None:
        return Engine.from_pretrained(model_dir, dtype=dtype, device=device, max_pixels=max_pixels, cpu_linear=cpu_linear)
    if config not in CONFIGS:
        raise BenchError(f"unknown --config {config!r}; expected one of {', '.join(CONFIGS)}")
    family, text, vision = _configs()[config]
    torch_dtype = getattr(torch, dtype) if dtype else (torch.float32 if config in ("bench", "tiny") else torch.bfloat16)
    tokenizer = build_tokenizer()
    cfg = tiny_config(family, tokenizer, text=text, vision=vision)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForImageTextToText.from_config(cfg).parameters())
    need, have = params * torch_dtype.itemsize, _available_bytes(dev)
    if need * 1.2 > have:
        raise BenchError(f"--config {config} needs {need / 2**30:.1f} GiB of {dev.type} memory for its "
                         f"{params / 1e9:.2f}B {torch_dtype} weights (plus activations); {have / 2**30:.1f} GiB "
                         f"available. Run it on a GPU with --device cuda.")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch_dtype, attn_implementation="sdpa").to(dev)
    processor = build_processor(family, tokenizer, min_pixels=56 * 56, max_pixels=max_pixels)
    adapter = adapter_class(cfg.model_type)(model, processor)
    return Engine(adapter, EngineSettings(seam_tokens=SEAM, cache_bytes=8 << 30, cpu_linear=cpu_linear),
                  model_id=f"random-{config}")


# ---- measuring --------------------------------------------------------------------------------------
@dataclass
class Sample:
    wall_s: float  # time to the next-token logits (an engine arm: its TTFT)
    cpu_s: float  # CPU time of this process meanwhile, all threads
    tokens: int  # LM tokens computed
    prompt_tokens: int = 0  # engine arms: the prompt the engine prefilled
    after_s: float = 0.0  # engine arms: CPU time after the first token (the prefix-cache insert), not in cpu_s
    applied: str = ""  # engine arms with an edit policy: the policy that ran (a fallback says recompute)


@dataclass
class Arm:
    name: str
    run: Callable[[], Sample]  # one turn
    vision_runs: int = 0
    per_round: int = 1  # samples per round: the fast arms take several, still interleaved with each other


@dataclass
class Row:
    """Medians over rounds. Ratios come from CPU time: on a CPU shared with other work, wall time
    measures the scheduler as much as the turn (both are kept)."""

    arm: str
    ms: float  # wall
    cpu_ms: float
    runs_ms: list[float]
    runs_cpu_ms: list[float]
    computed_tokens: int
    vision_runs: int
    speedup_vs_full: float | None = None
    pct_of_limit: float | None = None
    after_first_token_cpu_ms: float = 0.0  # engine arms: the prefix-cache insert, after the TTFT (not in cpu_ms)


@dataclass
class Table:
    mode: str
    case: str
    prompt_tokens: int
    rows: list[Row] = field(default_factory=list)
    notes: dict = field(default_factory=dict)
    decode: dict = field(default_factory=dict)  # `decode_after_prefill`'s figures (image and skill cases)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], int]) -> Callable[[], Sample]:
    """Wrap a turn that returns its computed-token count into one that returns its Sample."""
    def run() -> Sample:
        _sync()
        t0, c0 = time.perf_counter(), time.process_time()
        n = fn()
        _sync()
        return Sample(time.perf_counter() - t0, time.process_time() - c0, n)
    return run


def first_token(engine, messages, **kwargs) -> tuple[object, float, float]:
    """`Engine.generate(messages, max_new_tokens=1, **kwargs)` step by step as it runs: (result,
    CPU seconds to the first token, CPU seconds of the work after it: the prefix-cache insert).
    TTFT is time to the first token, so the engine arms' CPU time stops there too."""
    c0 = time.process_time()
    run = engine.start(messages, max_new_tokens=1, **kwargs)
    with engine._lock:  # as `generate` holds it
        run.prefill()
        run.stream.step(run.first_logits)
    c1 = time.process_time()
    run.first_token_out()
    return run.result(), c1 - c0, time.process_time() - c1


def engine_sample(engine, messages, **kwargs) -> Sample:
    """One engine turn (`first_token`): its TTFT, its CPU time to that token, its computed tokens."""
    r, cpu_s, after_s = first_token(engine, messages, **kwargs)
    return Sample(r.ttft_s, cpu_s, r.lm_tokens_computed, r.usage.prompt_tokens, after_s,
                  r.edit.applied if r.edit is not None else "")


def rows_of(names: list[str], samples: dict[str, list[Sample]], vision: dict[str, int]) -> list[Row]:
    return [Row(n, statistics.median(s.wall_s * 1e3 for s in samples[n]), statistics.median(s.cpu_s * 1e3 for s in samples[n]),
                [s.wall_s * 1e3 for s in samples[n]], [s.cpu_s * 1e3 for s in samples[n]], samples[n][-1].tokens,
                vision.get(n, 0), after_first_token_cpu_ms=statistics.median(s.after_s * 1e3 for s in samples[n]))
            for n in names]


def interleave(arms: list[Arm], repeats: int) -> list[Row]:
    """One warm-up each, then `repeats` rounds: each slow arm once, then the fast arms in turn,
    `per_round` times."""
    samples = {a.name: [] for a in arms}
    for a in arms:
        a.run()
    slow, fast = [a for a in arms if a.per_round == 1], [a for a in arms if a.per_round > 1]
    for _ in range(repeats):
        for a in slow:
            samples[a.name].append(a.run())
        for _ in range(max((a.per_round for a in fast), default=0)):
            for a in fast:
                samples[a.name].append(a.run())
    return rows_of([a.name for a in arms], samples, {a.name: a.vision_runs for a in arms})


def same_as_full(rows: list[Row]) -> list[Row]:
    """With no whole block in common with the earlier turn, exact-prefix caching computes exactly
    the full recompute's turn: its row is that row, renamed, not a second measurement."""
    if any(r.arm == "exact-prefix caching" for r in rows):
        return rows
    full = rows[0]
    return [full, Row(**{**asdict(full), "arm": "exact-prefix caching (no common block: = full recompute)"}), *rows[1:]]


def finish(table: Table, full: str | None, limit: str | None) -> Table:
    cpu = {r.arm: r.cpu_ms for r in table.rows}
    for r in table.rows:
        r.speedup_vs_full = cpu[full] / r.cpu_ms if full else None
        r.pct_of_limit = 100 * cpu[limit] / r.cpu_ms if limit else None
    return table


# ---- turns that every mode shares -------------------------------------------------------------------
class TextContext:
    """A text-only prompt with its KV, for turns of n tokens of which q are new: the limit (one
    forward of the last q tokens over the first n - q already in place) and the text-only turn
    (those n - q copied in, then one forward). The prompt grows, untimed, as cases need."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.words = adapter.tokenizer("the quick brown fox jumps over the lazy dog . ")["input_ids"]
        self.length = 0

    def _ensure(self, n: int) -> None:
        from mmkv.request.splice import prefill_full

        if n <= self.length:
            return
        self.length = n + 512
        self.ids = torch.tensor((self.words * (self.length // len(self.words) + 1))[:self.length])
        self.pos = torch.arange(self.length).expand(3, self.length)
        self.load = _kv_loader(self.adapter, prefill_full(self.adapter, self.ids, self.pos, None).cache)

    def limit(self, n: int, q: int) -> Callable[[], Sample]:
        from mmkv.request.splice import forward_into_slots, preallocate

        self._ensure(n)
        cache = self.load(n - q)
        layers = preallocate(self.adapter, cache, n - q, n)
        ids, pos, index = self.ids[:n], self.pos[:, :n], torch.arange(n - q, n)

        def turn() -> int:
            forward_into_slots(self.adapter, cache, layers, ids, pos, index)
            return q
        return timed(turn)

    def text_only(self, n: int, q: int) -> Callable[[], Sample]:
        from mmkv.request.splice import prefill_spliced

        self._ensure(n)
        ids, pos, load = self.ids[:n], self.pos[:, :n], self.load
        return timed(lambda: prefill_spliced(self.adapter, ids, pos, [], SEAM, cache=load(n - q),
                                             start=n - q).computed_tokens)


def _block_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Tokens exact-prefix caching reuses for prompt `a` after serving prompt `b`: whole blocks of
    their common prefix, capped at len(a) - 1."""
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    common = int(diff[0]) if diff.numel() else n
    return min(common, a.numel() - 1) // BLOCK * BLOCK


def _kv_loader(adapter, full_cache) -> Callable[[int], object]:
    """load(n): a new cache holding a copy of the first n tokens' KV of `full_cache` (what a
    prefix-cache hit costs: one copy)."""
    kv = [(layer.keys, layer.values) for layer in full_cache.layers]

    def load(n: int):
        cache = adapter.new_cache()
        for i, (k, v) in enumerate(kv):
            if n:
                cache.update(k[:, :, :n], v[:, :, :n], i)
        return cache
    return load


def chunk_arms(engine, messages: Callable[[int], list], text: TextContext, vision: tuple | None,
               tenant: str) -> tuple[list[Arm], dict]:
    """The arms for a turn whose chunk (image or skill) moved: messages(k) is the turn, k varying
    the text before the chunk (so no prefix cache covers the new turn). `vision` is (pixels, grid)
    for an image chunk, None for a skill. The case has its own tenant, so the engine's prefix cache
    holds only this case's earlier turns."""
    from mmkv.request.splice import prefill_full, prefill_spliced

    ad = engine.adapter
    plan, other = engine.splice_plan(messages(0), tenant=tenant), engine.splice_plan(messages(1), tenant=tenant)
    ids, native, n = plan.input_ids, plan.native_positions, plan.input_ids.numel()
    hit = _block_prefix(ids, other.input_ids)
    entry = plan.placements[0].entry
    feats = plan.chunk_features()
    load = _kv_loader(ad, prefill_full(ad, ids, native, feats).cache)
    encode = (lambda: ad.encode_image(*vision)) if vision else (lambda: None)
    runs_tower = int(vision is not None)

    def full() -> int:
        return prefill_full(ad, ids, native, encode()).computed_tokens

    def exact_prefix(features: Callable) -> Callable[[], int]:
        def turn() -> int:
            ad.forward(ids[hit:], native[:, hit:], load(hit), features())
            return n - hit
        return turn

    def splice(k: int) -> Callable[[], int]:
        return lambda: prefill_spliced(ad, ids, plan.positions, plan.placements, k, cache=load(hit),
                                       start=hit).computed_tokens

    def engine_turn() -> Sample:
        return engine_sample(engine, messages(next(counter)), tenant=tenant)

    counter = iter(range(1, 1 << 30))
    q = splice(SEAM)()
    arms = [Arm("full recompute", timed(full), runs_tower)]
    if hit:  # else exact-prefix caching runs the very turn of the full recompute (see `same_as_full`)
        arms.append(Arm("exact-prefix caching", timed(exact_prefix(encode)), runs_tower))
    if vision:
        arms.append(Arm("encoder cache + prefix caching", timed(exact_prefix(lambda: feats))))
    arms += [Arm(name, run, per_round=FAST_SAMPLES) for name, run in (
        ("mmkv splice k=0", timed(splice(0))), ("mmkv splice k=1", timed(splice(1))), ("engine (reuse)", engine_turn),
        ("text-only turn", text.text_only(n, q)), ("limit", text.limit(n, q)))]
    return arms, {"prefix_hit_tokens": hit, "chunk_tokens": entry.num_tokens, "new_tokens": q}


def decode_after_prefill(engine, plan, repeats: int, steps: int = DECODE_STEPS) -> dict:
    """Tokens/s of `steps` greedy decode steps (the engine's: one token a forward, its KV appended
    to the cache) after a splice k=1 of the turn and after a full prefill of the same prompt,
    interleaved, untimed prefills. The splice runs afresh for each sample; the full prefill (seconds
    at 4k tokens) once, each sample starting from a new cache holding a copy of its KV (the state
    it leaves: one contiguous tensor per layer; decoding appends, never writes into it)."""
    from mmkv.request.splice import PrefillResult, prefill_full, prefill_spliced

    ad = engine.adapter
    ids, feats = plan.input_ids, plan.chunk_features()
    once = prefill_full(ad, ids, plan.native_positions, feats)
    load = _kv_loader(ad, once.cache)

    def full_prefill() -> PrefillResult:
        return PrefillResult(load(ids.numel()), once.logits, ids.numel(), 0, [])

    def decode(prefill: Callable[[], object], first_position: int) -> Callable[[], Sample]:
        def run() -> Sample:
            r = prefill()
            token = int(r.logits[0].argmax())
            _sync()
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(steps):
                position = torch.full((3, 1), first_position + i, dtype=torch.long)
                token = int(ad.forward(torch.tensor([token]), position, r.cache)[0].argmax())
            _sync()
            return Sample(time.perf_counter() - t0, time.process_time() - c0, steps)
        return run

    full, splice = "after full prefill", "after splice k=1"
    rows = {r.arm: r for r in interleave([
        Arm(full, decode(full_prefill, int(plan.native_positions.max()) + 1)),
        Arm(splice, decode(lambda: prefill_spliced(ad, ids, plan.positions, plan.placements, SEAM),
                           int(plan.positions.max()) + 1))], repeats)}
    rate = {arm: steps / (r.cpu_ms / 1e3) for arm, r in rows.items()}
    return {"steps": steps, "full_tokens_s": rate[full], "splice_tokens_s": rate[splice],
            "splice_over_full": rate[splice] / rate[full], "full_ms": rows[full].ms, "splice_ms": rows[splice].ms,
            "runs_cpu_ms": {arm: r.runs_cpu_ms for arm, r in rows.items()}}


# ---- modes ------------------------------------------------------------------------------------------
def _picture(engine, tokens: int, variant: int = 0) -> bytes:
    """A square picture of `tokens` image tokens (a square number) for the engine's processor:
    patch x merge pixels per token side (28 for Qwen2/2.5-VL, 32 for Qwen3-VL). Each `variant`
    is another picture (another background)."""
    ip = engine.adapter.processor.image_processor
    return picture_png(int(round(tokens**0.5)) * ip.patch_size * ip.merge_size, variant)


def picture_png(px: int, variant: int = 0) -> bytes:
    """A px x px PNG; each `variant` is another picture (another background)."""
    img = Image.new("RGB", (px, px), (90 + 17 * variant % 160, 120, 150 - 7 * variant % 100))
    draw = ImageDraw.Draw(img)
    for i in range(0, px, 32):
        draw.rectangle([i, i // 2, i + 20, i // 2 + 20], fill=(i % 255, 200, 40))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


HISTORY = [{"role": "system", "content": "you are a careful assistant ."},
           {"role": "user", "content": "here is some context for the task . " * 3},
           {"role": "assistant", "content": "noted ."}]


def bench_image(engine, tokens: int, repeats: int, text: TextContext) -> Table:
    ad = engine.adapter
    png, tenant = _picture(engine, tokens), f"image-{tokens}"
    image_id = engine.add_image(png, tenant=tenant)
    vision = ad.preprocess_image(Image.open(io.BytesIO(png)).convert("RGB"))

    def messages(k: int):
        return HISTORY + [{"role": "user", "content": [
            {"type": "text", "text": f"turn {k} : look again at"},
            {"type": "image_file", "image_file": {"file_id": image_id}},
            {"type": "text", "text": "what is in it ?"}]}]

    arms, notes = chunk_arms(engine, messages, text, vision, tenant)
    n = engine.prompt_ids(messages(0), tenant=tenant).numel()
    table = Table("image", f"image, {notes['chunk_tokens'] - 2} tokens", n, same_as_full(interleave(arms, repeats)),
                  notes, decode_after_prefill(engine, engine.splice_plan(messages(0), tenant=tenant), repeats))
    return finish(table, "full recompute", "limit")


def _text_of(tokenizer, tokens: int, sentence: str) -> str:
    ids = tokenizer(sentence)["input_ids"]
    return sentence * (tokens // len(ids) + 1)


SKILL_SENTENCE = "tool search ( query , top_k ) returns ranked documents . "


def bench_skill(engine, tokens: int, repeats: int, text: TextContext) -> Table:
    skill_id, tenant = _skill(engine, tokens)

    def messages(k: int):
        return [{"role": "system", "content": [{"type": "text", "text": f"user {k} prefers short answers .\n"},
                                               {"type": "skill", "skill_id": skill_id}]},
                {"role": "user", "content": "which tool finds documents ?"}]

    arms, notes = chunk_arms(engine, messages, text, None, tenant)
    n = engine.prompt_ids(messages(0), tenant=tenant).numel()
    table = Table("skill", f"skill, {notes['chunk_tokens']} tokens", n, same_as_full(interleave(arms, repeats)), notes,
                  decode_after_prefill(engine, engine.splice_plan(messages(0), tenant=tenant), repeats))
    return finish(table, "full recompute", "limit")


def bench_errata(engine, policy_tokens: int, turns: int, text: TextContext) -> Table:
    """An agent loop whose status field changes every turn, through the engine: an appended erratum
    vs the field edited in the system prompt (exact-prefix caching then stops at the field) vs the
    full recompute; the limit and text-only turn at the erratum turn's length and new tokens."""
    policy = _text_of(engine.adapter.tokenizer, policy_tokens,
                      "refunds need a delivered order and a damage report within thirty days . ")

    def conversation(t: int, erratum: bool):
        values = [f"{('pending', 'shipped')[i % 2]}-{i}" for i in range(t + 1)]
        msgs = [{"role": "system", "content": f"order_status: {values[0] if erratum else values[t]}\n" + policy}]
        for u in range(t + 1):
            parts = [{"type": "state_update", "field": "order_status", "value": values[u]}] if erratum and u else []
            msgs.append({"role": "user", "content": parts + [{"type": "text", "text": "refund or escalate ?"}]})
            if u < t:
                msgs.append({"role": "assistant", "content": "escalate"})
        return msgs

    def turn(t: int, erratum: bool, reuse: bool, tenant: str, **kwargs) -> Sample:
        return engine_sample(engine, conversation(t, erratum), reuse=reuse, tenant=tenant, **kwargs)

    names = ["full recompute", "exact-prefix caching (field edited in place)", "mmkv erratum (appended)",
             "mmkv in_place (field edited, old KV reused)", "text-only turn", "limit"]
    samples = {name: [] for name in names}
    length, applied = 0, []
    for t in range(turns):
        samples[names[0]].append(turn(t, False, False, "errata-full"))
        samples[names[1]].append(turn(t, False, True, "errata-prefix"))
        samples[names[2]].append(turn(t, True, True, "errata-erratum"))
        samples[names[3]].append(turn(t, False, True, "errata-in-place", edit_policy="in_place"))
        applied.append(samples[names[3]][-1].applied)
        length, q = samples[names[2]][-1].prompt_tokens, samples[names[2]][-1].tokens
        for name, arm in ((names[4], text.text_only(length, q)), (names[5], text.limit(length, q))):
            arm()  # warm-up at this shape
            samples[name].append(arm())
    rows = rows_of(names, {name: s[1:] for name, s in samples.items()}, {})
    table = Table("errata", f"{policy_tokens}-token policy, turns 2..{turns}", length, rows,
                  {"turns": turns, "note": "median over turns 2.., the first turn fills the caches",
                   "in_place_applied": f"{applied[1:].count('in_place')}/{len(applied) - 1} turns"})
    return finish(table, "full recompute", "limit")


SPLICE, BEFORE, CLONE = "splice copy (rotate into slots)", "splice copy, three torch passes (before)", "plain clone"


def bench_copy(engine, entries: list, repeats: int) -> list[dict]:
    """GB/s of placing a cached chunk's KV (keys rotated by a constant position change, values
    copied) into a preallocated cache, against a plain clone of the same tensors; the placement
    also with the earlier three-pass elementwise rotation (`rotate_into_torch`), in the same run."""
    from mmkv.kv.rerotate import constant_delta, rotate_into_torch, rotation
    from mmkv.request.splice import Placement, place_chunk, preallocate

    ad = engine.adapter
    out = []
    for entry in entries:
        n = entry.num_tokens
        placement = Placement(7, entry, entry.position_ids + 37)
        layers = preallocate(ad, ad.new_cache(), 0, n + 7)
        nbytes = sum(t.numel() * t.element_size() for t in (*entry.keys, *entry.values))

        def splice():
            place_chunk(layers, placement, 0, n, ad.rope)
            return n

        def before():  # place_chunk's steps, with the earlier rotation
            turn = rotation(constant_delta(entry.position_ids, placement.target), ad.rope)
            for layer, k, v in zip(layers, entry.keys, entry.values):
                rotate_into_torch(layer.keys[0, :, 7:7 + n], k[:, 0:n], *turn)
                layer.values[0, :, 7:7 + n].copy_(v[:, 0:n])
            return n

        def clone():
            for k, v in zip(entry.keys, entry.values):
                k.clone(), v.clone()
            return n

        inner = max(1, int(2e8 // max(nbytes, 1)))  # ~200 MB moved per timed sample

        def many(fn):
            return timed(lambda: [fn() for _ in range(inner)][-1])

        rows = interleave([Arm(SPLICE, many(splice)), Arm(BEFORE, many(before)), Arm(CLONE, many(clone))], repeats)
        gbs = {r.arm: nbytes * inner / (r.cpu_ms / 1e3) / 1e9 for r in rows}  # per CPU-second
        out.append({"chunk": f"{entry.kind}, {n} tokens", "bytes": nbytes, "splice_gb_s": gbs[SPLICE],
                    "before_gb_s": gbs[BEFORE], "clone_gb_s": gbs[CLONE], "ratio": gbs[SPLICE] / gbs[CLONE],
                    "before_ratio": gbs[BEFORE] / gbs[CLONE]})
    return out


def bench_bytes(engine, entries: list, skill_tokens: list[int]) -> list[dict]:
    """Bytes per cached token, chunks and prefix blocks, against 2 x layers x kv_heads x head_dim x dtype."""
    ideal = kv_bytes_per_token(engine.adapter)
    out = []
    for entry in entries:
        kv = sum(t.numel() * t.element_size() for t in (*entry.keys, *entry.values))
        out.append({"what": f"{entry.kind} chunk, {entry.num_tokens} tokens", "kv_bytes_per_token": kv / entry.num_tokens,
                    "stored_bytes_per_token": entry.nbytes / entry.num_tokens, "ideal_bytes_per_token": ideal})
    before = engine.stats()
    engine.generate([{"role": "user", "content": "a plain text turn for the prefix cache . " * 20}], max_new_tokens=1,
                    tenant="bench-bytes")
    after = engine.stats()
    blocks = after.get("prefix_blocks", 0) - before.get("prefix_blocks", 0)
    if blocks > 0:
        stored = after["cache_bytes"] - before["cache_bytes"]
        # copies: each token's K and V of every layer; stored adds each tensor's heap and the entry
        out.append({"what": f"prefix blocks, {blocks} x {BLOCK} tokens (text turn)",
                    "kv_bytes_per_token": ideal, "stored_bytes_per_token": stored / (blocks * BLOCK),
                    "ideal_bytes_per_token": ideal})
    for n in skill_tokens[:1]:  # blocks inside a spliced skill reference its KV: they add no KV bytes
        skill_id, tenant = _skill(engine, n)
        before = engine.stats()
        engine.generate([{"role": "system", "content": [{"type": "text", "text": "bytes check .\n"},
                                                        {"type": "skill", "skill_id": skill_id}]},
                         {"role": "user", "content": "?"}], max_new_tokens=1, tenant=tenant)
        after = engine.stats()
        blocks = after["prefix_blocks"] - before["prefix_blocks"]
        stored = after["cache_bytes"] - before["cache_bytes"]
        out.append({"what": f"prefix blocks, {blocks} x {BLOCK} tokens (a turn splicing the {n}-token skill: "
                            "blocks inside it reference it)", "kv_bytes_per_token": ideal,
                    "stored_bytes_per_token": stored / (blocks * BLOCK), "ideal_bytes_per_token": ideal})
    return out


def _skill(engine, tokens: int) -> tuple[str, str]:
    """The skill of about `tokens` tokens the skill cases use, and its tenant (added once)."""
    tenant = f"skill-{tokens}"
    return engine.add_skill("spec", _text_of(engine.adapter.tokenizer, tokens, SKILL_SENTENCE), tenant=tenant), tenant


# ---- agent trajectory ------------------------------------------------------------------------------
@dataclass
class AgentTurn:
    """What one turn of the seeded session adds (the client resends the history every turn, less
    the screenshots its window drops: `agent_messages`)."""

    new_screenshot: int | None  # index of the screenshot first shown in this turn
    shown_again: list[int]  # earlier screenshots attached again, at this turn's new position
    erratum: str | None  # the status field's new value, appended as a state_update part

    def events(self) -> str:
        parts = ([f"new screenshot {self.new_screenshot}"] if self.new_screenshot is not None else []) + \
            [f"screenshot {i} again" for i in self.shown_again] + ([f"erratum {self.erratum}"] if self.erratum else [])
        return ", ".join(parts) or "text only"

    def images(self) -> int:
        """Image parts this turn attaches."""
        return (self.new_screenshot is not None) + len(self.shown_again)


def agent_script(turns: int, seed: int) -> list[AgentTurn]:
    """A seeded session like the paper's unified agent: a new screenshot most turns (always the
    first), an earlier one attached again on about half of them (always turn 2), the status field
    changed by an erratum on about a third (always turn 3)."""
    rng = random.Random(seed)
    script, shown = [], 0
    for t in range(turns):
        new = shown if t == 0 or rng.random() < 0.75 else None
        again = [rng.randrange(shown)] if shown and (t == 1 or rng.random() < 0.5) else []
        erratum = f"{rng.choice(('pending', 'shipped', 'delivered'))}-{t}" if t == 2 or (t and rng.random() < 0.35) \
            else None
        script.append(AgentTurn(new, again, erratum))
        shown += new is not None
    return script


def screenshots_dropped(attached: int, window: int, chunk: int) -> int:
    """How many of the `attached` image parts (oldest first) a client keeping the last `window`
    drops, `chunk` at a time. UI-TARS keeps 5 and drops one at a time (chunk 1); Anthropic's
    computer-use loop keeps 3 and drops them 3 at a time, so that its prompt prefix changes once
    every 3 screenshots (it then sends 3 to 5). Window 0 keeps them all."""
    if not window or attached <= window:
        return 0
    return (attached - window) // chunk * chunk


def _agent_system(skill_id: str) -> dict:
    return {"role": "system", "content": [{"type": "text", "text": "order_status: pending\n"},
                                          {"type": "skill", "skill_id": skill_id}]}


def agent_messages(script: list[AgentTurn], upto: int, skill_id: str, file_ids: list[str], window: int = 0,
                   drop_chunk: int = 1) -> list[dict]:
    """The request of turn `upto`: the system prompt (status field, spliced skill) and every turn so
    far, less the oldest image parts the window drops (`screenshots_dropped`); a dropped image's
    text stays, as those agents keep the step's text."""
    msgs = [_agent_system(skill_id)]
    for u, turn in enumerate(script[:upto + 1]):
        parts = [{"type": "state_update", "field": "order_status", "value": turn.erratum}] if turn.erratum else []
        if turn.new_screenshot is not None:
            parts.append({"type": "image_file", "image_file": {"file_id": file_ids[turn.new_screenshot]}})
        parts.append({"type": "text", "text": f"step {u} : what changed on the screen ?"})
        for i in turn.shown_again:
            parts += [{"type": "text", "text": "compare with this earlier screen :"},
                      {"type": "image_file", "image_file": {"file_id": file_ids[i]}}]
        msgs.append({"role": "user", "content": parts})
        if u < upto:
            msgs.append({"role": "assistant", "content": f"clicked the button of step {u} ."})
    drop = screenshots_dropped(sum(t.images() for t in script[:upto + 1]), window, drop_chunk)
    for m in msgs:
        if isinstance(m["content"], list):
            kept = []
            for part in m["content"]:
                if part["type"] == "image_file" and drop:
                    drop -= 1
                else:
                    kept.append(part)
            m["content"] = kept
    return msgs


def _encode_screenshot(adapter, png: bytes):
    """A screenshot as a server receives it: decoded, preprocessed, through the vision tower."""
    return adapter.encode_image(*adapter.preprocess_image(Image.open(io.BytesIO(png)).convert("RGB")))


class PrefixCacheArm:
    """Exact-prefix caching as vLLM / SGLang automatic prefix caching does it, at the mechanism
    level: whole blocks of the longest common prefix (token ids and image identities) with any
    earlier prompt of the session, their KV copied in; every image with a pad after that decoded,
    preprocessed and run through the vision tower; the rest prefilled at native positions. With
    `keep=False` nothing is kept: the full recompute. With `encoder_cache` each screenshot's
    features are kept once computed (an encoder cache): the vision tower runs once per screenshot."""

    def __init__(self, adapter, pngs: list[bytes], keep: bool, encoder_cache: bool = False):
        self.adapter, self.pngs, self.keep = adapter, pngs, keep
        self.kept: list[tuple[list, object]] = []  # (token keys, the prompt's KV)
        self.features: dict[int, object] | None = {} if encoder_cache else None

    def _features(self, image: int) -> tuple[object, int]:
        """The screenshot's features and the vision-tower runs they took."""
        if self.features is not None and image in self.features:
            return self.features[image], 0
        f = _encode_screenshot(self.adapter, self.pngs[image])
        if self.features is not None:
            self.features[image] = f
        return f, 1

    def turn(self, ids: torch.Tensor, positions: torch.Tensor, keys: list, images: list[int]) -> dict:
        """`keys` per token (id, screenshot index or None); `images` the screenshot of each image
        span, in order. Times the turn to its next-token logits."""
        from mmkv.adapters import ImageFeatures

        ad = self.adapter
        _sync()
        t0, c0 = time.perf_counter(), time.process_time()
        hit = max((common_prefix(k, keys) for k, _ in self.kept), default=0)
        hit = min(hit, ids.numel() - 1) // BLOCK * BLOCK
        cache = ad.new_cache()
        if hit:
            source = next(c for k, c in self.kept if common_prefix(k, keys) >= hit)
            for i, layer in enumerate(source.layers):
                cache.update(layer.keys[:, :, :hit], layer.values[:, :, :hit], i)
        feats, runs = [], 0
        for (start, end), image in zip(ad.image_spans(ids), images):
            first_pad, stop = start + 1, end - 1
            if stop > hit:  # pads after the hit are prefilled: their features are needed
                f, tower = self._features(image)
                feats.append(f.slice(max(hit - first_pad, 0), stop - first_pad))
                runs += tower
        logits = ad.forward(ids[hit:], positions[:, hit:], cache, ImageFeatures.concat(feats))
        _sync()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if self.keep:
            self.kept.append((keys, cache))
        return {"ms": wall * 1e3, "cpu_ms": cpu * 1e3, "computed_tokens": ids.numel() - hit, "vision_runs": runs,
                "reused_tokens": hit, "next_token": int(logits[0].argmax())}


@dataclass
class AgentPrompt:
    """One turn's request and what the mechanism arms and the limit need of it (planned untimed)."""

    messages: list[dict]
    ids: torch.Tensor
    positions: torch.Tensor
    keys: list  # per token (id, screenshot index or None)
    images: list[int]  # the screenshot of each image span
    new_tokens: int  # what the limit computes: the turn's own tokens, less each earlier screenshot's chunk but its seam
    dropped: int  # image parts the window has dropped by this turn


AGENT_ARMS = ("full recompute", "exact-prefix caching", "encoder cache + prefix caching", "mmkv exact", "mmkv composed",
              "limit")
AGENT_ARM_NAMES = dict(zip(("full", "prefix", "encoder", "exact", "composed", "limit"), AGENT_ARMS))  # --agent-arms
AGENT_PAIR = ("exact-prefix caching", "mmkv exact")  # the per-turn comparison: always run


def _agent_prompts(engine, script: list[AgentTurn], skill_id: str, file_ids: list[str], tenant: str,
                   window: int, drop_chunk: int, warm: list[dict]) -> list[AgentPrompt]:
    """Every turn's prompt. A turn's own tokens are those after its prompt's common prefix with the
    request before it (the previous turn's, or the warm-up's for the first), its windowed history
    being that request's; of a screenshot shown in an earlier turn, attached again, only the seam
    is new (its KV exists)."""
    before = engine.splice_plan(warm, tenant=tenant).input_ids.tolist()
    prompts = []
    for t, turn in enumerate(script):
        msgs = agent_messages(script, t, skill_id, file_ids, window, drop_chunk)
        ids, pos, keys, images = _agent_prompt(engine, msgs, tenant, file_ids)
        if t:
            before = engine.splice_plan(msgs[:-2], tenant=tenant).input_ids.tolist()
        own = common_prefix(ids.tolist(), before)
        new = ids.numel() - own - sum(end - start - SEAM for (start, end), image
                                      in zip(engine.adapter.image_spans(ids), images)
                                      if start >= own and image != turn.new_screenshot)
        dropped = screenshots_dropped(sum(u.images() for u in script[:t + 1]), window, drop_chunk)
        prompts.append(AgentPrompt(msgs, ids, pos, keys, images, new, dropped))
    return prompts


def bench_agent(engine, turns: int, seed: int, repeats: int, image_tokens: int, skill_tokens: int,
                text: TextContext, window: int = 0, drop_chunk: int = 1, arms: tuple[str, ...] = AGENT_ARMS) -> dict:
    """Cumulative and per-turn TTFT over a seeded agent session (`agent_script`) whose client keeps
    the last `window` screenshots (0: all), dropping them `drop_chunk` at a time; the arms
    interleaved turn by turn (`AGENT_ARMS`; the order rotated by turn and by session, so that a
    turn's paired comparison is not always made in one order), each session `repeats` times with fresh caches: full
    recompute, exact-prefix caching and encoder cache + prefix caching (mechanism level,
    PrefixCacheArm), mmkv exact (`Engine.generate` end to end, screenshots sent inline: `_mmkv_turn`),
    mmkv composed (the same under `history_policy` "compose", in its own tenant; its next token
    checked against full recompute's: `agreement`) and the limit (`_limit_turn`). Every caching arm
    is first served one turn of an earlier session (the shared system prompt, untimed), as a server
    would have been. Each mmkv turn's reused tokens are checked against what the plan says: the
    longest block prefix of an earlier prompt, the text after it that the previous turn's buffer
    still holds (`_kept_tail`), plus the spliced chunks after it (all but each seam token; a
    screenshot new in the turn is computed in context, first sight). `arms` (of `AGENT_ARMS`,
    `AGENT_PAIR` among them) runs only those: more sessions of the per-turn comparison in the
    same time."""
    from mmkv.engine import image_id_for
    from mmkv.request.splice import splice_layout

    ad = engine.adapter
    script = agent_script(turns, seed)
    shots = sum(t.new_screenshot is not None for t in script)
    pngs = [_picture(engine, image_tokens, variant=i) for i in range(shots)]
    file_ids = [image_id_for(engine.prepare_image(png).content_hash) for png in pngs]
    skill_id, skill_tenant = _skill(engine, skill_tokens)
    plan_tenant = f"agent-plan-{seed}"  # the prompts' ids and positions, untimed, under their own tenant
    engine.add_skill("spec", _text_of(ad.tokenizer, skill_tokens, SKILL_SENTENCE), tenant=plan_tenant)
    for png in pngs:
        engine.add_image(png, tenant=plan_tenant)
    warm = [_agent_system(skill_id), {"role": "user", "content": "hello , a new session ."}]
    prompts = _agent_prompts(engine, script, skill_id, file_ids, plan_tenant, window, drop_chunk, warm)
    warm_prompt = _agent_prompt(engine, warm, plan_tenant, [])
    arms = tuple(a for a in AGENT_ARMS if a in arms)
    if "limit" in arms:
        text._ensure(max(p.ids.numel() for p in prompts))  # the limit's context, built once, untimed
    sessions = []
    for r in range(repeats):
        tenant = f"agent-{seed}-{r}"
        engine.add_skill("spec", _text_of(ad.tokenizer, skill_tokens, SKILL_SENTENCE), tenant=tenant)
        mechanism = dict(zip(AGENT_ARMS, (PrefixCacheArm(ad, pngs, keep=False), PrefixCacheArm(ad, pngs, keep=True),
                                          PrefixCacheArm(ad, pngs, keep=True, encoder_cache=True))))
        mechanism = {arm: m for arm, m in mechanism.items() if arm in arms}
        engine.generate(warm, max_new_tokens=1, tenant=tenant)
        composed = f"{tenant}-composed"  # its own namespace: its turns and blocks apart from mmkv exact's
        if "mmkv composed" in arms:
            engine.add_skill("spec", _text_of(ad.tokenizer, skill_tokens, SKILL_SENTENCE), tenant=composed)
            engine.generate(warm, max_new_tokens=1, tenant=composed, history_policy="compose")
        for arm in mechanism.values():
            if arm.keep:
                arm.turn(*warm_prompt)
        history = [engine.splice_plan(warm, tenant=tenant)]
        rows, shots = [], {}  # the screenshots the mmkv client has prepared, by file id
        for t, (turn, p) in enumerate(zip(script, prompts)):
            new_png = pngs[turn.new_screenshot] if turn.new_screenshot is not None else None
            got = {}
            first = (t + r) % len(arms)  # by turn and session: on each turn, each arm runs first in as many sessions
            order = arms[first:] + arms[:first]
            for arm in order:
                if arm in mechanism:
                    got[arm] = mechanism[arm].turn(p.ids, p.positions, p.keys, p.images)
                elif arm == "mmkv exact":
                    got[arm] = _mmkv_turn(engine, p.messages, tenant, shots, new_png and (
                        file_ids[turn.new_screenshot], new_png))
                elif arm == "mmkv composed":
                    got[arm] = _mmkv_turn(engine, p.messages, composed, shots, new_png and (
                        file_ids[turn.new_screenshot], new_png), history_policy="compose")
                else:
                    got[arm] = _limit_turn(ad, text, new_png, p.ids.numel(), p.new_tokens)
            plan = engine.splice_plan(_inline(p.messages, shots), tenant=tenant)  # every chunk built by now
            hit = max(common_prefix(_chunk_token_keys(h), _chunk_token_keys(plan)) for h in history)
            hit = min(hit, p.ids.numel() - 1) // BLOCK * BLOCK
            tail = _kept_tail(_chunk_token_keys(history[-1]), _chunk_token_keys(plan), hit)
            images = sorted((c for c in plan.placements if c.entry.kind == "image"), key=lambda c: c.start)
            seen_now = {c.entry.key for c, i in zip(images, p.images) if i == turn.new_screenshot}
            spliced = sum(b - a for c, a, b in splice_layout(plan.placements, p.ids.numel(), hit, SEAM).reused
                          if c.entry.key not in seen_now)
            history.append(plan)
            rows.append({"turn": t + 1, "events": turn.events(), "prompt_tokens": int(p.ids.numel()),
                         "new_tokens": p.new_tokens, "screenshots": len(p.images), "dropped": p.dropped,
                         "arms": got, "order": list(order), "mmkv_expected_reused": hit + tail + spliced,
                         "mmkv_kept_tail": tail})
        sessions.append(rows)
    return {"turns": turns, "seed": seed, "repeats": repeats, "image_tokens": image_tokens, "window": window,
            "drop_chunk": drop_chunk, "skill_tokens": engine.skill_info(skill_id, tenant=skill_tenant).tokens,
            "arms": list(arms), "script": [asdict(t) for t in script], "summary": _agent_summary(sessions, arms),
            "agreement": _agent_agreement(sessions, arms), "per_turn": _agent_per_turn(sessions),
            "per_kind": _agent_per_kind(sessions, script), "sessions": sessions}


def median_interval(values: list[float]) -> dict:
    """The median of `values` and its distribution-free 95% interval: order statistics, exact
    binomial coverage (scipy's `quantile_test`); None below 6 values, which cannot reach 95%."""
    from scipy.stats import quantile_test

    med = statistics.median(values)
    ci = quantile_test(values, q=med, p=0.5).confidence_interval(confidence_level=0.95)
    bounded = len(values) >= 6 and not math.isnan(ci.low)
    return {"median": med, "low": float(ci.low) if bounded else None, "high": float(ci.high) if bounded else None}


def _agent_per_turn(sessions: list[list[dict]]) -> list[dict]:
    """Per turn, over the sessions: mmkv exact against exact-prefix caching, the two arms' wall and
    CPU time to the first token paired within each session (the arms ran one after the other on
    the same turn), their ratio's median and its 95% interval (`median_interval`), and the median
    background build that followed the turn, untimed in it."""
    out = []
    for rows in zip(*sessions):
        mmkv, prefix = ([row["arms"][arm] for row in rows] for arm in ("mmkv exact", "exact-prefix caching"))
        med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
        out.append({"turn": rows[0]["turn"], **_paired_ratio(mmkv, prefix),
                    "background_ms": med(mmkv, "background_ms"), "background_tokens": med(mmkv, "background_tokens")})
    return out


def _paired_ratio(mmkv: list[dict], prefix: list[dict]) -> dict:
    """mmkv exact over exact-prefix caching, session by session (`mmkv[i]` and `prefix[i]`: one
    session's wall and CPU milliseconds), in wall and CPU time: the median of those ratios and its
    95% interval (`median_interval`)."""
    ratio = {key: median_interval([m[key] / p[key] for m, p in zip(mmkv, prefix)]) for key in ("ms", "cpu_ms")}
    return {"mmkv_over_prefix_ms": ratio["ms"]["median"], "mmkv_over_prefix_cpu": ratio["cpu_ms"]["median"],
            "interval_ms": [ratio["ms"]["low"], ratio["ms"]["high"]],
            "interval_cpu": [ratio["cpu_ms"]["low"], ratio["cpu_ms"]["high"]]}


AGENT_TURN_KINDS = ("new screenshot", "screenshot again", "text only")


def turn_kind(turn: AgentTurn) -> str:
    """What bounds a turn's work: a screenshot never seen (its vision tower and LM forward, in both
    arms), else one shown again (spliced by mmkv), else text only (an erratum or a question)."""
    if turn.new_screenshot is not None:
        return "new screenshot"
    return "screenshot again" if turn.shown_again else "text only"


COMPUTED_ALIKE = "computed alike"  # the turns where mmkv does the work exact-prefix caching does


def computed_alike(row: dict) -> bool:
    """Whether mmkv exact did a turn's work as exact-prefix caching did: as many vision-tower runs
    and at most one block's tokens fewer through the language model (what a turn with nothing to
    splice and nothing cut from its history comes to)."""
    mmkv, prefix = row["arms"]["mmkv exact"], row["arms"]["exact-prefix caching"]
    return mmkv["vision_runs"] == prefix["vision_runs"] and mmkv["computed_tokens"] >= prefix["computed_tokens"] - BLOCK


def _agent_per_kind(sessions: list[list[dict]], script: list[AgentTurn]) -> list[dict]:
    """Per kind of turn (`turn_kind`), and for the turns computed alike (`computed_alike`; the same
    in every session, the session being seeded): in each session, mmkv exact's time to the first
    token summed over those turns, over exact-prefix caching's summed over the same turns; the
    median of those session ratios and its 95% interval (`median_interval`). Sessions are
    independent where a session's turns are not, so this pools the turns without counting them
    as independent samples."""
    out = []
    for kind in (*AGENT_TURN_KINDS, COMPUTED_ALIKE):
        turns = ([t for t, row in enumerate(sessions[-1]) if computed_alike(row)] if kind == COMPUTED_ALIKE else
                 [t for t, turn in enumerate(script) if turn_kind(turn) == kind])
        if not turns:
            continue
        mmkv, prefix = ([{key: sum(rows[t]["arms"][arm][key] for t in turns) for key in ("ms", "cpu_ms")}
                         for rows in sessions] for arm in ("mmkv exact", "exact-prefix caching"))
        out.append({"kind": kind, "turns": [t + 1 for t in turns], **_paired_ratio(mmkv, prefix)})
    return out


def _agent_summary(sessions: list[list[dict]], arms: tuple[str, ...] = AGENT_ARMS) -> list[dict]:
    """Per arm run: each session's sums over its turns, the median session's times, the ratios
    between arms from CPU time (None against an arm not run)."""
    totals = {arm: {key: [sum(row["arms"][arm][key] for row in rows) for rows in sessions]
                    for key in ("ms", "cpu_ms", "computed_tokens", "vision_runs", "reused_tokens")}
              for arm in arms}
    summary = [{"arm": arm, "ms": statistics.median(totals[arm]["ms"]), "cpu_ms": statistics.median(totals[arm]["cpu_ms"]),
                "computed_tokens": totals[arm]["computed_tokens"][-1], "vision_runs": totals[arm]["vision_runs"][-1],
                "reused_tokens": totals[arm]["reused_tokens"][-1], "runs_ms": totals[arm]["ms"],
                "runs_cpu_ms": totals[arm]["cpu_ms"]} for arm in arms]
    cpu = {row["arm"]: row["cpu_ms"] for row in summary}
    for row in summary:
        row["speedup_vs_full"] = cpu["full recompute"] / row["cpu_ms"] if "full recompute" in cpu else None
        row["speedup_vs_prefix"] = cpu["exact-prefix caching"] / row["cpu_ms"]
        row["pct_of_limit"] = 100 * cpu["limit"] / row["cpu_ms"] if "limit" in cpu else None
    return summary


def _agent_agreement(sessions: list[list[dict]], arms: tuple[str, ...] = AGENT_ARMS) -> dict:
    """Per mmkv arm run: turns whose next token equals full recompute's, of all turns, with the
    exact (Clopper-Pearson) 95% interval; nothing without the full recompute."""
    from scipy.stats import binomtest

    out = {}
    for arm in [a for a in ("mmkv exact", "mmkv composed") if a in arms] if "full recompute" in arms else []:
        same = [row["arms"][arm]["next_token"] == row["arms"]["full recompute"]["next_token"]
                for rows in sessions for row in rows]
        ci = binomtest(sum(same), len(same)).proportion_ci(confidence_level=0.95, method="exact")
        out[arm] = {"k": sum(same), "n": len(same), "low": float(ci.low), "high": float(ci.high)}
    return out


def _mmkv_turn(engine, msgs, tenant: str, shots: dict, new: tuple[str, bytes] | None, **kwargs) -> dict:
    """One mmkv turn as an agent sends it, every screenshot inline: the new one decoded, hashed and
    preprocessed in the turn (`prepare_image`, timed with it), the earlier ones as the client
    prepared them (`shots`, by file id), then `Engine.generate` to the first token (`first_token`,
    with `kwargs`): the new screenshot is computed in context (first sight). Then, untimed, the
    background build of its reusable chunk (`run_background`: the agent's environment step is idle
    time), whose duration the turn reports."""
    c0, t0 = time.process_time(), time.perf_counter()
    if new is not None:
        shots[new[0]] = engine.prepare_image(new[1])
    prepare_s, prepare_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    r, cpu_s, _ = first_token(engine, _inline(msgs, shots), tenant=tenant, **kwargs)
    built = engine.run_background()
    return {"ms": (prepare_s + r.ttft_s) * 1e3, "cpu_ms": (prepare_cpu_s + cpu_s) * 1e3,
            "computed_tokens": r.lm_tokens_computed, "vision_runs": r.vision_tower_runs,
            "reused_tokens": r.usage.cached_tokens, "background_ms": built.seconds * 1e3,
            "background_tokens": built.tokens, "next_token": int(r.first_logits.argmax()),
            "composed_tokens": r.history.composed_tokens if r.history else 0}


def _inline(msgs: list[dict], shots: dict) -> list[dict]:
    """`msgs` with each image_file part replaced by the prepared screenshot, sent inline."""
    return [{**m, "content": [{"type": "image", "image": shots[part["image_file"]["file_id"]]}
                              if part.get("type") == "image_file" else part for part in m["content"]]}
            if isinstance(m["content"], list) else m for m in msgs]


def _limit_turn(adapter, text: TextContext, new_png: bytes | None, n: int, q: int) -> dict:
    """The least a turn of n tokens, q of them new, can cost: its new screenshot (if any) through
    the vision tower, then one forward of the q new tokens over the other n - q tokens' KV already
    in place, nothing copied (`TextContext.limit`: a text context of the same length)."""
    forward = text.limit(n, q)
    _sync()
    t0, c0 = time.perf_counter(), time.process_time()
    if new_png is not None:
        _encode_screenshot(adapter, new_png)
    forward()
    _sync()
    return {"ms": (time.perf_counter() - t0) * 1e3, "cpu_ms": (time.process_time() - c0) * 1e3,
            "computed_tokens": q, "vision_runs": int(new_png is not None), "reused_tokens": n - q}


def _kept_tail(before: list, now: list, hit: int) -> int:
    """The tokens after a block hit that the conversation's buffer from its previous turn still
    holds (`SlotPool`): when the hit is exactly that prompt's full blocks, the text (no chunk) both
    prompts share after them, short of the last token."""
    if hit != len(before) // BLOCK * BLOCK or common_prefix(before, now) < hit:
        return 0
    text = lambda keys: itertools.takewhile(lambda k: k[1] is None, keys[hit:])  # noqa: E731
    return min(common_prefix(list(text(before)), list(text(now))), len(now) - 1 - hit)


def _chunk_token_keys(plan) -> list[tuple[int, str | None]]:
    """Per token (id, the chunk it was spliced from): what the engine's prefix-cache keys hash."""
    return list(zip(plan.input_ids.tolist(), plan.chunk_keys))


def _agent_prompt(engine, msgs, tenant: str, file_ids: list[str]):
    """Token ids, native positions, per-token keys (id, screenshot index or None) and the
    screenshot of each image span, for the mechanism-level arms."""
    plan = engine.splice_plan(msgs, tenant=tenant)
    images = [file_ids.index(part["image_file"]["file_id"]) for m in msgs if isinstance(m["content"], list)
              for part in m["content"] if part.get("type") == "image_file"]
    keys = [(int(i), None) for i in plan.input_ids]
    for (start, end), image in zip(engine.adapter.image_spans(plan.input_ids), images):
        keys[start:end] = [(k, image) for k, _ in keys[start:end]]
    return plan.input_ids, plan.native_positions, keys, images


# ---- report -----------------------------------------------------------------------------------------
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def _linear_backend(engine) -> str:
    """The linear layers' backend, naming the vision tower when its layers run on it too."""
    from mmkv.adapters.cpu_kernels import OneDNNLinear

    vision = any(isinstance(m, OneDNNLinear) and m.packed is not None for m in engine.adapter.model.model.visual.modules())
    return f"{engine.cpu_linear}, vision tower included" if vision else engine.cpu_linear


def header(engine, threads: int, repeats: int) -> dict:
    import transformers

    ad = engine.adapter
    t, v = ad.text_config, ad.config.vision_config
    dev = ad.device
    return {
        "machine": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{_cpu_name()}, {os.cpu_count()} cores",
        "device": str(dev), "threads": threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "repeats": repeats,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "model": {"id": engine.model_id, "family": ad.family, "dtype": str(ad.dtype).removeprefix("torch."),
                  "params_m": round(parameter_count(ad.model) / 1e6, 1), "linear": _linear_backend(engine),
                  "lm": f"{t.num_hidden_layers} x {t.hidden_size}, {t.num_attention_heads} heads / "
                        f"{t.num_key_value_heads} KV, head_dim {getattr(t, 'head_dim', None) or t.hidden_size // t.num_attention_heads}, "
                        f"mrope {(t.rope_parameters or {}).get('mrope_section')}",
                  "vision": f"{v.depth} x {v.hidden_size}"},
    }


def run_bench(engine, modes: list[str], repeats: int, threads: int, image_tokens: list[int], skill_tokens: list[int],
              policy_tokens: int, turns: int, show: Callable[[str, dict], None], agent_turns: int = 8,
              seed: int = 0, window: int = 0, drop_chunk: int = 1, video_groups: tuple[int, ...] = (),
              group_tokens: int = 16, agent_arms: tuple[str, ...] = AGENT_ARMS) -> dict:
    """Every chosen mode; `show(kind, figures)` gets the header, each table, the agent session, the
    copy and the bytes figures as they are measured. Returns them all (the --json report). The
    agent session uses the smallest image and skill sizes, its client keeping the last `window`
    screenshots (0: all), dropping them `drop_chunk` at a time."""
    report = header(engine, threads, repeats)
    show("header", report)
    text = TextContext(engine.adapter)
    report["tables"] = []
    cases = [(bench_image, n) for n in image_tokens if "image" in modes]
    cases += [(bench_skill, n) for n in skill_tokens if "skill" in modes]
    if "video" in modes:
        from mmkv.bench.video import bench_video

        cases += [(lambda e, g, r, t: bench_video(e, g, r, t, group_tokens), g) for g in video_groups]
    for bench, n in cases:
        report["tables"].append(asdict(bench(engine, n, repeats, text)))
        show("table", report["tables"][-1])
    if "errata" in modes:
        report["tables"].append(asdict(bench_errata(engine, policy_tokens, turns, text)))
        show("table", report["tables"][-1])
    if "stream" in modes:
        from mmkv.bench.video import bench_stream

        report["stream"] = bench_stream(engine, repeats, group_tokens)
        show("stream", report["stream"])
    if "agent" in modes:
        report["agent"] = bench_agent(engine, agent_turns, seed, repeats, min(image_tokens, default=64),
                                      min(skill_tokens, default=1024), text, window, drop_chunk, agent_arms)
        show("agent", report["agent"])
    entries = _chunks(engine, image_tokens, skill_tokens) if "copy" in modes or "bytes" in modes else []
    if "copy" in modes:
        report["copy"] = bench_copy(engine, entries, repeats)
        show("copy", {"rows": report["copy"]})
    if "bytes" in modes:
        report["bytes"] = bench_bytes(engine, entries, skill_tokens)
        show("bytes", {"rows": report["bytes"]})
    return report


def _chunks(engine, image_tokens: list[int], skill_tokens: list[int]) -> list:
    """One cached chunk per image and skill size, under the tenants the image and skill cases
    used (precompiled here if those modes did not run)."""
    entries = []
    for n in image_tokens:
        tenant = f"image-{n}"
        image = {"type": "image_file", "image_file": {"file_id": engine.add_image(_picture(engine, n), tenant=tenant)}}
        plan = engine.splice_plan([{"role": "user", "content": [image, {"type": "text", "text": "?"}]}], tenant=tenant)
        entries.append(plan.placements[0].entry)
    for n in skill_tokens:
        skill_id, tenant = _skill(engine, n)
        skill = {"type": "skill", "skill_id": skill_id}
        plan = engine.splice_plan([{"role": "user", "content": [skill, {"type": "text", "text": "?"}]}], tenant=tenant)
        entries.append(plan.placements[0].entry)
    return entries
