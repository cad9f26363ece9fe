"""Tool calls (issue 15): validation, parsing of the Qwen `<tool_call>` blocks, and the streaming
content filter, against stored expectations and the non-streamed parse."""

from __future__ import annotations

import json

import pytest

from mmkv.errors import InvalidRequestError
from mmkv.tools import ContentFilter, check_tools, parse_tool_calls, template_supports_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = {"get_weather", "get_time"}


def test_valid_tools_and_choices():
    spec = check_tools([WEATHER, TIME])
    assert spec.choice == "auto" and spec.names == NAMES and spec.forced_prefix() == ""
    assert check_tools([WEATHER], "none").choice == "none"
    assert check_tools([WEATHER], "required").forced_prefix() == '<tool_call>\n{"name": "'
    named = check_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.forced_prefix() == '<tool_call>\n{"name": "get_time", "arguments": '
    assert check_tools(None) is None and check_tools([], "auto") is None


@pytest.mark.parametrize("tools, choice, param", [
    ("get_weather", None, "tools"),
    ([{"type": "retrieval"}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "strict": True}}], None, "tools[0].function.strict"),
    ([WEATHER] * 0 + [TIME] * 1, "sometimes", "tool_choice"),
    ([TIME], {"type": "function", "function": {"name": "get_weather"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], None, "tools"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, param):
    with pytest.raises(InvalidRequestError) as err:
        check_tools(tools, choice)
    assert err.value.param == param


CASES = {
    "one call": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"}}\n</tool_call>',
                 "", [("get_weather", {"city": "Lisbon"})]),
    "content then two calls": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
                               "Let me check.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    "arguments as a string": ('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>',
                              "", [("get_time", {"tz": "UTC"})]),
    "broken json stays content": ('<tool_call>\n{"name": "get_time", "arguments": {</tool_call> sorry',
                                  '<tool_call>\n{"name": "get_time", "arguments": {</tool_call> sorry', []),
    "unknown tool stays content": ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                                   '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    "no call": ("It is sunny <tool in the text", "It is sunny <tool in the text", []),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parse_and_stream_agree(case):
    text, want_content, want_calls = CASES[case]
    content, calls = parse_tool_calls(text, NAMES)
    assert content == want_content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == len(calls)
    for step in (1, 3, 7):  # any split of the text into deltas streams the same content
        f = ContentFilter()
        streamed = "".join(f.feed(text[i:i + step]) for i in range(0, len(text), step))
        rest, streamed_calls = f.finish(NAMES)
        if calls:
            assert OPEN_MARK not in streamed and (streamed + rest).strip() == want_content
        else:
            assert streamed + rest == text
        assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in calls]


OPEN_MARK = "<tool_call>"


def test_forced_prefix_is_never_content():
    spec = check_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    f = ContentFilter(spec.forced_prefix())
    assert f.feed('{"city": "Rome"}}\n') == "" and f.feed("</tool_call>") == ""
    content, calls = f.finish(spec.names)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]


def test_which_templates_render_tools():
    from mmkv.realshape import QWEN3_VL_CHAT_TEMPLATE
    from mmkv.tiny import CHAT_TEMPLATE

    assert template_supports_tools(QWEN3_VL_CHAT_TEMPLATE) and not template_supports_tools(CHAT_TEMPLATE)
