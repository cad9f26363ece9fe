"""The operator's limits and switches over HTTP: skill quotas per key and in all (a refused skill
is neither precompiled nor recorded), and the fidelity switch (off: a request asking for it is a
400 naming `mmkv.fidelity`, never served silently without it). Oracles: the engine's own counters
(vision and LM work, registered skills, cache bytes) before and after.
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient
from typer.testing import CliRunner

import mmkv
import mmkv.server.app as server_app
import mmkv.server.serve as server_serve
from mmkv.cli import app as cli
from mmkv.server.app import ServerSettings, create_app
from mmkv.server.skill_quota import skill_bytes

from test_server import tiny_dir  # noqa: F401 - fixture

KEYS = {"a": {"Authorization": "Bearer ka"}, "b": {"Authorization": "Bearer kb"}}
SHORT = "refunds only for damaged orders . " * 2
LONG = "refunds only for delivered orders reported damaged within thirty days . " * 6


@pytest.fixture(scope="module")
def engine(tiny_dir):  # noqa: F811
    return mmkv.Engine.from_pretrained(tiny_dir)


def _serve(engine, **settings):
    return TestClient(create_app(engine, ServerSettings(api_keys=("ka", "kb"), served_model_names=("tiny",),
                                                        **settings)))


def _skill_bytes(engine, text: str) -> int:
    """The KV the engine keeps for `text` as a skill: its cache's growth when a scratch tenant adds it."""
    before = engine.stats()["cache_bytes"]
    skill_id = engine.add_skill("probe", text, tenant="probe")
    grown = engine.stats()["cache_bytes"] - before
    engine.remove_skill(skill_id, tenant="probe")
    return grown


def _add(client, key: str, text: str, name: str = "s"):
    return client.post("/v1/skills", json={"name": name, "text": text}, headers=KEYS[key])


def test_a_skill_counts_its_kv_bytes(engine):
    """Review finding 12: the quota counts a skill at the bytes its KV takes in every store."""
    for text in (SHORT, LONG):
        tokens = engine.skill_info(engine.add_skill("t", text, tenant="t"), tenant="t").tokens
        assert skill_bytes(engine, tokens) == _skill_bytes(engine, text)


@pytest.mark.parametrize("limit", ["count", "bytes"])
def test_a_key_over_its_skill_quota_gets_429_and_nothing_changes(engine, limit):
    """Review finding 12: skills had no quota, so one key could grow RAM, disk and the shared tier
    without bound and stall decoding with precompiles. Over its quota a key gets 429
    `skill_quota_exceeded` (param `text`, no Retry-After); nothing is precompiled or recorded, the
    other key is unaffected, a skill the key keeps can be added again, and a delete makes room."""
    quota = {"key_skills": 1} if limit == "count" else {"key_skill_bytes": _skill_bytes(engine, LONG)}
    with _serve(engine, **quota) as client:
        kept = _add(client, "a", LONG)
        assert kept.status_code == 200, kept.text
        stats = engine.stats()
        refused = _add(client, "a", SHORT, name="second")
        assert refused.status_code == 429 and "retry-after" not in refused.headers
        assert refused.json()["error"] == {"message": refused.json()["error"]["message"], "param": "text",
                                           "type": "invalid_request_error", "code": "skill_quota_exceeded"}
        after = engine.stats()
        for counter in ("registered_skills", "skill_entries", "cache_bytes", "prefill_tokens"):
            assert after[counter] == stats[counter], counter
        assert [s["id"] for s in client.get("/v1/skills", headers=KEYS["a"]).json()["data"]] == [kept.json()["id"]]
        assert _add(client, "a", LONG).json()["id"] == kept.json()["id"]  # the same skill again: no new room needed
        assert _add(client, "b", SHORT).status_code == 200  # another key has its own quota
        assert client.delete(f"/v1/skills/{kept.json()['id']}", headers=KEYS["a"]).status_code == 200
        assert _add(client, "a", SHORT).status_code == 200


def test_the_skill_budget_of_all_keys_is_a_507(engine):
    """Review finding 12: a total skill budget over all keys; past it, 507 `skill_store_full` and
    nothing changes."""
    with _serve(engine, skill_store_bytes=_skill_bytes(engine, LONG) + _skill_bytes(engine, SHORT) - 1) as client:
        assert _add(client, "a", LONG).status_code == 200
        stats = engine.stats()
        full = _add(client, "b", SHORT)
        assert full.status_code == 507 and full.json()["error"]["code"] == "skill_store_full"
        assert engine.stats()["registered_skills"] == stats["registered_skills"]
        assert engine.stats()["prefill_tokens"] == stats["prefill_tokens"]


def test_fidelity_is_refused_unless_the_server_allows_it(engine):
    """Review finding 14: `mmkv.fidelity` let any client run a second, whole forward under the
    engine lock (every decode waits). Off by default: asking for it is a 400 naming it, before any
    model work, and the published schema says so; with --allow-fidelity it is reported."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
    with _serve(engine) as client:
        requests = engine.stats()["requests"]
        refused = client.post("/v1/chat/completions", json={**chat, "mmkv": {"fidelity": True}}, headers=KEYS["a"])
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "mmkv.fidelity"
        assert refused.json()["error"]["code"] == "unsupported_parameter"
        assert engine.stats()["requests"] == requests
        fidelity = client.get("/openapi.json").json()["components"]["schemas"]["MMKVOptions"]["properties"]["fidelity"]
        assert fidelity["enum"] == [False]
        plain = client.post("/v1/chat/completions", json={**chat, "mmkv": {"fidelity": False}}, headers=KEYS["a"])
        assert plain.status_code == 200 and plain.json()["mmkv"]["fidelity"] is None
    with _serve(engine, allow_fidelity=True) as client:
        allowed = client.post("/v1/chat/completions", json={**chat, "mmkv": {"fidelity": True}}, headers=KEYS["a"])
        assert allowed.status_code == 200 and 0.9 < allowed.json()["mmkv"]["fidelity"]["logit_cosine"] <= 1 + 1e-6


def test_mmkv_serve_flags_reach_the_settings(monkeypatch):
    """The flags of findings 12 and 14, and their defaults (fidelity off), reach ServerSettings."""
    captured, real_create_app = [], server_app.create_app
    monkeypatch.setattr(server_app, "create_app",
                        lambda engine, settings: captured.append(settings) or real_create_app(engine, settings))
    monkeypatch.setattr(server_serve, "serve", lambda *args, **kwargs: None)
    flags = ["--allow-fidelity", "--skill-store-gb", "0.5", "--key-skill-quota-mb", "3", "--key-skill-quota-count", "7"]
    for args in (flags, []):
        result = CliRunner().invoke(cli, ["serve", "--store-dir", "none", *args])
        assert result.exit_code == 0, result.output
    flagged, default = captured
    assert (flagged.allow_fidelity, flagged.skill_store_bytes, flagged.key_skill_bytes, flagged.key_skills) == \
        (True, 1 << 29, 3 << 20, 7)
    assert (default.allow_fidelity, default.skill_store_bytes, default.key_skill_bytes, default.key_skills) == \
        (False, 1 << 30, 256 << 20, 1000)
