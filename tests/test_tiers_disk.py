"""The disk tier (issue 14): a restart with the same store keeps every upload and skill id and loads
their KV from disk (0 vision-tower runs, 0 LM tokens for them, logits equal to the first run's);
a corrupted, truncated, swapped or foreign KV file is detected, dropped, counted and recomputed;
the byte budget holds by LRU; a delete leaves nothing behind; the fingerprint covers the weights,
tokenizer, chat template and processor, and its weight-file digests are cached (a changed file is
hashed again); a store directory is held by one process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import mmkv.store.fingerprint
from conftest import free_port, make_png
from mmkv.store.chunk_codec import encode_chunk
from mmkv.store.disk_tier import StoreInUseError
from mmkv.engine import Engine
from mmkv.errors import UnknownImageError, UnknownSkillError
from mmkv.store.fingerprint import durable_key, image_source_digest, model_fingerprint
from mmkv.store.tiers import StoreConfig, Tiers

QUESTION = "What colour is the rectangle?"


def ask(image_id: str, skill_id: str | None = None) -> list[dict]:
    parts = [{"type": "skill", "skill_id": skill_id}] if skill_id else []
    parts += [{"type": "image_file", "image_file": {"file_id": image_id}}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": parts}]


def kv_files(store) -> list:
    return sorted((store / "kv").glob("*/*.safetensors"))


@pytest.fixture(scope="module")
def model_dir(tiny_dirs):
    return tiny_dirs["qwen2_5_vl"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_restart_keeps_ids_and_loads_kv_from_disk(tiny_dirs, tmp_path, family):
    """Both layouts (Qwen3's deepstack features travel in the file too)."""
    first = Engine.from_pretrained(tiny_dirs[family], store_dir=tmp_path)
    image_id = first.add_image(make_png(64, 48), tenant="t1")
    skill_id = first.add_skill("brief", "Answer in one word.", tenant="t1")
    before = first.generate(ask(image_id, skill_id), max_new_tokens=4, tenant="t1")
    first.close()  # the background writer's queue lands; the store directory is free again
    assert first.stats()["disk_writes"] == 2  # the image and the skill, written through once

    second = Engine.from_pretrained(tiny_dirs[family], store_dir=tmp_path)
    assert [s.skill_id for s in second.list_skills("t1")] == [skill_id]
    assert second.image_info(image_id, "t1").image_tokens == first.image_info(image_id, "t1").image_tokens
    after = second.generate(ask(image_id, skill_id), max_new_tokens=4, tenant="t1")
    stats = second.stats()
    assert after.vision_tower_runs == 0 and stats["vision_tower_runs"] == 0
    assert stats["disk_hits"] == 2 and stats["disk_corrupt"] == 0 and stats["disk_writes"] == 0
    assert after.image_tokens_reused == before.image_tokens_reused > 0
    assert after.lm_tokens_computed == before.lm_tokens_computed  # text and seams only, in both runs
    assert after.text == before.text
    torch.testing.assert_close(after.first_logits, before.first_logits, atol=1e-6, rtol=0)
    with pytest.raises(UnknownImageError):
        second.image_info(image_id, "t2")  # tenants stay apart after a restart too
    second.check_integrity()
    second.tiers.disk.check_integrity()


def _store_with_image(model_dir, store):
    engine = Engine.from_pretrained(model_dir, store_dir=store)
    image_id = engine.add_image(make_png(64, 48))
    engine.add_image(make_png(48, 64, seed=7))  # a second file, for the swap
    engine.close()
    return engine, image_id


def _image_file(engine, image_id):
    """The image's KV file, its durable key and its chunk in RAM."""
    reg = engine.registry.images[("", image_id)]
    key = engine.registry.durable_key("image", image_source_digest(reg.source), "")
    return engine.tiers.disk._path(key), key, engine.cache._entries[engine.registry.image_key(reg, "")]


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40  # inside the last tensor
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _other_model(path, chunk, key):
    """The same chunk, as a model with another fingerprint would have written it."""
    path.write_bytes(encode_chunk(chunk, key, "f" * 64))


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "swap", "other_model", "empty"])
def test_bad_kv_file_is_detected_dropped_counted_and_recomputed(model_dir, tmp_path, damage):
    engine, image_id = _store_with_image(model_dir, tmp_path)
    path, key, chunk = _image_file(engine, image_id)
    if damage == "flip_byte":
        _flip_byte(path)
    elif damage == "truncate":
        _truncate(path)
    elif damage == "swap":
        other = next(p for p in kv_files(tmp_path) if p != path)
        path.write_bytes(other.read_bytes())
    elif damage == "other_model":
        _other_model(path, chunk, key)
    else:
        path.write_bytes(b"")
    restarted = Engine.from_pretrained(model_dir, store_dir=tmp_path)
    skill_id = restarted.add_skill("brief", "Answer in one word.")
    got = restarted.generate(ask(image_id, skill_id), max_new_tokens=4)
    assert got.images_in_context == 1 and restarted.run_background().built == 1  # in no tier: first sight, built
    rebuilt = restarted.cache.get(chunk.key, "image")
    restarted.close()
    stats = restarted.stats()
    assert stats["disk_corrupt"] == 1 and got.vision_tower_runs == 1  # recomputed from the stored bytes
    assert all(torch.equal(a, b) for a, b in zip((*rebuilt.keys, *rebuilt.values), (*chunk.keys, *chunk.values)))
    # the turn itself computed the image in context: a full recompute's answer, not the splice's
    torch.testing.assert_close(got.first_logits, restarted.generate(ask(image_id, skill_id), max_new_tokens=1,
                                                                     reuse=False).first_logits, atol=1e-4, rtol=0)
    # The bad file was replaced by the recomputed chunk: the next restart loads it cleanly.
    again = Engine.from_pretrained(model_dir, store_dir=tmp_path)
    assert again.generate(ask(image_id), max_new_tokens=1).vision_tower_runs == 0
    assert again.stats()["disk_corrupt"] == 0
    again.tiers.disk.check_integrity()


