"""`mmkv bench-peers`: mmkv beside llama.cpp's `llama-server` (mmkv.bench.peer_build) on the same
checkpoint, both started here as their own processes with the same thread count, driven by one client
over HTTP. The same conversations go to both, turn by turn interleaved; each server gets them in its
own idiom only where the API differs: a skill is a `skill` part for mmkv and its text for llama.cpp,
an erratum a `state_update` part for mmkv and the line mmkv renders for it as text for llama.cpp, a
field edited in place asks mmkv for its `erratum` policy (llama.cpp recomputes from the change)."""

from __future__ import annotations

import base64
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from mmkv.bench.peer_build import (DEFAULT_PEER_DIR, SIZES, Peer, PeerError, build_peer, checkpoint_name, convert,
                                   find_peer, save_checkpoint)

MODEL = "bench"  # the name both servers answer to
END_TOKENS = (151645, 151643)  # <|im_end|>, <|endoftext|>: banned, so every answer is as long as asked
MMKV, PEER = "mmkv", "llama.cpp"


# ---- conversations ----------------------------------------------------------------------------------
@dataclass
class Turn:
    """One request. `messages` are OpenAI messages in which a part {"type": "skill", "text": ...} is
    a skill and a `state_update` part an erratum (`for_mmkv` / `for_peer` render them)."""

    messages: list[dict]
    timed: bool = True
    edit_policy: str | None = None  # mmkv's policy for a field edited in place (llama.cpp recomputes)


@dataclass
class Case:
    name: str
    sessions: list[list[Turn]]  # fresh conversations, one after another


