"""The wire format: OpenAI-shaped request and response models, plus the `mmkv` extension object.

The request schema checks the envelope (strict types, ranges, required fields -> 400 naming the
field); OpenAI fields mmkv does not implement are refused (400 `unsupported_parameter`), never
ignored. Content parts are checked one by one with `parse_content_part`, so a bad part is a 400
naming the part, as the OpenAI API answers it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from mmkv.errors import InvalidRequestError
from mmkv.request.messages import RESERVED_TOKENS
from mmkv.request.tools import MAX_TOOLS

from .errors import field_path

# ---------------------------------------------------------------- requests


def _integral(value: Any) -> Any:
    """JSON has one number type: 3.0 is the integer 3 (as JSON Schema reads it); 3.5 and "3" are not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


JSONInt = Annotated[int, BeforeValidator(_integral)]
# The bounds sit inside the type (not on the field) so that the schema of `X | None` keeps them.
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
NonNegativeInt = Annotated[int, Field(ge=0), BeforeValidator(_integral)]

# Text a client may not send (mmkv.request.messages.check_text; 400 naming where).
NO_RESERVED_TOKEN = {"not": {"pattern": "|".join(token.replace("|", "\\|") for token in RESERVED_TOKENS)}}
# Some character that Python's str.strip() keeps: a name or text of whitespace alone is refused.
NOT_BLANK = r"[^\t\n\v\f\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"


_PART = ConfigDict(extra="forbid")  # a key a part does not define is refused, not dropped


class TextPart(BaseModel):
    model_config = _PART
    type: Literal["text"]
    text: str = Field(json_schema_extra=NO_RESERVED_TOKEN)


class ImageURL(BaseModel):
    model_config = _PART
    url: str
    detail: Literal["auto", "low", "high"] | None = Field(None, json_schema_extra={"enum": ["auto", None]})  # others: 400


class ImageURLPart(BaseModel):
    model_config = _PART
    type: Literal["image_url"]
    image_url: ImageURL


class ImageFile(BaseModel):
    model_config = _PART
    file_id: str


class ImageFilePart(BaseModel):
    """An image uploaded once through /v1/files, referenced by id (the Assistants API shape)."""

    model_config = _PART

    type: Literal["image_file"]
    image_file: ImageFile


class VideoURL(BaseModel):
    model_config = _PART
    url: str


class VideoSamplingFields(BaseModel):
    """qwen-vl-utils' per-video settings (mmkv.video.VideoSampling checks their ranges)."""

    model_config = _PART
    fps: float | None = None
    nframes: int | None = None
    max_pixels: int | None = None
    video_start: float | None = None
    video_end: float | None = None


class VideoURLPart(VideoSamplingFields):
    """A video as a data: URL (MP4, MOV, WebM, MKV), sampled with the settings beside it."""

    type: Literal["video_url"]
    video_url: VideoURL


class VideoFile(BaseModel):
    model_config = _PART
    file_id: str


class VideoFilePart(BaseModel):
    """A video uploaded once through /v1/files, referenced by id."""

    model_config = _PART
    type: Literal["video_file"]
    video_file: VideoFile


class SkillPart(BaseModel):
    """A text skill precompiled through /v1/skills, spliced in at this place."""

    model_config = _PART

    type: Literal["skill"]
    skill_id: str = Field(min_length=1)


