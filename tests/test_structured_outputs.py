"""Structured outputs: `response_format` (json_object, json_schema) and a forced `tool_choice`
decode under the schema's grammar (mmkv.request.grammar).

Oracle: an independent JSON Schema validator (jsonschema-rs) on every answer, with Python's json
parser; the same requests without the grammar, whose answers are not JSON; for the batch,
`Engine.generate` of each request alone (identical token ids, constrained or not). Run
`MMKV_STRUCTURED_REQUESTS=500 pytest tests/test_structured_outputs.py -k batched` for the full
500-request run; the suite runs a seeded sample of the same generator.
"""

from __future__ import annotations

import json
import os
import random

import httpx
import jsonschema_rs
import openai
import pytest
import torch

import mmkv
from mmkv.engine import REPO_ROOT
from mmkv.errors import InvalidRequestError
from mmkv.request.grammar import GRAMMAR_CACHE_ENTRIES, MAX_DIGITS, parse_response_format
from mmkv.request.scheduler import Scheduler
from mmkv.server.app import ServerSettings, create_app

from test_server import LiveServer

BUNDLED = {name: REPO_ROOT / "samples" / "models" / name for name in ("qwen2_5_vl-tiny", "qwen3_vl-tiny")}
ASK = [{"role": "user", "content": "what is the order status ?"}]
ORDER = {"type": "object", "additionalProperties": False, "required": ["status", "count", "tags", "meta"],
         "properties": {"status": {"enum": ["shipped", "delivered", "lost"]},
                        "count": {"type": "integer", "minimum": 0, "maximum": 500},
                        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                 "minItems": 1, "maxItems": 3},
                        "meta": {"type": "object", "additionalProperties": False, "required": ["ok", "price"],
                                 "properties": {"ok": {"type": "boolean"},
                                                "price": {"type": "number", "minimum": 0, "maximum": 99}}}}}
GREEDY, SAMPLED = {}, {"temperature": 1.0, "seed": 11}


def json_schema(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def assert_valid(text: str, schema: dict) -> object:
    value = json.loads(text)
    jsonschema_rs.validate(schema, value)
    return value


@pytest.fixture(scope="module", params=sorted(BUNDLED))
def engine(request):
    return mmkv.Engine.from_pretrained(BUNDLED[request.param])


@pytest.fixture(scope="module")
def live():
    engine = mmkv.Engine.from_pretrained(BUNDLED["qwen3_vl-tiny"])
    server = LiveServer(create_app(engine, ServerSettings(served_model_names=("tiny",))))
    yield server, engine
    server.close()


# ---------------------------------------------------------------- the engine


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_json_schema_answers_parse_and_validate(engine, sampling):
    free = engine.generate(ASK, max_new_tokens=64, **sampling)
    with pytest.raises(ValueError):
        json.loads(free.text)  # the model alone writes no JSON: the grammar does the work
    result = engine.generate(ASK, max_new_tokens=200, response_format=json_schema(ORDER), **sampling)
    assert result.finish_reason == "stop"
    assert_valid(result.text, ORDER)


def test_stop_tokens_only_where_the_grammar_accepts_and_vision_tokens_stay_banned(engine):
    """<|im_end|>, `}` and the vision tokens pushed up by logit_bias +100: the answer still ends
    only when the schema is satisfied, and holds no vision token."""
    tok = engine.adapter.tokenizer
    bias = {tid: 100.0 for tid in [tok.convert_tokens_to_ids("<|im_end|>"), *engine.banned_ids,
                                   *tok.encode("}"), *tok.encode("{}")]}
    quit_at_once = engine.generate(ASK, max_new_tokens=8, logit_bias=bias)
    assert quit_at_once.text == "" and quit_at_once.finish_reason == "stop"
    result = engine.generate(ASK, max_new_tokens=200, logit_bias=bias, response_format=json_schema(ORDER))
    assert result.finish_reason == "stop" and not set(result.token_ids) & set(engine.banned_ids)
    assert_valid(result.text, ORDER)
    obj = engine.generate(ASK, max_new_tokens=8, logit_bias=bias, response_format={"type": "json_object"})
    assert obj.finish_reason == "stop" and json.loads(obj.text) == {}


def test_max_tokens_cuts_the_json_and_says_length(engine):
    """As OpenAI: an answer cut by max_tokens ends with finish_reason "length", mid-JSON."""
    result = engine.generate(ASK, max_new_tokens=4, response_format=json_schema(ORDER))
    assert result.finish_reason == "length" and len(result.token_ids) == 4
    assert result.text.startswith('{"status": "')
    with pytest.raises(ValueError):
        json.loads(result.text)


def test_numbers_stay_float64_sized(engine):
    """A bare number (no bounds) from a sampled small model: at most MAX_DIGITS digits in a run and
    a two-digit exponent where the grammar leaves the choice, so it parses to a finite float."""
    schema = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
              "properties": {"x": {"type": "number"}, "y": {"type": "array", "items": {"type": "number"},
                                                            "minItems": 3, "maxItems": 3}}}
    for seed in range(6):
        result = engine.generate(ASK, max_new_tokens=200, temperature=1.5, seed=seed,
                                 response_format=json_schema(schema))
        value = assert_valid(result.text, schema)
        numbers = [value["x"], *value["y"]]
        assert all(abs(v) < 1e120 for v in numbers), result.text
        assert all(len(run) <= MAX_DIGITS + 2 for run in _digit_runs(result.text)), result.text


