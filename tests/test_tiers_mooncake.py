"""The shared tier on Mooncake Store (issue 14). Always: a server asked for Mooncake without a
loadable library (package missing, or libibverbs missing) fails at start-up with the exact fix,
and Redis with Mooncake together is refused. Where the library loads (pip install 'mmkv[mooncake]'
plus Debian's libibverbs1), against a real `mooncake_master`: two engines share uploads, skills and
chunk KV (the second runs the vision tower 0 times), tenants stay apart, a delete reaches the other
engine, a corrupted value is dropped and recomputed, and a master stopped mid-run degrades the
tier (requests still answer) until it is back, without a restart."""

from __future__ import annotations

import importlib.abc
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import free_port, make_png
from mmkv.cli import app
from mmkv.engine import Engine
from mmkv.store.fingerprint import image_source_digest
from mmkv.store.mooncake_tier import MooncakeUnavailable, load_store_class
from mmkv.store.tiers import StoreConfig
from test_tiers_redis import ask, delete_reaches, share_through, wait_listening

SMALL = {"mooncake_segment_bytes": 64 << 20, "mooncake_buffer_bytes": 16 << 20}  # what each test engine lends


@pytest.fixture(scope="module")
def model_dir(tiny_dirs):
    return tiny_dirs["qwen2_5_vl"]


# ---- start-up errors: always run ------------------------------------------------------------------
class _Refuse(importlib.abc.MetaPathFinder):
    """Makes `import mooncake...` fail the way a machine without the package or without libibverbs does."""

    def __init__(self, error: ImportError):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name == "mooncake" or name.startswith("mooncake."):
            raise self.error
        return None