class StateUpdatePart(BaseModel):
    """Renders the erratum line: '[STATE UPDATE] <field> has just changed to <value>; ...'."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN is not a value to render, as in the request's floats

    type: Literal["state_update"]
    field: str = Field(min_length=1)
    value: str | int | float | bool


ContentPart = Annotated[TextPart | ImageURLPart | ImageFilePart | VideoURLPart | VideoFilePart | SkillPart | StateUpdatePart,
                        Field(discriminator="type")]
_content_part = TypeAdapter(ContentPart)


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with its local `$defs` references written out (none of them recursive)."""
    defs = schema.pop("$defs", {})
    schema.pop("discriminator", None)  # its mapping names $defs entries; `oneOf` says the same alone

    def expand(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return expand(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: expand(value) for key, value in node.items()}
        return [expand(item) for item in node] if isinstance(node, list) else node

    return expand(schema)


# Published as the schema of a message's parts, which the route checks one by one (parse_content_part).
CONTENT_PART_SCHEMA = _inlined(_content_part.json_schema())
PART_TYPES = "'text', 'image_url', 'image_file', 'video_url', 'video_file', 'skill' or 'state_update'"


def parse_content_part(raw: Any, param: str) -> (TextPart | ImageURLPart | ImageFilePart | VideoURLPart | VideoFilePart
                                                  | SkillPart | StateUpdatePart):
    """One content part, or InvalidRequestError (400) naming `param` and what is wrong."""
    try:
        return _content_part.validate_python(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        kind = raw.get("type") if isinstance(raw, dict) else None
        if err["type"] == "extra_forbidden":
            where = f"{param}.{field_path(err['loc'][1:])}"
            raise UnsupportedParameterError(f"{where} is not supported by this server; remove it", param=where) from None
        if err["loc"]:  # (tag, field, ...): a known part type with a bad field
            field = ".".join(str(p) for p in err["loc"][1:])
            message = f"invalid {kind} part: {field}: {err['msg']}"
        else:
            message = f"content part of type {kind!r} is not supported; use {PART_TYPES}"
        raise InvalidRequestError(message, param=param) from None


# A function tool as mmkv.request.tools.check_tools accepts it (names unique within a request).
_TOOL_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
_FUNCTION_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": _TOOL_NAME, "description": {"type": "string", **NO_RESERVED_TOKEN},
        "parameters": {"type": "object"}, "strict": {"enum": [False, None]}}}}}


# OpenAI's response_format as mmkv.request.grammar.parse_response_format accepts it (the schema itself is
# checked when it compiles: a feature structured outputs cannot enforce is a 400 naming it).
_RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "additionalProperties": False,
     "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False, "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["name", "schema"], "additionalProperties": False, "properties": {
            "name": _TOOL_NAME, "description": {"type": "string"}, "schema": {"type": "object"},
            "strict": {"type": ["boolean", "null"]}}}}},
    {"type": "null"}]}


# OpenAI's chat-completions request fields that mmkv does not implement, each with the values that
# mean "off" (accepted, since they ask for nothing); any other value is a 400 naming the field.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": ([],), "function_call": ("none",), "audio": (), "modalities": (["text"],),
    "prediction": (), "reasoning_effort": (), "verbosity": (), "web_search_options": (), "store": (False,),
    "metadata": (), "service_tier": ("auto", "default"), "prompt_cache_retention": (),
}
# Fields that by OpenAI's definition never change the answer (abuse monitoring, cache routing).
_NO_EFFECT = ("user", "safety_identifier", "prompt_cache_key")
_MESSAGE_UNSUPPORTED = {"name": (), "function_call": (), "refusal": (), "audio": ()}
_MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4  # stop strings per request, as OpenAI
MAX_STOP_CHARS = 256
_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
INT64 = (-(2**63), 2**63 - 1)
# < 2**63 rather than <= 2**63 - 1: the same integers, and a bound a validator comparing in float64 keeps.
Int64 = Annotated[int, Field(ge=INT64[0], lt=INT64[1] + 1), BeforeValidator(_integral)]


class UnsupportedParameterError(InvalidRequestError):
    """An OpenAI request field mmkv does not implement, set to something other than "off"."""

    code = "unsupported_parameter"


def _unsupported(param: str) -> UnsupportedParameterError:
    return UnsupportedParameterError(f"{param} is not supported by this server; remove it", param=param)


def check_unicode(value: Any, param: str) -> None:
    """Every string in a decoded JSON value must be valid Unicode: JSON can carry a lone surrogate
    ("\\udfff") that no encoder, tokenizer or log line accepts. Raises 400 naming where."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(f"{param} is not valid Unicode (it contains a lone surrogate)",
                                      param=param) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, param or "body")
            check_unicode(item, f"{param}.{key}" if param else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{param}[{i}]")


def _message_schema(schema: dict[str, Any]) -> None:
    """What `_message` and the chat route accept, in the published schema: any other key only as
    null, `tool_calls` only on an assistant message, `tool_call_id` only on a tool message, and
    `content` on every message but an assistant's (which may carry only tool calls)."""
    schema["additionalProperties"] = {"type": "null"}
    schema["allOf"] = [_only_with_role("tool_calls", "assistant"), _only_with_role("tool_call_id", "tool"),
                       {"not": {"properties": {"role": {"not": {"const": "assistant"}}, "content": {"type": "null"}}}}]


