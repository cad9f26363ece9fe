"""Request planning: the request's values checked, the chat template rendered and tokenized (each
image expanded to its pad tokens, each skill to its tokens) and the `SplicePlan` (native
positions, each cached chunk placed at its rope policy's target).

`Planner` reads only the model's tokenizer, processor and config; the engine calls it under its
lock, where the registries it is handed are consistent.
"""

from __future__ import annotations

import re
import sys
import threading
from array import array
from dataclasses import dataclass

import cachetools
import torch

from mmkv.adapters import ImageFeatures, VisualGrid, VLAdapter
from mmkv.kv.chunks import CachedChunk
from mmkv.errors import InvalidRequestError
from mmkv.request.registry import RegisteredImage, Skill
from mmkv.kv.rerotate import POLICIES, target_positions
from mmkv.request.splice import Placement
from mmkv.request.tools import ToolSpec, check_tools, template_supports_tools
from mmkv.request.videos import RegisteredVideo, VideoGroupRef

MAX_STOPS, MAX_STOP_CHARS = 4, 256  # as OpenAI: bounds the stop-string search per token
PROCESSOR_ONLY = re.compile(r"<\|(vision_[a-z]+|image_pad|video_pad)\|>")  # tokens only the processor places
LITERAL = "\ue002{}\ue003"  # the i-th special token's string, sent by a client: tokenized as plain text
_LITERAL_MARK = re.compile("\ue002(\\d+)\ue003")


def check_seam_tokens(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 64:
        raise InvalidRequestError("seam_tokens must be an integer from 0 to 64", param="seam_tokens")
    return value


def check_stops(stop) -> list[str]:
    """None, one string or a list of at most MAX_STOPS non-empty strings of at most MAX_STOP_CHARS."""
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else None if stop is not None else []
    if stops is None or len(stops) > MAX_STOPS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
                                                             for s in stops):
        raise InvalidRequestError(f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings of at "
                                  f"most {MAX_STOP_CHARS} characters", param="stop")
    return stops


def check_policy(value) -> str:
    if value not in POLICIES:
        raise InvalidRequestError(f"rope_policy must be one of {', '.join(POLICIES)}", param="rope_policy")
    return value


@dataclass
class SplicePlan:
    """What the reuse path prefills: tokens, positions, and where each cached chunk goes."""

    input_ids: torch.Tensor  # [L]
    positions: torch.Tensor  # [3, L] with each chunk at its policy's target
    native_positions: torch.Tensor  # [3, L] the model's own
    placements: list[Placement]
    chunk_keys: list[str | None]  # per token: the cache key of the chunk it comes from

    def chunk_features(self) -> ImageFeatures | None:
        """Visual features for every image pad of the prompt, in order."""
        return ImageFeatures.concat([p.entry.features for p in self.placements if p.entry.features is not None])


def check_rendered(template: list[dict], text: str) -> None:
    """Every message's text must appear in the rendered prompt, in order: some official templates
    drop messages (Qwen3-VL's renders only a first system message), and a message the model never
    sees must be refused, not ignored."""
    cursor = 0
    for i, msg in enumerate(template):
        content = msg["content"]
        pieces = [content] if isinstance(content, str) else [p["text"] for p in content if p.get("type") == "text"]
        for piece in (p.strip() for p in pieces):  # a template may trim a message
            at = text.find(piece, cursor) if piece else cursor
            if at < 0:
                raise InvalidRequestError(f"the model's chat template does not render messages[{i}] (role "
                                          f"{msg['role']!r} there); put system text in the first message",
                                          param=f"messages[{i}]")
            cursor = at + len(piece)


