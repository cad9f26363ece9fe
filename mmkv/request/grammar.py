"""Structured outputs: decoding under a grammar, with llguidance (the library vLLM's `guidance`
backend uses).

`response_format` `{"type": "json_object"}` (any JSON object) and `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}` constrain the content to a JSON schema; a forced
`tool_choice` (a named function or "required") constrains the call that the forced prefix opens
(mmkv.request.tools) to the tool's `parameters`; with tools under "auto" and a `response_format`,
the answer is either JSON content or tool calls, each under its schema.

Each decoding step asks the request's matcher for the tokens that keep the output inside the
grammar and sets every other logit to -inf before sampling (`GrammarMatcher.constrain`), so
whatever the model, greedy or sampled, a finished answer parses and validates. A stop token
(EOS / <|im_end|>) is allowed only where the grammar accepts; once it can go no further the answer
ends there. JSON is written compactly with Python's separators (`{"a": 1, "b": [2, 3]}`), no free
whitespace, so no model can pad an answer with blanks until max_tokens.

Schema features the library cannot enforce are refused (a 400 naming them), never ignored.
Compiled grammars are kept in a small LRU keyed by the schemas they come from (`GrammarCompiler`):
a schema is checked and compiled once; each request decodes with its own copy of the compiled state.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from mmkv.errors import InvalidRequestError
from mmkv.request.tools import ARGUMENTS, CALL_END, CALL_HEAD, CLOSE, MAX_SCHEMA_DEPTH, OPEN, ToolSpec

# Python's json.dumps separators: the JSON the Qwen templates show the model (`tojson`), no free whitespace.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
              "lenient": False, "coerce_one_of": False}  # unsupported keywords and oneOf are refused, not approximated
GRAMMAR_CACHE_ENTRIES = 64
# The lexer builds its states on demand, 1-2 kB each (llguidance's figure): this bounds one request's
# matcher at about 32 MiB; each step's work is bounded by llguidance's default fuel (about 15 ms).
LIMITS = dict(max_lexer_states=16_384)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a tool without `parameters`
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_DIGITS, MAX_EXPONENT_DIGITS = 17, 2  # a float64's significant digits; |exponent| < 100 stays finite
_LONG_NUMBER = re.compile(rb"([0-9]{%d}|[eE][+-]?[0-9]{%d})$" % (MAX_DIGITS, MAX_EXPONENT_DIGITS))
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")


@dataclass(frozen=True)
class ResponseFormat:
    """A validated `response_format` that constrains the answer: the JSON schema its content follows."""

    schema: dict[str, Any]
    param: str  # where the schema sits in the request, for errors


def parse_response_format(value: Any) -> ResponseFormat | None:
    """OpenAI's `response_format`: None or {"type": "text"} (unconstrained), {"type": "json_object"},
    or {"type": "json_schema", "json_schema": {"name", "schema", "description"?, "strict"?}}; each
    bad value an InvalidRequestError naming its field."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError('response_format.type must be "text", "json_object" or "json_schema"',
                                  param="response_format.type")
    kind = value["type"]
    _only_keys(value, {"type", "json_schema"} if kind == "json_schema" else {"type"}, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat({"type": "object"}, "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format.json_schema must be an object with name and schema",
                                  param="response_format.json_schema")
    param = "response_format.json_schema"
    _only_keys(spec, {"name", "schema", "description", "strict"}, param)
    if not isinstance(spec.get("name"), str) or not _NAME.match(spec["name"]):
        raise InvalidRequestError(f"{param}.name must match [A-Za-z0-9_-]{{1,64}}", param=f"{param}.name")
    if "description" in spec and not isinstance(spec["description"], str):
        raise InvalidRequestError(f"{param}.description must be a string", param=f"{param}.description")
    if not isinstance(spec.get("strict", False), bool | None):  # 1 is not true
        raise InvalidRequestError(f"{param}.strict must be true or false", param=f"{param}.strict")
    if not isinstance(spec.get("schema"), dict):
        raise InvalidRequestError(f"{param}.schema must be a JSON schema object", param=f"{param}.schema")
    _check_depth(spec["schema"], f"{param}.schema")
    try:
        json.dumps(spec["schema"], allow_nan=False)
    except (TypeError, ValueError):  # a Python caller's set or NaN: not JSON
        raise InvalidRequestError(f"{param}.schema must be JSON", param=f"{param}.schema") from None
    return ResponseFormat(spec["schema"], f"{param}.schema")


def _check_depth(schema: Any, param: str) -> None:
    """Nesting bounded as for a tool's parameters (iterative: a deeper one is a 400, not a RecursionError)."""
    stack = [(schema, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= MAX_SCHEMA_DEPTH:
                raise InvalidRequestError(f"{param} is nested deeper than {MAX_SCHEMA_DEPTH} levels", param=param)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))


def _only_keys(value: dict, allowed: set[str], param: str) -> None:
    for key in value:
        if key not in allowed:
            raise InvalidRequestError(f"{param}.{key} is not a field of this response_format; expected "
                                      f"{sorted(allowed)}", param=f"{param}.{key}")


class Vocabulary:
    """The tokenizer as llguidance reads it (the stop tokens as the grammar's end), and which tokens
    do not start with a digit (`GrammarMatcher`'s bound on number length)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        self.size = vocab_size
        self.ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_ids)
        self.not_digit_first = torch.tensor([not self.ll.decode_bytes([t])[:1].isdigit() for t in range(vocab_size)])
        self.tokenizer = tokenizer

    def literal(self, text: str) -> str:
        """`text` in the grammar: a token of its own that llguidance reads as special (Qwen's
        `<tool_call>` and `</tool_call>` are added tokens) by its id, else the quoted string."""
        token = self.tokenizer.convert_tokens_to_ids(text)
        if isinstance(token, int) and token < self.size and self.tokenizer.convert_ids_to_tokens(token) == text \
                and self.ll.is_special_token(token):
            return f"<[{token}]>"
        return json.dumps(text)

    def text(self, token: int) -> bytes:
        return self.ll.decode_bytes([token])


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next, and the tokens taken.

    Numbers stay what a float64 holds where the grammar leaves the choice: after a run of
    MAX_DIGITS digits, or MAX_EXPONENT_DIGITS exponent digits, a token starting with a digit is
    allowed only when nothing else is (a JSON number has no length limit, and a small model can
    repeat digits until max_tokens, or write 8e27777, which parsers read as infinity)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: Vocabulary, param: str):
        self.matcher, self.vocab, self.param = matcher, vocab, param
        self.tail = b""  # the last bytes written: where a number's digits run

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] logits with every token the grammar does not allow next at -inf (a new tensor)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # little-endian u32 words
        self._check()
        allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab.size].view(np.bool_))
        if _LONG_NUMBER.search(self.tail):
            shorter = allowed & self.vocab.not_digit_first
            allowed = shorter if shorter.any() else allowed
        x = logits[: self.vocab.size]
        return torch.where(allowed.to(x.device, non_blocking=True), x, -torch.inf)

    def advance(self, token: int) -> None:
        """Take the sampled token (one `constrain` allowed)."""
        self.matcher.consume_token(token)
        self._check()
        self.tail = (self.tail + self.vocab.text(token))[-2 * MAX_DIGITS:]

    @property
    def complete(self) -> bool:
        """The grammar is done: nothing but a stop token can follow."""
        return self.matcher.is_stopped()

    def _check(self) -> None:
        if self.matcher.is_error():  # a resource limit (llguidance's parser limits), or a token it refused
            raise InvalidRequestError(f"decoding under the schema at {self.param} failed: "
                                      f"{_first_line(self.matcher.get_error())}", param=self.param)


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar (its matcher in the start state; never advanced); `matcher()` for each request."""

    template: llguidance.LLMatcher
    vocab: Vocabulary
    param: str

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.template.deep_copy(), self.vocab, self.param)