@pytest.fixture(params=["package missing", "libibverbs missing"])
def broken_mooncake(request, monkeypatch):
    if request.param == "package missing":
        error, fix = ModuleNotFoundError("No module named 'mooncake'", name="mooncake"), "pip install 'mmkv[mooncake]'"
    else:
        error = ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
        fix = "apt-get install libibverbs1"
    for name in [n for n in sys.modules if n == "mooncake" or n.startswith("mooncake.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_Refuse(error), *sys.meta_path])
    return fix


def test_unloadable_library_fails_at_start_up_with_the_fix(model_dir, tmp_path, broken_mooncake):
    with pytest.raises(MooncakeUnavailable) as err:
        load_store_class()
    assert broken_mooncake in str(err.value)
    with pytest.raises(MooncakeUnavailable, match="--mooncake-master"):
        Engine.from_pretrained(model_dir, store_dir=tmp_path / "s", mooncake_master="127.0.0.1:1")
    assert not (tmp_path / "s").exists()  # refused before the model loads or anything is written
    result = CliRunner().invoke(app, ["serve", str(model_dir), "--mooncake-master", "127.0.0.1:1"])
    assert result.exit_code == 2 and broken_mooncake in result.output, result.output


def test_one_shared_store_at_a_time():
    with pytest.raises(ValueError, match="pick one"):
        StoreConfig(redis_url="redis://127.0.0.1:1/0", mooncake_master="127.0.0.1:2")
    with pytest.raises(ValueError, match="needs --mooncake-master"):
        StoreConfig(mooncake_metadata="http://127.0.0.1:1/metadata")


# ---- against a real store, where the library loads ------------------------------------------------
def _loads() -> str | None:
    try:
        load_store_class()
    except MooncakeUnavailable as exc:
        return str(exc)
    return None


needs_mooncake = pytest.mark.skipif(_loads() is not None, reason=f"Mooncake cannot load here: {_loads()}")


class MooncakeMaster:
    """A real mooncake_master with its HTTP metadata server, on free ports; stop() and start() keep them."""

    def __init__(self):
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.binary = shutil.which("mooncake_master", path=str(Path(sys.executable).parent)) or "mooncake_master"
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
                                      "--enable_http_metadata_server=true", f"--http_metadata_server_port={self.http}",
                                      "--http_metadata_server_host=127.0.0.1", f"--metrics_port={self.metrics}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_listening(self.proc, self.rpc, self.http)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def engine(self, model_dir, **kw) -> Engine:
        return Engine.from_pretrained(model_dir, mooncake_master=f"127.0.0.1:{self.rpc}",
                                      mooncake_metadata=f"http://127.0.0.1:{self.http}/metadata", store_options=SMALL,
                                      **kw)


@pytest.fixture(scope="module")
def master():
    server = MooncakeMaster()
    yield server
    server.stop()


@needs_mooncake
def test_two_engines_share_uploads_skills_and_kv(model_dir, tmp_path, master):
    a = master.engine(model_dir, store_dir=tmp_path / "a")
    b = master.engine(model_dir, store_dir=tmp_path / "b")
    try:
        image_id, skill_id = share_through(a, b, "mooncake")
        assert b.stats()["mooncake_up"] == 1
        secret = a.tiers.tenant_secret()  # API keys map to the same tenants on both servers
        assert b.tiers.tenant_secret() == secret and len(secret) == 32
        delete_reaches(a, b, image_id, skill_id)
    finally:
        a.close()
        b.close()


@needs_mooncake
def test_corrupt_value_is_dropped_and_recomputed(model_dir, master):
    a, b = master.engine(model_dir), master.engine(model_dir)
    try:
        image_id = a.add_image(make_png(64, 48, seed=2))
        a.generate(ask(image_id), max_new_tokens=3)
        a.tiers.flush()
        shared = a.tiers.shared
        key = shared.key("kv", a.registry.durable_key("image", image_source_digest(a.registry.images[("", image_id)].source), ""))
        value = bytearray(shared._get(key))
        value[-50] ^= 0x10
        shared._set(key, bytes(value))
        got = b.generate(ask(image_id), max_new_tokens=3)
        assert b.stats()["mooncake_corrupt"] == 1 and got.vision_tower_runs == 1
        assert got.images_in_context == 1 and b.run_background().built == 1  # in no tier: first sight, built
        chunk_key = a.registry.image_key(a.registry.images[("", image_id)], "")
        rebuilt, original = b.cache.get(chunk_key, "image"), a.cache.get(chunk_key, "image")
        assert all(torch.equal(x, y) for x, y in zip((*rebuilt.keys, *rebuilt.values),
                                                     (*original.keys, *original.values)))
        b.tiers.flush()
        assert shared._get(key) != bytes(value)  # the recomputed chunk replaced it
    finally:
        a.close()
        b.close()


@needs_mooncake
def test_master_down_then_back(model_dir, master):
    """Requests answer while the master is down (the tier says degraded); once it is back the
    engine uses it again without a restart."""
    engine = master.engine(model_dir)
    try:
        assert engine.tiers.shared.check()
        master.stop()
        deadline = time.monotonic() + 30
        while engine.tiers.shared.check():  # the client's heartbeat notices within seconds
            assert time.monotonic() < deadline, "the Mooncake client did not notice the master stopped"
            time.sleep(0.2)
        image_id = engine.add_image(make_png(64, 48, seed=5))
        got = engine.generate(ask(image_id), max_new_tokens=2)
        assert got.finish_reason in ("stop", "length") and got.vision_tower_runs == 0  # computed at upload
        stats = engine.stats()
        assert stats["mooncake_up"] == 0 and stats["mooncake_errors"] >= 1
        master.start()
        deadline = time.monotonic() + 30
        while not engine.tiers.shared.check():
            assert time.monotonic() < deadline, "the Mooncake client did not reconnect"
            time.sleep(0.5)
        before = engine.stats()["mooncake_writes"]
        engine.add_image(make_png(64, 48, seed=6))
        engine.tiers.flush()
        assert engine.stats()["mooncake_writes"] == before + 1 and engine.stats()["mooncake_up"] == 1
    finally:
        engine.close()
        if master.proc.poll() is not None:
            master.start()


class FakeStore:
    """The part of MooncakeDistributedStore the tier uses, over one dict that every instance shares
    (servers on one pool); `before_remove(key)` runs before each of this instance's removes."""

    pool: dict[str, bytes] = {}
    before_remove = staticmethod(lambda key: None)

    def setup(self, *args) -> int:
        return 0

    def health_check(self) -> int:
        return 0

    def get(self, key: str) -> bytes:
        return self.pool.get(key, b"")

    def upsert(self, key: str, value: bytes) -> int:
        self.pool[key] = bytes(value)
        return 0

    def put(self, key: str, value: bytes) -> int:
        self.pool.setdefault(key, bytes(value))
        return 0

    def remove(self, key: str, force: bool) -> int:
        self.before_remove(key)
        return 0 if self.pool.pop(key, None) is not None else -704

    def is_exist(self, key: str) -> int:
        return int(key in self.pool)

    def close(self) -> None:
        pass


def test_a_blob_named_by_another_record_survives_a_racing_delete_on_mooncake(monkeypatch):
    """Review finding 6: on Mooncake (no transactions) a blob's reference count was a
    read-modify-write across calls: a server adding a record for the same bytes between another
    server's count reaching 0 and its delete of the blob lost the bytes its record names. Each
    record now keeps its own copy, so there is no count to race on."""
    import mmkv.store.mooncake_tier as mooncake_tier

    FakeStore.pool = {}
    racer = type("Racer", (FakeStore,), {})
    monkeypatch.setattr(mooncake_tier.MooncakeTier, "_probe", lambda self, host, port, what: None)
    monkeypatch.setattr(mooncake_tier, "load_store_class", lambda: racer)
    a = mooncake_tier.MooncakeTier("127.0.0.1:50051", None, "ns")
    monkeypatch.setattr(mooncake_tier, "load_store_class", lambda: FakeStore)
    b = mooncake_tier.MooncakeTier("127.0.0.1:50051", None, "ns")
    digest, blob, raced = "d" * 64, b"the upload's bytes", []
    a.record_put("image", "t", "img-1", b'{"sealed": 1}', digest, blob)

    def b_writes_first(key):  # B's write lands just before A's first removal of a blob
        if ":blob:" in key and not raced:
            raced.append(key)
            b.record_put("file", "t", "img-1", b'{"sealed": 2}', digest, blob)

    racer.before_remove = staticmethod(b_writes_first)
    a.record_remove("image", "t", "img-1", lambda raw: digest)
    assert raced and b.blob_get("file", "t", "img-1", digest) == blob
    b.record_remove("file", "t", "img-1", lambda raw: digest)
    assert not [k for k in FakeStore.pool if ":blob" in k], FakeStore.pool