class ClientText:
    """A client's text is text. Where a message, a tool or an erratum holds a special token's
    string (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`...), the tokenizer would read it as that
    control token and the client could forge a turn the template never wrote (a system message
    after the user's, an ended assistant turn). Each occurrence becomes a marker (LITERAL) before
    the template renders, and `Planner.prompt` tokenizes the marker as the string's plain-text
    tokens, as OpenAI's API reads such text. Text parts that the template joins into a special
    token ("<|im_" + "end|>") are refused: no one part holds it to escape."""

    def __init__(self, tokenizer):
        added = tokenizer.added_tokens_decoder.values()
        self.specials = sorted({t.content for t in added if t.special}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        self._index = {s: i for i, s in enumerate(self.specials)}

    def escape(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: LITERAL.format(self._index[m.group(0)]), text)

    def escape_all(self, value):
        """Every string inside `value` (lists and dicts, keys too) escaped; other values as they are."""
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, list | tuple):
            return type(value)(self.escape_all(v) for v in value)
        if isinstance(value, dict):
            return {self.escape_all(k): self.escape_all(v) for k, v in value.items()}
        return value

    def messages(self, template: list[dict]) -> list[dict]:
        out = []
        for i, msg in enumerate(template):
            content = msg["content"]
            if isinstance(content, list):
                self._check_joins([p.get("text", "") if p.get("type") == "text" else None for p in content],
                                  f"messages[{i}].content")
            out.append(self.escape_all(msg))
        return out

    def _check_joins(self, texts: list[str | None], param: str) -> None:
        """Adjacent text parts render back to back: refuse a special token that only their join holds."""
        if self._pattern is None:
            return
        run: list[str] = []
        for text in texts + [None]:
            if text is not None:
                run.append(text)
                continue
            if len(run) > 1:
                cuts, at = set(), 0
                for piece in run[:-1]:
                    at += len(piece)
                    cuts.add(at)
                for m in self._pattern.finditer("".join(run)):
                    if any(m.start() < c < m.end() for c in cuts):
                        raise InvalidRequestError(f"adjacent text parts of {param} join into the special token "
                                                  f"{m.group(0)}; send it within one part", param=param)
            run = []


TURN_MARK = "<|im_start|>"  # where the chat template opens a message
TURN_TOKENS_BYTES = 8 << 20


class TurnTokens:
    """Token ids of rendered template text, tokenized a message at a time: the text split before
    each `TURN_MARK`, a special token the tokenizer splits on before anything else, so each piece
    tokenizes alone exactly as inside the whole (checked once at start; where it does not hold,
    the whole text is tokenized at once). Each piece's ids are kept in an LRU of at most `budget`
    bytes (the text and its ids at their Python size), so a conversation's next turn tokenizes only
    its new messages. Thread-safe."""

    def __init__(self, tokenizer, budget: int = TURN_TOKENS_BYTES):
        self.tokenizer = tokenizer
        self.split = TURN_MARK in tokenizer.get_added_vocab() and self._splits_alone()
        self._cache = cachetools.LRUCache(budget, getsizeof=lambda entry: entry[1])
        self._lock = threading.Lock()

    def _splits_alone(self) -> bool:
        tok = self.tokenizer
        head, tail = "a b\n\n ", TURN_MARK + " user\n  c"
        return tok(head + tail)["input_ids"] == tok(head)["input_ids"] + tok(tail)["input_ids"]

    def __call__(self, text: str) -> list[int]:
        if not self.split:
            return self.tokenizer(text)["input_ids"]
        pieces = text.split(TURN_MARK)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            piece = TURN_MARK + piece if i else piece
            if not piece:
                continue
            with self._lock:
                hit = self._cache.get(piece)
            if hit is None:
                got = array("q", self.tokenizer(piece)["input_ids"])
                hit = (got, sys.getsizeof(piece) + sys.getsizeof(got))
                with self._lock:
                    if hit[1] <= self._cache.maxsize:
                        self._cache[piece] = hit
            ids.extend(hit[0])
        return ids

    @property
    def nbytes(self) -> int:
        return int(self._cache.currsize)