def _digit_runs(text: str) -> list[str]:
    runs, run = [], ""
    for ch in text:
        run = run + ch if ch.isdigit() else (runs.append(run) or "") if run else ""
    return runs + ([run] if run else [])


def test_compiled_grammars_are_kept_in_a_bounded_lru(engine, monkeypatch):
    grammars = engine.grammars
    first = grammars.for_request(_format({"const": 0}), None)
    compiles = []
    monkeypatch.setattr(grammars, "_compiled", lambda *a: compiles.append(a))
    monkeypatch.setattr(grammars, "_json", lambda *a: compiles.append(a))
    assert grammars.for_request(_format({"const": 0}), None) is first and not compiles  # checked, compiled once
    monkeypatch.undo()
    for i in range(1, GRAMMAR_CACHE_ENTRIES + 1):
        grammars.for_request(_format({"const": i}), None)
    assert len(grammars._cache) == GRAMMAR_CACHE_ENTRIES
    assert grammars.for_request(_format({"const": 0}), None) is not first  # evicted, compiled again


def _format(schema: dict):
    return parse_response_format(json_schema(schema))


@pytest.mark.parametrize("response_format, param, words", [
    ({"type": "xml"}, "response_format.type", "json_schema"),
    ({"type": "json_object", "schema": {}}, "response_format.schema", "not a field"),
    ({"type": "json_schema"}, "response_format.json_schema", "name and schema"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "response_format.json_schema.name", "match"),
    ({"type": "json_schema", "json_schema": {"name": "a"}}, "response_format.json_schema.schema", "JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": 1}},
     "response_format.json_schema.strict", "true or false"),
])
def test_a_bad_response_format_is_refused_naming_the_field(engine, response_format, param, words):
    with pytest.raises(InvalidRequestError) as err:
        engine.start(ASK, response_format=response_format)
    assert err.value.param == param and words in err.value.message


# ---------------------------------------------------------------- the server, with the openai client


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_client_gets_valid_json(live, sampling, stream):
    server, _ = live
    client = server.client()
    kwargs = dict(model="tiny", messages=ASK, max_tokens=200, response_format=json_schema(ORDER), **sampling)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        reply = client.chat.completions.create(**kwargs)
        text, finish = reply.choices[0].message.content, [reply.choices[0].finish_reason]
    assert finish == ["stop"]
    assert_valid(text, ORDER)


