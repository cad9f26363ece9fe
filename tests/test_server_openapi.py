"""/openapi.json describes what the server accepts: schemathesis generates requests from the
published schema (examples, coverage of each constraint's edges, fuzzing, and a stateful run that
follows the schema's links) against the app in-process on the bundled tiny model, and every
answer must conform: no 5xx, a schema-valid request never refused with 400, a schema-invalid one
never accepted, status codes, content types and bodies as documented, `Allow` on a 405 naming
every method of the path.

Oracle: schemathesis's own checks (the server's answer against the schema); the example counts
are bounded and the generation derandomized, so a run is reproducible and takes seconds.
"""

from __future__ import annotations

import io

import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from PIL import Image
from starlette.testclient import TestClient

import mmkv
from mmkv.engine import BUNDLED_MODEL
from mmkv.server.app import ServerSettings, create_app
from mmkv.testing.clips import encode_clip

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
SETTINGS = ServerSettings(served_model_names=("tiny",), default_max_tokens=4)
APP = create_app(mmkv.Engine.from_pretrained(BUNDLED_MODEL), SETTINGS)


class OneLifespan:
    """The app, with the lifespan started once for the module: schemathesis's pytest plugin ends an
    ASGI app's lifespan after each operation, and the server's engine worker starts only once."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)
        while (await receive())["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


def _png(rgb: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), rgb).save(buf, "PNG")
    return buf.getvalue()


# The upload's `file` is published as an image (image/png among others): schemathesis sends PNGs.
schemathesis.openapi.media_type("image/png", st.tuples(*[st.integers(0, 255)] * 3).map(_png))
# A stream segment's `file` is published as a video (video/mp4 first): schemathesis sends short clips.
schemathesis.openapi.media_type("video/mp4", st.integers(0, 3).map(lambda seed: encode_clip(4, 4, 64, 48, seed=seed)))
schema = schemathesis.openapi.from_asgi("/openapi.json", OneLifespan(APP))


@pytest.fixture(scope="module", autouse=True)
def running_app():
    with TestClient(APP):
        yield


@schema.parametrize()
@FUZZ
def test_every_operation_conforms_to_the_published_schema(case):
    """Review finding 17: 872 generated requests found 8 conformance failures (schema-valid
    requests refused: an empty upload, an empty `after`, max_tokens with max_completion_tokens;
    405 answers whose Allow listed fewer methods than the path has)."""
    case.call_and_validate()


APIWorkflow = schema.as_state_machine()
APIWorkflow.TestCase.settings = settings(FUZZ, max_examples=8, stateful_step_count=6)


class TestStatefulFollowsLinks(APIWorkflow.TestCase):
    """Review finding 17: links let a stateful fuzzer follow POST /v1/files (and /v1/skills) to the id."""


# ------------------------------------------------------------------ the findings one by one


@pytest.fixture(scope="module")
def client():
    """A second app on its own engine: the fuzzed one serves schemathesis's event loop."""
    with TestClient(create_app(mmkv.Engine.from_pretrained(BUNDLED_MODEL), SETTINGS)) as client:
        yield client


def _validator(spec: dict, component: str):
    return jsonschema_rs.Draft202012Validator({"$ref": f"#/components/schemas/{component}",
                                               "components": spec["components"]})


@pytest.mark.parametrize(("path", "methods"), [("/v1/files", {"GET", "POST"}),
                                               ("/v1/files/img-x", {"GET", "DELETE"}),
                                               ("/v1/skills", {"GET", "POST"}),
                                               ("/v1/skills/skill-x", {"GET", "DELETE"}),
                                               ("/v1/chat/completions", {"POST"})])
def test_method_not_allowed_names_every_method_of_the_path(client, path, methods):
    """Review finding 17: a 405's Allow listed only the first route's method (`Allow: POST` on
    /v1/files, which also answers GET)."""
    response = client.request("PUT", path)
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"
    assert set(response.headers["allow"].split(", ")) - {"HEAD"} == methods


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


