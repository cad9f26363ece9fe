"""The uploaded-file store: its disk and shared-tier I/O never runs on the event loop, and its
byte and file budgets hold on every path a file can arrive by, a fetch of another server's upload
from the shared tier included."""

from __future__ import annotations

import asyncio
import threading

import pytest

from conftest import make_png
from mmkv.engine import Engine
from mmkv.server.app import ServerSettings, create_app
from mmkv.server.files import FileStore, new_stored_file
from mmkv.store.durable_registry import DurableRegistry
from mmkv.store.redis_tier import RedisTier
from test_server import LiveServer
from test_tiers_redis import RedisServer

DURABLE_IO = ("put", "get", "remove", "drop_local", "gone", "shared_ids", "local")


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer()
    yield server.url()
    server.stop()


def upload(i: int, tenant: str = "t"):
    data = make_png(30 + i, 30, seed=i)
    return new_stored_file(tenant, f"img-{i:032x}", f"{i}.png", "image/png", data, 30 + i, 30, 4)


def test_a_fetch_from_the_shared_tier_keeps_within_the_quotas(redis_url, tmp_path):
    """Review finding 13: the fetch path from the shared tier skipped the byte and file quotas, so
    one GET /v1/files pulled every other server's uploads for a key into one process."""
    a = FileStore(1 << 30, durable=DurableRegistry(tmp_path / "a", RedisTier(redis_url, "q1")))
    files = [a.add(upload(i)) for i in range(4)]
    b = FileStore(1 << 30, key_files=1, durable=DurableRegistry(tmp_path / "b", RedisTier(redis_url, "q1")))
    listed = b.list("t")
    assert [f.id for f in listed] == [f.id for f in files]  # every file listed, with its size
    assert [f.nbytes for f in listed] == [len(f.data) for f in files]
    assert len(b) == 1 and b.nbytes == files[0].nbytes and b.not_kept == 3  # only the quota's worth kept
    assert b.get("t", files[3].id).data == files[3].data  # still answered, not kept
    assert len(b) == 1 and b.nbytes == files[0].nbytes
    small = FileStore(files[0].nbytes + 1, durable=DurableRegistry(tmp_path / "c", RedisTier(redis_url, "q1")))
    small.list("t")
    assert small.nbytes <= files[0].nbytes + 1 and len(small) == 1  # the store's budget holds too


def test_concurrent_uploads_cannot_both_pass_the_quota(tmp_path):
    """Review finding 13 (the store is now called from threads): the room is taken before the durable write."""
    store = FileStore(1 << 30, key_files=1, durable=DurableRegistry(tmp_path, None))
    results, barrier = [], threading.Barrier(4)

    def add(i):
        barrier.wait()
        try:
            results.append(store.add(upload(i)).id)
        except Exception as exc:  # noqa: BLE001 - the quota error is the expected outcome for all but one
            results.append(type(exc).__name__)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results).count("FileQuotaError") == 3 and len(store) == 1


def test_file_io_never_runs_on_the_event_loop(tiny_dirs, tmp_path, redis_url):
    """Review finding 13: FileStore did its fsyncs and Redis round trips on the event loop (every
    image_file reference, every upload, every list, every delete)."""
    engine = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path, redis_url=redis_url)
    app = create_app(engine, ServerSettings(api_keys=("sk-1",), served_model_names=("m",)))
    durable, on_loop, calls = app.state.ctx.files.durable, [], []
    for name in DURABLE_IO:
        def watched(*args, _name=name, _real=getattr(durable, name), **kwargs):
            calls.append(_name)
            try:
                asyncio.get_running_loop()
                on_loop.append(_name)
            except RuntimeError:
                pass
            return _real(*args, **kwargs)
        setattr(durable, name, watched)
    server = LiveServer(app)
    try:
        client = server.client("sk-1")
        up = client.files.create(file=("a.png", make_png(64, 48), "image/png"), purpose="vision")
        assert [f.id for f in client.files.list().data] == [up.id]
        assert client.files.retrieve(up.id).id == up.id and client.files.content(up.id).content
        messages = [{"role": "user", "content": [{"type": "image_file", "image_file": {"file_id": up.id}},
                                                 {"type": "text", "text": "Hi"}]}]
        assert client.chat.completions.create(model="m", messages=messages, max_tokens=1).choices
        assert client.files.delete(up.id).deleted
    finally:
        server.close()
    assert {"put", "gone", "shared_ids", "remove"} <= set(calls)
    assert on_loop == [], f"blocking file-store I/O on the event loop: {on_loop}"
