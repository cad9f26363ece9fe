"""Videos in the durable and shared tiers, as images: an uploaded video's groups are written
through to the disk (and, for an upload, the shared) tier under SHA-256 durable keys and its record
(sampled frames) is kept, so a restarted server or a second server on the same shared store knows
the video id, runs the vision tower 0 times for it and answers exactly as before; a delete purges
the record and every group's KV in every tier, and a server that adopted the video forgets it on
its next lookup (tombstone); inline videos' groups stay on their server; live streams stay in RAM;
restored videos are counted in the video store budget at their real bytes."""

from __future__ import annotations

import base64
import logging

import pytest
import redis
import torch

from mmkv import Engine
from mmkv.errors import UnknownVideoError, VideoStoreFullError
from mmkv.request.videos import VideoGroupRef
from mmkv.server.app import ServerSettings, create_app
from mmkv.store.shared_tier import SharedTierUnavailableError
from mmkv.testing.clips import clip_frames, encode_clip
from PIL import Image
from test_server import LiveServer
from test_tiers_shared_store import redis_server  # noqa: F401 - the fixture (one server a test, stoppable)

QUESTION = "what moved ?"


def small(engine) -> dict:
    """Few pads per frame: a fast clip."""
    f = engine.registry.videos.budget.factor
    return {"max_pixels": 4 * f * f}


def clip(seed: int = 0, frames: int = 8) -> bytes:
    return encode_clip(frames, 4, 64, 48, seed=seed)


def ask(video_id: str) -> list[dict]:
    return [{"role": "system", "content": "be brief ."},
            {"role": "user", "content": [{"type": "video_file", "video_file": {"file_id": video_id}},
                                         {"type": "text", "text": QUESTION}]}]


def ask_inline(data: bytes, engine) -> list[dict]:
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}, **small(engine)},
                                         {"type": "text", "text": QUESTION}]}]


def durable_keys(engine, video_id: str, tenant: str = "") -> list[str]:
    videos = engine.registry.videos
    video = videos.videos[(tenant, video_id)].video
    return [videos.group_durable_key(video, g, tenant) for g in range(video.num_groups)]


def shared_kv(url: str) -> list[bytes]:
    return redis.Redis.from_url(url).keys("mmkv:*:kv:*")


def disk_has(engine, key: str) -> bool:
    return key in engine.tiers.disk


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_restart_keeps_the_upload_and_loads_its_groups_from_disk(tiny_dirs, tmp_path, family):
    """Finding (videos in the tiers): uploads and their groups' KV lived in RAM only, so a
    restart forgot every video. Qwen3-VL's groups carry their timestamp text before the pads (the
    first pad's index travels in the entry)."""
    first = Engine.from_pretrained(tiny_dirs[family], store_dir=tmp_path)
    video_id = first.add_video(clip(), tenant="t1", **small(first))
    groups = first.video_info(video_id, "t1").groups
    before = first.generate(ask(video_id), max_new_tokens=6, tenant="t1")
    nbytes = first.registry.videos.store_bytes
    first.close()
    assert first.stats()["disk_writes"] == groups

    second = Engine.from_pretrained(tiny_dirs[family], store_dir=tmp_path)
    assert second.registry.videos.store_bytes == nbytes  # restored at its frames' real bytes
    assert second.video_info(video_id, "t1") == first.video_info(video_id, "t1")
    after = second.generate(ask(video_id), max_new_tokens=6, tenant="t1")
    stats = second.stats()
    assert after.vision_tower_runs == 0 and stats["vision_tower_runs"] == 0
    assert stats["disk_hits"] == groups and stats["disk_corrupt"] == 0 and stats["disk_writes"] == 0
    assert after.video_tokens_reused == before.video_tokens_reused > 0  # every pad but each group's seam
    assert after.usage.cached_tokens == before.usage.cached_tokens
    assert after.lm_tokens_computed == before.lm_tokens_computed
    assert after.token_ids == before.token_ids and after.text == before.text
    torch.testing.assert_close(after.first_logits, before.first_logits, atol=1e-6, rtol=0)
    with pytest.raises(UnknownVideoError):
        second.video_info(video_id, "t2")  # tenants stay apart after a restart too
    second.check_integrity()
    second.close()


def test_a_second_server_answers_about_the_first_servers_upload(tiny_dirs, tmp_path, redis_server):
    """Two servers on one shared store: the second adopts the upload's record and loads every
    group from the shared tier (0 vision-tower runs, the groups counted as reused), same answer."""
    url = redis_server.url()
    a = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path / "a", redis_url=url)
    video_id = a.add_video(clip(), **small(a))
    groups = a.video_info(video_id).groups
    answer = a.generate(ask(video_id), max_new_tokens=6)
    a.tiers.flush()
    assert len(shared_kv(url)) == groups

    b = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path / "b", redis_url=url)
    got = b.generate(ask(video_id), max_new_tokens=6)
    assert got.vision_tower_runs == 0 and b.stats()["redis_hits"] == groups
    assert got.video_tokens_reused == answer.video_tokens_reused > 0
    assert got.token_ids == answer.token_ids
    torch.testing.assert_close(got.first_logits, answer.first_logits, atol=1e-6, rtol=0)
    a.close()
    b.close()


