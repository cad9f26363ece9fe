"""OpenAI-shaped chat messages -> chat-template messages and the images they reference, in order."""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from typing import Any

from PIL import Image

from mmkv.errors import InvalidRequestError
from mmkv.images import PreparedImage
from mmkv.video import DecodedVideo, VideoSampling

ROLES = ("system", "user", "assistant", "tool", "developer")
# The processor's image tokens (send images as image parts) and the private-use characters mmkv's own
# markers use: \ue000N\ue001 a skill's place, \ue002N\ue003 a special token's text sent as text (mmkv.request.plan).
RESERVED_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                   "\ue000", "\ue001", "\ue002", "\ue003")
# The paper's erratum line, verbatim (MECHANISM.md section 1).
ERRATUM = "[STATE UPDATE] {field} has just changed to {value}; this overrides any earlier value. Apply the current value."


def skill_marker(index: int) -> str:
    """Placeholder for the index-th chunk reference in the rendered template text."""
    return f"\ue000{index}\ue001"


def erratum_line(field: str, value: str) -> str:
    return ERRATUM.format(field=field, value=value)


@dataclass(frozen=True)
class ImageRef:
    """One image a prompt references: an id the tenant added, or inline data to decode."""

    image_id: str | None = None
    data: Any = None  # bytes | PIL.Image | PreparedImage | data: URL
    param: str = ""  # where in the request it came from, for errors


@dataclass(frozen=True)
class VideoRef:
    """One video a prompt references: an id the tenant added, or inline data to decode with its
    sampling settings."""

    video_id: str | None = None
    data: Any = None  # bytes | file object | data: URL | [(PIL image, seconds), ...] | DecodedVideo
    sampling: VideoSampling = VideoSampling()
    param: str = ""


@dataclass(frozen=True)
class SkillRef:
    """A precompiled text skill the prompt splices in at this place."""

    skill_id: str
    param: str = ""


def check_unicode(value: str, param: str) -> str:
    """Refuse a string that is not valid Unicode (a lone surrogate such as "\\udfff"): it cannot
    be tokenized or sent back as JSON."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{param} is not valid Unicode: a lone surrogate at index {exc.start}",
                                  param=param) from None
    return value


def check_text(value: Any, param: str) -> str:
    """A client's string: valid Unicode, none of RESERVED_TOKENS."""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param} must be a string", param=param)
    check_unicode(value, param)
    for token in RESERVED_TOKENS:
        if token in value:
            why = (f"the reserved token {token}; send images as image parts" if token.startswith("<")
                   else f"U+{ord(token):04X}, a private-use character mmkv reserves for its own markers")
            raise InvalidRequestError(f"{param} contains {why}", param=param)
    return value


def one_line(value: Any, param: str) -> str:
    """:func:`check_text` for a piece of the one-line erratum: a line break or other control
    character would split it, and let a value write a second, unmarked line into the prompt."""
    text = check_text(value, param)
    if any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in text):
        raise InvalidRequestError(f"{param} must be one line, without control characters", param=param)
    return text


def _image_part(part: dict, param: str) -> ImageRef:
    kind = part.get("type")
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise InvalidRequestError(f"{param}.image_url.url must be a string", param=param)
        if url.startswith("mmkv://"):  # an uploaded id written as a URL
            return ImageRef(image_id=url.removeprefix("mmkv://"), param=param)
        return ImageRef(data=url, param=param)
    if kind == "image_file":
        ref = part.get("image_file")
        file_id = ref.get("file_id") if isinstance(ref, dict) else None
        if not isinstance(file_id, str) or not file_id:
            raise InvalidRequestError(f"{param}.image_file.file_id must be a non-empty string", param=param)
        return ImageRef(image_id=file_id, param=param)
    data = part.get("image")
    if isinstance(data, str) and not data.startswith("data:"):
        return ImageRef(image_id=data, param=param)
    return ImageRef(data=data, param=param)


