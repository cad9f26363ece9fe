"""Crash safety of the disk tier (issue 14): a process killed with SIGKILL at several points of its
writes (a torn temporary file, before the rename, right after it) leaves no visible half entry,
and after a restart every request answers; a real `mmkv serve` killed with SIGKILL comes back with
its files, skills and API-key tenants, and serves an uploaded image with 0 vision-tower runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from conftest import free_port, make_png
import mmkv.store.disk_tier
import mmkv.store.durable_registry
import mmkv.store.tiers
from mmkv.engine import Engine
from mmkv.store.tiers import StoreConfig

# A forked child numbers its atomic writes: 1 the store's MODEL marker, then image A's KV (2), blob
# (3) and record (4), the skill's KV (5) and record (6), image B's KV (7), blob (8) and record (9).
# (The child writes chunk KV in line, not through the background writer, to keep that order.)
CASES = [("torn", 2), ("before_rename", 3), ("after_rename", 3), ("torn", 4), ("after_rename", 4),
         ("before_rename", 6), ("torn", 7), ("after_rename", 9)]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _crash_at(point: str, nth: int, adapter, store: Path) -> None:
    """In a forked child: write as an upload and a skill do, and SIGKILL this process at write `nth`."""
    real, count = mmkv.store.disk_tier.atomic_write, [0]

    def injected(path, data):
        count[0] += 1
        if count[0] != nth:
            return real(path, data)
        if point == "torn":  # killed inside write(): half a temporary file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_name(f".{path.name}.torn.tmp").write_bytes(data[: len(data) // 2])
            _die()
        if point == "before_rename":
            os.replace = lambda *a: _die()
        real(path, data)
        _die()  # after_rename: the entry is complete, the process dies before it goes on

    for module in (mmkv.store.disk_tier, mmkv.store.durable_registry, mmkv.store.tiers):
        module.atomic_write = injected
    mmkv.store.tiers.Tiers.store = lambda self, key, chunk, shared=True: mmkv.store.tiers._write_through(
        self.disk, self.shared, self.fingerprint, self.counts, key, chunk, None)
    engine = Engine(adapter, store=StoreConfig(store))
    engine.add_image(make_png(64, 48, seed=1))
    engine.add_skill("brief", "Answer in one word.")
    engine.add_image(make_png(64, 48, seed=2), tenant="t")


def test_sigkill_during_writes_leaves_no_partial_entry(tiny_dirs, tmp_path):
    model = tiny_dirs["qwen2_5_vl"]
    adapter = Engine.from_pretrained(model).adapter
    for point, nth in CASES:
        store = tmp_path / f"{point}-{nth}"
        pid = os.fork()
        if pid == 0:
            try:
                _crash_at(point, nth, adapter, store)
            finally:
                os._exit(3)  # only reached if the injected kill did not happen
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (point, nth, status)

        engine = Engine.from_pretrained(model, store_dir=store)
        engine.tiers.disk.check_integrity()
        assert not [p for p in store.rglob("*.tmp")], (point, nth)
        images = sorted(engine.registry.images)
        skills = sorted(engine.registry.skills)
        complete = nth - (0 if point == "after_rename" else 1)  # writes that finished
        assert len(images) == (complete >= 4) + (complete >= 9), (point, nth, images)
        assert len(skills) == (complete >= 6), (point, nth, skills)
        blobs = [p for p in (store / "blobs").rglob("*") if p.is_file()]
        assert len(blobs) == len(images), (point, nth, blobs)  # an unnamed blob is removed
        for tenant, image_id in images:
            got = engine.generate([{"role": "user", "content": [
                {"type": "image_file", "image_file": {"file_id": image_id}}, {"type": "text", "text": "Colour?"}]}],
                max_new_tokens=2, tenant=tenant)
            assert got.finish_reason in ("stop", "length")
            # its KV file was complete before the record was written, so it loads from disk
            assert got.vision_tower_runs == 0, (point, nth)
        # every request answers: the lost upload can simply be sent again
        assert engine.add_image(make_png(64, 48, seed=1)).startswith("img-")
        engine.tiers.disk.check_integrity()


def _serve(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mmkv.cli", "serve", *args, "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "mmkv serve did not come up"
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.2)


def _disk_writes(base: str) -> float:
    line = next(m for m in httpx.get(f"{base}/metrics").text.splitlines() if m.startswith('mmkv:tier_writes_total{tier="disk"}'))
    return float(line.split()[-1])


def test_mmkv_serve_killed_with_sigkill_keeps_files_skills_and_reuse(tiny_dirs, tmp_path):
    args = [str(tiny_dirs["qwen2_5_vl"]), "--store-dir", str(tmp_path / "store"), "--api-key", "sk-a"]
    auth = {"Authorization": "Bearer sk-a"}
    proc, base = _serve(args, tmp_path / "serve.log")
    try:
        up = httpx.post(f"{base}/v1/files", headers=auth, data={"purpose": "vision"},
                        files={"file": ("a.png", make_png(64, 48), "image/png")}).json()
        skill = httpx.post(f"{base}/v1/skills", headers=auth, json={"name": "brief", "text": "Answer in one word."}).json()
        # KV reaches the disk in the background (a kill before that costs a recompute, not an error):
        # wait for both writes, so that the restart below can show the reuse
        deadline = time.monotonic() + 60
        while (written := _disk_writes(base)) < 2:
            assert time.monotonic() < deadline, (written, up, skill)
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    proc, base = _serve(args, tmp_path / "serve.log")
    try:
        listed = httpx.get(f"{base}/v1/files", headers=auth).json()
        assert [f["id"] for f in listed["data"]] == [up["id"]]
        assert httpx.get(f"{base}/v1/files/{up['id']}/content", headers=auth).content == make_png(64, 48)
        assert [s["id"] for s in httpx.get(f"{base}/v1/skills", headers=auth).json()["data"]] == [skill["id"]]
        body = {"model": "qwen2_5_vl", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "skill", "skill_id": skill["id"]},
            {"type": "image_file", "image_file": {"file_id": up["id"]}}, {"type": "text", "text": "Colour?"}]}]}
        reply = httpx.post(f"{base}/v1/chat/completions", headers=auth, json=body, timeout=60).json()
        assert reply["mmkv"]["vision_tower_runs"] == 0, reply
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= up["image_tokens"]
        metrics = httpx.get(f"{base}/metrics").text
        assert 'mmkv:tier_hits_total{tier="disk"} 2.0' in metrics, metrics
    finally:
        proc.terminate()
        proc.wait(30)
