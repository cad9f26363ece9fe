"""`mmkv bench-concurrency`: many clients at once through the HTTP server, continuous batching
against one-at-a-time decoding, measured side by side in one run.

For N clients (1, 4, 8) each sends one streamed chat with `--tokens` completion tokens (end
tokens banned, so every answer has the same length); the table gives aggregate completion tokens
per second and p50 / p90 TTFT, for the server with `--max-batch 8` (batched) and `--max-batch 1`
(serial: what mmkv did before the scheduler). A last row: a short request's TTFT alone and while
4 long decodes run. Arms alternate round by round; each cell is the median over `--rounds`. The
clients run in a separate process, so their JSON parsing does not compete with the server for
the interpreter.

`--mode prefill` (chunked prefill): one stream decodes; once it has its first tokens a request
with a long prompt (`--prompt-tokens`, text, no prefix-cache hit) arrives. For the server with
prefills whole (`--prefill-chunk 0`) and chunked (`--prefill-chunk`; each chunk with an arrival
preempting the forward in flight, the default, and without; `--prefill-slice-ms` adds arms in
slices of those times), the table gives the decoding
stream's largest gap between two tokens while the long prompt is prefilled (and its usual gap)
and the long request's TTFT, with the ratio of chunked to whole; and a short request's TTFT
alone, when it arrives just behind the long prompt, and when it arrives mid-prefill (once the
stream has three more tokens, half a stream gap later: halfway through a forward of the long
prompt, whose context has grown), against alone (prefill fairness).

`--mix` (with `--mode clients`): real traffic instead of equal text requests. Each client sends
`MIX_REQUESTS` requests back to back, each about a picture of `--image-tokens` image tokens (two
pictures, uploaded once, shared by the clients: a cached prefix of system prompt and image, then
the client's own question), `temperature` 1.0 with a seed, completion lengths from 2 to 24 tokens
(`MIX_LENGTHS`, each client starting at its own place in the cycle, so every client asks for the
same tokens in another order), end tokens banned on every second request and other `logit_bias`
entries or none on the rest (so some end early, by their own seeded draw). The table adds each
batched cell's ratio to the serial arm's, and an arm without prefills riding in the decode steps
(`--no-ride-prefill`).

`--mode shadow`: the fidelity monitor's cost: 4 clients streaming about one uploaded image (spliced
at a moved position, the fast path it shadows), tokens/s with `--shadow-rate` 0, 0.01 and 0.1.
"""

from __future__ import annotations

import dataclasses
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


def _server(engine, max_batch: int, prefill_chunk: int | None = None, **settings_kw):
    """The app on a loopback port in this process; `prefill_chunk` None: the server's default;
    `settings_kw`: more ServerSettings fields."""
    import uvicorn

    from mmkv.server.app import ServerSettings, create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    settings = ServerSettings(max_batch=max_batch, **settings_kw)
    if prefill_chunk is not None:  # 0: prefills whole
        settings = dataclasses.replace(settings, prefill_chunk=prefill_chunk)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, settings), log_level="warning"))
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
    return _run_threads([threading.Thread(target=_stream, args=(url, b, out, i)) for i, b in enumerate(bodies)], out)


def _run_threads(threads: list[threading.Thread], out: list) -> dict:
    """Start every thread, wait for all; the wall time and `out`, which they fill."""
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall": time.perf_counter() - t0, "results": out}


def _run_sequences(url: str, sequences: list[list[dict]]) -> dict:
    """In the client process: one thread per client sending its bodies one after another; the wall
    time and every request's result."""
    out: list = [None] * sum(len(seq) for seq in sequences)
    starts = [sum(len(seq) for seq in sequences[:c]) for c in range(len(sequences))]

    def client(c: int) -> None:
        for j, body in enumerate(sequences[c]):
            _stream(url, body, out, starts[c] + j)
    return _run_threads([threading.Thread(target=client, args=(c,)) for c in range(len(sequences))], out)