def _only_with_role(key: str, role: str) -> dict[str, Any]:
    return {"not": {"required": [key], "properties": {key: {"not": {"type": "null"}},
                                                      "role": {"not": {"const": role}}}}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(json_schema_extra=_message_schema)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Parts stay raw here and go through parse_content_part: a bad part is a 400 naming the part.
    content: Annotated[str | list[dict[str, Any]] | None, WithJsonSchema({"anyOf": [
        {"type": "string", **NO_RESERVED_TOKEN}, {"type": "array", "items": CONTENT_PART_SCHEMA}, {"type": "null"}]})] = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made (checked by the engine)
    tool_call_id: str | None = None  # tool: which call this is the result of


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


BlendRatio = Annotated[float, Field(ge=0.0, le=1.0)]


class MMKVOptions(BaseModel):
    """mmkv's own knobs; the openai client sends them with extra_body={"mmkv": {...}}."""

    model_config = ConfigDict(extra="forbid", strict=True)

    reuse: bool = Field(True, description="Splice cached image/prefix KV. False recomputes everything (the reference).")
    seam_tokens: NonNegativeInt | None = Field(None, description="Tokens recomputed after each spliced chunk.")
    rope_policy: str | None = Field(None, description="How cached keys are moved to new positions.")
    edit_policy: str | None = Field(None, description="What to do when the prompt equals a recent one but for a "
                                    "changed field: recompute, erratum, in_place or selective@K.")
    history_policy: str | None = Field(None, description="exact (default) or compose: earlier turns resent at "
                                       "moved positions spliced from their cached KV (approximate, reported).")
    fidelity: bool = Field(False, description="Also run the full recompute and report how far the fast path's "
                           "first next-token logits are from it (costs a full prefill).")
    blend: BlendRatio | dict[Literal["image", "skill", "video", "turn"], BlendRatio] | None = Field(
        None, description="The fidelity dial: the share of each spliced chunk's tokens recomputed in context, "
        "0 (the plain splice) to 1 (a full recompute's KV); one ratio, or one per chunk kind (the others keep the "
        "server's --blend). Not with reuse false.")
    blend_select: Literal["deviation", "stride"] | None = Field(
        None, description="How the dial chooses tokens: deviation (a probe over the first layers, the tokens "
        "whose K/V deviate most from the cached ones) or stride (evenly spaced). Default: the server's.")


class ChatCompletionRequest(BaseModel):
    """OpenAI's fields, each implemented or refused (400 `unsupported_parameter` naming it); null
    means unset, as in OpenAI's API. Types are strict: "5" is not an integer, true is not 1."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,  # NaN: "a finite number"
                              json_schema_extra=lambda schema: _request_schema(schema))

    model: str = Field(description="One of the names /v1/models lists (404 `model_not_found` otherwise).")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: JSONInt = Field(0, ge=-1, description="Sample from the k most likely tokens; 0 or -1: off (vLLM's extension).")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[str, float] | None, WithJsonSchema({"anyOf": [
        {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
         "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
        {"type": "null"}]})] = Field(None, description="Token id (decimal string) -> bias in [-100, 100].")
    logprobs: bool = False
    top_logprobs: JSONInt = Field(0, ge=0, le=20)
    stop: Annotated[str | list[str] | None, WithJsonSchema({"anyOf": [
        _STOP_STRING, {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP}, {"type": "null"}]})] = None
    seed: Int64 | None = None
    n: JSONInt = Field(1, ge=1, description="Only 1 (more is a 400 unsupported_parameter).",
                   json_schema_extra={"maximum": 1})
    tools: Annotated[list[dict[str, Any]] | None, WithJsonSchema(
        {"anyOf": [{"type": "array", "items": _FUNCTION_TOOL, "maxItems": MAX_TOOLS}, {"type": "null"}]})] = Field(None, description="Function tools, rendered by the model's chat "
                                               "template (400 where it has none).")
    tool_choice: Annotated[str | dict[str, Any] | None, WithJsonSchema({"anyOf": [
        {"enum": ["auto", "none", "required"]},
        {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {"name": _TOOL_NAME}}}},
        {"type": "null"}]})] = None
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (the first).")
    response_format: Annotated[dict[str, Any] | None, WithJsonSchema(_RESPONSE_FORMAT)] = Field(
        None, description="json_object or json_schema: the answer is decoded under the schema's grammar "
                          "(docs/server.md, structured outputs).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    mmkv: MMKVOptions = Field(default_factory=MMKVOptions)

    @model_validator(mode="before")
    @classmethod
    def _refuse_what_is_not_implemented(cls, raw: Any) -> Any:
        """Raises (400) on invalid Unicode anywhere and on fields mmkv does not implement; drops
        nulls and the fields that never change an answer, so the schema sees only what it checks."""
        if not isinstance(raw, dict):
            return raw
        check_unicode(raw, "")
        out = {}
        for key, value in raw.items():
            if value is None or key in _NO_EFFECT:
                continue
            if key in _UNSUPPORTED or key not in cls.model_fields:
                if _is_off(value, _UNSUPPORTED.get(key, ())):
                    continue
                raise _unsupported(key)
            out[key] = value
        options = out.get("stream_options")
        if isinstance(options, dict) and "include_obfuscation" in options:  # OpenAI's padding of stream chunks
            if options["include_obfuscation"] not in (None, False):
                raise _unsupported("stream_options.include_obfuscation")
            out["stream_options"] = {k: v for k, v in options.items() if k != "include_obfuscation"}
        if isinstance(out.get("messages"), list):
            out["messages"] = [_message(m, f"messages[{i}]") for i, m in enumerate(out["messages"])]
        return out

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequestError(f"logit_bias key {key!r} is not a token id (a decimal integer string)",
                                          param="logit_bias")
            if not -100.0 <= value <= 100.0:
                raise InvalidRequestError(f"logit_bias[{key!r}] = {value} is outside [-100, 100]", param="logit_bias")
        return bias

    @field_validator("stop")
    @classmethod
    def _stop_bounds(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP:
            raise InvalidRequestError(f"stop has {len(stops)} strings; at most {MAX_STOP}", param="stop")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise InvalidRequestError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters", param="stop")
        return stop

    @model_validator(mode="after")
    def _combinations(self) -> ChatCompletionRequest:
        if self.n != 1:
            raise UnsupportedParameterError(f"n={self.n} is not supported; only one choice per request", param="n")
        if self.max_tokens is not None and self.max_completion_tokens is not None:  # as OpenAI: one would be ignored
            raise InvalidRequestError("max_tokens and max_completion_tokens cannot both be set; max_tokens is the "
                                      "deprecated name of max_completion_tokens, send one", param="max_tokens")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        if self.stream_options is not None and not self.stream:  # as OpenAI: not silently dropped
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        if self.parallel_tool_calls is not None and not self.tools:
            raise InvalidRequestError("parallel_tool_calls needs tools", param="parallel_tool_calls")
        return self

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_logit_bias(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None


def _request_schema(schema: dict[str, Any]) -> None:
    """The published schema says what `_refuse_what_is_not_implemented` and `_combinations` accept:
    null for any optional field (unset), the fields that never change an answer with any value,
    OpenAI's unimplemented fields only at their "off" values, any other key only as null, and the
    pairs that go together."""
    properties, required = schema["properties"], set(schema.get("required", ()))
    for name, prop in properties.items():
        if name not in required and not _allows_null(prop):
            meta = {key: prop.pop(key) for key in ("title", "description", "default") if key in prop}
            properties[name] = {"anyOf": [prop, {"type": "null"}], **meta}
    for name in _NO_EFFECT:
        properties[name] = {"description": "Accepted and ignored: by OpenAI's definition it never changes an answer."}
    for name, off_values in _UNSUPPORTED.items():
        if off_values:
            properties[name] = {"enum": [*off_values, None], "description": "Not implemented: only 'off' is accepted."}
    schema["additionalProperties"] = {"type": "null"}
    schema["allOf"] = [
        {"not": {"required": ["max_tokens", "max_completion_tokens"],  # both set: one would be ignored
                 "properties": {"max_tokens": {"type": "integer"}, "max_completion_tokens": {"type": "integer"}}}},
        {"not": {"required": ["top_logprobs"],  # top_logprobs needs logprobs
                 "properties": {"top_logprobs": {"type": "integer", "minimum": 1},
                                "logprobs": {"not": {"const": True}}}}},
        {"not": {"required": ["stream_options"],  # stream_options needs stream
                 "properties": {"stream_options": {"type": "object"}, "stream": {"not": {"const": True}}}}},
        {"not": {"required": ["parallel_tool_calls"],  # parallel_tool_calls needs tools
                 "properties": {"parallel_tool_calls": {"type": "boolean"},
                                "tools": {"not": {"type": "array", "minItems": 1}}}}},
    ]


def _allows_null(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "null" or any(_allows_null(p) for p in prop.get("anyOf", ()))


def _is_off(value: Any, off_values: tuple[Any, ...]) -> bool:
    return any(type(value) is type(off) and value == off for off in off_values)  # False is off, 0 is not


def _message(raw: Any, param: str) -> Any:
    """One message with its unsupported fields refused and its nulls dropped."""
    if not isinstance(raw, dict):
        return raw
    role = raw.get("role")
    if role == "function":
        raise UnsupportedParameterError(f"{param}.role 'function' is not supported (the legacy function API); "
                                        f"use tools and role 'tool'", param=f"{param}.role")
    out = {}
    for key, value in raw.items():
        if key in ("role", "content") or (key == "tool_calls" and role == "assistant") or \
                (key == "tool_call_id" and role == "tool"):
            out[key] = value
        elif value is not None and not _is_off(value, _MESSAGE_UNSUPPORTED.get(key, ())):
            raise _unsupported(f"{param}.{key}")
    return out


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class MMKVReport(BaseModel):
    """What reuse did for this request."""

    ttft_ms: float = Field(description="Request arrival to first token, queue wait included.")
    image_tokens_reused: int
    vision_tower_runs: int = Field(description="Vision tower runs this request caused.")
    prefix_tokens_reused: int = Field(0, description="Leading prompt tokens taken from the prefix cache.")
    skill_tokens_reused: int = Field(0, description="Skill tokens spliced from cached KV.")
    video_tokens_reused: int = Field(0, description="Video pad tokens spliced from cached KV.")
    lm_tokens_computed: int = Field(0, description="Prompt tokens the language model computed.")
    images_in_context: int = Field(0, description="Images seen for the first time (their KV in no tier): computed "
                                   "in the prompt's context, their reusable KV built afterwards in idle time.")
    edit: dict[str, Any] | None = Field(None, description="The edit policy's report when a changed field was "
                                        "detected or an edit policy was asked for.")
    fidelity: dict[str, Any] | None = Field(None, description="With mmkv.fidelity: logit_cosine, max_abs_diff and "
                                            "same_argmax of the first next-token logits against full recompute.")
    history: dict[str, Any] | None = Field(None, description="With mmkv.history_policy compose: the policy applied "
                                           "and the turns and tokens composed.")
    blend: dict[str, Any] | None = Field(None, description="The fidelity dial's report when it is on: ratios per "
                                         "chunk kind, select, tokens recomputed per chunk, the probe's tokens, layers "
                                         "and milliseconds, applied (false, with a reason, when an edit policy "
                                         "placed the prompt).")


class SkillCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, raw: Any) -> Any:
        check_unicode(raw, "")
        return raw

    name: str = Field(min_length=1, max_length=256, pattern=NOT_BLANK)
    text: str = Field(min_length=1, pattern=NOT_BLANK, json_schema_extra=NO_RESERVED_TOKEN)


class SkillObject(BaseModel):
    id: str
    object: Literal["skill"] = "skill"
    name: str
    tokens: int
    created_at: int


class SkillList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SkillObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class SkillDeleted(BaseModel):
    id: str
    object: Literal["skill"] = "skill"
    deleted: bool = True


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    mmkv: MMKVReport


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    mmkv: MMKVReport | None = None


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    width: int
    height: int
    image_tokens: int


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mmkv"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


def id_links(param: str, *operation_ids: str) -> dict[str, Any]:
    """OpenAPI links from a created object's `id` to the operations that take it as `param`, so a
    client generator or a stateful API fuzzer can follow a create to its object."""
    return {op: {"operationId": op, "parameters": {param: "$response.body#/id"}} for op in operation_ids}


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
