"""Skills, errata and edit policies over HTTP, with the official openai client; the oracle is a
second engine given the same calls (the HTTP layer adds nothing)."""

from __future__ import annotations

import httpx
import pytest

import mmkv
from mmkv.request.messages import erratum_line
from mmkv.server.app import ServerSettings, create_app

from test_server import LiveServer, tiny_dir  # noqa: F401 - fixture

POLICY = "refund policy . refunds only for delivered orders reported damaged within thirty days . " * 6


@pytest.fixture(scope="module")
def live(tiny_dir):  # noqa: F811
    settings = ServerSettings(api_keys=("k1", "k2"), served_model_names=("tiny",), allow_fidelity=True)
    server = LiveServer(create_app(mmkv.Engine.from_pretrained(tiny_dir), settings))
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference(tiny_dir):  # noqa: F811
    return mmkv.Engine.from_pretrained(tiny_dir)


def _post_skill(live, name, text, key="k1"):
    return httpx.post(f"{live.base_url}/v1/skills", json={"name": name, "text": text},
                      headers={"Authorization": f"Bearer {key}"})


def test_skill_lifecycle_and_chat(live, reference):
    created = _post_skill(live, "refunds", POLICY)
    assert created.status_code == 200, created.text
    skill = created.json()
    assert skill["object"] == "skill" and skill["name"] == "refunds" and skill["tokens"] > 0
    headers = {"Authorization": "Bearer k1"}
    listed = httpx.get(f"{live.base_url}/v1/skills", headers=headers).json()
    assert [s["id"] for s in listed["data"]] == [skill["id"]]
    assert httpx.get(f"{live.base_url}/v1/skills/{skill['id']}", headers=headers).json()["tokens"] == skill["tokens"]

    messages = [{"role": "system", "content": [{"type": "skill", "skill_id": skill["id"]}]},
                {"role": "user", "content": [{"type": "state_update", "field": "order_status", "value": "shipped"},
                                             {"type": "text", "text": "refund ?"}]}]
    client = live.client("k1")
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"mmkv": {"fidelity": True}})
    report = reply.model_extra["mmkv"]
    assert 0.9 < report["fidelity"]["logit_cosine"] <= 1.0 + 1e-6 and report["fidelity"]["max_abs_diff"] > 0
    assert report["skill_tokens_reused"] == skill["tokens"] - 1  # seam 1
    sid = reference.add_skill("refunds", POLICY)
    assert sid == skill["id"]
    want = reference.generate(messages, max_new_tokens=4, fidelity=True)
    assert report["fidelity"]["logit_cosine"] == pytest.approx(want.fidelity.logit_cosine, abs=1e-6)
    assert reply.choices[0].message.content == want.text
    assert reply.usage.prompt_tokens == want.usage.prompt_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens == want.usage.cached_tokens

    other = httpx.get(f"{live.base_url}/v1/skills/{skill['id']}", headers={"Authorization": "Bearer k2"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "skill_not_found"
    with pytest.raises(Exception) as err:
        live.client("k2").chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert getattr(err.value, "status_code", None) == 404

    gone = httpx.delete(f"{live.base_url}/v1/skills/{skill['id']}", headers=headers)
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    assert httpx.get(f"{live.base_url}/v1/skills/{skill['id']}", headers=headers).status_code == 404


def test_edit_policy_erratum_over_http(live):
    client = live.client("k2")

    def ask(value, policy):
        msgs = [{"role": "system", "content": POLICY + f"\norder_status: {value}\n" + POLICY},
                {"role": "user", "content": "refund ?"}]
        return client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0,
                                              extra_body={"mmkv": {"edit_policy": policy}})

    first = ask("pending", "erratum")
    assert first.model_extra["mmkv"]["edit"] == {**first.model_extra["mmkv"]["edit"], "detected": False}
    second = ask("shipped", "erratum")
    edit = second.model_extra["mmkv"]["edit"]
    assert edit["detected"] and edit["policy"] == "erratum" and edit["field"] == "order_status"
    assert edit["erratum"] == erratum_line("order_status", "shipped")
    assert second.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens // 16) * 16
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the erratum was appended


@pytest.mark.parametrize("body,status,code", [
    ({"name": "x", "text": ""}, 400, "invalid_schema"),
    ({"name": "x"}, 400, "invalid_schema"),
    ({"name": "x", "text": "has <|image_pad|> inside"}, 400, "invalid_request"),
])
def test_bad_skills(live, body, status, code):
    r = httpx.post(f"{live.base_url}/v1/skills", json=body, headers={"Authorization": "Bearer k1"})
    assert r.status_code == status, r.text
    if code:
        assert r.json()["error"]["code"] == code


@pytest.mark.parametrize("part,status,code", [
    ({"type": "skill"}, 400, "invalid_request"),
    ({"type": "skill", "skill_id": "skill-nope"}, 404, "skill_not_found"),
    ({"type": "state_update", "field": "x"}, 400, "invalid_request"),
])
def test_bad_parts(live, part, status, code):
    r = httpx.post(f"{live.base_url}/v1/chat/completions", headers={"Authorization": "Bearer k1"},
                   json={"model": "tiny", "messages": [{"role": "user", "content": [part]}], "max_tokens": 1})
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    bad_policy = httpx.post(f"{live.base_url}/v1/chat/completions", headers={"Authorization": "Bearer k1"},
                            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                  "mmkv": {"edit_policy": "sometimes"}})
    assert bad_policy.status_code == 400 and bad_policy.json()["error"]["param"] == "edit_policy"
