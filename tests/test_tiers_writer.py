"""The background writer of the lower tiers (issue 14): a request's answer never waits for a tier
write; a write still lands (flush, then a new engine on the store reads it back); a failing write
is counted and never fails a request; the queue's byte bound holds, with writes past it dropped
and counted, never waited for; a delete takes back a queued write so it cannot bring the chunk back."""

from __future__ import annotations

import base64
import threading
import tracemalloc

import pytest
import torch

import mmkv.store.tiers
from conftest import make_png
from mmkv.engine import Engine
from mmkv.store.chunk_codec import encoded_nbytes
from mmkv.store.tier_writer import TierWriter

QUESTION = "What colour is the rectangle?"


def ask(image_id: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_file", "image_file": {"file_id": image_id}},
                                         {"type": "text", "text": QUESTION}]}]


def inline(seed: int) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(make_png(40, 40, seed=seed)).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def model_dir(tiny_dirs):
    return tiny_dirs["qwen2_5_vl"]


class Gate:
    """Holds `writer`'s writes until opened, recording the keys written."""

    def __init__(self, writer: TierWriter):
        self.open, self.started, self.keys, self.execute = threading.Event(), threading.Event(), [], writer._execute
        writer._execute = self

    def __call__(self, key, write):
        self.started.set()
        assert self.open.wait(60), "the gate was never opened"
        self.keys.append(key)
        self.execute(key, write)


def nothing():
    return lambda: None


def test_answer_does_not_wait_and_the_write_lands(model_dir, tmp_path):
    engine = Engine.from_pretrained(model_dir, store_dir=tmp_path)
    gate = Gate(engine.tiers.writer)
    got = engine.generate(inline(1), max_new_tokens=2)  # a first-time image: computed in context
    assert got.vision_tower_runs == 1 and got.images_in_context == 1 and got.finish_reason in ("stop", "length")
    assert engine.run_background().built == 1  # its chunk built off the request path, its write queued
    assert gate.started.wait(30) and gate.keys == []
    spliced = engine.generate(inline(1), max_new_tokens=2)  # answered while its write was still held
    assert spliced.vision_tower_runs == 0 and spliced.image_tokens_reused > 0
    assert engine.stats()["disk_writes"] == 0
    gate.open.set()
    engine.close()  # flushes
    assert engine.stats()["disk_writes"] == 1 and engine.stats()["tier_writes_dropped"] == 0
    again = Engine.from_pretrained(model_dir, store_dir=tmp_path)
    try:
        hit = again.generate(inline(1), max_new_tokens=2)
        assert hit.vision_tower_runs == 0 and again.stats()["disk_hits"] == 1
        # the chunk's KV is the same; the 32 template tokens before it came from the prefix cache in
        # `spliced` and from a forward of another length here: float32 rounding apart
        torch.testing.assert_close(hit.first_logits, spliced.first_logits, atol=1e-5, rtol=0)
    finally:
        again.close()