def test_a_delete_purges_every_tier_and_the_other_server_on_its_next_lookup(tiny_dirs, tmp_path, redis_server):
    """The record and every group's KV go from the disk and the shared tier; a server that adopted
    the video (and copied its groups to its own disk) finds the tombstone on its next lookup and
    drops its copies too, and one that was down during the delete drops them at its start."""
    url = redis_server.url()
    a = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path / "a", redis_url=url)
    video_id = a.add_video(clip(), **small(a))
    keys = durable_keys(a, video_id)
    a.tiers.flush()
    b, c = (Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path / d, redis_url=url) for d in "bc")
    for other in (b, c):
        assert other.generate(ask(video_id), max_new_tokens=1).vision_tower_runs == 0
        other.tiers.flush()
        assert all(disk_has(other, k) for k in keys) and other.tiers.registry.local("video")
    c.close()

    a.remove_video(video_id)
    a.tiers.flush()
    assert shared_kv(url) == [] and not any(disk_has(a, k) for k in keys)
    assert a.tiers.registry.get("video", "", video_id) is None and a.tiers.registry.local("video") == []
    with pytest.raises(UnknownVideoError):
        a.video_info(video_id)

    with pytest.raises(UnknownVideoError):
        b.generate(ask(video_id), max_new_tokens=1)  # the tombstone: purged here too
    assert not any(disk_has(b, k) for k in keys) and b.tiers.registry.local("video") == []
    assert b.cache.count("video") == 0
    b.check_integrity()
    a.close()
    b.close()
    restarted = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path / "a")
    with pytest.raises(UnknownVideoError):
        restarted.video_info(video_id)
    restarted.close()
    c = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path / "c", redis_url=url)
    assert ("", video_id) not in c.registry.videos.videos and c.registry.videos.store_bytes == 0
    assert not any(disk_has(c, k) for k in keys) and c.tiers.registry.local("video") == []
    c.close()


def test_a_delete_the_shared_tier_does_not_take_changes_nothing_here(tiny_dirs, tmp_path, redis_server):
    """A delete goes to the shared tier first: while it does not answer the delete fails and this
    server still holds, and serves, the video, its record and its groups' KV on disk; once it is
    back the delete goes through."""
    url = redis_server.url()
    a = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path, redis_url=url)
    video_id = a.add_video(clip(), **small(a))
    keys = durable_keys(a, video_id)
    a.tiers.flush()
    redis_server.stop()
    with pytest.raises(SharedTierUnavailableError):
        a.remove_video(video_id)
    assert a.generate(ask(video_id), max_new_tokens=1).vision_tower_runs == 0
    assert all(disk_has(a, k) for k in keys) and a.tiers.registry.local("video")
    redis_server.start()  # a delete tries the store even inside its degraded window
    a.remove_video(video_id)
    assert shared_kv(url) == [] and not any(disk_has(a, k) for k in keys) and a.tiers.registry.local("video") == []
    a.close()


def test_inline_video_groups_stay_on_their_server_and_an_upload_shares_them(tiny_dirs, tmp_path, redis_server):
    """An inline video's groups are written to this server's disk only; uploading the same clip
    later computes nothing and shares them then."""
    url = redis_server.url()
    a = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path / "a", redis_url=url)
    data = clip(seed=2)
    first = a.generate(ask_inline(data, a), max_new_tokens=1)
    a.tiers.flush()
    groups = a.stats()["disk_writes"]
    assert first.vision_tower_runs == groups > 0 and shared_kv(url) == []
    a.add_video(data, **small(a))
    a.tiers.flush()
    assert a.stats()["vision_tower_runs"] == groups and len(shared_kv(url)) == groups
    a.close()


def test_stream_groups_stay_in_ram_while_an_uploads_reach_the_disk(tiny_dirs, tmp_path):
    """Live streams are RAM only: neither their window's groups nor the ones the window drops are
    ever written to a tier, and a restart knows the upload but not the stream."""
    engine = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path)
    video_id = engine.add_video(clip(), **small(engine))
    uploaded = len(durable_keys(engine, video_id))
    stream_id = engine.create_stream(window_groups=2, **small(engine))
    frames = [(Image.fromarray(img), i / 2) for i, img in enumerate(clip_frames(12, 64, 64, seed=5))]
    for i in range(0, 12, 2):
        engine.append_frames(stream_id, frames[i:i + 2])
        engine.generate(ask(stream_id), max_new_tokens=1)
    window = engine.registry.videos.lookup(stream_id, "")
    dropped = engine.stream_info(stream_id).first_group
    assert dropped > 0
    engine.tiers.flush()
    assert engine.stats()["disk_writes"] == uploaded and len(engine.tiers.disk) == uploaded
    videos = engine.registry.videos
    stream_keys = [videos.group_durable_key(window.video, g, "") for g in range(window.video.num_groups)]
    assert not any(disk_has(engine, k) for k in stream_keys)
    engine.close()
    restarted = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path)
    assert restarted.video_info(video_id).groups == uploaded
    with pytest.raises(UnknownVideoError):
        restarted.stream_info(stream_id)
    restarted.close()


