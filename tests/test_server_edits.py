"""Issue 11 over HTTP: the edit policies on ordinary chats and real field edits answer within a
bound, streamed and not, and an exception on the engine worker (even StopIteration, which asyncio
cannot put into a Future) never leaves a request without an answer."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import torch

from mmkv import Engine
from mmkv.server.app import ServerSettings, create_app

from conftest import make_png
from test_server import LiveServer

BOUND_S = 30  # every request here answers well within this on the tiny model


@pytest.fixture(scope="module")
def server(tiny_dirs):
    engine = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu")
    return LiveServer(create_app(engine, ServerSettings(served_model_names=("tiny",)))), engine


def _post(base_url: str, body: dict) -> tuple[int, dict | list[str]]:
    """Status and JSON body, or the list of SSE data lines of a stream."""
    with httpx.Client(timeout=BOUND_S) as client:
        r = client.post(f"{base_url}/v1/chat/completions", json=body)
        if body.get("stream") and r.status_code == 200:
            return r.status_code, [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        return r.status_code, r.json()


def _edit_report(status, body) -> dict:
    assert status == 200, body
    if isinstance(body, list):
        assert body[-1] == "[DONE]", body
        final = [json.loads(x) for x in body[:-1] if "mmkv" in json.loads(x)]
        return final[-1]["mmkv"]["edit"]
    return body["mmkv"]["edit"]


@pytest.mark.parametrize("stream", [False, True])
def test_policies_on_new_questions_and_field_edits_answer(server, stream):
    live, _ = server
    url = "data:image/png;base64," + base64.b64encode(make_png(70, 56, seed=5)).decode()
    for policy in ("erratum", "in_place", "selective@2"):
        for messages, detected in _asks(url, f"{policy} {stream}"):
            body = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0, "stream": stream,
                    "mmkv": {"edit_policy": policy}}
            edit = _edit_report(*_post(live.base_url, body))
            assert edit["detected"] is detected and edit["applied"] in (policy, "recompute"), (policy, edit)
            assert edit["applied"] == policy or edit["reason"], edit


def _asks(url: str, chat: str) -> list[tuple[list[dict], bool]]:
    """New questions, the same image asked again, then a real field edit (the last one)."""
    system = {"role": "system", "content": f"chat {chat} .\n" + "you answer questions about shapes .\n"
                                           "order_status: pending\n" * 3}
    edited = {"role": "system", "content": system["content"].replace("pending", "shipped", 1)}
    return [
        ([system, {"role": "user", "content": "what color is the sky ?"}], False),
        ([system, {"role": "user", "content": "is the red shape left of the blue shape ?"}], False),
        ([system, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "what color ?"}]}], False),
        ([system, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "what shape ?"}]}], False),
        ([edited, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "what shape ?"}]}], True),
    ]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("when", ["before the first token", "mid-stream"])
def test_an_exception_on_the_worker_still_answers(server, monkeypatch, stream, when):
    live, engine = server

    def broken(messages, on_text=None, **kwargs):
        if when == "mid-stream" and on_text is not None:
            on_text("partial")
        raise StopIteration("injected")

    monkeypatch.setattr(engine, "start", broken)  # the scheduler's prefill stage
    status, body = _post(live.base_url, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 3, "stream": stream})
    if stream and when == "mid-stream":
        assert status == 200 and body[-1] == "[DONE]", body
        error = json.loads(body[-2])["error"]
    else:
        assert status == 500, body
        error = body["error"]
    assert error["code"] == "internal_error" and "injected" not in json.dumps(error)
    monkeypatch.undo()
    status, body = _post(live.base_url, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 2, "temperature": 0})
    assert status == 200, body  # and the server keeps serving
