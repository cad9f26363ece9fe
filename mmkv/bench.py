"""TTFT of a repeated-image request: cached splice vs full recompute, side by side in one run.

    python -m mmkv.bench [--family qwen2_5_vl] [--image-px 448] [--repeats 7] [--model-dir DIR]

Without --model-dir it builds a bench-size random model from config (the size is printed).
Runs are interleaved (reuse, full, reuse, full, ...) so machine noise hits both arms alike.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--image-px", type=int, default=448)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seam-tokens", type=int, default=1)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            vision = dict(BENCH_VISION, patch_size=16) if args.family == "qwen3_vl" else BENCH_VISION
            if args.family == "qwen2_vl":
                vision = dict(depth=4, embed_dim=256, hidden_size=512, num_heads=4)
            text = dict(BENCH_TEXT, head_dim=64) if args.family == "qwen3_vl" else BENCH_TEXT
            rope = {"rope_type": "default", "rope_theta": 10000.0,
                    "mrope_section": [8, 12, 12] if args.family != "qwen3_vl" else [12, 10, 10]}
            if args.family == "qwen3_vl":
                rope["mrope_interleaved"] = True
            model_dir = save_tiny_checkpoint(args.family, f"{tmp}/bench", seed=0, max_pixels=1024 * 1024,
                                             text={**text, "rope_parameters": rope}, vision=vision)
        engine = Engine.from_pretrained(model_dir, seam_tokens=args.seam_tokens)
        params = sum(p.numel() for p in engine.adapter.model.parameters())
        image_id = engine.add_image(_picture(args.image_px))
        info = engine.image_info(image_id)

        def turn(k: int):
            return [{"role": "system", "content": "you are a careful assistant ."},
                    {"role": "user", "content": f"turn {k}: " + "some context . " * (1 + k % 3)},
                    {"role": "assistant", "content": "noted ."},
                    {"role": "user", "content": [{"type": "text", "text": "look again at"},
                                                 {"type": "image_file", "image_file": {"file_id": image_id}},
                                                 {"type": "text", "text": "what is in it ?"}]}]

        engine.generate(turn(0), max_new_tokens=1)
        engine.generate(turn(0), max_new_tokens=1, reuse=False)
        ttft = {True: [], False: []}
        prompt = 0
        for k in range(args.repeats):
            for reuse in (True, False):
                r = engine.generate(turn(k + 1), max_new_tokens=1, reuse=reuse)
                ttft[reuse].append(r.ttft_s)
                prompt = r.usage.prompt_tokens
        hit, full = statistics.median(ttft[True]), statistics.median(ttft[False])
        device = engine.adapter.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
        print(f"# mmkv bench | {device.type} ({name}), torch threads {torch.get_num_threads()} | "
              f"{engine.adapter.family} {params / 1e6:.1f}M params, {engine.adapter.dtype} | image "
              f"{args.image_px}px -> {info.image_tokens} tokens | prompt {prompt} tokens | seam {args.seam_tokens} "
              f"| median of {args.repeats}")
        print("| arm | TTFT median (ms) | TTFT min (ms) | ratio vs full |")
        print("|---|---|---|---|")
        print(f"| reuse (cached image, spliced) | {hit * 1e3:.1f} | {min(ttft[True]) * 1e3:.1f} | {full / hit:.2f}x |")
        print(f"| full recompute (reuse=False) | {full * 1e3:.1f} | {min(ttft[False]) * 1e3:.1f} | 1.00x |")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"(bench ran {time.perf_counter() - start:.0f} s)")
