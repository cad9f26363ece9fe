"""The HTTP server end to end: real uvicorn on a loopback port, driven by the official openai client.

Oracle: every answer equals what `mmkv.Engine.generate` returns for the same messages and
settings on a second engine loaded from the same checkpoint; the HTTP layer adds nothing.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

import mmkv
from mmkv.engine import BUNDLED_MODEL, REPO_ROOT as REPO
from mmkv.server.app import ServerSettings, create_app

MAX_TOKENS = 6


# ------------------------------------------------------------------ harness (shared with test_server_errors)


class LiveServer:
    """uvicorn serving `app` on a free loopback port, in a thread of this process."""

    def __init__(self, app, **config):
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets, and without it
        # every keep-alive response waits ~40 ms for a delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, **{"log_level": "warning", **config}))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{label="v",...}': value}."""
        out = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.base_url}/metrics").text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def png_bytes(color: tuple[int, int, int], size: tuple[int, int] = (112, 112)) -> bytes:
    image = Image.new("RGB", size, (255, 255, 255))
    image.paste(color, (size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_file(file_id: str) -> dict:
    return {"type": "image_file", "image_file": {"file_id": file_id}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def stream_text(client: openai.OpenAI, messages, **kw) -> tuple[str, str, object, dict]:
    """(text, finish_reason, usage, mmkv report) of a streamed completion."""
    pieces, finish, usage, report = [], None, None, None
    for chunk in client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        report = (chunk.model_extra or {}).get("mmkv") or report
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, usage, report


def ask(client: openai.OpenAI, messages, stream: bool = False, **kw) -> tuple[str, str, object, dict]:
    """(text, finish_reason, usage, mmkv report) of one completion, streamed or not."""
    if stream:
        return stream_text(client, messages, **kw)
    reply = client.chat.completions.create(model="tiny", messages=messages, **kw)
    return reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage, reply.model_extra["mmkv"]


@pytest.fixture(scope="session")
def tiny_dir(tiny_dirs):
    """conftest's position-sensitive tiny Qwen2.5-VL: a splice that moved a key wrongly would show."""
    return tiny_dirs["qwen2_5_vl"]


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """A second engine on the same checkpoint: what the server must answer."""
    return mmkv.Engine.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def live(tiny_dir):
    server = LiveServer(create_app(mmkv.Engine.from_pretrained(tiny_dir), ServerSettings(served_model_names=("tiny",))))
    yield server
    server.close()


def in_lockstep(client, reference, messages, stream=False, mmkv_options=None):
    """Ask the server and the reference engine the same thing, in the same order (so both caches
    hold the same history), and require the same answer and accounting. Returns the reference."""
    options = mmkv_options or {}
    want = reference.generate(messages, max_new_tokens=MAX_TOKENS, temperature=0.0, **options)
    got, finish, usage, report = ask(client, messages, stream, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"mmkv": options})
    assert (got, finish) == (want.text, want.finish_reason)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens) == (
        want.usage.prompt_tokens, want.usage.completion_tokens, want.usage.cached_tokens)
    assert (report["image_tokens_reused"], report["vision_tower_runs"]) == (
        want.image_tokens_reused, want.vision_tower_runs)
    assert report["ttft_ms"] > 0
    return want


# ------------------------------------------------------------------ tests


def test_upload_three_turns_stream_and_reference(live, reference):
    client = live.client()
    red = png_bytes((220, 30, 30))
    uploaded = client.files.create(file=("red.png", red, "image/png"), purpose="vision")
    assert uploaded.id.startswith("img-") and uploaded.object == "file" and uploaded.purpose == "vision"
    assert (uploaded.bytes, uploaded.filename) == (len(red), "red.png")
    info = reference.image_info(reference.add_image(red))
    assert (uploaded.width, uploaded.height, uploaded.image_tokens) == (info.width, info.height, info.image_tokens)
    again = client.files.create(file=("copy.png", red, "image/png"), purpose="vision")
    assert again.id == uploaded.id == reference.add_image(red)
    assert live.metrics()["mmkv:vision_tower_runs_total"] == 1

    turn1 = [{"role": "user", "content": [image_file(uploaded.id), text("what color is the shape ?")]}]
    a1 = in_lockstep(client, reference, turn1).text
    turn2 = turn1 + [{"role": "assistant", "content": a1},
                     {"role": "user", "content": [text("and here ? "), image_file(uploaded.id), text("what shape is it ?")]}]
    turn3 = [{"role": "system", "content": "You are a careful assistant. describe the image ."},
             {"role": "user", "content": "how many shapes are there ?"},
             {"role": "assistant", "content": "two"},
             {"role": "user", "content": [text("look again at the shape"), image_file(uploaded.id)]}]

    before = live.metrics()
    cached = 0
    for messages in (turn1, turn2, turn3):
        for stream in (False, True):
            want = in_lockstep(client, reference, messages, stream)
            assert want.vision_tower_runs == 0 and want.image_tokens_reused > 0
            cached += want.usage.cached_tokens
    after = live.metrics()
    assert after["mmkv:vision_tower_runs_total"] == 1, "uploaded once, never re-encoded"
    assert after["mmkv:cached_prompt_tokens_total"] - before["mmkv:cached_prompt_tokens_total"] == cached > 0
    key = 'mmkv:requests_total{endpoint="/v1/chat/completions",status="200"}'
    assert after[key] - before[key] == 6
    assert after["mmkv:time_to_first_token_seconds_count"] - before["mmkv:time_to_first_token_seconds_count"] == 6
    assert after["mmkv:image_cache_hits_total"] - before["mmkv:image_cache_hits_total"] >= 6
    assert after["mmkv:image_cache_hits_tokens_total"] > before["mmkv:image_cache_hits_tokens_total"]
    ref_stats = reference.stats()  # same history, same engine counters
    assert after["mmkv:prefix_cache_hits_tokens_total"] == ref_stats["prefix_cache_hit_tokens"] > 0
    assert after["mmkv:prefix_cache_queries_tokens_total"] == ref_stats["prefix_cache_query_tokens"]

    # reuse=false is the reference path: a full recompute, vision tower included.
    want = in_lockstep(client, reference, turn3, mmkv_options={"reuse": False})
    assert want.usage.cached_tokens == 0 and want.vision_tower_runs == 1 and want.image_tokens_reused == 0
    assert live.metrics()["mmkv:vision_tower_runs_total"] == 2
    # seam_tokens / rope_policy pass through to the engine unchanged.
    in_lockstep(client, reference, turn2, stream=True, mmkv_options={"seam_tokens": 0, "rope_policy": "native"})

    assert [f.id for f in client.files.list().data] == [uploaded.id]
    assert client.files.content(uploaded.id).content == red
    deleted = client.files.delete(uploaded.id)
    assert deleted.deleted and deleted.id == uploaded.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="tiny", messages=turn1, max_tokens=MAX_TOKENS)
    assert err.value.body["param"] == "messages[0].content[0].image_file.file_id"