def test_failing_write_never_fails_the_request(model_dir, tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(mmkv.store.tiers, "encode_chunk", broken)
    engine = Engine.from_pretrained(model_dir, store_dir=tmp_path)
    try:
        image_id = engine.add_image(make_png(64, 48))
        got = engine.generate(ask(image_id), max_new_tokens=2)
        engine.tiers.flush()
        stats = engine.stats()
        assert got.finish_reason in ("stop", "length") and stats["tier_writes_failed"] == 1
        assert stats["disk_writes"] == 0 and stats["disk_entries"] == 0
    finally:
        engine.close()


def test_queue_bound_drops_and_counts_never_blocks():
    """Review finding 16: the write in flight counts against the bound until it is done."""
    writer = TierWriter(bound_bytes=100)
    gate = Gate(writer)
    assert writer.submit("a", 60, nothing)
    assert gate.started.wait(10)  # "a" is in flight: it still holds its 60 bytes
    accepted = [writer.submit(k, 20, nothing) for k in "bcd"]  # b, c fit (100); d would make 120
    assert accepted == [True, True, False] and writer.dropped == 1 and writer.held_bytes == 100
    assert not writer.submit("e", 101, nothing)  # larger than the bound: never fits
    assert writer.submit("b", 20, nothing)  # already queued: not twice
    gate.open.set()
    assert writer.flush(30)
    assert gate.keys == ["a", "b", "c"] and writer.written == 3 and writer.dropped == 2
    assert writer.peak_bytes == 100 and writer.held_bytes == 0
    writer.close()
    assert not writer.submit("f", 1, nothing) and writer.dropped == 3  # closed: refused, counted


def test_a_write_that_does_not_fit_is_never_prepared():
    """Review finding 16: the host copy of device KV is made only for a write that fits."""
    writer = TierWriter(bound_bytes=10)
    prepared = []
    assert not writer.submit("a", 11, lambda: prepared.append("a") or (lambda: None))
    assert writer.submit("b", 10, lambda: prepared.append("b") or (lambda: None))
    assert writer.flush(30) and prepared == ["b"]


def test_a_chunk_write_is_counted_at_the_most_it_holds(tmp_path):
    """Review finding 16: a chunk's write was counted at its KV bytes while queued and at nothing
    in flight, though while it is written it holds the KV and its encoded copy. Measured: what the
    writer counts for it covers the KV's tensors plus every byte the write allocates (tracemalloc)."""
    from test_tiers_integrity import image_chunk

    tiers = mmkv.store.tiers.Tiers.open(mmkv.store.tiers.StoreConfig(tmp_path), "ab" * 32, 2, torch.float32,
                                        torch.device("cpu"))
    chunk = image_chunk(pads=4096)
    gate = Gate(tiers.writer)
    try:
        tiers.store("c" * 64, chunk)
        assert gate.started.wait(10)
        held = tiers.writer.held_bytes
        tracemalloc.start()
        gate.open.set()
        assert tiers.flush(30)
        allocated = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert tiers.stats()["disk_writes"] == 1
        assert held >= encoded_nbytes(chunk) + allocated, (held, encoded_nbytes(chunk), allocated)
        assert held <= 2 * encoded_nbytes(chunk) + (128 << 10)  # and not much more: the bound stays useful
    finally:
        tiers.close()


def test_cancel_takes_back_a_queued_write_and_waits_for_one_in_flight():
    writer = TierWriter(bound_bytes=1000)
    gate = Gate(writer)
    writer.submit("a", 10, nothing)
    assert gate.started.wait(10)
    writer.submit("b", 10, nothing)
    writer.cancel("b")  # queued: taken back, never written
    threading.Timer(0.2, gate.open.set).start()
    writer.cancel("a")  # in flight: returns only once it is written
    assert gate.keys == ["a"]
    assert writer.flush(30) and gate.keys == ["a"] and writer.held_bytes == 0


def test_delete_while_queued_leaves_nothing(model_dir, tmp_path):
    engine = Engine.from_pretrained(model_dir, store_dir=tmp_path)
    gate = Gate(engine.tiers.writer)
    image_id = engine.add_image(make_png(64, 48))
    engine.add_image(make_png(48, 64, seed=3))  # queued behind the first
    assert gate.started.wait(30)
    threading.Timer(0.2, gate.open.set).start()
    engine.remove_image(image_id)
    engine.close()
    assert len(list((tmp_path / "kv").glob("*/*.safetensors"))) == 1  # only the second image's KV
    assert engine.stats()["disk_entries"] == 1


def test_metrics_show_every_shared_backend_and_the_writer_queue():
    """/metrics exports the Mooncake tier like the Redis one, and the background writer's queue."""
    from prometheus_client import generate_latest

    from mmkv.server.metrics import ServerMetrics

    stats = {"mooncake_up": 0, "mooncake_errors": 3, "mooncake_calls": 7, "mooncake_call_s": 0.5, "mooncake_skipped": 2,
             "mooncake_hits": 4, "disk_hits": 1, "tier_write_queue_bytes": 4096, "tier_writes_dropped": 5,
             "tier_writes_failed": 6}
    text = generate_latest(ServerMetrics(lambda: stats, lambda: 0).registry).decode()
    for line in ("mmkv:mooncake_up 0.0", "mmkv:mooncake_errors_total 3.0", "mmkv:mooncake_skipped_total 2.0",
                 'mmkv:tier_hits_total{tier="mooncake"} 4.0', 'mmkv:tier_hits_total{tier="disk"} 1.0',
                 "mmkv:tier_write_queue_bytes 4096.0", "mmkv:tier_writes_dropped_total 5.0",
                 "mmkv:tier_writes_failed_total 6.0"):
        assert line in text.splitlines(), line
    assert "mmkv:redis_up" not in text  # a backend that is not configured shows nothing
