"""/v1/chat/completions. Life of a request here: auth -> tenant -> schema (400, unsupported
fields named) -> content parts checked and resolved to engine parts, inline images decoded on the
image threads (400/404) -> one generation on the scheduler (429 when the queue is full): its
prefill, then its tokens in batched decode steps with the other running requests, text deltas
and logprobs streamed back as they decode -> the OpenAI response plus the `mmkv` report. The engine's figures are passed through unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from mmkv.errors import InvalidRequestError, MMKVError

from .context import ServerContext, disconnected
from .edge import ARRIVED
from .errors import error_body
from .files import resolve_image_url
from .schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    ImageFilePart,
    ImageURLPart,
    MMKVReport,
    PromptTokensDetails,
    SkillPart,
    StateUpdatePart,
    TextPart,
    TokenLogprob,
    UnsupportedParameterError,
    Usage,
    VideoFilePart,
    VideoURLPart,
    parse_content_part,
)
from .video_prep import VIDEO_PART_TYPES, engine_video_part
from .worker import Job, WorkerStoppedError

log = logging.getLogger("mmkv.server")

_END = object()  # end of a stream of text deltas


class _Logprobs(list):
    """A stream item: the logprobs of the tokens whose text is the next delta."""


def chat_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    chat = ChatCompletions(ctx)

    @router.post("/v1/chat/completions", response_model=ChatCompletion,
                 responses={200: {"content": {"text/event-stream": {}},
                                  "description": "A chat.completion, or with stream=true an SSE stream of chunks."}})
    async def chat_completions(body: ChatCompletionRequest, request: Request, tenant: str = Depends(ctx.tenant_of)):
        return await chat.answer(request, body, tenant)

    return router


class ChatCompletions:
    """One chat request's stages: check, resolve the messages, submit the generation, then answer
    whole (`complete`) or as an SSE stream (`stream`: the first item held back so that a prompt
    the engine refuses is still an HTTP error status, then `events`)."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    async def answer(self, request: Request, body: ChatCompletionRequest, tenant: str):
        self.check(body)
        messages = await engine_messages(self.ctx, body, tenant)
        kwargs = self.generate_kwargs(body, tenant)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return await self.stream(request, body, messages, kwargs, completion_id)
        return await self.complete(request, body, messages, kwargs, completion_id)

    def check(self, body: ChatCompletionRequest) -> None:
        """What the server's settings refuse: another model's name (404), fidelity while it is off."""
        self.ctx.check_model(body.model)
        if body.mmkv.fidelity and not self.ctx.settings.allow_fidelity:
            raise UnsupportedParameterError("mmkv.fidelity is off on this server: it runs a full recompute that "
                                            "stalls every other request (start the server with --allow-fidelity)",
                                            param="mmkv.fidelity")

    def generate_kwargs(self, body: ChatCompletionRequest, tenant: str) -> dict[str, Any]:
        return dict(
            max_new_tokens=body.max_completion_tokens or body.max_tokens or self.ctx.settings.default_max_tokens,
            temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0), seed=body.seed,
            stop=body.stop_list(), presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, logit_bias=body.token_logit_bias(), logprobs=body.logprobs,
            top_logprobs=body.top_logprobs, reuse=body.mmkv.reuse, seam_tokens=body.mmkv.seam_tokens,
            rope_policy=body.mmkv.rope_policy, edit_policy=body.mmkv.edit_policy, fidelity=body.mmkv.fidelity,
            history_policy=body.mmkv.history_policy,
            blend=body.mmkv.blend, blend_select=body.mmkv.blend_select,
            tenant=tenant, tools=body.tools, tool_choice=body.tool_choice, response_format=body.response_format,
        )

    async def complete(self, request: Request, body: ChatCompletionRequest, messages, kwargs,
                       completion_id: str) -> ChatCompletion | Response:
        job = self.ctx.worker.submit_generation(messages, kwargs)
        result = await self.ctx.until_done(request, job, asyncio.wrap_future(job.future))
        if result.finish_reason == "cancelled":  # the client left as the job finished
            return Response(status_code=499)
        mmkv_report, usage = self.report(request, job, result)
        logprobs = _choice_logprobs(result.logprobs) if body.logprobs else None
        return ChatCompletion(id=completion_id, created=int(time.time()), model=self.ctx.model_id, usage=usage,
                              mmkv=mmkv_report,
                              choices=[Choice(message=_message(body, result), logprobs=logprobs,
                                              finish_reason=result.finish_reason)])

    def report(self, request: Request, job: Job, result) -> tuple[MMKVReport, Usage]:
        """The response's mmkv report and usage; records the request's metrics."""
        arrived = request.scope[ARRIVED]
        ttft_s = job.started_at - arrived + result.ttft_s
        u = result.usage
        self.ctx.metrics.observe_completion(ttft_s=ttft_s, e2e_s=time.perf_counter() - arrived,
                                            prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
                                            completion_tokens=u.completion_tokens,
                                            image_tokens_reused=result.image_tokens_reused)
        usage = Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                      total_tokens=u.prompt_tokens + u.completion_tokens,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens))
        mmkv_report = MMKVReport(ttft_ms=round(ttft_s * 1000, 3), image_tokens_reused=result.image_tokens_reused,
                                 vision_tower_runs=result.vision_tower_runs,
                                 prefix_tokens_reused=result.prefix_tokens_reused,
                                 skill_tokens_reused=result.skill_tokens_reused,
                                 video_tokens_reused=result.video_tokens_reused,
                                 lm_tokens_computed=result.lm_tokens_computed,
                                 images_in_context=result.images_in_context,
                                 edit=dataclasses.asdict(result.edit) if result.edit else None,
                                 fidelity=dataclasses.asdict(result.fidelity) if result.fidelity else None,
                                 history=dataclasses.asdict(result.history) if result.history else None,
                                 blend=result.blend.to_json() if result.blend else None)
        log.info("chat completion", extra={
            "ttft_ms": mmkv_report.ttft_ms, "queue_ms": round((job.started_at - arrived) * 1000, 3),
            "prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
            "completion_tokens": u.completion_tokens, "finish_reason": result.finish_reason,
            "image_tokens_reused": result.image_tokens_reused, "vision_tower_runs": result.vision_tower_runs})
        return mmkv_report, usage

    async def stream(self, request: Request, body: ChatCompletionRequest, messages, kwargs,
                     completion_id: str) -> StreamingResponse:
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:  # runs on the scheduler thread
            loop.call_soon_threadsafe(items.put_nowait, item)

        job = self.ctx.worker.submit_generation(messages, dict(
            kwargs, on_text=put, on_logprobs=(lambda lps: put(_Logprobs(lps))) if body.logprobs else None))
        # Scheduled after every callback of the job, so _END arrives after the last item.
        job.future.add_done_callback(lambda _: loop.call_soon_threadsafe(items.put_nowait, _END))
        first = await self.first_item(request, job, items)
        sse = _SSE(completion_id, int(time.time()), self.ctx.model_id)
        return StreamingResponse(self.events(request, body, job, items, first, sse), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def first_item(self, request: Request, job: Job, items: asyncio.Queue):
        """Hold the headers until the first item or the end: a prompt the engine rejects is still
        an HTTP error status, not a 200 with an error inside the stream."""
        first_item = asyncio.ensure_future(items.get())
        try:
            first = await self.ctx.until_done(request, job, first_item)
        finally:
            first_item.cancel()
        if first is _END and job.future.exception() is not None:
            raise job.future.exception()
        return first

    async def events(self, request: Request, body: ChatCompletionRequest, job: Job, items: asyncio.Queue, first,
                     sse: _SSE) -> AsyncIterator[str]:
        ctx = self.ctx
        # Starlette cancels this generator when the client goes away; the watcher also covers
        # servers that only report it on the next send.
        watcher = asyncio.ensure_future(disconnected(request))
        watcher.add_done_callback(lambda w: w.cancelled() or ctx.cancel(job))
        deadline = asyncio.ensure_future(ctx.shutdown_deadline.wait())
        try:
            yield sse.chunk(Delta(role="assistant", content=""))
            item, pending_logprobs = first, []
            while item is not _END:
                if isinstance(item, _Logprobs):
                    pending_logprobs.extend(item)
                elif item:
                    yield sse.chunk(Delta(content=item), logprobs=_chunk_logprobs(pending_logprobs, body.logprobs))
                    pending_logprobs = []
                next_item = asyncio.ensure_future(items.get())
                await asyncio.wait({next_item, deadline}, return_when=asyncio.FIRST_COMPLETED)
                if not next_item.done():  # the shutdown grace period is over: end the stream properly
                    next_item.cancel()
                    ctx.cancel(job)
                    yield sse.error(WorkerStoppedError("the server is shutting down; this stream ran past its "
                                                       "grace period"))
                    yield _DONE
                    return
                item = next_item.result()
            if pending_logprobs:  # tokens that produced no text (a stop string, an unfinished character)
                yield sse.chunk(Delta(content=""), logprobs=_chunk_logprobs(pending_logprobs, True))
            async for event in self.ending(request, body, job, sse):
                yield event
        finally:
            watcher.cancel()
            deadline.cancel()
            ctx.cancel(job)

    async def ending(self, request: Request, body: ChatCompletionRequest, job: Job, sse: _SSE) -> AsyncIterator[str]:
        """The stream's last events: the error event, or the tool calls, the finishing chunk with
        the mmkv report, the usage chunk when asked for, and [DONE]."""
        if (exc := job.future.exception()) is not None:
            if not isinstance(exc, MMKVError):
                log.error("generation failed mid-stream", exc_info=exc)
                exc = _internal_error()
            yield sse.error(exc)
            yield _DONE
            return
        result = job.future.result()
        if result.finish_reason == "cancelled":  # the client has gone; nobody to tell
            return
        mmkv_report, usage = self.report(request, job, result)
        if calls := _tool_calls(body, result):  # whole calls in one delta: clients accumulate them
            yield sse.chunk(Delta(tool_calls=[dict(index=i, **c) for i, c in enumerate(calls)]))
        yield sse.chunk(Delta(), finish_reason=result.finish_reason, mmkv=mmkv_report)
        if body.stream_options and body.stream_options.include_usage:
            yield sse.event(ChatCompletionChunk(id=sse.completion_id, created=sse.created, model=sse.model,
                                                choices=[], usage=usage))
        yield _DONE


_DONE = "data: [DONE]\n\n"


@dataclasses.dataclass(frozen=True)
class _SSE:
    """One stream's events, each a `data:` line of JSON."""

    completion_id: str
    created: int
    model: str

    def chunk(self, delta: Delta, finish_reason=None, logprobs=None, **extra) -> str:
        choice = ChunkChoice(delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return self.event(ChatCompletionChunk(id=self.completion_id, created=self.created, model=self.model,
                                              choices=[choice], **extra))

    @staticmethod
    def event(data: ChatCompletionChunk) -> str:
        return f"data: {data.model_dump_json(exclude_none=True)}\n\n"

    @staticmethod
    def error(error: MMKVError) -> str:
        return f"data: {json.dumps({'error': error_body(error)})}\n\n"


def _tool_calls(body: ChatCompletionRequest, result) -> list[dict[str, Any]]:
    """The answer's tool calls in OpenAI's shape; with parallel_tool_calls false, the first only."""
    calls = [c.openai() for c in result.tool_calls]
    return calls[:1] if body.parallel_tool_calls is False else calls


def _message(body: ChatCompletionRequest, result) -> AssistantMessage:
    calls = _tool_calls(body, result)
    return AssistantMessage(content=result.text or (None if calls else ""), tool_calls=calls or None)


def _internal_error() -> MMKVError:
    error = MMKVError("internal error during generation")
    error.code = "internal_error"
    return error


def _choice_logprobs(logprobs) -> ChoiceLogprobs:
    return ChoiceLogprobs(content=[TokenLogprob.model_validate(dataclasses.asdict(lp)) for lp in logprobs or []])


def _chunk_logprobs(logprobs: list, wanted: bool) -> ChoiceLogprobs | None:
    return _choice_logprobs(logprobs) if wanted else None


def _tool_fields(message) -> dict[str, Any]:
    """An assistant message's calls and a tool message's call id, for the engine to check."""
    return ({"tool_calls": message.tool_calls} if message.tool_calls else {}) \
        | ({"tool_call_id": message.tool_call_id} if message.tool_call_id is not None else {})


async def engine_messages(ctx: ServerContext, body: ChatCompletionRequest, tenant: str) -> list[dict[str, Any]]:
    """The request's messages in the engine's shape, every part checked: image_file ids must be
    the tenant's files (404); image URLs must be data: URLs or allowed (fetched here, 400); inline
    images are decoded on the image threads, each distinct URL once."""
    _check_video_count(body, ctx.settings.max_videos_per_request)
    out, images, inline = [], 0, {}
    for i, message in enumerate(body.messages):
        role = "system" if message.role == "developer" else message.role
        if message.content is None and message.role != "assistant":
            raise InvalidRequestError(f"messages[{i}].content is required for role {message.role!r}",
                                      param=f"messages[{i}].content")
        if message.content is None or isinstance(message.content, str):
            out.append({"role": role, "content": message.content or ""} | _tool_fields(message))
            continue
        parts = []
        for j, raw in enumerate(message.content):
            param = f"messages[{i}].content[{j}]"
            part = parse_content_part(raw, param)
            if isinstance(part, (TextPart, SkillPart, StateUpdatePart)):
                parts.append(part.model_dump())  # the engine checks skill ids per tenant (404)
                continue
            if isinstance(part, (VideoURLPart, VideoFilePart)):
                parts.append(await engine_video_part(ctx, part, param, tenant))
                continue
            images += 1
            if images > ctx.settings.max_images_per_request:
                raise InvalidRequestError(f"at most {ctx.settings.max_images_per_request} images per request",
                                          param=param)
            parts.append(await _engine_image_part(ctx, part, param, tenant, inline))
        out.append({"role": role, "content": parts} | _tool_fields(message))
    return out


def _check_video_count(body: ChatCompletionRequest, most: int) -> None:
    """At most `most` video parts, counted before any is decoded: the part past it is a 400."""
    count = 0
    for i, message in enumerate(body.messages):
        for j, raw in enumerate(message.content if isinstance(message.content, list) else ()):
            if isinstance(raw, dict) and raw.get("type") in VIDEO_PART_TYPES:
                count += 1
                if count > most:
                    raise InvalidRequestError(f"at most {most} videos per request",
                                              param=f"messages[{i}].content[{j}]")


async def _engine_image_part(ctx: ServerContext, part: ImageURLPart | ImageFilePart, param: str, tenant: str,
                             inline: dict[str, Any]) -> dict[str, Any]:
    if isinstance(part, ImageURLPart) and part.image_url.detail not in (None, "auto"):
        raise UnsupportedParameterError(f"image_url.detail {part.image_url.detail!r} is not supported; images are "
                                        "sized by --max-pixels (send 'auto' or nothing)",
                                        param=f"{param}.image_url.detail")
    if isinstance(part, ImageURLPart) and part.image_url.url.startswith("mmkv://"):
        # An uploaded id written as a URL: the same as an image_file part.
        part = ImageFilePart(type="image_file", image_file={"file_id": part.image_url.url.removeprefix("mmkv://")})
    if isinstance(part, ImageFilePart):
        file_id = (await run_in_threadpool(ctx.files.get, tenant, part.image_file.file_id,
                                           f"{param}.image_file.file_id")).id
        return {"type": "image_file", "image_file": {"file_id": file_id}}
    url_param = f"{param}.image_url.url"
    url = part.image_url.url
    if url not in inline:
        data = await resolve_image_url(url, ctx.settings.allowed_image_url_prefixes, ctx.settings.max_body_bytes,
                                       url_param)
        inline[url] = await ctx.images.prepare(data, url_param)
    return {"type": "image", "image": inline[url]}