def image_part(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


def skill_part(text: str) -> dict:
    return {"type": "skill", "text": text}


def _parts(messages: list[dict], render) -> list[dict]:
    return [m if isinstance(m["content"], str) else {**m, "content": [render(p) for p in m["content"]]}
            for m in messages]


def for_mmkv(messages: list[dict], skill_ids: dict[str, str]) -> list[dict]:
    """mmkv's request: each skill part names the skill registered with its text (`skill_ids`)."""
    return _parts(messages, lambda p: {"type": "skill", "skill_id": skill_ids[p["text"]]}
                  if p["type"] == "skill" else p)


def for_peer(messages: list[dict]) -> list[dict]:
    """llama.cpp's request: a skill as its text, an erratum as the line mmkv renders for it, and
    adjacent text parts joined into one (llama.cpp puts a line break between text parts of a message
    with an image; the chat template joins them with nothing, as mmkv does)."""
    from mmkv.request.messages import erratum_line

    def text(p: dict) -> dict:
        if p["type"] == "skill":
            return {"type": "text", "text": p["text"]}
        if p["type"] == "state_update":
            return {"type": "text", "text": erratum_line(p["field"], str(p["value"])) + "\n"}
        return p

    out = []
    for m in _parts(messages, text):
        if not isinstance(m["content"], str):
            joined: list[dict] = []
            for p in m["content"]:
                if p["type"] == "text" and joined and joined[-1]["type"] == "text":
                    joined[-1] = {"type": "text", "text": joined[-1]["text"] + p["text"]}
                else:
                    joined.append(p)
            m = {**m, "content": joined}
        out.append(m)
    return out


def skills_in(cases: list[Case]) -> list[str]:
    """Every skill text the cases use, once each, in order of first use."""
    seen: dict[str, None] = {}
    for case in cases:
        for session in case.sessions:
            for turn in session:
                for m in turn.messages:
                    for p in m["content"] if isinstance(m["content"], list) else ():
                        if p["type"] == "skill":
                            seen.setdefault(p["text"], None)
    return list(seen)


@dataclass
class Sizes:
    rounds: int = 3  # sessions of each short case
    image_px: int = 448  # 256 image tokens (Qwen2.5-VL: 28 px a token side)
    shot_px: int = 224  # agent screenshots: 64 tokens
    skill_tokens: int = 2048
    policy_tokens: int = 512  # the erratum case's system text after the field
    agent_turns: int = 16
    agent_sessions: int = 1
    window: int = 3  # screenshots the agent keeps


class Pictures:
    """A new picture for every use that must be cold (no server has seen it)."""

    def __init__(self):
        self.n = 0

    def new(self, px: int) -> bytes:
        from mmkv.bench.run import picture_png

        self.n += 1
        return picture_png(px, self.n)


def _words(tokenizer, tokens: int, sentence: str) -> str:
    from mmkv.bench.run import _text_of

    return _text_of(tokenizer, tokens, sentence)


def build_cases(tokenizer, sizes: Sizes, seed: int = 0) -> list[Case]:
    """The conversations of the bench, seeded; each session opens with its own line, so no
    session shares a cached prefix past the template's header with another."""
    from mmkv.bench.run import SKILL_SENTENCE

    pics = Pictures()
    q = "what is in this picture ?"
    skill = _words(tokenizer, sizes.skill_tokens, SKILL_SENTENCE)
    policy = _words(tokenizer, sizes.policy_tokens, "refunds follow the written policy of the store . ")

    def system(tag: str) -> dict:
        return {"role": "system", "content": f"session {tag} . you are a careful assistant ."}

    def about(png: bytes) -> dict:
        return {"role": "user", "content": [image_part(png), {"type": "text", "text": q}]}

    cold, moved, chat, skills, errata = [], [], [], [], []
    for r in range(sizes.rounds):
        png = pics.new(sizes.image_px)
        cold.append([Turn([system(f"cold {r}"), about(png)])])
        png = pics.new(sizes.image_px)
        first = [system(f"moved {r}"), about(png)]
        again = [system(f"moved {r}"), {"role": "user", "content": [
            {"type": "text", "text": f"note {r} : the picture below came with this message . "}, image_part(png),
            {"type": "text", "text": "and now , what is in it ?"}]}]
        moved.append([Turn(first, timed=False), Turn(again)])
        png = pics.new(sizes.image_px)
        history = [system(f"chat {r}"), about(png)]
        session = [Turn(list(history), timed=False)]
        for i, follow in enumerate(("what colour is it ?", "how many shapes are there ?", "describe it again .")):
            history += [{"role": "assistant", "content": f"answer {i} ."}, {"role": "user", "content": follow}]
            session.append(Turn(list(history)))
        chat.append(session)
        ask = {"role": "user", "content": "which tool ranks documents ?"}

        def after(preamble: str) -> list[dict]:
            return [{"role": "system", "content": [{"type": "text", "text": preamble}, skill_part(skill)]}, ask]
        skills.append([Turn(after(f"preamble {r} a .\n"), timed=False),
                       Turn(after(f"new preamble {r} b , longer .\n"))])

        def edited(value: str) -> list[dict]:
            return [{"role": "system", "content": f"session erratum {r} .\norder_status: {value}\n{policy}"},
                    {"role": "user", "content": "what is the order status ?"},
                    {"role": "assistant", "content": "it is noted ."}, {"role": "user", "content": "and now ?"}]
        errata.append([Turn(edited("pending"), timed=False), Turn(edited(f"shipped-{r}"), edit_policy="erratum")])
    return [Case("cold image", cold), Case("image moved", moved), Case("chat about one image", chat),
            Case(f"agent, last {sizes.window} screenshots", _agent_sessions(tokenizer, sizes, seed, pics)),
            Case(f"{sizes.skill_tokens}-token skill moved", skills), Case("field edited (erratum)", errata)]


def _agent_sessions(tokenizer, sizes: Sizes, seed: int, pics: Pictures) -> list[list[Turn]]:
    """`mmkv bench`'s agent trajectory (mmkv.bench.run.agent_script / agent_messages): a new
    screenshot most turns, an earlier one attached again, errata; the client keeps the last
    `window` screenshots; a warm-up turn first (the shared system prompt, untimed)."""
    from mmkv.bench.run import SKILL_SENTENCE, agent_messages, agent_script

    skill = _words(tokenizer, sizes.skill_tokens // 4, SKILL_SENTENCE)
    sessions = []
    for s in range(sizes.agent_sessions):
        script = agent_script(sizes.agent_turns, seed + s)
        shots = {f"shot-{i}": image_part(pics.new(sizes.shot_px))
                 for i in range(sum(t.new_screenshot is not None for t in script))}

        def render(part: dict) -> dict:
            if part["type"] == "skill":
                return skill_part(skill)
            return shots[part["image_file"]["file_id"]] if part["type"] == "image_file" else part

        def turn(msgs: list[dict], timed: bool = True) -> Turn:
            msgs = _parts(msgs, render)
            msgs[0]["content"].insert(0, {"type": "text", "text": f"agent session {s} .\n"})
            return Turn(msgs, timed)

        warm = [agent_messages(script, 0, "skill", list(shots))[0],
                {"role": "user", "content": "hello , a new session ."}]
        sessions.append([turn(warm, timed=False)] + [turn(agent_messages(script, t, "skill", list(shots), sizes.window))
                                                     for t in range(len(script))])
    return sessions


# ---- the client -------------------------------------------------------------------------------------
@dataclass
class TurnResult:
    ttft_s: float  # request sent to its first content
    decode_s: float  # first content to the end of the stream
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int | None
    text: str

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate after the first token: (completion tokens - 1) over the time after it."""
        if self.completion_tokens < 2 or self.decode_s <= 0:
            return None
        return (self.completion_tokens - 1) / self.decode_s


def stream_chat(url: str, body: dict, timeout: float = 900) -> TurnResult:
    """One streamed chat completion, timed by this client."""
    import httpx

    t0 = time.perf_counter()
    first, text, usage = None, [], {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise PeerError(f"{url} answered {r.status_code}: {r.read().decode(errors='replace')[:2000]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            delta = (event.get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content"):
                first = first or time.perf_counter()
                text.append(delta["content"])
            usage = event.get("usage") or usage
    end = time.perf_counter()
    first = first or end
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return TurnResult(first - t0, end - first, usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0),
                      cached, "".join(text))


def chat_body(messages: list[dict], max_tokens: int, stream: bool = True) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "logit_bias": {str(t): -100 for t in END_TOKENS}}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


# ---- the servers ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A server process this command started, and how it wants a turn rendered."""

    name: str
    argv: list[str]
    env: dict
    log: Path
    port: int = field(default_factory=free_port)
    skill_ids: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600) -> None:
        import httpx

        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerError(f"{self.name} exited ({self.proc.returncode}) while starting: "
                                f"{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise PeerError(f"{self.name} not ready after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def messages(self, turn: Turn) -> list[dict]:
        return for_mmkv(turn.messages, self.skill_ids) if self.name == MMKV else for_peer(turn.messages)

    def body(self, turn: Turn, max_tokens: int, stream: bool = True) -> dict:
        body = chat_body(self.messages(turn), max_tokens, stream)
        if self.name == MMKV and turn.edit_policy:
            body["mmkv"] = {"edit_policy": turn.edit_policy}
        return body

    def add_skills(self, texts: list[str]) -> None:
        """mmkv: each skill registered once before the conversations (llama.cpp reads them as text)."""
        import httpx

        for i, text in enumerate(texts):
            if self.name == MMKV and text not in self.skill_ids:
                r = httpx.post(f"{self.url}/v1/skills", json={"name": f"skill-{i}", "text": text}, timeout=600)
                r.raise_for_status()
                self.skill_ids[text] = r.json()["id"]


# Idle threads sleep in both servers: on a CPU shared with other work a spinning thread waits for a
# core the other threads need (llama.cpp's barrier-synchronised graph stalled for seconds a token).
WAITING = {"OMP_WAIT_POLICY": "PASSIVE"}


def mmkv_server(checkpoint: Path, threads: int, log_dir: Path) -> Server:
    env = {**os.environ, **WAITING, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    server = Server(MMKV, [], env, log_dir / "mmkv.log")
    server.argv = [sys.executable, "-c", "from mmkv.cli import app; app()", "serve", str(checkpoint),
                   "--port", str(server.port), "--device", "cpu", "--dtype", "float32", "--store-dir", "none",
                   "--served-model-name", MODEL, "--log-level", "warning"]
    return server


def peer_server(peer: Peer, model: Path, mmproj: Path, threads: int, context: int, log_dir: Path) -> Server:
    server = Server(PEER, [], {**os.environ, **WAITING}, log_dir / "llama-server.log")
    server.argv = [str(peer.server), "-m", str(model), "--mmproj", str(mmproj), "--host", "127.0.0.1",
                   "--port", str(server.port), "-t", str(threads), "-tb", str(threads), "--poll", "0",
                   "-c", str(context), "--alias", MODEL]
    return server


# ---- agreement: the same prompt and the same greedy tokens ------------------------------------------
def probes(tokenizer, pics: Pictures, sizes: Sizes) -> list[tuple[str, Turn]]:
    """Requests whose prompts both servers must count alike and answer alike (greedy)."""
    from mmkv.bench.run import SKILL_SENTENCE

    ask = {"type": "text", "text": "what is in this picture ?"}
    return [("text", Turn([{"role": "user", "content": "hello , who are you ?"}])),
            ("system + text", Turn([{"role": "system", "content": "you are a careful assistant ."},
                                    {"role": "user", "content": "name three colours ."}])),
            (f"image {sizes.shot_px} px",
             Turn([{"role": "user", "content": [image_part(pics.new(sizes.shot_px)), ask]}])),
            (f"image {sizes.image_px} px, text before", Turn([{"role": "user", "content": [
                {"type": "text", "text": "look : "}, image_part(pics.new(sizes.image_px)), ask]}])),
            ("skill", Turn([{"role": "system", "content": [{"type": "text", "text": "tools :\n"},
                                                          skill_part(_words(tokenizer, 256, SKILL_SENTENCE))]},
                            {"role": "user", "content": "which tool ranks documents ?"}]))]


def agreement(servers: list[Server], checks: list[tuple[str, Turn]], tokens: int = 4) -> list[dict]:
    """Per probe and server: prompt tokens, the greedy tokens (as bytes) and their log-probabilities.
    mmkv answers on its exact path (`reuse: false`: one full forward, no spliced chunk), the one
    llama.cpp's answer should equal; the splice's distance from it is what mmkv's evaluation measures."""
    import httpx

    rows = []
    for what, turn in checks:
        row = {"probe": what}
        for s in servers:
            body = {**s.body(turn, tokens, stream=False), "logprobs": True, "top_logprobs": 2}
            if s.name == MMKV:
                body["mmkv"] = {**body.get("mmkv", {}), "reuse": False}
            r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=600)
            if r.status_code != 200:
                raise PeerError(f"{s.name} answered {r.status_code} to probe {what!r}: {r.text[:2000]}")
            out = r.json()
            content = out["choices"][0]["logprobs"]["content"]
            row[s.name] = {"prompt_tokens": out["usage"]["prompt_tokens"], "bytes": [c["bytes"] for c in content],
                           "logprobs": [c["logprob"] for c in content],
                           "runner_up": [c["top_logprobs"][1]["logprob"] if len(c["top_logprobs"]) > 1 else None
                                         for c in content]}
        rows.append(row)
    return rows


def _entries(side: dict) -> dict[tuple[int, bytes], float]:
    """Logprob entries keyed by (byte offset, bytes). llama.cpp reports a token that ends inside a
    UTF-8 character together with the next one, as one entry: keyed so, such entries match nothing
    and only tokens both report alike are compared."""
    out, offset = {}, 0
    for b, lp in zip(side["bytes"], side["logprobs"]):
        out[(offset, bytes(b))] = lp
        offset += len(b)
    return out


def compare(row: dict) -> dict:
    """One probe: the same prompt count, the greedy answers' common byte prefix, the largest
    log-probability difference over the tokens both report alike, and where the answers part,
    mmkv's gap between its two best tokens (a near tie any float difference can flip)."""
    a, b = row[MMKV], row[PEER]
    mine, theirs = b"".join(bytes(x) for x in a["bytes"]), b"".join(bytes(x) for x in b["bytes"])
    common = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
    ea, eb = _entries(a), _entries(b)
    shared = [k for k in ea if k in eb and k[0] + len(k[1]) <= common]
    split = next((i for i, k in enumerate(ea) if k[0] + len(k[1]) > common), None)
    gap = None
    if split is not None and common < max(len(mine), len(theirs)) and a["runner_up"][split] is not None:
        gap = a["logprobs"][split] - a["runner_up"][split]
    return {"same_prompt": a["prompt_tokens"] == b["prompt_tokens"], "same_answer": mine == theirs,
            "common_bytes": common, "answer_bytes": len(mine), "compared_tokens": len(shared),
            "max_dlogprob": max((abs(ea[k] - eb[k]) for k in shared), default=None), "gap_at_split": gap}


def agreement_lines(rows: list[dict]) -> list[str]:
    lines = [f"{'probe':<28} {'prompt mmkv':>11} {'llama.cpp':>9} {'same answer':>11} {'common bytes':>12} "
             f"{'max |dlogprob|':>14} {'top-2 gap at split':>18}"]
    for row in rows:
        c = compare(row)
        diff = f"{c['max_dlogprob']:.1e} ({c['compared_tokens']})" if c["max_dlogprob"] is not None else "-"
        gap = f"{c['gap_at_split']:.4f}" if c["gap_at_split"] is not None else "-"
        lines.append(f"{row['probe']:<28} {row[MMKV]['prompt_tokens']:>11} {row[PEER]['prompt_tokens']:>9} "
                     f"{str(c['same_answer']):>11} {c['common_bytes']:>5} of {c['answer_bytes']:<4} {diff:>14} "
                     f"{gap:>18}")
    return lines


# ---- aiperf: the same Poisson arrivals against both ---------------------------------------------------
AIPERF_DATA = ("a screenshot per request", "3 screenshots repeated")


def aiperf_datasets(out_dir: Path, tokenizer, sizes: Sizes, n: int, rate_index: int) -> dict[str, Path]:
    """aiperf's single_turn datasets for one rate (mmkv.bench.serve.write_aiperf_lines): the shared
    policy, a step line of each request's own and a `shot_px` screenshot, one of its own per request
    or 3 repeated. Each rate gets pictures no earlier rate showed, so neither server starts warm."""
    from mmkv.bench.run import picture_png
    from mmkv.bench.serve import POLICY_SENTENCE, write_aiperf_lines

    policy = _words(tokenizer, sizes.policy_tokens, POLICY_SENTENCE)
    first = 2000 + rate_index * (n + 3)  # the probes' pictures are 1000 on
    unique = [picture_png(sizes.shot_px, first + i) for i in range(n)]
    repeated = [picture_png(sizes.shot_px, first + n + i) for i in range(3)]
    return {name: write_aiperf_lines(out_dir / f"rate-{rate_index}" / tag / "dataset.jsonl", policy, pngs, n)
            for name, tag, pngs in zip(AIPERF_DATA, ("unique", "repeated"), (unique, repeated))}


def aiperf_tokenizer(snapshot: Path) -> tuple[str, dict]:
    """aiperf reads the checkpoint's own tokenizer offline from the hub cache the checkpoint sits in
    (HUB/models--OWNER--NAME/snapshots/REV): its hub id, and aiperf's environment."""
    repo = snapshot.parent.parent
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(repo.parent)}
    return repo.name.removeprefix("models--").replace("--", "/"), env


def aiperf_bench(servers: list[Server], snapshot: Path, tokenizer, sizes: Sizes, rates: tuple, n: int,
                 max_tokens: int, seed: int, out_dir: Path, show=print) -> list[dict]:
    """aiperf against each server at each rate and dataset: its chat endpoint, streamed, the same
    seeded Poisson arrivals for both (mmkv.bench.serve.aiperf_command), the servers' order
    alternating run by run; one row each from aiperf's own export."""
    from mmkv.bench.serve import Workload, aiperf_command, profile

    workload = Workload(MODEL, "", max_tokens, END_TOKENS)
    name, env = aiperf_tokenizer(snapshot)
    rows, k = [], 0
    show(aiperf_header())
    for i, rate in enumerate(rates):
        for data, path in aiperf_datasets(out_dir, tokenizer, sizes, n, i).items():
            k += 1
            for s in servers if k % 2 else servers[::-1]:
                run_dir = path.parent / s.name
                cmd = aiperf_command(s.url, workload, rate, n, seed, run_dir, path, sizes.shot_px,
                                     sizes.policy_tokens, tokenizer=name)
                rows.append({"server": s.name, "data": data, "rate": rate, **profile(cmd, run_dir, env)})
                show(aiperf_line(rows[-1]))
    return rows


def aiperf_header() -> str:
    return ("| server | screenshots | offered req/s | requests (errors) | prompt tokens | p50 TTFT ms | p90 TTFT ms | "
            "p99 TTFT ms | req/s | tokens/s | cached share |\n|---|---|---|---|---|---|---|---|---|---|---|")


def aiperf_line(r: dict) -> str:
    t = r["ttft_ms"]
    return (f"| {r['server']} | {r['data']} | {r['rate']:.2f} | {r['requests']} ({r['errors']}) | "
            f"{r['prompt_tokens']:.0f} | {t[50]:.0f} | {t[90]:.0f} | {t[99]:.0f} | {r['req_s']:.2f} | "
            f"{r['tokens_s']:.1f} | {100 * r['cached_share']:.1f}% |")


# ---- replay and report ------------------------------------------------------------------------------
def replay(cases: list[Case], servers: list[Server], max_tokens: int, progress=print) -> dict[str, dict[str, list]]:
    """Every case's sessions turn by turn through every server, the servers' order alternating
    turn by turn; the timed turns' results per case and server."""
    results: dict[str, dict[str, list]] = {}
    k = 0
    for case in cases:
        got = results[case.name] = {s.name: [] for s in servers}
        for session in case.sessions:
            for turn in session:
                k += 1
                for s in servers if k % 2 else servers[::-1]:
                    r = stream_chat(s.url, s.body(turn, max_tokens))
                    if turn.timed:
                        got[s.name].append(r)
        progress(f"  {case.name}: {sum(len(v) for v in got.values())} timed turns")
    return results


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between order statistics (numpy's default)."""
    import numpy as np

    return float(np.percentile(values, q))


def summarize(results: dict[str, dict[str, list[TurnResult]]]) -> list[dict]:
    """Per case and server: TTFT median and p90 (ms), median decode tokens/s, median prompt and
    cached tokens; per case the ratio llama.cpp / mmkv of the TTFT medians (above 1: mmkv faster)."""
    rows = []
    for case, by_server in results.items():
        medians = {}
        for name, turns in by_server.items():
            ttft = [t.ttft_s * 1e3 for t in turns]
            rates = [t.tokens_per_s for t in turns if t.tokens_per_s is not None]
            cached = [t.cached_tokens for t in turns if t.cached_tokens is not None]
            medians[name] = statistics.median(ttft)
            rows.append({"case": case, "server": name, "turns": len(turns), "ttft_ms_p50": medians[name],
                         "ttft_ms_p90": percentile(ttft, 90), "tokens_s": statistics.median(rates) if rates else None,
                         "prompt_tokens": statistics.median(t.prompt_tokens for t in turns),
                         "cached_tokens": statistics.median(cached) if cached else None})
        if MMKV in medians and PEER in medians:
            for row in rows[-len(by_server):]:
                row["peer_over_mmkv"] = medians[PEER] / medians[MMKV]
    return rows


def table_lines(rows: list[dict]) -> list[str]:
    lines = [f"{'case':<30} {'server':<9} {'turns':>5} {'TTFT p50 ms':>11} {'p90 ms':>8} {'tok/s':>6} "
             f"{'prompt':>6} {'cached':>6} {'llama.cpp / mmkv':>16}"]
    for r in rows:
        rate = f"{r['tokens_s']:.1f}" if r["tokens_s"] is not None else "-"
        cached = f"{r['cached_tokens']:.0f}" if r["cached_tokens"] is not None else "-"
        ratio = f"{r['peer_over_mmkv']:.2f}x" if r["server"] == MMKV and "peer_over_mmkv" in r else ""
        lines.append(f"{r['case']:<30} {r['server']:<9} {r['turns']:>5} {r['ttft_ms_p50']:>11.0f} "
                     f"{r['ttft_ms_p90']:>8.0f} {rate:>6} {r['prompt_tokens']:>6.0f} {cached:>6} {ratio:>16}")
    return lines


def header(peer: Peer, threads: int, checkpoint: Path, outtype: str) -> dict:
    import importlib.metadata

    import torch
    import transformers

    from mmkv.bench.run import _cpu_name

    return {"machine": f"{_cpu_name()}, {os.cpu_count()} cores", "threads": threads,
            "waiting": "OMP_WAIT_POLICY=PASSIVE for both, llama-server --poll 0",
            "checkpoint": str(checkpoint), "gguf": outtype, "mmkv_dtype": "float32",
            "versions": {"python": platform.python_version(), "mmkv": importlib.metadata.version("mmkv"),
                         "torch": torch.__version__, "transformers": transformers.__version__,
                         PEER: f"{peer.build['package']} {peer.build['version']}, "
                               f"llama-server {peer.server_version()}"},
            "peer_build": {k: peer.build[k] for k in ("cmake_flags", "targets", "jobs", "build_s", "compiler")}}


def _prepare(peer: Peer, work: Path, family: str, size: str, outtype: str) -> tuple[Path, Path, Path]:
    """The checkpoint (written once per family and size) and its GGUF files."""
    repo = work / "hub" / f"models--mmkv-peer--{checkpoint_name(family, size)}"
    ref = repo / "refs" / "main"
    snapshot = repo / "snapshots" / ref.read_text() if ref.is_file() else save_checkpoint(work / "hub", family, size)
    model, mmproj = convert(peer, snapshot, work / "gguf" / snapshot.parent.parent.name / snapshot.name, outtype)
    return snapshot, model, mmproj


def bench_peers_command(
    build_peer_: Annotated[bool, typer.Option("--build-peer", help="Download the llama-cpp-python sdist with pip, "
                                              "build its llama-server into --peer-dir (cmake, g++) and exit.")] = False,
    peer_dir: Annotated[Path, typer.Option(envvar="MMKV_PEER_DIR", help="Where the peer is built.")] = DEFAULT_PEER_DIR,
    peer_version: Annotated[str | None, typer.Option(help="--build-peer: this llama-cpp-python version.")] = None,
    jobs: Annotated[int, typer.Option(min=1, help="--build-peer: compile jobs.")] = 2,
    work_dir: Annotated[Path, typer.Option(help="The checkpoint and its GGUF files (written once).")] =
        Path("~/.cache/mmkv/peer-bench"),
    family: Annotated[str, typer.Option(help="qwen2_5_vl (the bench size) or qwen3_vl (its real-shape test size).")] =
        "qwen2_5_vl",
    size: Annotated[str, typer.Option(help="bench or tiny (qwen2_5_vl).")] = "bench",
    outtype: Annotated[str, typer.Option(help="GGUF weights: f32 (mmkv serves float32), or f16.")] = "f32",
    threads: Annotated[int, typer.Option(min=1, help="Threads of each server.")] = 2,
    rounds: Annotated[int, typer.Option(min=1, help="Sessions of each short case.")] = 3,
    agent_turns: Annotated[int, typer.Option(min=1)] = 16,
    max_tokens: Annotated[int, typer.Option(min=2, help="Completion tokens per turn (end tokens banned).")] = 8,
    skill_tokens: Annotated[int, typer.Option(min=16)] = 2048,
    check_only: Annotated[bool, typer.Option("--check-only", help="Only the prompt-count and greedy-token check.")] =
        False,
    aiperf: Annotated[bool, typer.Option("--aiperf", help="Instead of the conversations: aiperf drives both servers "
                                                          "at each of --aiperf-rates, the same Poisson arrivals, "
                                                          "screenshots of their own and repeated (pip install "
                                                          "'mmkv[bench]').")] = False,
    aiperf_rates: Annotated[str, typer.Option(help="--aiperf: offered requests per second, comma-separated.")] =
        "0.25,0.5",
    aiperf_requests: Annotated[int, typer.Option(min=2, help="--aiperf: requests per server, rate and dataset.")] = 8,
    seed: Annotated[int, typer.Option(help="--aiperf: the arrivals' seed.")] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report here.")] = None,
) -> None:
    """mmkv beside llama.cpp's llama-server on one checkpoint, one client: prompt counts and greedy
    tokens compared, then TTFT (p50, p90) and decode tokens/s per case and server, interleaved."""
    for value, allowed, name in ((family, ("qwen2_5_vl", "qwen3_vl"), "--family"), (size, tuple(SIZES), "--size"),
                                 (outtype, ("f32", "f16"), "--outtype")):
        if value not in allowed:
            raise typer.BadParameter(f"expected one of {', '.join(allowed)}", param_hint=name)
    rates = ()
    if aiperf:
        from mmkv.bench.serve import _floats, require_aiperf

        require_aiperf()
        rates = _floats(aiperf_rates, "--aiperf-rates")
    try:
        if build_peer_:
            peer = build_peer(peer_dir.expanduser(), jobs, peer_version)
            print(json.dumps(peer.build, indent=2))
            return
        report = run(find_peer(peer_dir.expanduser()), work_dir.expanduser(), family, size, outtype, threads,
                     Sizes(rounds=rounds, agent_turns=agent_turns, skill_tokens=skill_tokens), max_tokens, check_only,
                     Aiperf(rates, aiperf_requests, seed))
    except PeerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n")


@dataclass
class Aiperf:
    rates: tuple[float, ...] = ()  # none: the conversations instead
    requests: int = 8
    seed: int = 0


def run(peer: Peer, work: Path, family: str, size: str, outtype: str, threads: int, sizes: Sizes, max_tokens: int,
        check_only: bool, aiperf: Aiperf | None = None) -> dict:
    from transformers import AutoTokenizer

    snapshot, model, mmproj = _prepare(peer, work, family, size, outtype)
    if family == "qwen3_vl":  # 32 px a token side
        sizes.image_px, sizes.shot_px = 512, 256
    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    report = header(peer, threads, snapshot, outtype)
    print(json.dumps(report, indent=2))
    log_dir = work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = [mmkv_server(snapshot, threads, log_dir), peer_server(peer, model, mmproj, threads, 16384, log_dir)]
    try:
        for s in servers:
            s.start()
        pics = Pictures()
        pics.n = 1000  # the probes' pictures are not the cases'
        checks = probes(tokenizer, pics, sizes)
        cases = [] if check_only or aiperf and aiperf.rates else build_cases(tokenizer, sizes)
        for s in servers:
            s.add_skills(skills_in(cases) + skills_in([Case("probes", [[t for _, t in checks]])]))
        report["agreement"] = agreement(servers, checks)
        print("\n".join(agreement_lines(report["agreement"])))
        if aiperf and aiperf.rates and not check_only:
            print(f"\n# aiperf, Poisson arrivals (seed {aiperf.seed}), {aiperf.requests} requests a run, "
                  f"{max_tokens} completion tokens, {sizes.policy_tokens}-token policy, {sizes.shot_px} px screenshots")
            report["aiperf"] = aiperf_bench(servers, snapshot, tokenizer, sizes, aiperf.rates, aiperf.requests,
                                            max_tokens, aiperf.seed, work / "aiperf")
        elif not check_only:
            results = replay(cases, servers, max_tokens)
            report["rows"] = summarize(results)
            report["turns"] = {case: {name: [asdict(t) for t in turns] for name, turns in by.items()}
                               for case, by in results.items()}
            print(f"\n# TTFT and decode tokens/s, {max_tokens} tokens a turn, {threads} threads each, "
                  "servers interleaved turn by turn")
            print("\n".join(table_lines(report["rows"])))
    finally:
        for s in servers:
            s.stop()
    return report
