"""TTFT of the fast paths vs full recompute, side by side in one run, one table.

    python -m mmkv.bench                              # a cached image asked about again
    python -m mmkv.bench --mode skill --skill-tokens 8192
    python -m mmkv.bench --mode errata --policy-tokens 2048 --turns 8

Without --model-dir it builds a bench-size random Qwen model from config (the size is printed).
Runs are interleaved (fast, full, fast, full, ...) so machine noise hits both arms alike.
"""

from __future__ import annotations

import argparse
import io
import platform
import statistics
import tempfile
import time

import torch
from PIL import Image, ImageDraw

from mmkv import Engine
from mmkv.tiny import save_tiny_checkpoint

BENCH_TEXT = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4)
BENCH_VISION = dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=512)


def _picture(px: int) -> bytes:
    img = Image.new("RGB", (px, px), (90, 120, 150))
    draw = ImageDraw.Draw(img)
    for i in range(0, px, 32):
        draw.rectangle([i, i // 2, i + 20, i // 2 + 20], fill=(i % 255, 200, 40))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def _bench_model(family: str, tmp: str) -> str:
    vision = dict(BENCH_VISION, patch_size=16) if family == "qwen3_vl" else BENCH_VISION
    if family == "qwen2_vl":
        vision = dict(depth=4, embed_dim=256, hidden_size=512, num_heads=4)
    text = dict(BENCH_TEXT, head_dim=64) if family == "qwen3_vl" else BENCH_TEXT
    rope = {"rope_type": "default", "rope_theta": 10000.0,
            "mrope_section": [8, 12, 12] if family != "qwen3_vl" else [12, 10, 10]}
    if family == "qwen3_vl":
        rope["mrope_interleaved"] = True
    return save_tiny_checkpoint(family, f"{tmp}/bench", seed=0, max_pixels=1024 * 1024,
                                text={**text, "rope_parameters": rope, "max_position_embeddings": 32768},
                                vision=vision)


def _interleaved(arms: dict, repeats: int) -> dict:
    """Run each arm's request(k) in turn, k = 1..repeats; returns {arm: [results]}."""
    out = {name: [] for name in arms}
    for name, request in arms.items():
        request(0)  # warm-up: precompiles, allocator
    for k in range(1, repeats + 1):
        for name, request in arms.items():
            out[name].append(request(k))
    return out


def _table(rows: list[tuple[str, list]], ref: str) -> None:
    """One markdown table: median / min TTFT, ratio against `ref`, tokens computed, cached share."""
    med = {name: statistics.median(r.ttft_s for r in results) for name, results in rows}
    print("| arm | TTFT median (ms) | TTFT min (ms) | speed-up vs " + ref + " | LM tokens computed | cached / prompt |")
    print("|---|---|---|---|---|---|")
    for name, results in rows:
        last = results[-1]
        print(f"| {name} | {med[name] * 1e3:.1f} | {min(r.ttft_s for r in results) * 1e3:.1f} | "
              f"{med[ref] / med[name]:.2f}x | {last.lm_tokens_computed} | "
              f"{statistics.mean(r.usage.cached_tokens / r.usage.prompt_tokens for r in results):.3f} |")


def _header(engine: Engine, what: str, repeats: int) -> None:
    device = engine.adapter.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    params = sum(p.numel() for p in engine.adapter.model.parameters())
    print(f"# mmkv bench | {device.type} ({name}), torch threads {torch.get_num_threads()} | "
          f"{engine.adapter.family} {params / 1e6:.1f}M params, {engine.adapter.dtype} | seam "
          f"{engine.settings.seam_tokens} | {what} | median of {repeats}")


def bench_image(engine: Engine, image_px: int, repeats: int) -> None:
    """A cached image asked about again after other text, vs the full recompute."""
    image_id = engine.add_image(_picture(image_px))

    def turn(k: int):
        return [{"role": "system", "content": "you are a careful assistant ."},
                {"role": "user", "content": f"turn {k}: " + "some context . " * (1 + k % 3)},
                {"role": "assistant", "content": "noted ."},
                {"role": "user", "content": [{"type": "text", "text": "look again at"},
                                             {"type": "image_file", "image_file": {"file_id": image_id}},
                                             {"type": "text", "text": "what is in it ?"}]}]

    res = _interleaved({"reuse (cached image, spliced)": lambda k: engine.generate(turn(k), max_new_tokens=1),
                        "full recompute (reuse=False)": lambda k: engine.generate(turn(k), max_new_tokens=1,
                                                                                  reuse=False)}, repeats)
    info = engine.image_info(image_id)
    _header(engine, f"image {image_px}px -> {info.image_tokens} tokens, prompt "
                    f"{res['full recompute (reuse=False)'][-1].usage.prompt_tokens} tokens", repeats)
    _table(list(res.items()), "full recompute (reuse=False)")


def _text_of(engine: Engine, tokens: int, sentence: str) -> str:
    text = sentence
    while len(engine.adapter.tokenizer(text)["input_ids"]) < tokens:
        text += sentence
    return text


def bench_skill(engine: Engine, skill_tokens: int, repeats: int) -> None:
    """A skill spliced after a per-user prefix (so the prefix cache cannot cover it) vs its prefill."""
    text = _text_of(engine, skill_tokens, "tool search ( query , top_k ) returns ranked documents . ")
    skill_id = engine.add_skill("spec", text)

    def msgs(k: int):
        return [{"role": "system", "content": [{"type": "text", "text": f"user {k} prefers short answers .\n"},
                                               {"type": "skill", "skill_id": skill_id}]},
                {"role": "user", "content": "which tool finds documents ?"}]

    res = _interleaved({"skill spliced": lambda k: engine.generate(msgs(k), max_new_tokens=1),
                        "full prefill (reuse=False)": lambda k: engine.generate(msgs(k), max_new_tokens=1,
                                                                                reuse=False)}, repeats)
    _header(engine, f"skill {engine.skill_info(skill_id).tokens} tokens", repeats)
    _table(list(res.items()), "full prefill (reuse=False)")


def bench_errata(engine: Engine, policy_tokens: int, turns: int) -> None:
    """An agent loop whose status field changes every turn: an appended erratum vs editing the
    field in the system prompt (the prefix cache then stops at the field)."""
    policy = _text_of(engine, policy_tokens, "refunds need a delivered order and a damage report within thirty days . ")

    def conversation(t: int, erratum: bool):
        values = [f"{('pending', 'shipped')[i % 2]}-{i}" for i in range(t + 1)]
        msgs = [{"role": "system", "content": f"order_status: {values[0] if erratum else values[t]}\n" + policy}]
        for u in range(t + 1):
            parts = [{"type": "state_update", "field": "order_status", "value": values[u]}] if erratum and u else []
            msgs.append({"role": "user", "content": parts + [{"type": "text", "text": "refund or escalate ?"}]})
            if u < t:
                msgs.append({"role": "assistant", "content": "escalate"})
        return msgs

    res = {"erratum (appended state update)": [], "in-prefix edit (recompute)": []}
    for t in range(turns):
        res["erratum (appended state update)"].append(
            engine.generate(conversation(t, True), max_new_tokens=1, tenant="erratum"))
        res["in-prefix edit (recompute)"].append(
            engine.generate(conversation(t, False), max_new_tokens=1, tenant="in-prefix"))
    _header(engine, f"{policy_tokens}-token policy, {turns} turns, turns 2..{turns} shown", turns - 1)
    _table([(name, results[1:]) for name, results in res.items()], "in-prefix edit (recompute)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="image", choices=["image", "skill", "errata"])
    ap.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--image-px", type=int, default=448)
    ap.add_argument("--skill-tokens", type=int, default=2048)
    ap.add_argument("--policy-tokens", type=int, default=2048)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seam-tokens", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine.from_pretrained(args.model_dir or _bench_model(args.family, tmp),
                                        seam_tokens=args.seam_tokens)
        if args.mode == "image":
            bench_image(engine, args.image_px, args.repeats)
        elif args.mode == "skill":
            bench_skill(engine, args.skill_tokens, args.repeats)
        else:
            bench_errata(engine, args.policy_tokens, args.turns)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"(bench ran {time.perf_counter() - start:.0f} s)")