def _token_times(url: str, body: dict, out: dict, started: threading.Event, after: int) -> None:
    """One streamed chat: perf_counter time of each content event in out["times"]; `started` is set
    once `after` of them arrived."""
    import httpx

    out["sent"], out["times"] = time.perf_counter(), []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                out["times"].append(time.perf_counter())
                if len(out["times"]) == after:
                    started.set()
    started.set()


def _run_stall(url: str, bodies: list[dict]) -> dict:
    """In the client process: a short request alone; then the decoding stream, the long prompt
    once the stream has 8 tokens, and the short request again just after the long one. The
    stream's largest gap between tokens from the long request's arrival to its first token, the
    stream's median gap before it, the long request's TTFT, and the short request's TTFT alone,
    behind the long prompt and mid-prefill."""
    stream, long_, short_alone, short_behind, short_mid = {}, {}, {}, {}, {}
    _token_times(url, bodies[2], short_alone, threading.Event(), 1)
    going = threading.Event()
    first = threading.Thread(target=_token_times, args=(url, bodies[0], stream, going, 8))
    first.start()
    going.wait()
    second = threading.Thread(target=_token_times, args=(url, bodies[1], long_, threading.Event(), 1))
    second.start()
    time.sleep(0.05)  # the long prompt is admitted first
    third = threading.Thread(target=_token_times, args=(url, bodies[2], short_behind, threading.Event(), 1))
    third.start()
    seen = len(stream["times"])
    while len(stream["times"]) < seen + 3 and not long_.get("times") and first.is_alive():
        time.sleep(0.005)  # mid-prefill: three turns into the long prompt ...
    times = stream["times"]
    time.sleep(0.5 * (times[-1] - times[-2]) if len(times) > 1 else 0.0)  # ... halfway through a turn's forward
    fourth = threading.Thread(target=_token_times, args=(url, bodies[3], short_mid, threading.Event(), 1))
    fourth.start()
    for t in (second, third, fourth, first):
        t.join()
    arrived, ttft_at = long_["sent"], long_["times"][0]
    times = stream["times"]
    before = [b - a for a, b in zip(times, times[1:]) if b <= arrived]
    around = [t for t in times if t <= arrived][-1:] + [t for t in times if arrived < t <= ttft_at] + \
        [t for t in times if t > ttft_at][:1]  # the stream's tokens from the arrival to just after the TTFT
    return {"gap": max(b - a for a, b in zip(around, around[1:])), "usual": statistics.median(before),
            "ttft": ttft_at - arrived, "short_alone": short_alone["times"][0] - short_alone["sent"],
            "short_behind": short_behind["times"][0] - short_behind["sent"],
            "short_mid": short_mid["times"][0] - short_mid["sent"], "mid_early": bool(long_.get("times")) and
            short_mid["sent"] >= long_["times"][0]}  # the long prompt was done before it arrived


def _spawn(url: str, bodies: list, run: str = "_run_clients") -> subprocess.Popen:
    code = (f"import json, sys; from mmkv.bench.concurrency import {run}; "
            f"url, bodies = json.load(sys.stdin); print(json.dumps({run}(url, bodies)))")
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
    return {"model": engine.model_id, "max_tokens": tokens, "temperature": 0, "stream": True, "logit_bias": banned,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"request {i} : describe the image . " * 2}]}


