"""`mmkv bench-concurrency`: many clients at once through the HTTP server, continuous batching
against one-at-a-time decoding, measured side by side in one run.

For N clients (1, 4, 8) each sends one streamed chat with `--tokens` completion tokens (end
tokens banned, so every answer has the same length); the table gives aggregate completion tokens
per second and p50 / p90 TTFT, for the server with `--max-batch 8` (batched) and `--max-batch 1`
(serial: what mmkv did before the scheduler). A last row: a short request's TTFT alone and while
4 long decodes run. Arms alternate round by round; each cell is the median over `--rounds`. The
clients run in a separate process, so their JSON parsing does not compete with the server for
the interpreter.
"""

from __future__ import annotations

import json
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Annotated

import typer


def _server(engine, max_batch: int):
    import uvicorn

    from mmkv.server.app import ServerSettings, create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, ServerSettings(max_batch=max_batch)),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def _stream(url: str, body: dict, out: list, i: int) -> None:
    """One streamed chat: (seconds to the first content, seconds to the end, completion tokens)."""
    import httpx

    t0 = time.perf_counter()
    first = None
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices") and event["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    out[i] = (first if first is not None else time.perf_counter() - t0, time.perf_counter() - t0, tokens)


def _run_clients(url: str, bodies: list[dict]) -> dict:
    """In the client process: every body at once, one thread each; the wall time and each result."""
    out: list = [None] * len(bodies)
    threads = [threading.Thread(target=_stream, args=(url, b, out, i)) for i, b in enumerate(bodies)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall": time.perf_counter() - t0, "results": out}


def _spawn(url: str, bodies: list[dict]) -> subprocess.Popen:
    code = ("import json, sys; from mmkv.bench_concurrency import _run_clients; "
            "url, bodies = json.load(sys.stdin); print(json.dumps(_run_clients(url, bodies)))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    proc.stdin.write(json.dumps([url, bodies]))
    proc.stdin.close()
    return proc


def _collect(proc: subprocess.Popen) -> dict:
    out = json.loads(proc.stdout.read())
    proc.wait()
    return out


def _clients(url: str, bodies: list[dict]) -> dict:
    return _collect(_spawn(url, bodies))


def _body(engine, tokens: int, i: int) -> dict:
    """A streamed chat of exactly `tokens` completion tokens (the end tokens banned)."""
    banned = {str(t): -100 for t in engine.stop_ids}
    return {"model": "m", "max_tokens": tokens, "temperature": 0, "stream": True, "logit_bias": banned,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"request {i} : describe the image . " * 2}]}


def bench_concurrency_command(
    model_dir: Annotated[str | None, typer.Argument(help="Checkpoint dir; default: the built-in config.")] = None,
    config: Annotated[str, typer.Option(help="Random model when no MODEL_DIR: bench (140M) or tiny.")] = "bench",
    tokens: Annotated[int, typer.Option(help="Completion tokens per request.")] = 32,
    rounds: Annotated[int, typer.Option(help="Rounds; arms alternate within each.")] = 3,
    threads: Annotated[int, typer.Option(help="torch threads.")] = 2,
) -> None:
    """Aggregate tokens/s and TTFT for 1, 4 and 8 clients, batched vs serial, in one run."""
    import torch

    from mmkv.bench_run import build_engine

    torch.set_num_threads(threads)
    engine = build_engine(config, model_dir, "cpu", None, 64)
    servers = {arm: _server(engine, batch) for arm, batch in (("batched", 8), ("serial", 1))}
    cells: dict[tuple[str, int], list] = {}
    short: dict[tuple[str, str], list] = {}
    try:
        for arm in servers:  # warm-up
            _clients(servers[arm][2], [_body(engine, 4, 0)])
        for _ in range(rounds):
            for n in (1, 4, 8):
                for arm, (_, _, url) in servers.items():
                    got = _clients(url, [_body(engine, tokens, i) for i in range(n)])
                    rate = sum(g[2] for g in got["results"]) / got["wall"]
                    cells.setdefault((arm, n), []).append((rate, [g[0] for g in got["results"]]))
            for arm, (_, _, url) in servers.items():
                alone = _clients(url, [_body(engine, 2, 99)])["results"][0][0]
                longs = _spawn(url, [_body(engine, tokens * 4, i) for i in range(4)])
                time.sleep(2.0)  # the client process is up and the long decodes are running
                busy = _clients(url, [_body(engine, 2, 98)])["results"][0][0]
                _collect(longs)
                short.setdefault((arm, "alone"), []).append(alone)
                short.setdefault((arm, "busy"), []).append(busy)
    finally:
        for server, thread, _ in servers.values():
            server.should_exit = True
            thread.join(10)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {threads} threads, "
          f"model {model_dir or config} ({engine.adapter.num_layers} layers), {tokens} tokens per request, "
          f"median of {rounds} rounds, HTTP on loopback, clients in another process")
    print(f"{'clients':>7} {'arm':>8} {'tokens/s':>9} {'vs 1 client':>12} {'p50 TTFT ms':>12} {'p90 TTFT ms':>12}")
    for n in (1, 4, 8):
        for arm in servers:
            rates = [r for r, _ in cells[(arm, n)]]
            ttfts = sorted(t for _, ts in cells[(arm, n)] for t in ts)
            base = statistics.median(r for r, _ in cells[(arm, 1)])
            p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
            print(f"{n:>7} {arm:>8} {statistics.median(rates):>9.1f} {statistics.median(rates) / base:>11.2f}x "
                  f"{statistics.median(ttfts) * 1e3:>12.0f} {p90 * 1e3:>12.0f}")
    for arm in servers:
        alone, busy = statistics.median(short[(arm, "alone")]), statistics.median(short[(arm, "busy")])
        print(f"short request TTFT, {arm}: alone {alone * 1e3:.0f} ms, with 4 long decodes running "
              f"{busy * 1e3:.0f} ms ({busy / alone:.2f}x)")


if __name__ == "__main__":
    typer.run(bench_concurrency_command)