def test_store_of_another_model_is_refused(tiny_dirs, tmp_path):
    Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path).close()
    with pytest.raises(ValueError, match="another model"):
        Engine.from_pretrained(tiny_dirs["qwen3_vl"], store_dir=tmp_path)


def test_disk_budget_evicts_least_recently_used(model_dir, tmp_path):
    engine = Engine.from_pretrained(model_dir, store_dir=tmp_path)
    a = engine.add_image(make_png(64, 48, seed=1))
    engine.close()
    size = engine.stats()["disk_bytes"]
    engine = Engine.from_pretrained(model_dir, store_dir=tmp_path, store_bytes=int(size * 2.5))
    b = engine.add_image(make_png(64, 48, seed=2))
    engine.tiers.flush()
    engine.generate(ask(a), max_new_tokens=1)  # a is now more recent than b
    c = engine.add_image(make_png(64, 48, seed=3))  # evicts b
    engine.close()
    stats = engine.stats()
    assert stats["disk_evictions"] == 1 and stats["disk_entries"] == 2 and stats["disk_bytes"] <= size * 2.5
    engine.tiers.disk.check_integrity()
    restarted = Engine.from_pretrained(model_dir, store_dir=tmp_path, store_bytes=int(size * 2.5))
    runs = [restarted.generate(ask(i), max_new_tokens=1).vision_tower_runs for i in (a, c, b)]
    assert runs == [0, 0, 1]  # the evicted one is recomputed from its stored upload


def test_delete_purges_every_tier(model_dir, tmp_path):
    engine = Engine.from_pretrained(model_dir, store_dir=tmp_path)
    image_id = engine.add_image(make_png(64, 48))
    skill_id = engine.add_skill("brief", "Answer in one word.")
    engine.remove_image(image_id)
    engine.remove_skill(skill_id)
    engine.close()  # nothing was left queued to bring them back
    assert kv_files(tmp_path) == []
    assert [p for p in (tmp_path / "records").rglob("*") if p.is_file()] == []
    assert [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()] == []
    restarted = Engine.from_pretrained(model_dir, store_dir=tmp_path)
    with pytest.raises(UnknownImageError):
        restarted.image_info(image_id)
    with pytest.raises(UnknownSkillError):
        restarted.skill_info(skill_id)


