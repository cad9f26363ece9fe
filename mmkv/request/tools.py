"""Tool calls as the Qwen chat templates define them.

`tools` (OpenAI's function tools) render into the prompt through the checkpoint's own chat
template (Qwen3-VL's puts them in the system turn inside <tools></tools>); the model answers a
call as a block `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, which becomes an
OpenAI `tool_calls` entry; `role: "tool"` messages render back as <tool_response> through the
template. A template with no tool support refuses `tools` instead of ignoring them.

`tool_choice`: "auto" (the default when tools are given) lets the model choose; "none" renders
the tools but never parses a call; "required" and a named function start the assistant turn
with the opening of a call (`<tool_call>\\n{"name": "` and, when named, the name), so the model
can only complete a call, and the call's arguments decode under the tool's `parameters` schema
(mmkv.request.grammar).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from mmkv.errors import InvalidRequestError
from mmkv.request.messages import check_text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# a call as the Qwen templates write it: <tool_call>\n{"name": "NAME", "arguments": {...}}\n</tool_call>
CALL_HEAD, ARGUMENTS, CALL_END = '\n{"name": "', '", "arguments": ', "}\n"
MAX_TOOLS = 128
MAX_SCHEMA_DEPTH = 32  # nesting of a tool's parameters (OpenAI's strict mode allows 5-10); a deeper one is a 400
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolSpec:
    """Validated `tools` and `tool_choice` of one request."""

    tools: tuple[dict, ...]  # as the template receives them ({"type": "function", "function": {...}})
    choice: str  # "auto" | "none" | "required" | "function"
    forced_name: str | None = None

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def forced_prefix(self) -> str:
        """Text the assistant turn starts with, so the model can only complete a call."""
        if self.choice == "required":
            return OPEN + CALL_HEAD
        if self.choice == "function":
            return OPEN + CALL_HEAD + self.forced_name + ARGUMENTS
        return ""


def check_tools(tools: Any, tool_choice: Any = None) -> ToolSpec | None:
    """Validate OpenAI `tools` / `tool_choice`; None when there are no tools (and no choice)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools must be a list of at most {MAX_TOOLS} function tools", param="tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequestError(f'{param} must be {{"type": "function", "function": {{...}}}}', param=param)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"{param}.function.name must match [A-Za-z0-9_-]{{1,64}}",
                                      param=f"{param}.function.name")
        if name in names:
            raise InvalidRequestError(f"{param}.function.name {name!r} is given twice", param=f"{param}.function.name")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise InvalidRequestError(f"{param}.function.description must be a string",
                                      param=f"{param}.function.description")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise InvalidRequestError(f"{param}.function.parameters must be a JSON schema object",
                                      param=f"{param}.function.parameters")
        if "strict" in fn and fn["strict"]:
            raise InvalidRequestError(f"{param}.function.strict is not supported: a call is decoded under its "
                                      f"parameters schema only when tool_choice forces it", param=f"{param}.function.strict")
        for key in ("description", "parameters"):
            if key in fn:
                _check_strings(fn[key], f"{param}.function.{key}")
        kept = {k: fn[k] for k in ("name", "description", "parameters") if k in fn}
        out.append({"type": "function", "function": kept})
    choice, forced = tool_choice if tool_choice is not None else "auto", None
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        forced = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(forced, str) or forced not in names:  # a list or dict name is no name (nor hashable)
            raise InvalidRequestError("tool_choice must name one of the tools", param="tool_choice")
        choice = "function"
    elif choice not in ("auto", "none", "required"):
        raise InvalidRequestError('tool_choice must be "auto", "none", "required" or '
                                  '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    return ToolSpec(tuple(out), choice, forced)


def _check_strings(value: Any, param: str) -> None:
    """Every string of a tool's description or schema (keys too) is a client's text, rendered
    into the prompt: the same reserved-token checks as message text (mmkv.request.messages). Iterative,
    and nesting is bounded (MAX_SCHEMA_DEPTH): the prompt's escaping and the chat template's
    `tojson` walk the schema recursively, so a deeper one is refused here, not a RecursionError."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            check_text(item, param)
        elif isinstance(item, dict | list):
            if depth >= MAX_SCHEMA_DEPTH:
                raise InvalidRequestError(f"{param} is nested deeper than {MAX_SCHEMA_DEPTH} levels", param=param)
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


def template_supports_tools(chat_template: str | None) -> bool:
    """The template renders `tools` (the Qwen3-VL and Qwen2.5 text templates do; Qwen2-VL's and
    Qwen2.5-VL's released templates do not)."""
    return bool(chat_template) and "tools" in chat_template and "tool_call" in chat_template


def parse_tool_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """Split a completion into content and calls. A block whose JSON does not parse into
    {"name": <one of names>, "arguments": {...}} stays in the content, verbatim: nothing a
    model writes is dropped."""
    calls, kept, cursor = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1), names)
        if call is None:
            continue
        kept.append(text[cursor:m.start()])
        cursor = m.end()
        calls.append(call)
    kept.append(text[cursor:])
    return "".join(kept).strip() if calls else text, calls


def _call(body: str, names: set[str]) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    args = data.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", data["name"], json.dumps(args, ensure_ascii=False))


class ContentFilter:
    """Streams the content of a completion while holding back whatever may be a tool-call
    block: from a `<tool_call>` on (or a prefix of it at the end of the text so far) text is
    held until `finish`, where `parse_tool_calls` decides. With a forced call prefix, nothing
    is content until the end."""

    def __init__(self, prefix: str = ""):
        self.text = prefix  # everything so far, the forced prefix included
        self.sent = 0  # text[:sent] went out as content
        self.held_from = 0 if prefix else None

    def feed(self, delta: str) -> str:
        """Append generated text; returns the content that is safe to send now."""
        self.text += delta
        if self.held_from is None and (at := self.text.find(OPEN, self.sent)) >= 0:
            self.held_from = at
        limit = self.held_from if self.held_from is not None else len(self.text) - _partial_open(self.text)
        out = self.text[self.sent:limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        return out

    def finish(self, names: set[str]) -> tuple[str, list[ToolCall]]:
        """(the content not sent yet, the calls)."""
        return parse_tool_calls(self.text[self.sent:], names)


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0