class Planner:
    def __init__(self, adapter: VLAdapter):
        self.adapter = adapter
        self.client_text = ClientText(adapter.tokenizer)
        self.turn_tokens = TurnTokens(adapter.tokenizer)  # a conversation's earlier messages tokenized once
        self.videos = None  # the engine's VideoRegistry: a video's group tokens and grids

    def render(self, template_messages: list[dict], add_generation_prompt: bool = True,
               tools: ToolSpec | None = None) -> str:
        """The chat template's text; with `tools`, rendered by the template and, for a forced
        tool choice, the assistant turn already opened with the call (mmkv.request.tools)."""
        text = self.adapter.processor.apply_chat_template(
            template_messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            **({"tools": self.client_text.escape_all(list(tools.tools))} if tools else {}))
        return text + (tools.forced_prefix() if tools and add_generation_prompt else "")

    def tool_spec(self, tools, tool_choice) -> ToolSpec | None:
        spec = check_tools(tools, tool_choice)
        if spec and not template_supports_tools(self.adapter.processor.chat_template):
            raise InvalidRequestError("this model's chat template does not render tools", param="tools")
        return spec

    def anchor_ids(self) -> torch.Tensor:
        """The chat template's default header up to a first-turn image: the tokens an image
        normally follows, so a chunk's first token is not its attention sink."""
        text = self.render([{"role": "user", "content": [{"type": "image"}]}], add_generation_prompt=False)
        start = self.adapter.tokenizer.convert_ids_to_tokens(self.adapter.vision_start_id)
        return torch.tensor(self.adapter.tokenizer(text.split(start)[0])["input_ids"], dtype=torch.long)

    def prompt(self, template: list[dict], refs: list[RegisteredImage | Skill | RegisteredVideo],
               tools: ToolSpec | None = None) -> tuple[torch.Tensor, list[tuple[int, RegisteredImage | Skill |
                                                                                   VideoGroupRef]]]:
        """Render the chat template and tokenize it, expanding each image placeholder to its pad
        tokens (as the processor does), each video to its temporal groups (`_video`) and each skill
        marker to the skill's tokens. Returns the ids and (start index, reference) of every image
        span, video group and skill, in order. A special token's string in the client's text is
        plain text (ClientText)."""
        template = self.client_text.messages(template)
        text = self.render(template, tools=tools)
        check_rendered(template, text)
        self._check_reserved(text, sum(isinstance(r, RegisteredImage) for r in refs),
                             sum(isinstance(r, RegisteredVideo) for r in refs))
        pad, video_pad = self.adapter.processor.image_token, self.adapter.processor.video_token
        pattern = re.compile(re.escape(pad) + "|\\ue000(\\d+)\\ue001|(" + re.escape(video_pad) + ")")
        images = iter(r for r in refs if isinstance(r, RegisteredImage))
        videos = iter(r for r in refs if isinstance(r, RegisteredVideo))
        ids: list[int] = []
        spans = []
        cursor = 0
        for m in pattern.finditer(text):
            ids += self._tokenize_escaped(text[cursor:m.start()])
            cursor = m.end()
            if m.group(2) is not None:
                cursor = self._video(next(videos), ids, spans, text, cursor)
            elif m.group(1) is None:
                reg = next(images, None)
                if reg is None or not ids or ids[-1] != self.adapter.vision_start_id:
                    raise InvalidRequestError("the chat template did not place every image exactly once")
                spans.append((len(ids) - 1, reg))
                ids += [self.adapter.image_token_id] * self.adapter.image_token_count(reg.grid_thw)
            else:
                skill = refs[int(m.group(1))]
                spans.append((len(ids), skill))
                ids += skill.token_ids.tolist()
        ids += self._tokenize_escaped(text[cursor:])
        if next(images, None) is not None:
            raise InvalidRequestError("the chat template did not place every image exactly once")
        return torch.tensor(ids, dtype=torch.long), spans

    def _video(self, video: RegisteredVideo, ids: list[int], spans: list, text: str, cursor: int) -> int:
        """Expand the template's vision_start, video pad, vision_end into the video's groups, each
        a span: its pads inside the one vision_start .. vision_end (Qwen2/2.5-VL), or, as
        Qwen3-VL's processor renders a video, `<t seconds>` vision_start pads vision_end per group
        in place of the template's three tokens. Returns where the text resumes."""
        if not ids or ids[-1] != self.adapter.vision_start_id:
            raise InvalidRequestError("the chat template did not place every video exactly once")
        videos = self.videos
        if videos.timestamps:
            end = self.adapter.tokenizer.convert_ids_to_tokens(self.adapter.vision_end_id)
            if not text.startswith(end, cursor):
                raise InvalidRequestError("the chat template did not place every video exactly once")
            ids.pop()
            cursor += len(end)
        for g in range(video.video.num_groups):
            spans.append((len(ids), VideoGroupRef(video, g)))
            ids += videos.group_tokens(video.video, g)[0].tolist()
        return cursor

    def text_ids(self, text: str) -> list[int]:
        """Client text that does not pass through the chat template (an erratum line built from a
        client's field and value) tokenized as `prompt` tokenizes client text: a special token's
        string becomes its plain-text tokens, never the control token (ClientText)."""
        return self._tokenize_escaped(self.client_text.escape(text))

    def _tokenize_escaped(self, text: str) -> list[int]:
        """Tokenize text in which ClientText marked each special token's string (LITERAL): the
        marks as the string's plain-text tokens, the rest as the template wrote it."""
        ids, cursor, tok = [], 0, self.adapter.tokenizer
        for m in _LITERAL_MARK.finditer(text):
            ids += self.turn_tokens(text[cursor:m.start()])
            ids += tok(self.client_text.specials[int(m.group(1))], split_special_tokens=True)["input_ids"]
            cursor = m.end()
        return ids + self.turn_tokens(text[cursor:])

    def _check_reserved(self, text: str, images: int, videos: int = 0) -> None:
        """Each text part was checked alone (mmkv.request.messages); adjacent parts can still join into a
        placeholder ("<|image_" + "pad|>"), so the rendered prompt may hold processor-only tokens
        only where the template put an image."""
        tok = self.adapter.tokenizer
        placeholder = (tok.convert_ids_to_tokens(self.adapter.vision_start_id) + self.adapter.processor.image_token
                       + tok.convert_ids_to_tokens(self.adapter.vision_end_id))
        video = placeholder.replace(self.adapter.processor.image_token, self.adapter.processor.video_token)
        stray = PROCESSOR_ONLY.search(text.replace(placeholder, "").replace(video, ""))
        if stray or text.count(placeholder) != images or text.count(video) != videos:
            token = stray.group(0) if stray else placeholder if text.count(placeholder) != images else video
            raise InvalidRequestError(f"the rendered prompt contains the reserved token {token} outside an image part "
                                      f"(adjacent text parts join into it); send images as image parts",
                                      param="messages")

    def native_positions(self, input_ids: torch.Tensor, refs: list) -> torch.Tensor:
        """The model's own positions of a prompt whose spans hold these references (`prompt`'s):
        transformers' for images alone, mmkv's implementation of the released models' rule
        (mmkv.adapters.mrope_positions) once a video is in it."""
        if not any(isinstance(r, VideoGroupRef) for r in refs):
            return self.adapter.native_positions(input_ids, [r.grid_thw for r in refs if isinstance(r, RegisteredImage)])
        visuals: list[VisualGrid] = []
        run: list[VideoGroupRef] = []
        for r in [*refs, None]:
            if run and not (isinstance(r, VideoGroupRef) and r.video is run[0].video and r.index == run[-1].index + 1):
                visuals += self.videos.visual_grids(run)
                run = []
            if isinstance(r, VideoGroupRef):
                run.append(r)
            elif isinstance(r, RegisteredImage):
                visuals.append(VisualGrid(self.adapter.image_token_id, r.grid_thw))
        return self.adapter.positions(input_ids, visuals)

    def plan(self, input_ids: torch.Tensor, spans: list[tuple[int, CachedChunk]], policy: str,
             native: torch.Tensor | None = None) -> SplicePlan:
        """Native positions for the prompt (given, or those of its image chunks), then each chunk
        placed at its policy's target (a first-sight image, computed in context, at its native
        positions)."""
        if native is None:
            native = self.adapter.native_positions(input_ids, [c.grid_thw for _, c in spans if c.kind == "image"])
        positions = native.clone()
        placements, keys = [], [None] * input_ids.numel()
        for start, chunk in spans:
            end = start + chunk.num_tokens
            target = native[:, start:end] if chunk.in_context else target_positions(
                native[:, start:end], chunk.position_ids, policy)
            placements.append(Placement(start, chunk, target))
            positions[:, start:end] = target
            keys[start:end] = [chunk.key] * chunk.num_tokens
        return SplicePlan(input_ids, positions, native, placements, keys)