def test_openai_client_json_object(live):
    server, engine = live
    tok = engine.adapter.tokenizer
    bias = {str(t): 100 for t in tok.encode('"') + tok.encode("}")}  # short keys, a closed object
    reply = server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=64, logit_bias=bias,
                                                    response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_logprobs_list_only_tokens_the_grammar_allows(live):
    """Where the grammar allows fewer tokens than top_logprobs asks for, the alternatives are the
    allowed ones: every logprob a finite number, never a token the grammar masked (was: null
    logprobs of masked special tokens)."""
    server, _ = live
    reply = server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=200, logprobs=True,
                                                    top_logprobs=5, response_format=json_schema(ORDER))
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    for entry in entries:
        assert entry.top_logprobs and all(isinstance(t.logprob, float) and t.logprob <= 0 for t in entry.top_logprobs)
        assert not any(t.token.startswith("<|") for t in entry.top_logprobs)
    assert entries[0].top_logprobs[0].token == entries[0].token and entries[0].logprob == 0.0  # `{"` is forced


CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
UNSUPPORTED = [
    ({"not": {"type": "string"}}, "response_format.json_schema.schema.not", "not"),
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     "response_format.json_schema.schema.properties.tags.uniqueItems", "uniqueItems"),
    ({"if": {"type": "string"}, "then": {"maxLength": 3}}, "response_format.json_schema.schema.if", "if"),
    ({"type": "object", "properties": {"not": {"not": {}}}},  # a property named like the keyword is a name
     "response_format.json_schema.schema.properties.not.not", "not"),
    (CYCLE, "response_format.json_schema.schema", "$ref cycle"),
    ({"type": "string", "format": "credit-card"}, "response_format.json_schema.schema", "credit-card"),
    ({"type": "string", "pattern": "(?=a)b"}, "response_format.json_schema.schema", "look-around"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "response_format.json_schema.schema", "oneOf"),
    ({"$ref": "#/$defs/missing"}, "response_format.json_schema.schema", "missing"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "response_format.json_schema.schema", "Unsatisfiable"),
]


@pytest.mark.parametrize("schema, param, words", UNSUPPORTED, ids=[p.rsplit(".", 1)[-1] + f"-{i}"
                                                                    for i, (_, p, _) in enumerate(UNSUPPORTED)])
def test_unsupported_schema_features_are_a_400_naming_them(live, schema, param, words):
    server, _ = live
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=8,
                                                response_format=json_schema(schema))
    body = err.value.body
    assert body["param"] == param and words in body["message"], body
    ok = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30,  # the server serves on
                    json={"model": "tiny", "messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200


# ---------------------------------------------------------------- forced tool calls (real tokenizer and template)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days", "unit"],
    "properties": {"city": {"enum": ["Oslo", "Lisbon", "Kyiv"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"enum": ["C", "F"]}}}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["hour", "repeat"],
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "repeat": {"type": "boolean"}}}}}
NO_ARGS = {"type": "function", "function": {"name": "get_time"}}
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
           for t in (WEATHER, ALARM, NO_ARGS)}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from mmkv.testing.realshape import save_real_checkpoint

    snapshot = save_real_checkpoint("qwen3_vl", tmp_path_factory.mktemp("hub"), seed=2)
    engine = mmkv.Engine.from_pretrained(snapshot, dtype=torch.float32, device="cpu")
    server = LiveServer(create_app(engine, ServerSettings(served_model_names=("tiny",))))
    yield server
    server.close()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                    {"type": "function", "function": {"name": "set_alarm"}},
                                    {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "get_weather", "set_alarm", "get_time"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_forced_tool_call_has_arguments_valid_against_its_schema(qwen3, choice, sampling):
    reply = qwen3.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Oslo, and wake me at 7?"}],
        tools=[WEATHER, ALARM, NO_ARGS], tool_choice=choice, max_tokens=64, **sampling)
    message = reply.choices[0]
    assert message.finish_reason == "tool_calls" and len(message.message.tool_calls) == 1
    call = message.message.tool_calls[0].function
    if isinstance(choice, dict):
        assert call.name == choice["function"]["name"]
    assert_valid(call.arguments, SCHEMAS[call.name])