def test_data_url_sampling_and_stop_match_engine(live, reference):
    client = live.client()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png_bytes((30, 30, 220)))}},
                                             text("describe the image .")]}]
    settings = dict(temperature=0.8, top_p=0.9, seed=7)
    want = reference.generate(messages, max_new_tokens=MAX_TOKENS, **settings)
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, **settings)
    assert got.choices[0].message.content == want.text
    streamed = stream_text(client, messages, max_completion_tokens=MAX_TOKENS, **settings)[0]
    assert streamed == want.text
    # A stop string cut from the reference's own greedy answer: both must stop there.
    greedy = reference.generate(messages, max_new_tokens=MAX_TOKENS, temperature=0.0).text
    stop = greedy[len(greedy) // 2:][:2] or "x"
    want = reference.generate(messages, max_new_tokens=MAX_TOKENS, temperature=0.0, stop=[stop])
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                         stop=[stop])
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == (want.text, want.finish_reason)
    assert stream_text(client, messages, max_tokens=MAX_TOKENS, temperature=0, stop=stop)[:2] == (
        want.text, want.finish_reason)


def test_models_health_openapi(live):
    assert [m.id for m in live.client().models.list().data] == ["tiny"]  # its served name
    health = httpx.get(f"{live.base_url}/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny"
    schema = httpx.get(f"{live.base_url}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content",
            "/v1/models"} <= set(schema["paths"])
    assert "MMKVOptions" in schema["components"]["schemas"]


def test_api_keys_scope_files_and_cache_per_key(tiny_dir):
    settings = ServerSettings(api_keys=("key-a", "key-b"), served_model_names=("tiny",))
    live = LiveServer(create_app(mmkv.Engine.from_pretrained(tiny_dir), settings))
    try:
        a, b = live.client("key-a"), live.client("key-b")
        green = png_bytes((30, 200, 30))
        file_a = a.files.create(file=("g.png", green, "image/png"), purpose="vision")
        assert live.metrics()["mmkv:vision_tower_runs_total"] == 1
        with pytest.raises(openai.NotFoundError):
            b.files.retrieve(file_a.id)
        with pytest.raises(openai.NotFoundError):
            b.chat.completions.create(model="tiny", max_tokens=2, messages=[
                {"role": "user", "content": [image_file(file_a.id), text("what color ?")]}])
        assert b.files.list().data == []
        # The same bytes under key-b: same content id, but no cache hit across keys.
        file_b = b.files.create(file=("g.png", green, "image/png"), purpose="vision")
        assert file_b.id == file_a.id
        assert live.metrics()["mmkv:vision_tower_runs_total"] == 2
        b.files.delete(file_b.id)
        assert a.files.retrieve(file_a.id).id == file_a.id, "key-b's delete leaves key-a's file"
        got = a.chat.completions.create(model="tiny", max_tokens=2, temperature=0, messages=[
            {"role": "user", "content": [image_file(file_a.id), text("what color ?")]}])
        assert got.model_extra["mmkv"]["vision_tower_runs"] == 0
        # Text prefixes are scoped too: key-a's cached prompt is no hit for key-b.
        prompt = [{"role": "system", "content": "you are a careful assistant . " * 8}, {"role": "user", "content": "hi"}]
        cached = [c.chat.completions.create(model="tiny", max_tokens=1, messages=prompt).usage.prompt_tokens_details
                  .cached_tokens for c in (a, a, b)]
        assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0
        assert httpx.get(f"{live.base_url}/health").status_code == 200
    finally:
        live.close()


@contextlib.contextmanager
def mmkv_serve(args: list[str], env: dict[str, str], log_path):
    """`python -m mmkv.cli serve ARGS --port P` as a subprocess, up and healthy; yields its base URL.
    Output goes to `log_path` (a pipe nobody reads could fill and block the server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mmkv.cli", "serve", *args, "--port", str(port)],
                                env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, open(log_path).read()
            assert time.monotonic() < deadline, "mmkv serve did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


def test_mmkv_serve_command(tiny_dir, tmp_path):
    """`mmkv serve` end to end: env vars read, the flag wins over its env var, the openai client works;
    a request names one of the served model names or gets a 404, never another model's answer."""
    env = dict(MMKV_PORT="1", MMKV_API_KEY="sk-env", MMKV_MODEL_DIR=str(tiny_dir), MMKV_LOG_JSON="1",
               MMKV_SERVED_MODEL_NAME="tiny tiny-alias")
    with mmkv_serve([], env, tmp_path / "serve.log") as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-env", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny", "tiny-alias"]
        assert client.models.retrieve("tiny-alias").id == "tiny-alias"
        # greedy: a sampled first token may be <|im_end|> (0 completion tokens), which once failed this test
        got = client.chat.completions.create(model="tiny", max_tokens=2, temperature=0,
                                             messages=[{"role": "user", "content": "hi"}])
        assert got.usage.completion_tokens >= 1
        alias = client.chat.completions.create(model="tiny-alias", max_tokens=2, temperature=0,
                                               messages=[{"role": "user", "content": "hi"}])
        assert alias.model == "tiny"  # the first served name, as vLLM reports it
        for other in (tiny_dir.name, "gpt-4o"):  # the directory's name is no longer one of them
            with pytest.raises(openai.NotFoundError) as err:
                client.chat.completions.create(model=other, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            assert (err.value.body["code"], err.value.body["param"]) == ("model_not_found", "model")
            assert repr(other) in err.value.body["message"] and "'tiny'" in err.value.body["message"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()
    out = (tmp_path / "serve.log").read_text()
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert any(r["logger"] == "mmkv.cli" and r["msg"].startswith("loaded") for r in records), out
    completion = next(r for r in records if r["msg"] == "chat completion")
    assert completion["completion_tokens"] == got.usage.completion_tokens and completion["ttft_ms"] > 0
    assert any(r["logger"] == "uvicorn.access" and r["status"] == 401 for r in records)


@pytest.mark.skipif(not BUNDLED_MODEL.is_dir(), reason="the bundled sample model is not in samples/ yet")
def test_mmkv_serve_without_a_model_dir_answers_the_docs_example(tmp_path):
    """docs/server.md's curl example, through the openai client: upload a sample image, ask about it."""
    with mmkv_serve([], {}, tmp_path / "serve.log") as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [BUNDLED_MODEL.name]
        image = REPO / "samples" / "vqa" / "images" / "color-000.png"
        uploaded = client.files.create(file=open(image, "rb"), purpose="vision")
        messages = [{"role": "user", "content": [image_file(uploaded.id), text("what color is the shape ?")]}]
        reply = client.chat.completions.create(model=BUNDLED_MODEL.name, messages=messages, max_tokens=8,
                                               temperature=0)
        assert reply.choices[0].message.content.strip()
        assert reply.usage.prompt_tokens_details.cached_tokens >= uploaded.image_tokens
        assert reply.model_extra["mmkv"]["vision_tower_runs"] == 0


def test_mmkv_serve_bad_model_dir_says_what_to_pass(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mmkv.cli", "serve", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "missing" in proc.stderr and "mmkv serve:" in proc.stderr
    assert "pass MODEL_DIR as a local" in proc.stderr and "checkpoint directory" in proc.stderr
