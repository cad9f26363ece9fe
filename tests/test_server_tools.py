"""Tool calls end to end through the official openai client (issue 15), on the real-shape
Qwen3-VL checkpoint (real tokenizer and template) with forced outputs; a template without tools
refuses them with 400 naming `tools`."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from mmkv import Engine
from mmkv.server.app import ServerSettings, create_app

from test_server import LiveServer
from test_tools import HISTORY, TIME, WEATHER, ScriptedSampler


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    from mmkv.testing.realshape import save_real_checkpoint

    snapshot = save_real_checkpoint("qwen3_vl", tmp_path_factory.mktemp("hub"), seed=2)
    engine = Engine.from_pretrained(snapshot, dtype=torch.float32, device="cpu")
    return LiveServer(create_app(engine, ServerSettings(served_model_names=("tiny",)))), engine


def _force(engine, monkeypatch, answer: str) -> None:
    tok = engine.adapter.tokenizer
    ScriptedSampler.script = tok(answer)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    monkeypatch.setattr("mmkv.request.decode.Sampler", ScriptedSampler)


ANSWER = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("parallel", [None, False])
def test_tool_calls_with_the_openai_client(qwen3_server, monkeypatch, parallel):
    live, engine = qwen3_server
    _force(engine, monkeypatch, ANSWER)
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    reply = live.client().chat.completions.create(model="tiny", messages=HISTORY, tools=[WEATHER, TIME],
                                                  max_tokens=64, **extra)
    choice = reply.choices[0]
    want = [("get_weather", {"city": "Oslo"}), ("get_time", {})][: 1 if parallel is False else 2]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == want
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    # the calls and their result go back in the next turn: rendered by the template
    follow = HISTORY + [choice.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "7 C"}]
    _force(engine, monkeypatch, "It is 7 C in Oslo.")
    again = live.client().chat.completions.create(model="tiny", messages=follow, tools=[WEATHER, TIME], max_tokens=16)
    assert again.choices[0].message.content == "It is 7 C in Oslo." and again.choices[0].finish_reason == "stop"
    assert again.usage.prompt_tokens == engine.prompt_ids(follow, tools=[WEATHER, TIME]).numel()


def test_streamed_tool_calls_accumulate_like_openai(qwen3_server, monkeypatch):
    live, engine = qwen3_server
    _force(engine, monkeypatch, "Let me look.\n" + ANSWER)
    stream = live.client().chat.completions.create(model="tiny", messages=HISTORY, tools=[WEATHER, TIME],
                                                   max_tokens=64, stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        assert "<tool_call>" not in (delta.content or "")
        for call in delta.tool_calls or []:
            calls.setdefault(call.index, {"name": "", "arguments": ""})
            calls[call.index]["name"] += call.function.name or ""
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content.strip() == "Let me look." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Oslo"}),
                                                                                 ("get_time", {})]


def test_bad_tools_are_400_naming_the_field(qwen3_server, tiny_dirs):
    live, _ = qwen3_server
    client = live.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=HISTORY[:2], max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "bad name"}}])
    assert err.value.body["param"] == "tools[0].function.name"
    tiny = LiveServer(create_app(Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32, device="cpu"), ServerSettings(served_model_names=("tiny",))))
    with pytest.raises(openai.BadRequestError) as err:
        tiny.client().chat.completions.create(model="tiny", messages=HISTORY[:2], max_tokens=2, tools=[WEATHER])
    assert err.value.body["param"] == "tools"
    tiny.server.should_exit = True


@pytest.mark.parametrize("depth", [33, 450])
def test_a_deeply_nested_tool_schema_is_400_not_a_recursion_error(qwen3_server, depth):
    """The prompt's escaping and the template's `tojson` walk a schema recursively: one nested
    near Python's recursion limit (still valid JSON) was a 500; it is refused with 400, and a
    schema at the bound still renders."""
    import httpx

    live, _ = qwen3_server

    def nested(n):
        body = "{}"
        for _ in range(n):
            body = '{"type": "object", "properties": {"x": ' + body + "}}"
        return body

    def send(n):
        tool = '{"type": "function", "function": {"name": "f", "parameters": ' + nested(n) + "}}"
        body = '{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "tools": [' + tool + "]}"
        return httpx.post(f"{live.base_url}/v1/chat/completions", content=body,
                          headers={"Content-Type": "application/json"}, timeout=60)

    reply = send(depth)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tools[0].function.parameters"
    assert "nested deeper than 32" in reply.json()["error"]["message"]
    assert send(15).status_code == 200  # 15 objects deep = 31 levels of dicts: within the bound