def test_fingerprint_covers_weights_tokenizer_template_and_processor(model_dir, tmp_path):
    engine = Engine.from_pretrained(model_dir)
    adapter = engine.adapter
    base = model_fingerprint(adapter)
    assert base == engine.fingerprint and len(base) == 64
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    assert model_fingerprint(adapter, copy) == base  # the same files, the same fingerprint
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-3] ^= 1  # one bit of one weight: a fine-tune with the same config
    weights.write_bytes(bytes(data))
    assert model_fingerprint(adapter, copy) != base
    tok = adapter.tokenizer
    template = adapter.processor.chat_template
    adapter.processor.chat_template = template + " "
    assert model_fingerprint(adapter) != base
    adapter.processor.chat_template = template
    ip = adapter.processor.image_processor
    size = dict(ip.size)
    ip.size = {**size, "longest_edge": size["longest_edge"] * 2}
    assert model_fingerprint(adapter) != base
    ip.size = size
    tok.add_tokens(["<extra_tiers_token>"])
    assert model_fingerprint(adapter) != base


def test_durable_keys_are_sha256_of_every_setting():
    base = ("image", "d" * 64, "f" * 64, "grid", "system", "t1")
    key = durable_key(*base)
    assert len(key) == 64 and int(key, 16) >= 0
    for i in range(len(base)):
        changed = list(base)
        changed[i] = changed[i] + "x"
        assert durable_key(*changed) != key


def test_auto_store_dir_is_under_the_user_cache_per_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fingerprint = "ab" * 32
    tiers = Tiers.open(StoreConfig("auto"), fingerprint, 2, torch.float32, torch.device("cpu"))
    tiers.close()
    assert tiers.root == tmp_path / "mmkv" / fingerprint[:16]
    assert (tiers.root / "MODEL").read_text() == fingerprint and tiers.shared is None
    assert Tiers.open(StoreConfig(None), fingerprint, 2, torch.float32, torch.device("cpu")) is None


def test_a_store_directory_is_held_by_one_process(model_dir, tmp_path):
    """A second `mmkv serve` on a held directory fails at start with the directory and the holder's
    pid; a holder killed with SIGKILL leaves it free (the kernel drops the flock)."""
    store = tmp_path / "store"
    held = Tiers.open(StoreConfig(store), "ab" * 32, 2, torch.float32, torch.device("cpu"))
    second = subprocess.run([sys.executable, "-m", "mmkv.cli", "serve", str(model_dir), "--store-dir", str(store),
                             "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stderr
    assert f"{store} is in use by another mmkv process (pid {os.getpid()})" in second.stderr, second.stderr
    with pytest.raises(StoreInUseError, match="in this process"):
        Tiers.open(StoreConfig(store), "ab" * 32, 2, torch.float32, torch.device("cpu"))
    held.close()
    code = ("import os, signal, torch; from mmkv.store.tiers import StoreConfig, Tiers; "
            f"Tiers.open(StoreConfig({str(store)!r}), {'ab' * 32!r}, 2, torch.float32, torch.device('cpu')); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    Tiers.open(StoreConfig(store), "ab" * 32, 2, torch.float32, torch.device("cpu")).close()


def test_weight_digests_are_cached_and_a_changed_file_is_hashed_again(model_dir, tmp_path, monkeypatch):
    engine = Engine.from_pretrained(model_dir)
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    cache = tmp_path / "store" / "weight_digests.json"
    reads: list[str] = []
    real = mmkv.store.fingerprint.file_digest
    monkeypatch.setattr(mmkv.store.fingerprint, "file_digest", lambda path: reads.append(path.name) or real(path))
    weights = sorted(p.name for p in copy.glob("*.safetensors"))
    base = model_fingerprint(engine.adapter, copy, digest_cache=cache)
    assert sorted(reads) == weights and cache.is_file()  # the first start reads every weight file
    assert base == model_fingerprint(engine.adapter, copy)  # the cache changes nothing but the reads
    reads.clear()
    assert model_fingerprint(engine.adapter, copy, digest_cache=cache) == base and reads == []  # restart: none read
    path = copy / weights[0]
    data = bytearray(path.read_bytes())
    data[-3] ^= 1  # same size; new mtime and ctime
    path.write_bytes(bytes(data))
    changed = model_fingerprint(engine.adapter, copy, digest_cache=cache)
    assert reads == [weights[0]] and changed != base
    stat = path.stat()
    data[-3] ^= 1  # back to the original bytes, mtime set back too: ctime still tells
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    reads.clear()
    assert model_fingerprint(engine.adapter, copy, digest_cache=cache) == base and reads == [weights[0]]
    cache.write_text("{not json")  # an unreadable cache is only a slower start
    assert model_fingerprint(engine.adapter, copy, digest_cache=cache) == base