def test_tools_under_auto_with_a_response_format_answer_json_or_valid_calls(qwen3):
    for seed in range(3):
        reply = qwen3.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Order status?"}], tools=[WEATHER, ALARM],
            max_tokens=120, temperature=1.0, seed=seed, response_format=json_schema(ORDER))
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                assert_valid(call.function.arguments, SCHEMAS[call.function.name])
        else:
            assert choice.finish_reason == "stop"
            assert_valid(choice.message.content, ORDER)


def test_a_forced_tool_with_an_unsupported_schema_is_a_400_naming_it(qwen3):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}
    with pytest.raises(openai.BadRequestError) as err:
        qwen3.client().chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, bad], max_tokens=8,
                                               tool_choice={"type": "function", "function": {"name": "f"}})
    assert err.value.body["param"] == "tools[1].function.parameters.not"


# ---------------------------------------------------------------- many generated schemas, batched


WORDS = ["red", "green", "blue", "gold", "open", "closed", "paid", "late", "ok", "x y"]
KEYS = ["id", "name", "kind", "count", "price", "tags", "ok", "meta", "score", "items"]


def generated_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema as clients write them: required fields, enums, bounded arrays and strings,
    nested objects, integers (bounded or not), bounded numbers, booleans."""
    names = rng.sample(KEYS, rng.randint(1, 4))
    return {"type": "object", "additionalProperties": False,
            "properties": {n: _value_schema(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.8] or names[:1]}


def _value_schema(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["integer", "number", "boolean", "enum", "string", "array"] + ["object"] * 2 * (depth < 3))
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", **({"minimum": low, "maximum": low + rng.randint(0, 200)} if rng.random() < 0.7 else {})}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4)) + [rng.randint(0, 9)] * (rng.random() < 0.3)}
    if kind == "string":
        high = rng.randint(1, 8)
        return {"type": "string", "minLength": rng.randint(0, high), "maxLength": high}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": _value_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 3)}
    if kind == "boolean":
        return {"type": "boolean"}
    return generated_schema(rng, depth)


def test_batched_generated_schemas_all_parse_and_validate():
    """Seeded generated schemas, greedy and sampled, interleaved with unconstrained requests in one
    scheduler (max_batch 8): every constrained answer finishes and validates, and a request decodes
    exactly as alone, constrained or not (rows without a grammar untouched)."""
    count = int(os.environ.get("MMKV_STRUCTURED_REQUESTS", "24"))
    engine = mmkv.Engine.from_pretrained(BUNDLED["qwen3_vl-tiny"])
    rng = random.Random(0)
    requests = []
    for i in range(count):
        sampling = {"temperature": 1.0, "seed": i} if i % 2 else {}
        schema = generated_schema(rng)
        requests.append((schema, [{"role": "user", "content": f"item {i} ?"}],
                         dict(max_new_tokens=512, response_format=json_schema(schema), **sampling)))
        if i % 3 == 0:
            requests.append((None, [{"role": "user", "content": "what is the status ?"}],
                             dict(max_new_tokens=12, temperature=0.8, seed=i)))
    scheduler = Scheduler(engine, max_batch=8).start()
    try:
        futures = [scheduler.submit(messages, **kwargs) for _, messages, kwargs in requests]
        results = [f.result(timeout=600) for f in futures]
    finally:
        scheduler.stop()
    valid = 0
    for i, ((schema, messages, kwargs), result) in enumerate(zip(requests, results)):
        if schema is None or i % 3 == 0:  # every unconstrained request and a third of the others
            assert result.token_ids == engine.generate(messages, **kwargs).token_ids
        if schema is not None:
            assert result.finish_reason == "stop", (schema, result.text)
            assert_valid(result.text, schema)
            valid += 1
    assert valid == count
    print(f"{valid}/{count} generated schema-constrained requests parsed and validated")