def test_restore_stays_inside_the_video_store_budget(tiny_dirs, tmp_path, caplog):
    """A restart restores uploads while the video store has room, counting each at its frames'
    bytes; one over budget stays on disk with a warning, and asking for it is a full store (507),
    not an unknown video."""
    first = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path)
    ids = [first.add_video(clip(seed=s), **small(first)) for s in (0, 1)]
    one = first.registry.videos.videos[("", ids[0])].nbytes
    assert first.registry.videos.videos[("", ids[1])].nbytes == one
    first.close()

    with caplog.at_level(logging.WARNING, logger="mmkv.engine"):
        second = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], store_dir=tmp_path, video_store_bytes=one)
    restored = [v for v in ids if ("", v) in second.registry.videos.videos]
    assert len(restored) == 1 and second.registry.videos.store_bytes == one
    left = next(v for v in ids if v not in restored)
    assert f"stored upload {left} not restored" in caplog.text
    with pytest.raises(VideoStoreFullError):
        second.video_info(left)
    assert len(second.tiers.registry.local("video")) == 2  # still on disk
    second.remove_video(restored[0])
    assert second.video_info(left).groups > 0  # room again: adopted on lookup
    second.check_integrity()
    second.close()


def test_group_refs_of_a_restored_video_load_the_same_kv(tiny_dirs, tmp_path):
    """A restored group's entry equals the precompiled one bit for bit (keys, values, features,
    positions, tokens, pad index), on Qwen3-VL whose pads follow the timestamp text."""
    first = Engine.from_pretrained(tiny_dirs["qwen3_vl"], store_dir=tmp_path)
    video_id = first.add_video(clip(), **small(first))
    reg = first.registry.videos.videos[("", video_id)]
    made = [first.registry.videos.group_chunk(VideoGroupRef(reg, g), "") for g in range(reg.video.num_groups)]
    first.close()
    second = Engine.from_pretrained(tiny_dirs["qwen3_vl"], store_dir=tmp_path)
    reg2 = second.registry.videos.lookup(video_id, "")
    assert torch.equal(reg2.video.frames, reg.video.frames) and reg2.video.timestamps == reg.video.timestamps
    for g, want in enumerate(made):
        got = second.registry.videos.group_chunk(VideoGroupRef(reg2, g), "")
        assert got.pad_offset == want.pad_offset > 1
        assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.position_ids, want.position_ids)
        assert all(torch.equal(x, y) for x, y in zip(got.keys + got.values, want.keys + want.values))
        assert torch.equal(got.features.embeds, want.features.embeds)
    assert second.stats()["vision_tower_runs"] == 0
    second.close()


def test_over_http_another_server_and_a_restart_answer_about_an_uploaded_video(tiny_dirs, tmp_path, redis_server):
    """POST /v1/files on server A; server B on the same shared store answers a `video_file` part
    about it with 0 vision-tower runs and the pads as cached tokens; A restarted answers from its
    disk the same way; a delete on A is a 404 on B."""
    url, model = redis_server.url(), tiny_dirs["qwen2_5_vl"]
    settings = ServerSettings(api_keys=("sk-1",), served_model_names=("m",))

    def serve(store: str) -> tuple[Engine, LiveServer]:
        engine = Engine.from_pretrained(model, store_dir=tmp_path / store, redis_url=url)
        return engine, LiveServer(create_app(engine, settings))

    def chat(server: LiveServer, file_id: str):
        return server.client("sk-1").chat.completions.create(model="m", max_tokens=3, temperature=0, messages=[
            {"role": "user", "content": [{"type": "video_file", "video_file": {"file_id": file_id}},
                                         {"type": "text", "text": QUESTION}]}])

    engine_a, a = serve("a")
    engine_b, b = serve("b")
    try:
        up = a.client("sk-1").files.create(file=("clip.mp4", clip()), purpose="vision")
        first = chat(a, up.id)
        engine_a.tiers.flush()
        a.close()
        engine_a.close()
        replies = [chat(b, up.id)]
        engine_a, a = serve("a")  # restarted on its own disk
        replies.append(chat(a, up.id))
        for reply in replies:
            report = reply.model_extra["mmkv"]
            assert report["vision_tower_runs"] == 0 and report["video_tokens_reused"] > 0
            assert reply.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens_details.cached_tokens
            assert reply.choices[0].message.content == first.choices[0].message.content
        a.client("sk-1").files.delete(up.id)
        with pytest.raises(Exception) as err:
            chat(b, up.id)
        assert getattr(err.value, "status_code", None) == 404
    finally:
        a.close()
        b.close()
        engine_a.close()
        engine_b.close()