@pytest.mark.parametrize(("body", "valid"), [
    (CHAT, True),
    ({**CHAT, "max_tokens": 2, "max_completion_tokens": 2}, False),  # one of them would be ignored
    ({**CHAT, "max_tokens": 2, "max_completion_tokens": None}, True),  # null: unset
    ({**CHAT, "max_tokens": 2.0}, True),  # JSON's 2.0 is the integer 2
    ({**CHAT, "max_tokens": 2.5}, False),
    ({**CHAT, "top_logprobs": 2}, False),  # needs logprobs
    ({**CHAT, "stream_options": {"include_usage": True}}, False),  # needs stream
    ({**CHAT, "temperature": None, "user": 7}, True),  # null: unset; `user` never changes an answer
    ({**CHAT, "store": False, "x-unknown": None}, True),  # an unimplemented field "off"; an unknown one null
    ({**CHAT, "store": True}, False),
    ({**CHAT, "messages": [{"role": "user"}]}, False),  # content is needed but on an assistant message
    ({**CHAT, "messages": [{"role": "user", "content": "a<|image_pad|>"}]}, False),
    ({**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, False),
])
def test_chat_schema_accepts_exactly_what_the_server_accepts(client, body, valid):
    """Review finding 17: a request the published schema accepts is never a 400, and one it
    refuses is one (here for the constraints the schema states)."""
    spec = client.get("/openapi.json").json()
    assert _validator(spec, "ChatCompletionRequest").is_valid(body) is valid
    response = client.post("/v1/chat/completions", json=body)
    assert (response.status_code == 200) is valid, response.text


@pytest.mark.parametrize(("query", "status"), [("after=", 400), ("after=img-gone", 404), ("limit=1", 200)])
def test_an_empty_cursor_is_refused_by_the_schema_and_an_unknown_one_is_not_found(client, query, status):
    """Review finding 17: `after=` was schema-valid but refused; now the schema says `minLength: 1`,
    and a cursor naming no item is a 404 (the item it names does not exist), as any unknown id."""
    spec = client.get("/openapi.json").json()
    after = next(p for p in spec["paths"]["/v1/files"]["get"]["parameters"] if p["name"] == "after")
    assert after["schema"]["anyOf"][0]["minLength"] == 1
    response = client.get(f"/v1/files?{query}")
    assert response.status_code == status, response.text
    if status == 404:
        assert response.json()["error"]["param"] == "after"


def test_the_upload_form_is_published_as_it_is_read(client):
    """Review finding 17: an empty upload was schema-valid but refused. The form's schema says one
    non-empty image file, `purpose` "vision" and nothing else; the server answers accordingly."""
    spec = client.get("/openapi.json").json()
    form = spec["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert form["schema"]["additionalProperties"] is False and form["schema"]["required"] == ["file"]
    assert form["schema"]["properties"]["file"]["minLength"] == 1
    assert form["encoding"]["file"]["contentType"].startswith("image/png")
    assert client.post("/v1/files", files={"file": ("a.png", b"", "image/png")}).status_code == 400
    assert client.post("/v1/files", files={"file": ("a.png", _png((1, 2, 3)), "image/png")},
                       data={"tags": "x"}).status_code == 400
    assert client.post("/v1/files", files={"file": ("a.png", _png((1, 2, 3)), "image/png")}).status_code == 200


@pytest.mark.parametrize(("create", "kwargs", "param", "targets"), [
    ("/v1/files", {"files": {"file": ("a.png", _png((9, 9, 9)), "image/png")}}, "file_id",
     {"get_file", "get_file_content", "delete_file"}),
    ("/v1/skills", {"json": {"name": "n", "text": "a policy"}}, "skill_id", {"get_skill", "delete_skill"}),
])
def test_links_lead_from_a_create_to_its_object(client, create, kwargs, param, targets):
    """Review finding 17: the schema had no links, so a stateful fuzzer could not follow POST
    /v1/files to the id it made. Each link, resolved as OpenAPI says, reaches the object."""
    spec = client.get("/openapi.json").json()
    links = spec["paths"][create]["post"]["responses"]["200"]["links"]
    assert set(links) == targets
    operations = {op["operationId"]: (path, method) for path, item in spec["paths"].items()
                  for method, op in item.items()}
    created = client.post(create, **kwargs)
    assert created.status_code == 200, created.text
    for name in sorted(targets, key=lambda n: n.startswith("delete")):  # delete last
        link = links[name]
        assert link["parameters"] == {param: "$response.body#/id"}
        path, method = operations[link["operationId"]]
        answer = client.request(method.upper(), path.replace("{" + param + "}", created.json()["id"]))
        assert answer.status_code == 200, (name, answer.text)


def test_a_streams_append_documents_its_conflict():
    """Both append routes answer 409 stream_conflict (a time not after the latest frame, another
    frame size, a window over the token limit): the schema says so, so a fuzzer's 409 is documented."""
    paths = APP.openapi()["paths"]
    for path in ("/v1/video_streams/{stream_id}/frames", "/v1/video_streams/{stream_id}/segments"):
        assert "409" in paths[path]["post"]["responses"], path