def _video_part(part: dict, param: str) -> VideoRef:
    """`video_url` (a data: URL, or mmkv://ID), `video_file` (an uploaded id) or, from Python,
    `video` (bytes, a file object, frames with their times, or an id); sampling settings (`fps`,
    `nframes`, `max_pixels`, `video_start`, `video_end`) beside them apply to inline data, and are
    refused for an uploaded id (its frames were sampled at upload)."""
    kind = part.get("type")
    sampling = VideoSampling.parse({k: part[k] for k in VideoSampling.FIELDS if k in part}, param)
    if kind == "video_url":
        url = part.get("video_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise InvalidRequestError(f"{param}.video_url.url must be a string", param=param)
        ref = VideoRef(video_id=url.removeprefix("mmkv://"), param=param) if url.startswith("mmkv://") \
            else VideoRef(data=url, sampling=sampling, param=param)
    elif kind == "video_file":
        file = part.get("video_file")
        file_id = file.get("file_id") if isinstance(file, dict) else None
        if not isinstance(file_id, str) or not file_id:
            raise InvalidRequestError(f"{param}.video_file.file_id must be a non-empty string", param=param)
        ref = VideoRef(video_id=file_id, param=param)
    else:
        data = part.get("video")
        ref = VideoRef(video_id=data, param=param) if isinstance(data, str) and not data.startswith("data:") \
            else VideoRef(data=data, sampling=sampling, param=param)
    if ref.video_id is not None and not sampling.is_default:
        field = next(k for k in VideoSampling.FIELDS if getattr(sampling, k) is not None)
        raise InvalidRequestError(f"{param}.{field}: an uploaded video was sampled when it was added; send the "
                                  f"settings with the upload (or the video inline)", param=f"{param}.{field}")
    return ref


def _attach_tool_calls(out: dict, msg: dict, param: str) -> None:
    """An assistant message's OpenAI `tool_calls` go to the template as they are (it renders
    them as <tool_call> blocks); each needs a function name and JSON-object arguments."""
    calls = msg.get("tool_calls")
    if calls is None:
        return
    if out["role"] != "assistant" or not isinstance(calls, list):
        raise InvalidRequestError(f"{param}.tool_calls must be a list, on an assistant message",
                                  param=f"{param}.tool_calls")
    kept = []
    for k, call in enumerate(calls):
        cparam = f"{param}.tool_calls[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        name, args = (fn.get("name"), fn.get("arguments")) if isinstance(fn, dict) else (None, None)
        try:
            parsed = json.loads(args) if isinstance(args, str) else None
        except ValueError:
            parsed = None
        if not isinstance(name, str) or not name or not isinstance(parsed, dict):
            raise InvalidRequestError(f"{cparam} needs function.name and function.arguments (a JSON object as a "
                                      f"string)", param=cparam)
        kept.append({"type": "function", "id": str(call.get("id", "")),
                     "function": {"name": check_text(name, f"{cparam}.function.name"),
                                  "arguments": check_text(args, f"{cparam}.function.arguments")}})
    out["tool_calls"] = kept


def _check_tool_results(messages: list) -> None:
    """As OpenAI: a ``tool`` message answers a call of the assistant message just before it (or
    before the tool messages that follow that one), names it by ``tool_call_id``, once. The
    templates place tool results by order only, so an id that matches no call would otherwise be
    dropped unseen."""
    open_ids: set[str] | None = None  # the calls the latest assistant made and no tool answered yet
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            return  # parse_messages names it
        param = f"messages[{i}]"
        if msg.get("role") != "tool":
            calls = msg.get("tool_calls") if msg.get("role") == "assistant" else None
            open_ids = {str(c.get("id")) for c in calls if isinstance(c, dict) and c.get("id")} \
                if isinstance(calls, list) and calls else None
            continue
        if open_ids is None:
            raise InvalidRequestError(f"{param}: a tool message must answer a tool call of the assistant message "
                                      f"before it", param=f"{param}.role")
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequestError(f"{param}.tool_call_id is required: the id of the call this message answers",
                                      param=f"{param}.tool_call_id")
        if call_id not in open_ids:
            raise InvalidRequestError(f"{param}.tool_call_id {call_id!r} names no unanswered call of the assistant "
                                      f"message before it (open: {sorted(open_ids)})", param=f"{param}.tool_call_id")
        open_ids.discard(call_id)


def parse_messages(messages: Any) -> tuple[list[dict], list[ImageRef | SkillRef | VideoRef]]:
    """Validate `messages`; return template messages (images as {"type": "image"}, skills as a
    marker text) and the image and skill references in order."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    _check_tool_results(messages)
    out, refs = [], []
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequestError(f"{param} must be an object", param=param)
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{param}.role must be one of {', '.join(ROLES)}", param=f"{param}.role")
        if role == "developer":  # OpenAI's newer name for the system role; the templates know "system"
            role = "system"
        content = msg.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            out.append({"role": role, "content": check_text(content, f"{param}.content")})
            _attach_tool_calls(out[-1], msg, param)
            continue
        if not isinstance(content, list):
            raise InvalidRequestError(f"{param}.content must be a string or a list of parts", param=f"{param}.content")
        parts = []
        for j, part in enumerate(content):
            pparam = f"{param}.content[{j}]"
            if isinstance(part, (Image.Image, PreparedImage)):
                part = {"type": "image", "image": part}
            elif isinstance(part, DecodedVideo):
                part = {"type": "video", "video": part}
            if not isinstance(part, dict):
                raise InvalidRequestError(f"{pparam} must be an object", param=pparam)
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": check_text(part.get("text"), f"{pparam}.text")})
            elif kind == "skill":
                skill_id = part.get("skill_id")
                if not isinstance(skill_id, str) or not skill_id:
                    raise InvalidRequestError(f"{pparam}.skill_id must be a non-empty string", param=pparam)
                parts.append({"type": "text", "text": skill_marker(len(refs))})
                refs.append(SkillRef(skill_id, pparam))
            elif kind == "state_update":
                field, value = part.get("field"), part.get("value")
                if not isinstance(field, str) or not field.strip() or not isinstance(value, (str, int, float, bool)):
                    raise InvalidRequestError(f"{pparam} needs a string field and a scalar value", param=pparam)
                text = erratum_line(one_line(field, f"{pparam}.field"), one_line(str(value), f"{pparam}.value"))
                parts.append({"type": "text", "text": text + "\n"})
            elif kind in ("image_url", "image_file", "image"):
                if role not in ("user", "system"):
                    raise InvalidRequestError(f"{pparam}: images are accepted in user and system messages only",
                                              param=pparam)
                refs.append(_image_part(part, pparam))
                parts.append({"type": "image"})
            elif kind in ("video_url", "video_file", "video"):
                if role not in ("user", "system"):
                    raise InvalidRequestError(f"{pparam}: videos are accepted in user and system messages only",
                                              param=pparam)
                refs.append(_video_part(part, pparam))
                parts.append({"type": "video"})
            else:
                raise InvalidRequestError(f"{pparam}.type {kind!r} is not supported; use text, image_url, image_file, "
                                          f"video_url, video_file, skill or state_update",
                                          param=f"{pparam}.type")
        out.append({"role": role, "content": parts})
        _attach_tool_calls(out[-1], msg, param)
    return out, refs