class GrammarCompiler:
    """One engine's grammars: its `Vocabulary` (built on first use, 1-2 s for a 150k
    vocabulary) and an LRU of compiled grammars (GRAMMAR_CACHE_ENTRIES) keyed by what they are
    compiled from (the schema's text, the tools and the choice). Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int], entries: int = GRAMMAR_CACHE_ENTRIES):
        self.tokenizer, self.vocab_size, self.stop_ids, self.entries = tokenizer, vocab_size, sorted(stop_ids), entries
        self._lock = threading.Lock()
        self._vocab: Vocabulary | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self.limits = llguidance.LLParserLimits(**LIMITS)

    def for_request(self, response_format: ResponseFormat | None, tools: ToolSpec | None) -> Grammar | None:
        """The grammar of one request's answer, or None when nothing constrains it; compiled once
        for the same schemas and tools. Raises InvalidRequestError naming the schema a feature of
        which cannot be enforced."""
        forced = tools is not None and tools.choice in ("required", "function")
        if response_format is None and not forced:
            return None
        key = json.dumps([[response_format.schema, response_format.param] if response_format else None,
                          [tools.tools, tools.choice, tools.forced_name] if tools else None])  # order kept: it is the output's
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        if forced:
            grammar = self._compiled(self._forced_call(tools), "tool_choice")
        else:
            content = self._json(response_format.schema, response_format.param)
            calls = self._calls(tools) if tools is not None and tools.choice == "auto" else None
            lark = f"start: content | calls\ncontent: {content}\n{calls}" if calls else f"start: {content}\n"
            grammar = self._compiled(lark, response_format.param)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self.entries:
                self._cache.popitem(last=False)
        return grammar

    # ---- grammars (llguidance's Lark dialect, each JSON schema embedded as %json) -----------------
    def _forced_call(self, tools: ToolSpec) -> str:
        """The rest of the call after the forced prefix (`<tool_call>\\n{"name": "` and, for a named
        function, the name and `", "arguments": `): its arguments, `}`, the closing tag."""
        if tools.choice == "function":
            i, fn = next((i, t["function"]) for i, t in enumerate(tools.tools)
                         if t["function"]["name"] == tools.forced_name)
            return f"start: {self._arguments(fn, i)} {self._call_end()}\n"
        return f"start: call {self._call_end()}\ncall: {self._named_arguments(tools)}\n"

    def _calls(self, tools: ToolSpec) -> str:
        """Tool calls as the Qwen templates write them, each call's arguments under its tool's schema."""
        head = f"{self.vocab.literal(OPEN)} {json.dumps(CALL_HEAD)}"
        return (f"calls: call ({json.dumps(chr(10))} call)*\n"
                f"call: {head} ({self._named_arguments(tools)}) {self._call_end()}\n")

    def _call_end(self) -> str:
        return f"{json.dumps(CALL_END)} {self.vocab.literal(CLOSE)}"

    def _named_arguments(self, tools: ToolSpec) -> str:
        """`NAME", "arguments": {...}` for each tool, as alternatives."""
        rows = []
        for i, tool in enumerate(tools.tools):
            name = json.dumps(tool["function"]["name"] + ARGUMENTS)
            rows.append(f"{name} {self._arguments(tool['function'], i)}")
        return " | ".join(rows)

    def _arguments(self, fn: dict, i: int) -> str:
        return self._json(fn.get("parameters", NO_PARAMETERS), f"tools[{i}].function.parameters")

    def _json(self, schema: dict, param: str) -> str:
        """`%json {...}` of `schema` in mmkv's JSON style, after checking that llguidance compiles it
        (InvalidRequestError naming what it cannot enforce, at `param` or the path of the keyword)."""
        cycle = _alias_cycle(schema)
        if cycle:
            raise InvalidRequestError(f"{param} has a $ref cycle that never reaches a schema ({' -> '.join(cycle)}); "
                                      f"no JSON value matches it", param=param)
        styled = {**schema, "x-guidance": JSON_STYLE}  # replaces a client's own x-guidance (e.g. lenient)
        text = llguidance.LLMatcher.grammar_from_json_schema(styled)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.vocab.ll,
                                                                              limits=self.limits)
        if failed:
            raise _schema_error(schema, param, messages[0])
        return f"%json {json.dumps(styled)}"

    def _compiled(self, lark: str, param: str) -> Grammar:
        template = llguidance.LLMatcher(self.vocab.ll, llguidance.LLMatcher.grammar_from_lark(lark),
                                        log_level=0, limits=self.limits)
        if template.is_error():
            raise InvalidRequestError(f"{param} cannot be decoded: {_first_line(template.get_error())}", param=param)
        probe = template.deep_copy()
        probe.compute_bitmask()  # the first step shows a grammar that matches nothing
        if probe.is_error():
            raise InvalidRequestError(f"{param} admits no JSON value the model can write "
                                      f"({_first_line(probe.get_error())})", param=param)
        return Grammar(template, self.vocab, param)

    @property
    def vocab(self) -> Vocabulary:
        with self._lock:
            if self._vocab is None:
                self._vocab = Vocabulary(self.tokenizer, self.vocab_size, self.stop_ids)
            return self._vocab


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


def _one_line(message: str, limit: int = 400) -> str:
    """A multi-line library message on one line, without its caret markers (`^^^`)."""
    lines = [line.strip() for line in message.splitlines() if line.strip().strip("^")]
    return " ".join(lines)[:limit]


def _schema_error(schema: dict, param: str, message: str) -> InvalidRequestError:
    """The library's refusal as a 400; an unimplemented keyword is named with its path in the schema."""
    found = _UNIMPLEMENTED.search(message)
    if found:
        keys = json.loads(found.group(1))
        path = _path_of_key(schema, set(keys))
        where = f"{param}.{path}" if path else param
        return InvalidRequestError(f"{where}: JSON schema keyword(s) {', '.join(keys)} not supported in "
                                   f"structured outputs", param=where)
    return InvalidRequestError(f"{param} is not supported in structured outputs: {_one_line(message)}", param=param)


