"""`mmkv bench-serve`: online serving under load, as the paper measured it on vLLM (V1 engine,
continuous batching, automatic prefix caching, Poisson arrivals at a controlled offered load, a
shared long policy with one mutable field), here on mmkv's own HTTP server.

The server is the app `mmkv serve` runs (uvicorn on loopback, continuous batching, the prefix
cache), on a random model of a built-in config or a local checkpoint; the clients run in another
process and send each request at its Poisson arrival time, streamed, timing the first content
token (TTFT) and the end. Arms:
- in-place: every request carries the policy with the field's new value written into it, before
  the policy's text: exact-prefix caching's only option, so everything after the field is
  recomputed (the server's default edit policy, `recompute`, is exact-prefix caching's rule);
- erratum: the policy keeps the field's first value and the request appends the new one as a
  `state_update` part (an erratum line): the policy stays a prefix-cache hit;
- agent: windowed agent sessions (`agent_script`, `agent_messages` of `mmkv bench --modes agent`):
  a spliced skill, new screenshots, earlier ones shown again, the client keeping the last
  `--window` screenshots; screenshots travel inline (data: URLs), as agents send them.

The in-place arm's saturation (its throughput with every request sent at once) is measured first;
the offered rates are fractions of it (`--rates`), and every arm also runs unthrottled. Per arm
and rate: p50 / p90 / p99 TTFT, requests and completion tokens per second, the prefix-cache hit
rate (prompt tokens served from the prefix cache over prompt tokens looked up, from the server's
/metrics, as vLLM's `gpu_prefix_cache_hits / queries`) and the cached share (usage's
`cached_tokens` over `prompt_tokens`: splices included).

`write_aiperf_dataset` writes aiperf's single_turn JSONL with repeated screenshots (aiperf's own
synthetic images are unique per request); docs/bench.md gives the aiperf command.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

ARMS = ("in-place", "erratum", "agent")
FIELD = "order_status"
FIRST_VALUE = "pending"
POLICY_SENTENCE = "refunds need a delivered order and a damage report within thirty days . "
QUESTION = "refund or escalate ?"
PERCENTILES = (50, 90, 99)


# ---- arrivals ----------------------------------------------------------------------------------------
def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """The first `n` arrival times (seconds from the start) of a Poisson process of `rate` requests
    per second: cumulative sums of exponential gaps of mean 1 / rate, from a seeded generator."""
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate!r}")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n)).tolist()


# ---- the arms' requests ------------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentSessions:
    """Windowed agent sessions: each its seeded script and its screenshots as data: URLs."""

    scripts: list[list]  # per session, its AgentTurns
    screenshots: list[list[str]]  # per session, screenshot index -> data: URL
    skill_id: str
    window: int
    drop_chunk: int


@dataclass(frozen=True)
class Workload:
    """What every request of a run shares: the model's name, the policy, the completion length
    (the end tokens banned, so each answer has exactly `tokens` tokens)."""

    model: str
    policy: str
    tokens: int
    end_ids: tuple[int, ...]

    def chat(self, messages: list[dict]) -> dict:
        return {"model": self.model, "messages": messages, "max_tokens": self.tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True},
                "logit_bias": {str(t): -100 for t in self.end_ids}}

    def in_place(self, value: str) -> dict:
        """The field's new value written into the policy (the prefix after it changes)."""
        return self.chat([{"role": "system", "content": f"{FIELD}: {value}\n" + self.policy},
                          {"role": "user", "content": QUESTION}])

    def erratum(self, value: str) -> dict:
        """The policy as first sent, the new value appended as an erratum."""
        return self.chat([{"role": "system", "content": f"{FIELD}: {FIRST_VALUE}\n" + self.policy},
                          {"role": "user", "content": [{"type": "state_update", "field": FIELD, "value": value},
                                                       {"type": "text", "text": QUESTION}]}])

    def agent(self, sessions: AgentSessions, session: int, turn: int) -> dict:
        """Turn `turn` of agent session `session`, the client's window applied, screenshots inline."""
        from mmkv.bench.run import agent_messages

        shots = sessions.screenshots[session]
        msgs = agent_messages(sessions.scripts[session], turn, sessions.skill_id, shots, sessions.window,
                              sessions.drop_chunk)
        return self.chat([_inline_images(m) for m in msgs])