def _long_body(engine, prompt_tokens: int, tag: str) -> dict:
    """A streamed chat whose prompt is about `prompt_tokens` tokens of text, `tag` first (so no
    two share a prefix-cache block past the template's header); two completion tokens."""
    unit = " describe the image ."
    reps = max(prompt_tokens // len(engine.adapter.tokenizer(unit)["input_ids"]), 1)
    body = _body(engine, 2, 0)
    body["messages"] = [{"role": "user", "content": f"{tag} :" + unit * reps}]
    return body


def _clients_table(engine, tokens: int, rounds: int) -> list[str]:
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
        _stop(servers)
    lines = _rate_lines(cells, list(servers))
    for arm in servers:
        alone, busy = statistics.median(short[(arm, "alone")]), statistics.median(short[(arm, "busy")])
        lines.append(f"short request TTFT, {arm}: alone {alone * 1e3:.0f} ms, with 4 long decodes running "
                     f"{busy * 1e3:.0f} ms ({busy / alone:.2f}x)")
    return lines


def _rate_lines(cells: dict[tuple[str, int], list], arms: list[str], vs_serial: bool = False) -> list[str]:
    """Per client count and arm: median aggregate tokens/s over the rounds, its ratio to the arm's
    one client (and, with `vs_serial`, to the serial arm at the same count), p50 / p90 TTFT over
    every request of every round."""
    head = f"{'clients':>7} {'arm':>8} {'tokens/s':>9} {'vs 1 client':>12}" + (f" {'vs serial':>10}" if vs_serial else "")
    lines = [head + f" {'p50 TTFT ms':>12} {'p90 TTFT ms':>12}"]
    for n in (1, 4, 8):
        for arm in arms:
            rate = statistics.median(r for r, _ in cells[(arm, n)])
            ttfts = sorted(t for _, ts in cells[(arm, n)] for t in ts)
            base = statistics.median(r for r, _ in cells[(arm, 1)])
            p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
            line = f"{n:>7} {arm:>8} {rate:>9.1f} {rate / base:>11.2f}x"
            if vs_serial:
                line += f" {rate / statistics.median(r for r, _ in cells[('serial', n)]):>9.2f}x"
            lines.append(line + f" {statistics.median(ttfts) * 1e3:>12.0f} {p90 * 1e3:>12.0f}")
    return lines


MIX_REQUESTS = 4  # per client, back to back
MIX_LENGTHS = (24, 2, 16, 8)  # completion tokens; client c starts at index c % 4


def _upload(url: str, png: bytes) -> str:
    import httpx

    return httpx.post(f"{url}/v1/files", data={"purpose": "vision"}, timeout=300,
                      files={"file": ("bench.png", png, "image/png")}).json()["id"]


def _mix_body(engine, file_id: str, client: int, j: int, tag: str) -> dict:
    """Client `client`'s request `j`: about the uploaded picture `file_id` after a shared system
    prompt, its own question (with `tag`: no prefix-cache hit past the image across rounds and
    arms), sampled at temperature 1.0 with its own seed, MIX_LENGTHS[(client + j) % 4] tokens at
    most; end tokens banned on even j, two other tokens biased on j % 4 == 1, no bias on j % 4 == 3."""
    body = _body(engine, MIX_LENGTHS[(client + j) % len(MIX_LENGTHS)], client)
    body.update(temperature=1.0, seed=1000 * client + j)
    if j % 4 == 1:
        body["logit_bias"] = {"5": 4.0, "11": -3.0}
    elif j % 4 == 3:
        del body["logit_bias"]
    body["messages"] = [
        {"role": "system", "content": "you are a careful assistant . answer about the image ."},
        {"role": "user", "content": [{"type": "image_file", "image_file": {"file_id": file_id}},
                                     {"type": "text", "text": f"{tag} client {client} question {j} : what is in it ?"}]}]
    return body


def _mix_table(engine, image_tokens: int, rounds: int) -> list[str]:
    """`--mix`: N clients (1, 4, 8), each MIX_REQUESTS requests back to back, batched (prefills
    riding in the decode steps, the default), batched with every prefill its own forward, and
    serial, arms alternating within each round."""
    from mmkv.bench.run import _picture

    arms = (("batched", 8, True), ("no ride", 8, False), ("serial", 1, True))
    servers = {arm: _server(engine, batch, ride_prefill=ride) for arm, batch, ride in arms}
    pictures = [_picture(engine, image_tokens, variant=v) for v in range(2)]
    cells: dict[tuple[str, int], list] = {}
    try:
        files = {arm: [_upload(url, png) for png in pictures] for arm, (_, _, url) in servers.items()}
        for arm, (_, _, url) in servers.items():  # warm-up: each picture precompiled, its prefix cached
            _collect(_spawn(url, [[_mix_body(engine, f, c, 0, f"warm {arm}") for c, f in enumerate(files[arm])]],
                            "_run_sequences"))
        for r in range(rounds):
            for n in (1, 4, 8):
                for arm, (_, _, url) in servers.items():
                    sequences = [[_mix_body(engine, files[arm][c % 2], c, j, f"round {r} {arm}")
                                  for j in range(MIX_REQUESTS)] for c in range(n)]
                    got = _collect(_spawn(url, sequences, "_run_sequences"))
                    rate = sum(g[2] for g in got["results"]) / got["wall"]
                    cells.setdefault((arm, n), []).append((rate, [g[0] for g in got["results"]]))
    finally:
        _stop(servers)
    return _rate_lines(cells, list(servers), vs_serial=True)


def _prefill_table(engine, prompt_tokens: int, chunks: list[int], slices: list[float], rounds: int) -> list[str]:
    arms = {"whole": {"prefill_chunk": 0}}
    for c in chunks:  # an arrival preempts a forward (the default), none does, in slices of each time
        arms[f"{c} preempt"] = {"prefill_chunk": c}
        arms[f"{c} no preempt"] = {"prefill_chunk": c, "preempt_prefill": False}
        for ms in slices:
            arms[f"{c}/{ms:g} ms"] = {"prefill_chunk": c, "prefill_slice_ms": ms, "preempt_prefill": False}
    servers = {arm: _server(engine, 8, **kw) for arm, kw in arms.items()}
    cells: dict[str, list[dict]] = {}
    try:
        for arm in servers:  # warm-up
            _clients(servers[arm][2], [_body(engine, 4, 0)])
        for r in range(rounds):
            for arm, (_, _, url) in servers.items():
                bodies = [_body(engine, 64, r), _long_body(engine, prompt_tokens, f"long {r} {arm}"),
                          _long_body(engine, 16, f"short {r} {arm}"), _long_body(engine, 16, f"mid {r} {arm}")]
                cells.setdefault(arm, []).append(_collect(_spawn(url, bodies, "_run_stall")))
    finally:
        _stop(servers)
    lines = [f"{'prefill':>14} {'usual gap ms':>13} {'largest gap ms':>15} {'long TTFT ms':>13} {'TTFT vs whole':>14} "
             f"{'short alone ms':>15} {'behind ms':>10} {'behind/alone':>13} {'mid ms':>7} {'mid/alone':>10}"]
    whole = statistics.median(c["ttft"] for c in cells["whole"])
    for arm in servers:
        med = {k: statistics.median(c[k] for c in cells[arm])
               for k in ("usual", "gap", "ttft", "short_alone", "short_behind", "short_mid")}
        late = sum(c["mid_early"] for c in cells[arm])
        lines.append(f"{arm:>14} {med['usual'] * 1e3:>13.0f} {med['gap'] * 1e3:>15.0f} {med['ttft'] * 1e3:>13.0f} "
                     f"{med['ttft'] / whole:>13.2f}x {med['short_alone'] * 1e3:>15.0f} "
                     f"{med['short_behind'] * 1e3:>10.0f} {med['short_behind'] / med['short_alone']:>12.2f}x "
                     f"{med['short_mid'] * 1e3:>7.0f} {med['short_mid'] / med['short_alone']:>9.2f}x"
                     + (f"  ({late} of {len(cells[arm])} mid requests came after the long TTFT)" if late else ""))
    return lines


def _image_body(engine, url: str, tokens: int, i: int) -> dict:
    """A streamed chat about an image uploaded to the server at `url` (the same bytes each time, so
    one precompile), after `i`-dependent text: a spliced image at a moved position, the fast path
    the fidelity monitor shadows."""
    import io

    import httpx
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", (224, 224), (200, 200, 200))
    ImageDraw.Draw(picture).rectangle([40, 40, 140, 120], fill=(30, 160, 60))
    buf = io.BytesIO()
    picture.save(buf, "PNG")
    file_id = httpx.post(f"{url}/v1/files", data={"purpose": "vision"}, timeout=120,
                         files={"file": ("bench.png", buf.getvalue(), "image/png")}).json()["id"]
    body = _body(engine, tokens, i)
    body["messages"] = [{"role": "user", "content": [
        {"type": "text", "text": f"client {i} : " + "look at this . " * (2 + i % 4)},
        {"type": "image_file", "image_file": {"file_id": file_id}}, {"type": "text", "text": "what is in it ?"}]}]
    return body


def _shadow_table(engine, tokens: int, rounds: int, clients: int = 4) -> list[str]:
    """Aggregate tokens/s of `clients` streams about one image with the fidelity monitor off and at
    --shadow-rate 0.01 and 0.1, arms alternating, in one run."""
    rates = (0.0, 0.01, 0.1)
    servers = {rate: _server(engine, 8, shadow_rate=rate, shadow_window=10) for rate in rates}
    cells: dict[float, list[float]] = {}
    try:
        bodies = {rate: [_image_body(engine, url, tokens, i) for i in range(clients)]
                  for rate, (_, _, url) in servers.items()}
        for rate, (_, _, url) in servers.items():  # warm-up
            _clients(url, bodies[rate][:1])
        for _ in range(rounds):
            for rate, (_, _, url) in servers.items():
                got = _clients(url, bodies[rate])
                cells.setdefault(rate, []).append(sum(g[2] for g in got["results"]) / got["wall"])
        shadows = {rate: servers[rate][0].config.app.state.ctx.worker.scheduler.shadow for rate in rates}
        summaries = {rate: (s.snapshot()["kinds"]["image"] if s is not None else None) for rate, s in shadows.items()}
    finally:
        _stop(servers)
    base = statistics.median(cells[0.0])
    lines = [f"{'shadow rate':>11} {'tokens/s':>9} {'vs off':>7} {'shadowed':>9} {'agreed':>7} {'dropped':>8}"]
    for rate in rates:
        rate_s, k = statistics.median(cells[rate]), summaries[rate]
        counts = (k["shadowed"], k["agreed"], k["dropped"]) if k else ("-", "-", "-")
        lines.append(f"{rate:>11} {rate_s:>9.1f} {rate_s / base:>6.3f}x {counts[0]:>9} {counts[1]:>7} {counts[2]:>8}")
    return lines


def _stop(servers: dict) -> None:
    for server, thread, _ in servers.values():
        server.should_exit = True
        thread.join(10)


def bench_concurrency_command(
    model_dir: Annotated[str | None, typer.Argument(help="Checkpoint dir; default: the built-in config.")] = None,
    config: Annotated[str, typer.Option(help="Random model when no MODEL_DIR: bench (140M) or tiny.")] = "bench",
    tokens: Annotated[int, typer.Option(help="Completion tokens per request.")] = 32,
    rounds: Annotated[int, typer.Option(help="Rounds; arms alternate within each.")] = 3,
    threads: Annotated[int, typer.Option(help="torch threads.")] = 2,
    mode: Annotated[str, typer.Option(help="clients (N clients, batched vs serial), prefill (a long prompt "
                                           "beside a decoding stream, whole vs chunked), shadow (the fidelity "
                                           "monitor's cost at --shadow-rate 0, 0.01, 0.1), shared (8 and 32 "
                                           "requests on one --prompt-tokens policy: the batch's KV shared vs "
                                           "whole; not in all) or all.")] = "all",
    prompt_tokens: Annotated[int, typer.Option(help="--mode prefill: the long prompt's tokens; "
                                                          "--mode shared: the policy's.")] = 2048,
    prefill_slice_ms: Annotated[str, typer.Option(help="--mode prefill: more arms, in slices of these times "
                                                       "in ms, comma-separated (none by default).")] = "",
    prefill_chunk: Annotated[str, typer.Option(help="--mode prefill: the chunked arms' chunks, comma-separated "
                                                    "(one arm each, beside the whole prefill).")] = "512",
    mix: Annotated[bool, typer.Option("--mix", help="--mode clients: each client sends requests about an image, "
                                                     "sampled with a seed, of mixed lengths and logit_bias.")] = False,
    image_tokens: Annotated[int, typer.Option(min=4, help="--mix: image tokens per picture (a square).")] = 1024,
    cpu_linear: Annotated[str, typer.Option(help="The model's linear layers: onednn (the server's default) or "
                                                 "dense (PyTorch's nn.Linear).")] = "onednn",
) -> None:
    """Aggregate tokens/s and TTFT for 1, 4 and 8 clients, batched vs serial, and a decoding
    stream's stall behind a long prefill, whole vs chunked; each in one run."""
    import torch

    from mmkv.bench.run import build_engine

    if mode not in ("clients", "prefill", "shadow", "shared", "all"):
        raise typer.BadParameter("expected clients, prefill, shadow, shared or all", param_hint="--mode")
    try:
        chunks = [int(c) for c in prefill_chunk.split(",")]
    except ValueError:
        chunks = []
    try:
        slices = [float(t) for t in prefill_slice_ms.split(",")] if prefill_slice_ms else []
    except ValueError:
        slices = [0.0]
    if slices and min(slices) <= 0:
        raise typer.BadParameter(f"expected positive times in ms, comma-separated; got {prefill_slice_ms!r}",
                                 param_hint="--prefill-slice-ms")
    if not chunks or min(chunks) < 1:
        raise typer.BadParameter(f"expected positive token counts, comma-separated; got {prefill_chunk!r}",
                                 param_hint="--prefill-chunk")
    if mix and mode not in ("clients", "all"):
        raise typer.BadParameter("--mix changes the clients table: --mode clients or all", param_hint="--mix")
    if cpu_linear not in ("onednn", "dense"):
        raise typer.BadParameter("expected onednn or dense", param_hint="--cpu-linear")
    torch.set_num_threads(threads)
    engine = build_engine(config, model_dir, "cpu", None, max(64, image_tokens) if mix else 64, cpu_linear)
    tables = []
    if mode in ("clients", "all") and mix:
        tables.append((f"{MIX_REQUESTS} requests per client back to back, each about a {image_tokens}-token image, "
                       f"temperature 1.0 with a seed, {min(MIX_LENGTHS)}-{max(MIX_LENGTHS)} tokens, logit_bias on 3 of 4",
                       _mix_table(engine, image_tokens, rounds)))
    elif mode in ("clients", "all"):
        tables.append((f"{tokens} tokens per request", _clients_table(engine, tokens, rounds)))
    if mode in ("prefill", "all"):
        tables.append((f"one stream decoding, a {prompt_tokens}-token prompt arrives",
                       _prefill_table(engine, prompt_tokens, chunks, slices, rounds)))
    if mode in ("shadow", "all"):
        tables.append((f"4 clients about one image, {tokens} tokens each, the fidelity monitor off and on",
                       _shadow_table(engine, tokens, rounds)))
    if mode == "shared":
        from mmkv.bench.shared_kv import shared_table

        tables.append((f"N requests on one {prompt_tokens}-token policy (in the prefix cache), {tokens} tokens each, "
                       "through the scheduler (no HTTP)", shared_table(engine, prompt_tokens, (8, 32), tokens, rounds)))
    for what, lines in tables:
        print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {threads} threads, "
              f"model {model_dir or config} ({engine.adapter.num_layers} layers, linear layers {engine.cpu_linear}), {what}, "
              f"median of {rounds} rounds" + ("" if "no HTTP" in what else ", HTTP on loopback, clients in another process"))
        print("\n".join(lines))


if __name__ == "__main__":
    typer.run(bench_concurrency_command)