_NAMES = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}  # keys there are names
_DATA = {"enum", "const", "default", "examples"}  # values there are JSON data, not schemas


def _path_of_key(schema: Any, keys: set[str]) -> str | None:
    """The dotted path of the first occurrence of one of `keys` as a keyword in `schema` (breadth
    first; a property named like a keyword, or data in an `enum`, is not one)."""
    queue = deque([(schema, "", False)])  # (node, path, its keys are names)
    while queue:
        node, path, names = queue.popleft()
        if isinstance(node, dict):
            for key, value in node.items():
                here = f"{path}.{key}" if path else key
                if key in keys and not names:
                    return here
                if names or key not in _DATA:
                    queue.append((value, here, not names and key in _NAMES))
        elif isinstance(node, list):
            queue.extend((item, f"{path}[{i}]", False) for i, item in enumerate(node))
    return None


def _alias_cycle(schema: dict) -> list[str] | None:
    """A chain of schemas that are only a `$ref` leading back to itself (`a` -> `b` -> `a`): no JSON
    value matches it. Local references (`#/...`) only."""
    def target(ref: str) -> Any:
        node: Any = schema
        for part in ref.removeprefix("#").strip("/").split("/") if ref.strip("#/") else []:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        return node

    def alias(node: Any) -> str | None:
        if isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") \
                and not set(node) - {"$ref", "$defs", "definitions", "title", "description", "$comment", "x-guidance"}:
            return node["$ref"]
        return None

    for start in _refs(schema):
        chain, ref = [], start
        while ref is not None and ref not in chain and len(chain) <= MAX_SCHEMA_DEPTH:
            chain.append(ref)
            ref = alias(target(ref))
        if ref is not None and ref in chain:
            return chain[chain.index(ref):] + [ref]
    return None


def _refs(schema: Any) -> list[str]:
    out, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                out.append(node["$ref"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out
