"""The wire format: OpenAI-shaped request and response models, plus the `mmkv` extension object.

The request schema checks the envelope (types, ranges, required fields -> 422). Content parts
are checked one by one with `parse_content_part`, so a bad part is a 400 naming the part, as the
OpenAI API answers it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from mmkv.errors import InvalidRequestError

# ---------------------------------------------------------------- requests


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ImageFile(BaseModel):
    file_id: str


class ImageFilePart(BaseModel):
    """An image uploaded once through /v1/files, referenced by id (the Assistants API shape)."""

    type: Literal["image_file"]
    image_file: ImageFile


class SkillPart(BaseModel):
    """A text skill precompiled through /v1/skills, spliced in at this place."""

    type: Literal["skill"]
    skill_id: str = Field(min_length=1)


class StateUpdatePart(BaseModel):
    """Renders the erratum line: '[STATE UPDATE] <field> has just changed to <value>; ...'."""

    type: Literal["state_update"]
    field: str = Field(min_length=1)
    value: str | int | float | bool


ContentPart = Annotated[TextPart | ImageURLPart | ImageFilePart | SkillPart | StateUpdatePart,
                        Field(discriminator="type")]
_content_part = TypeAdapter(ContentPart)
PART_TYPES = "'text', 'image_url', 'image_file', 'skill' or 'state_update'"


def parse_content_part(raw: Any, param: str) -> TextPart | ImageURLPart | ImageFilePart | SkillPart | StateUpdatePart:
    """One content part, or InvalidRequestError (400) naming `param` and what is wrong."""
    try:
        return _content_part.validate_python(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        kind = raw.get("type") if isinstance(raw, dict) else None
        if err["loc"]:  # (tag, field, ...): a known part type with a bad field
            field = ".".join(str(p) for p in err["loc"][1:])
            message = f"invalid {kind} part: {field}: {err['msg']}"
        else:
            message = f"content part of type {kind!r} is not supported; use {PART_TYPES}"
        raise InvalidRequestError(message, param=param) from None


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    # Parts stay raw here and go through parse_content_part: a bad part is a 400, not a 422.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class MMKVOptions(BaseModel):
    """mmkv's own knobs; the openai client sends them with extra_body={"mmkv": {...}}."""

    model_config = ConfigDict(extra="forbid")

    reuse: bool = Field(True, description="Splice cached image/prefix KV. False recomputes everything (the reference).")
    seam_tokens: int | None = Field(None, ge=0, description="Tokens recomputed after each spliced chunk.")
    rope_policy: str | None = Field(None, description="How cached keys are moved to new positions.")
    edit_policy: str | None = Field(None, description="What to do when the prompt equals a recent one but for a "
                                    "changed field: recompute, erratum, in_place or selective@K.")
    fidelity: bool = Field(False, description="Also run the full recompute and report how far the fast path's "
                           "first next-token logits are from it (costs a full prefill).")


class ChatCompletionRequest(BaseModel):
    # Unknown OpenAI fields (user, logit_bias, ...) are accepted and ignored, as other servers do.
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    mmkv: MMKVOptions = Field(default_factory=MMKVOptions)

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


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
    lm_tokens_computed: int = Field(0, description="Prompt tokens the language model computed.")
    edit: dict[str, Any] | None = Field(None, description="The edit policy's report when a changed field was "
                                        "detected or an edit policy was asked for.")
    fidelity: dict[str, Any] | None = Field(None, description="With mmkv.fidelity: logit_cosine, max_abs_diff and "
                                            "same_argmax of the first next-token logits against full recompute.")


class SkillCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    text: str = Field(min_length=1)


class SkillObject(BaseModel):
    id: str
    object: Literal["skill"] = "skill"
    name: str
    tokens: int
    created_at: int


class SkillList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SkillObject]


class SkillDeleted(BaseModel):
    id: str
    object: Literal["skill"] = "skill"
    deleted: bool = True


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


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


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


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


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