def _inline_images(message: dict) -> dict:
    """image_file parts whose file_id is a data: URL, as image_url parts."""
    if not isinstance(message["content"], list):
        return message
    parts = [{"type": "image_url", "image_url": {"url": p["image_file"]["file_id"]}} if p["type"] == "image_file"
             else p for p in message["content"]]
    return {**message, "content": parts}


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def arm_bodies(arm: str, workload: Workload, n: int, tag: str, sessions: AgentSessions | None = None) -> list[dict]:
    """The `n` requests of one cell, in arrival order. in-place / erratum: the field's value is new
    in every request (`tag` keeps values of different cells apart, so no cell hits another's
    prefix). agent: request k is the next turn of session k mod S."""
    if arm == "in-place":
        return [workload.in_place(f"{tag}-{k}") for k in range(n)]
    if arm == "erratum":
        return [workload.erratum(f"{tag}-{k}") for k in range(n)]
    if arm == "agent":
        s = len(sessions.scripts)
        return [workload.agent(sessions, k % s, k // s) for k in range(n)]
    raise ValueError(f"unknown arm {arm!r}; expected one of {', '.join(ARMS)}")


# ---- the clients (another process) ---------------------------------------------------------------------
def _one(url: str, offset: float, body: dict, t0: float, out: list, i: int) -> None:
    """Send `body` at t0 + offset, streamed: its times from t0 and its usage, or its error."""
    import httpx

    time.sleep(max(0.0, t0 + offset - time.perf_counter()))
    sent = time.perf_counter()
    rec = {"offset": offset, "sent": sent - t0, "ttft": None, "end": None, "usage": None, "error": None}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
            else:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        rec["error"] = json.dumps(event["error"])[:200]
                    elif rec["ttft"] is None and event.get("choices") and event["choices"][0]["delta"].get("content"):
                        rec["ttft"] = time.perf_counter() - sent
                    if event.get("usage"):
                        rec["usage"] = event["usage"]
    except httpx.HTTPError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["end"] = time.perf_counter() - t0
    out[i] = rec


def run_schedule(url: str, schedule: list[tuple[float, dict]]) -> list[dict]:
    """In the client process: each (offset, body) sent at its offset on its own thread."""
    out: list = [None] * len(schedule)
    t0 = time.perf_counter() + 0.2  # every thread started before the first arrival
    threads = [threading.Thread(target=_one, args=(url, offset, body, t0, out, i))
               for i, (offset, body) in enumerate(schedule)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


class ClientProcess:
    """The clients' process, started once: each `run` hands it a schedule (one JSON line) and reads
    back its records (one JSON line)."""

    CODE = ("import json, sys\nfrom mmkv.bench.serve import run_schedule\nfor line in sys.stdin:\n"
            "    print(json.dumps(run_schedule(*json.loads(line))), flush=True)")

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def run(self, url: str, schedule: list[tuple[float, dict]]) -> list[dict]:
        self.proc.stdin.write(json.dumps([url, schedule]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the client process ended (exit code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


# ---- one cell ------------------------------------------------------------------------------------------
def _prefix_counters(url: str) -> tuple[float, float]:
    """(prefix-cache hit tokens, query tokens) from the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    got = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            got[sample.name.removesuffix("_total")] = sample.value
    return got.get("mmkv:prefix_cache_hits_tokens", 0.0), got.get("mmkv:prefix_cache_queries_tokens", 0.0)


@dataclass
class Cell:
    arm: str
    rate: float | None  # offered requests per second; None: unthrottled (every request at once)
    fraction: float | None  # the rate over the in-place arm's saturation
    requests: int
    errors: int
    ttft_ms: dict  # percentile -> ms
    req_s: float
    tokens_s: float
    prefix_hit: float  # prefix-cache hit tokens / query tokens, from /metrics
    cached_share: float  # usage: cached_tokens / prompt_tokens
    records: list = field(default_factory=list)


def run_cell(clients: ClientProcess, url: str, arm: str, bodies: list[dict], rate: float | None,
             fraction: float | None, seed: int) -> Cell:
    offsets = poisson_arrivals(rate, len(bodies), seed) if rate else [0.0] * len(bodies)
    hits0, queries0 = _prefix_counters(url)
    records = clients.run(url, list(zip(offsets, bodies)))
    hits1, queries1 = _prefix_counters(url)
    ok = [r for r in records if r["error"] is None and r["ttft"] is not None]
    ttfts = np.array([r["ttft"] for r in ok]) * 1e3
    span = max((r["end"] for r in ok), default=0.0)  # from the schedule's start
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok if r["usage"])
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok if r["usage"])
    completion = sum(r["usage"]["completion_tokens"] for r in ok if r["usage"])
    return Cell(arm, rate, fraction, len(bodies), len(records) - len(ok),
                {p: float(np.percentile(ttfts, p)) if len(ttfts) else math.nan for p in PERCENTILES},
                len(ok) / span if span else 0.0, completion / span if span else 0.0,
                (hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else 0.0,
                cached / prompt if prompt else 0.0, records)


# ---- the run -------------------------------------------------------------------------------------------
@dataclass
class Settings:
    arms: tuple[str, ...] = ARMS
    fractions: tuple[float, ...] = (0.5, 1.0, 1.5)
    requests: int = 12  # per cell
    saturation_requests: int = 12
    policy_tokens: int = 512
    tokens: int = 8
    image_tokens: int = 64
    skill_tokens: int = 256
    sessions: int = 2
    window: int = 3
    drop_chunk: int = 1
    seed: int = 0


def _agent_sessions(engine, url: str, settings: Settings, turns: int, first_variant: int) -> AgentSessions:
    """`settings.sessions` new sessions of `turns` turns each (scripts seeded apart, screenshots of
    their own), their skill created on the server."""
    import httpx

    from mmkv.bench.run import SKILL_SENTENCE, _picture, _text_of, agent_script

    scripts = [agent_script(max(turns, 3), settings.seed + first_variant + s) for s in range(settings.sessions)]
    shots, variant = [], first_variant
    for script in scripts:
        count = sum(t.new_screenshot is not None for t in script)
        shots.append([data_url(_picture(engine, settings.image_tokens, variant=variant + i)) for i in range(count)])
        variant += count
    text = _text_of(engine.adapter.tokenizer, settings.skill_tokens, SKILL_SENTENCE)
    r = httpx.post(f"{url}/v1/skills", json={"name": "agent-spec", "text": text}, timeout=600)
    r.raise_for_status()
    return AgentSessions(scripts, shots, r.json()["id"], settings.window, settings.drop_chunk)


class Bench:
    """One server, the cells run against it; each cell's requests new to the server (field values,
    screenshots) but the shared policy and skill, which are warmed once."""

    def __init__(self, engine, url: str, settings: Settings, clients: ClientProcess | None = None):
        from mmkv.bench.run import _text_of

        self.engine, self.url, self.settings, self.clients = engine, url, settings, clients
        policy = _text_of(engine.adapter.tokenizer, settings.policy_tokens, POLICY_SENTENCE)
        self.workload = Workload(engine.model_id, policy, settings.tokens, tuple(sorted(engine.stop_ids)))
        self.cells = 0
        self.variants = 0  # screenshot variants used so far

    def bodies(self, arm: str, n: int) -> list[dict]:
        self.cells += 1
        sessions = None
        if arm == "agent":
            turns = -(-n // self.settings.sessions)
            sessions = _agent_sessions(self.engine, self.url, self.settings, turns, self.variants)
            self.variants += sum(len(s) for s in sessions.screenshots)
        return arm_bodies(arm, self.workload, n, f"c{self.cells}", sessions)

    def warm(self) -> None:
        """The policy's prefix cached (the erratum arm's first request would do it), the server's
        code paths run once; untimed, so sent from this process."""
        run_schedule(self.url, [(0.0, b) for arm in self.settings.arms for b in self.bodies(arm, 1)])

    def cell(self, arm: str, n: int, rate: float | None, fraction: float | None, seed: int) -> Cell:
        return run_cell(self.clients, self.url, arm, self.bodies(arm, n), rate, fraction, seed)


def run_bench_serve(engine, settings: Settings, show=print) -> dict:
    """Saturation first (every arm unthrottled; the in-place arm's throughput sets the rates), then
    each offered rate, arms in rotating order. `show` gets each table line as it is measured."""
    from mmkv.bench.concurrency import _server, _stop

    server = _server(engine, 8, max_queue=max(256, settings.requests, settings.saturation_requests))
    url, clients = server[2], ClientProcess()
    cells: list[Cell] = []
    try:
        bench = Bench(engine, url, settings, clients)
        bench.warm()
        show(HEADER)
        for arm in settings.arms:
            cells.append(bench.cell(arm, settings.saturation_requests, None, None, settings.seed))
            show(format_cell(cells[-1]))
        saturation = next((c.req_s for c in cells if c.arm == "in-place"), cells[0].req_s)
        for i, fraction in enumerate(settings.fractions):
            k = i % len(settings.arms)
            for arm in settings.arms[k:] + settings.arms[:k]:
                # every arm of a rate gets the same arrival times
                cells.append(bench.cell(arm, settings.requests, fraction * saturation, fraction, settings.seed + i))
                show(format_cell(cells[-1]))
    finally:
        clients.close()
        _stop({"server": server})
    return {"settings": asdict(settings), "saturation_req_s": saturation, "cells": [asdict(c) for c in cells]}


# ---- report --------------------------------------------------------------------------------------------
HEADER = ("| offered req/s | x in-place saturation | arm | requests (errors) | p50 TTFT ms | p90 TTFT ms | "
          "p99 TTFT ms | req/s | tokens/s | prefix-cache hit | cached share |\n|---|---|---|---|---|---|---|---|---|---|---|")


def format_cell(c: Cell | dict) -> str:
    c = asdict(c) if isinstance(c, Cell) else c
    rate = "unthrottled" if c["rate"] is None else f"{c['rate']:.2f}"
    fraction = "-" if c["fraction"] is None else f"{c['fraction']:.2f}x"
    t = c["ttft_ms"]
    return (f"| {rate} | {fraction} | {c['arm']} | {c['requests']} ({c['errors']}) | {t[50]:.0f} | {t[90]:.0f} | "
            f"{t[99]:.0f} | {c['req_s']:.2f} | {c['tokens_s']:.1f} | {100 * c['prefix_hit']:.1f}% | "
            f"{100 * c['cached_share']:.1f}% |")


def compare(report: dict) -> list[str]:
    """Per offered rate: the in-place arm's p90 TTFT over the erratum's, the erratum's throughput
    over the in-place's; and whether the erratum leads on both at every rate past half of
    saturation (unthrottled included)."""
    by = {(c["arm"], c["fraction"]): c for c in report["cells"]}
    lines = ["| x in-place saturation | p90 TTFT, in-place / erratum | req/s, erratum / in-place |", "|---|---|---|"]
    ahead = []
    for fraction in [None, *report["settings"]["fractions"]]:
        a, b = by.get(("in-place", fraction)), by.get(("erratum", fraction))
        if a is None or b is None:
            continue
        p90 = a["ttft_ms"][90] / b["ttft_ms"][90]
        thr = b["req_s"] / a["req_s"] if a["req_s"] else math.inf
        lines.append(f"| {'unthrottled' if fraction is None else f'{fraction:.2f}x'} | {p90:.1f}x | {thr:.2f}x |")
        if fraction is None or fraction > 0.5:
            ahead.append(p90 > 1 and thr > 1)
    if ahead:
        lines.append(f"\nerratum ahead of in-place on p90 TTFT and throughput at every rate past half of "
                     f"saturation: {'yes' if all(ahead) else 'no'} ({sum(ahead)} of {len(ahead)} rates)")
    return lines


# ---- aiperf --------------------------------------------------------------------------------------------
AIPERF_TOKENIZER = "Qwen/Qwen2.5-VL-7B-Instruct"  # found offline in HF_HUB_CACHE (mmkv.testing.realshape writes it)


def write_aiperf_dataset(path: Path, engine, n: int, screenshots: int, policy_tokens: int, image_tokens: int,
                         first_variant: int = 0) -> Path:
    """aiperf's single_turn JSONL: `n` requests, each the shared policy, a step line of its own and
    one of `screenshots` PNG files (written beside the file, pictures `first_variant` on) in turn,
    so with fewer screenshots than requests each comes back after other text: exact-prefix caching
    recomputes it, mmkv splices it. `screenshots` = `n`: every request's its own."""
    from mmkv.bench.run import _picture, _text_of

    pictures = [_picture(engine, image_tokens, variant=first_variant + i) for i in range(screenshots)]
    return write_aiperf_lines(path, _text_of(engine.adapter.tokenizer, policy_tokens, POLICY_SENTENCE), pictures, n)


def write_aiperf_lines(path: Path, policy: str, pictures: list[bytes], n: int) -> Path:
    """`n` single_turn lines: `policy`, a step line of each request's own, and the PNG `pictures`
    (written beside the file) in turn."""
    path.parent.mkdir(parents=True, exist_ok=True)
    files = []
    for i, png in enumerate(pictures):
        f = path.parent / f"screenshot-{i}.png"
        f.write_bytes(png)
        files.append(f)
    with path.open("w") as out:
        for k in range(n):
            out.write(json.dumps({"text": f"{policy}\nstep {k} : what changed on this screen ?",
                                  "image": str(files[k % len(files)].resolve())}) + "\n")
    return path


def aiperf_command(url: str, workload: Workload, rate: float, n: int, seed: int, out_dir: Path,
                   dataset: Path | None, image_px: int, policy_tokens: int,
                   tokenizer: str = AIPERF_TOKENIZER) -> list[str]:
    """`aiperf profile`: its chat endpoint, streamed, Poisson arrivals at `rate`, `n` requests of
    `workload.tokens` completion tokens (the end tokens banned through logit_bias, so the length is
    exact); the token counts from the server's usage. With `dataset`, its requests in order (the
    repeated screenshots); else aiperf's synthetic ones: a shared system prompt of
    `policy_tokens`, a short user text and a unique `image_px` square image each."""
    extra = {"temperature": 0, "logit_bias": {str(t): -100 for t in workload.end_ids}}
    cmd = [sys.executable, "-m", "aiperf", "profile", "--model", workload.model, "--tokenizer", tokenizer,
           "--url", url, "--endpoint-type", "chat", "--streaming", "--use-server-token-count",
           "--request-rate", f"{rate:.4f}", "--arrival-pattern", "poisson", "--request-count", str(n),
           "--random-seed", str(seed), "--prompt-output-tokens-mean", str(workload.tokens),
           "--extra-inputs", json.dumps(extra), "--ui-type", "none", "--no-gpu-telemetry",
           "--output-artifact-dir", str(out_dir)]
    if dataset is not None:
        return cmd + ["--custom-dataset-type", "single_turn", "--input-file", str(dataset),
                      "--dataset-sampling-strategy", "sequential"]
    return cmd + ["--shared-system-prompt-length", str(policy_tokens), "--prompt-input-tokens-mean", "16",
                  "--prompt-input-tokens-stddev", "0", "--image-batch-size", "1", "--image-width-mean", str(image_px),
                  "--image-width-stddev", "0", "--image-height-mean", str(image_px), "--image-height-stddev", "0",
                  "--image-format", "png"]


def aiperf_summary(out_dir: Path) -> dict:
    """TTFT percentiles (ms), requests and output tokens per second, errors and the cached share of
    prompt tokens from aiperf's own export."""
    d = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    ttft = d["time_to_first_token"]
    return {"ttft_ms": {p: ttft[f"p{p}"] for p in PERCENTILES}, "req_s": d["request_throughput"]["avg"],
            "tokens_s": d["output_token_throughput"]["avg"],
            "requests": int(d["request_count"]["avg"]),
            "errors": int(sum(e.get("count", 0) for e in d.get("error_summary") or [])),
            "prompt_tokens": d["usage_prompt_tokens"]["avg"],
            "cached_share": d.get("overall_usage_prompt_cache_read_pct", {}).get("avg", 0.0) / 100}


def profile(cmd: list[str], out_dir: Path, env: dict | None = None) -> dict:
    """One `aiperf profile` run (`aiperf_command`, writing into `out_dir`), its summary."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode:
        raise RuntimeError(f"aiperf failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")
    return aiperf_summary(out_dir)


def require_aiperf() -> None:
    """aiperf importable, or a typer error saying how to install it."""
    import importlib.util

    if importlib.util.find_spec("aiperf") is None:
        raise typer.BadParameter("needs aiperf: pip install 'mmkv[bench]'", param_hint="--aiperf")


def check_aiperf() -> None:
    """aiperf importable and its tokenizer offline in HF_HUB_CACHE, or a typer error saying how."""
    require_aiperf()
    cache = os.environ.get("HF_HUB_CACHE")
    repo = "models--" + AIPERF_TOKENIZER.replace("/", "--")
    if not cache or not (Path(cache) / repo).is_dir() or os.environ.get("HF_HUB_OFFLINE") != "1":
        raise typer.BadParameter(f"aiperf loads its tokenizer ({AIPERF_TOKENIZER}) offline from a hub cache: "
                                 "python -m mmkv.testing.realshape DIR qwen2_5_vl, then HF_HUB_OFFLINE=1 "
                                 "HF_HUB_CACHE=DIR", param_hint="--aiperf")


def run_aiperf(engine, settings: Settings, rate: float, out_dir: Path, show=print) -> dict:
    """aiperf against the server at `rate`, one table row each: its synthetic requests (a shared
    system prompt, unique images), then two datasets that differ only in their screenshots: one of
    its own per request, and 3 repeated (pictures neither earlier run showed)."""
    from PIL import Image

    from mmkv.bench.concurrency import _server, _stop
    from mmkv.bench.run import _picture

    px = Image.open(io.BytesIO(_picture(engine, settings.image_tokens))).size[0]
    n, shots = settings.requests, 3
    server = _server(engine, 8, max_queue=max(256, n))
    workload = Bench(engine, server[2], settings).workload
    runs = {"aiperf synthetic, unique images": None}
    for name, count, first in (("dataset, a screenshot per request", n, 0),
                               (f"dataset, {shots} screenshots repeated", shots, n)):
        runs[name] = write_aiperf_dataset(out_dir / f"dataset-{count}" / "dataset.jsonl", engine, n, count,
                                          settings.policy_tokens, settings.image_tokens, first)
    rows = {}
    show("| aiperf requests | offered req/s | requests (errors) | prompt tokens | p50 TTFT ms | p90 TTFT ms | "
         "p99 TTFT ms | req/s | cached share |\n|---|---|---|---|---|---|---|---|---|")
    try:
        for name, data in runs.items():
            run_dir = out_dir / ("synthetic" if data is None else data.parent.name)
            cmd = aiperf_command(server[2], workload, rate, n, settings.seed, run_dir, data, px,
                                 settings.policy_tokens)
            rows[name] = r = profile(cmd, run_dir)
            t = r["ttft_ms"]
            show(f"| {name} | {rate:.2f} | {r['requests']} ({r['errors']}) | {r['prompt_tokens']:.0f} | {t[50]:.0f} | "
                 f"{t[90]:.0f} | {t[99]:.0f} | {r['req_s']:.2f} | {100 * r['cached_share']:.1f}% |")
    finally:
        _stop({"server": server})
    return rows


# ---- command -------------------------------------------------------------------------------------------
def _floats(value: str, flag: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"takes comma-separated numbers, got {value!r}", param_hint=flag) from None
    if not out or any(not math.isfinite(x) or x <= 0 for x in out):
        raise typer.BadParameter(f"takes positive numbers, got {value!r}", param_hint=flag)
    return out


def bench_serve_command(
    model_dir: Annotated[Path | None, typer.Argument(
        show_default=False, help="Local Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint dir (overrides --config).")] = None,
    config: Annotated[str, typer.Option(help="Random model when no MODEL_DIR: bench (144M) or tiny.")] = "bench",
    threads: Annotated[int, typer.Option(min=1, help="torch threads of the server.")] = 2,
    arms: Annotated[str, typer.Option(help=f"Comma-separated, of: {', '.join(ARMS)}.")] = ",".join(ARMS),
    rates: Annotated[str, typer.Option(help="Offered rates as fractions of the in-place arm's saturation "
                                            "throughput (measured first).")] = "0.5,1,1.5",
    requests: Annotated[int, typer.Option(min=2, help="Requests per arm and rate.")] = 12,
    saturation_requests: Annotated[int, typer.Option(min=2, help="Requests sent at once to measure "
                                                                 "saturation.")] = 12,
    policy_tokens: Annotated[int, typer.Option(min=16, help="The shared policy's length in tokens.")] = 512,
    tokens: Annotated[int, typer.Option(min=1, help="Completion tokens per request (end tokens banned).")] = 8,
    image_tokens: Annotated[int, typer.Option(min=4, help="agent: tokens per screenshot (a square number).")] = 64,
    skill_tokens: Annotated[int, typer.Option(min=16, help="agent: the skill's length in tokens.")] = 256,
    sessions: Annotated[int, typer.Option(min=1, help="agent: sessions interleaved in each cell.")] = 2,
    window: Annotated[int, typer.Option(min=1, help="agent: screenshots the client keeps.")] = 3,
    drop_chunk: Annotated[int, typer.Option(min=1, help="agent: screenshots dropped at a time (1 to "
                                                        "--window).")] = 1,
    seed: Annotated[int, typer.Option(help="Arrival times' and agent scripts' seed.")] = 0,
    aiperf: Annotated[bool, typer.Option("--aiperf", help="Instead of the arms: aiperf drives the server at "
                                                          "--aiperf-rate, its synthetic requests (unique images) "
                                                          "and a dataset of repeated screenshots (pip install "
                                                          "'mmkv[bench]'; HF_HUB_OFFLINE=1, HF_HUB_CACHE with "
                                                          "Qwen's tokenizer).")] = False,
    aiperf_rate: Annotated[float, typer.Option(min=0.001, help="--aiperf: offered requests per second.")] = 0.5,
    aiperf_dir: Annotated[Path, typer.Option(help="--aiperf: where aiperf writes its datasets and exports.")] =
        Path("aiperf-runs"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Write every figure (each request too).")] = None,
) -> None:
    """TTFT percentiles, throughput and prefix-cache hit rate under Poisson load: the field edited in
    place, the appended erratum, windowed agents."""
    chosen = tuple(a.strip() for a in arms.split(",") if a.strip())
    if not chosen or any(a not in ARMS for a in chosen):
        raise typer.BadParameter(f"expected some of {', '.join(ARMS)}", param_hint="--arms")
    if drop_chunk > window:
        raise typer.BadParameter(f"must be 1 to --window ({window}), got {drop_chunk}", param_hint="--drop-chunk")
    if config not in ("bench", "tiny"):
        raise typer.BadParameter("expected bench or tiny", param_hint="--config")
    settings = Settings(chosen, _floats(rates, "--rates"), requests, saturation_requests, policy_tokens, tokens,
                        image_tokens, skill_tokens, sessions, window, drop_chunk, seed)
    if aiperf:
        check_aiperf()
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # idle OpenMP threads sleep (as `mmkv bench`)
    import torch

    from mmkv.bench.run import build_engine

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    engine = build_engine(config, model_dir, "cpu", None, image_tokens)
    ad = engine.adapter
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {threads} threads | model "
               f"{model_dir or config} ({ad.num_layers} layers) | HTTP on loopback")
    if aiperf:
        typer.echo(f"# mmkv bench-serve --aiperf | {machine} | aiperf, Poisson arrivals at {aiperf_rate} req/s "
                   f"(seed {seed}) | {requests} requests each, {policy_tokens}-token policy, {tokens} completion "
                   f"tokens, {image_tokens}-token images")
        report = {"aiperf": run_aiperf(engine, settings, aiperf_rate, aiperf_dir.resolve(), typer.echo)}
        if json_out:
            json_out.write_text(json.dumps(report, indent=1))
        return
    typer.echo(f"# mmkv bench-serve | {machine}, clients in another process, Poisson arrivals (seed {seed}) | "
               f"{policy_tokens}-token policy, {tokens} completion tokens, {requests} requests per cell "
               f"({saturation_requests} unthrottled) | agent: {sessions} sessions, window {window}, "
               f"{image_tokens}-token screenshots, {skill_tokens}-token skill")
    report = run_bench_serve(engine, settings, typer.echo)
    typer.echo(f"\nin-place saturation: {report['saturation_req_s']:.2f} req/s\n")
    typer.echo("\n".join(compare(report)))
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    typer.echo(f"(bench-serve ran {report['wall_s']:.0f} s)")
    if json_out:
        json_out.write_text(json.dumps(report, indent=1))
        typer.echo(f"wrote {json_out}")
