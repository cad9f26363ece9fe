"""Live video streams over HTTP (/v1/video_streams): create, append frames (one or a batch a
request) or a segment, ask with the official openai client (a question after k new groups runs the
vision tower k times), read, delete (then 404); a batch equals its frames appended one by one;
every bad append or create a 4xx naming its field (a batch's bad frame by its index), never a 5xx,
and the stream unchanged."""

from __future__ import annotations

import io

import httpx
import mmkv
import pytest
from mmkv.server.app import ServerSettings, create_app
from mmkv.testing.clips import clip_frames, encode_audio_only, encode_clip
from PIL import Image
from mmkv.server.routes_streams import MAX_FRAMES_PER_POST
from test_server import LiveServer, tiny_dir  # noqa: F401 - fixture

SIDE = 64


@pytest.fixture(scope="module")
def live(tiny_dir):
    engine = mmkv.Engine.from_pretrained(tiny_dir)
    server = LiveServer(create_app(engine, ServerSettings(served_model_names=("tiny",))))
    server.engine = engine
    yield server
    server.close()


def _png(img) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "PNG")
    return buf.getvalue()


FRAMES = [_png(f) for f in clip_frames(32, SIDE, SIDE)]


def _append(http, sid, start: int, count: int, fps: float = 4.0):
    """Camera frames start .. start + count at `fps`, one request each; the last answer."""
    for i in range(start, start + count):
        r = http.post(f"/v1/video_streams/{sid}/frames", files={"frame": (f"{i}.png", FRAMES[i], "image/png")},
                      data={"time": str(i / fps)})
        if r.status_code != 200:
            break
    return r


def _ask(client, sid, question):
    return client.chat.completions.create(model="tiny", max_tokens=1, temperature=0, messages=[
        {"role": "user", "content": [{"type": "video_file", "video_file": {"file_id": sid}},
                                     {"type": "text", "text": question}]}])


def test_stream_lifecycle_with_the_openai_client(live):
    http, client = httpx.Client(base_url=live.base_url, timeout=60), live.client()
    created = http.post("/v1/video_streams", json={"fps": 2, "window_groups": 4, "max_pixels": 56 * 56})
    assert created.status_code == 200, created.text
    sid = created.json()["id"]
    assert created.json()["object"] == "video_stream" and created.json()["groups"] == 0
    r = _append(http, sid, 0, 8)  # 2 s at 4 fps: ticks 0..3, two groups
    assert r.status_code == 200 and r.json()["groups"] == 2, r.text
    first = _ask(client, sid, "what moved ?").model_extra["mmkv"]
    assert first["vision_tower_runs"] == 2
    assert _append(http, sid, 8, 4).json()["groups"] == 3
    again = _ask(client, sid, "and now ?").model_extra["mmkv"]
    assert again["vision_tower_runs"] == 1 and again["video_tokens_reused"] > 0
    assert http.get(f"/v1/video_streams/{sid}").json()["groups_total"] == 3
    assert http.delete(f"/v1/video_streams/{sid}").json() == {"id": sid, "object": "video_stream.deleted",
                                                               "deleted": True}
    with pytest.raises(Exception) as err:
        _ask(client, sid, "still there ?")
    assert getattr(err.value, "status_code", None) == 404
    assert http.get(f"/v1/video_streams/{sid}").status_code == 404


def test_segment_append(live):
    http = httpx.Client(base_url=live.base_url, timeout=60)
    sid = http.post("/v1/video_streams", json={"max_pixels": 56 * 56}).json()["id"]
    seg = encode_clip(8, 4, SIDE, SIDE)
    r = http.post(f"/v1/video_streams/{sid}/segments", files={"file": ("seg.mp4", seg, "video/mp4")},
                  data={"start": "10"})
    # the clock starts at the group holding t = 10 s: ticks 20 .. 23, groups 10 and 11
    assert r.status_code == 200 and r.json()["last_time_s"] == pytest.approx(11.75), r.text
    assert (r.json()["groups"], r.json()["first_group"], r.json()["groups_total"]) == (2, 10, 12)
    http.delete(f"/v1/video_streams/{sid}")


def test_bad_appends_are_4xx_and_change_nothing(live):
    http = httpx.Client(base_url=live.base_url, timeout=60)
    sid = http.post("/v1/video_streams", json={"max_pixels": 56 * 56}).json()["id"]
    assert _append(http, sid, 0, 4).status_code == 200
    state = http.get(f"/v1/video_streams/{sid}").json()
    png = ("f.png", FRAMES[9], "image/png")
    seg = ("s.mp4", encode_clip(4, 4, SIDE, SIDE), "video/mp4")
    other = ("f.png", _png(clip_frames(1, SIDE + 8, SIDE)[0]), "image/png")
    cases = {  # name: (path, files, fields, status, param)
        "nothing": ("frames", {}, {"time": "9"}, 400, "frame"),
        "segment as frame": ("frames", {"file": seg}, {}, 400, "file"),
        "over the batch limit": ("frames", [("frame", png)] * (MAX_FRAMES_PER_POST + 1), {}, 400, "frame"),
        "a bad frame in a batch": ("frames", [("frame", png), ("frame", ("f.png", b"junk", "image/png")),
                                              ("frame", png)], {"time": ["9", "9.5", "10"]}, 400, "frame[1]"),
        "an empty frame in a batch": ("frames", [("frame", png), ("frame", ("f.png", b"", "image/png"))], {}, 400,
                                      "frame[1]"),
        "a frame of another size in a batch": ("frames", [("frame", png), ("frame", other)], {}, 400, "frame[1]"),
        "a bad time in a batch": ("frames", [("frame", png)] * 3, {"time": ["9", "soon", "10"]}, 400, "time[1]"),
        "times out of order in a batch": ("frames", [("frame", png)] * 3, {"time": ["9", "10", "9.5"]}, 400,
                                          "frame[2]"),
        "fewer times than frames": ("frames", [("frame", png)] * 2, {"time": "9"}, 400, "time"),
        "a batch not after the latest": ("frames", [("frame", png)] * 2, {"time": ["0.5", "9"]}, 409, "frame"),
        "two times for one frame": ("frames", {"frame": png}, {"time": ["9", "10"]}, 400, "time"),
        "two segments": ("segments", [("file", seg), ("file", seg)], {}, 400, "file"),
        "time not a number": ("frames", {"frame": png}, {"time": "soon"}, 400, "time"),
        "time negative": ("frames", {"frame": png}, {"time": "-1"}, 400, "time"),
        "start with a frame": ("frames", {"frame": png}, {"start": "9"}, 400, "start"),
        "time with a segment": ("segments", {"file": seg}, {"time": "9"}, 400, "time"),
        "not after the latest": ("frames", {"frame": png}, {"time": "0.5"}, 409, "frame"),
        "segment not after the latest": ("segments", {"file": seg}, {"start": "0.25"}, 409, "file"),
        "not an image": ("frames", {"frame": ("f.png", b"junk", "image/png")}, {}, 400, "frame"),
        "empty frame": ("frames", {"frame": ("f.png", b"", "image/png")}, {}, 400, "frame"),
        "other size": ("frames", {"frame": other}, {}, 409, "frame"),
        "extra field": ("frames", {"frame": png}, {"fps": "3"}, 400, "fps"),
        "corrupt segment": ("segments", {"file": ("s.mp4", b"\x00\x00\x00\x18ftypmp42junk", "video/mp4")}, {}, 400,
                            "file"),
        "audio only segment": ("segments", {"file": ("a.mp4", encode_audio_only(), "video/mp4")}, {}, 400, "file"),
    }
    for name, (path, files, data, status, param) in cases.items():
        r = http.post(f"/v1/video_streams/{sid}/{path}", files=files or None, data=data or None)
        assert r.status_code == status, (name, r.status_code, r.text)
        assert r.json()["error"]["param"] == param, (name, r.json())
        assert http.get(f"/v1/video_streams/{sid}").json() == state, name
    assert _append(http, "vstream-nope", 0, 1).status_code == 404
    for body, param in (({"fps": 0}, "fps"), ({"window_groups": 1000}, "window_groups"), ({"seconds": 1}, "seconds")):
        r = http.post("/v1/video_streams", json=body)
        assert r.status_code == 400 and param in r.json()["error"]["param"], r.json()
    empty = http.post("/v1/video_streams", json={}).json()["id"]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "video_file", "video_file": {"file_id": empty}}]}]})
    assert r.status_code == 400 and "no complete temporal group" in r.json()["error"]["message"]
    for s in (sid, empty):
        assert http.delete(f"/v1/video_streams/{s}").status_code == 200


def test_frames_whose_window_would_be_over_the_token_limit_conflict_with_the_stream(live):
    """A stream made with 384 groups a window takes 224x224 frames (64 tokens a group: 24,576 a
    window, over the 16,384 of the video limit): a 409 stream_conflict naming the frame, and the
    stream is as before. The frame itself is valid: a stream with a window of 64 groups takes it."""
    http = httpx.Client(base_url=live.base_url, timeout=60)
    sid = http.post("/v1/video_streams", json={"window_groups": 384, "max_pixels": 224 * 224}).json()["id"]
    state = http.get(f"/v1/video_streams/{sid}").json()
    big = ("f.png", _png(clip_frames(1, 224, 224)[0]), "image/png")
    r = http.post(f"/v1/video_streams/{sid}/frames", files={"frame": big})
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("stream_conflict", "frame") and "fewer window_groups" in err["message"]
    assert http.get(f"/v1/video_streams/{sid}").json() == state
    fewer = http.post("/v1/video_streams", json={"window_groups": 64, "max_pixels": 224 * 224}).json()["id"]
    taken = http.post(f"/v1/video_streams/{fewer}/frames", files={"frame": big})
    assert taken.status_code == 200, taken.text
    for s in (sid, fewer):
        assert http.delete(f"/v1/video_streams/{s}").status_code == 200


def _video(live, sid: str):
    return live.engine.registry.videos.lookup(sid, "").video


def _same_stream(http, a: str, b: str) -> dict:
    """The two streams' objects, equal but for their ids."""
    one, two = (http.get(f"/v1/video_streams/{s}").json() for s in (a, b))
    assert {**one, "id": ""} == {**two, "id": ""}
    return one


def test_a_batch_equals_its_frames_one_by_one(live):
    """A batch of frames with their times (here MAX_FRAMES_PER_POST, the most one request takes)
    and without (one tick apart after the latest) leaves the stream exactly as the same frames
    appended one request each: the same groups, the same hashes and times, the same greedy answer."""
    http, client = httpx.Client(base_url=live.base_url, timeout=60), live.client()
    create = {"fps": 2, "window_groups": 16, "max_pixels": 56 * 56}
    single, batch = (http.post("/v1/video_streams", json=create).json()["id"] for _ in range(2))
    assert _append(http, single, 0, MAX_FRAMES_PER_POST).status_code == 200
    r = http.post(f"/v1/video_streams/{batch}/frames",
                  files=[("frame", (f"{i}.png", FRAMES[i], "image/png")) for i in range(MAX_FRAMES_PER_POST)],
                  data={"time": [str(i / 4.0) for i in range(MAX_FRAMES_PER_POST)]})
    assert r.status_code == 200, r.text
    assert _same_stream(http, single, batch)["groups"] == MAX_FRAMES_PER_POST // 4
    for untimed in range(3):  # then three frames without times: one tick apart after the latest
        ok = http.post(f"/v1/video_streams/{single}/frames", files={"frame": ("f.png", FRAMES[untimed], "image/png")})
        assert ok.status_code == 200, ok.text
    ok = http.post(f"/v1/video_streams/{batch}/frames",
                   files=[("frame", ("f.png", FRAMES[i], "image/png")) for i in range(3)])
    assert ok.status_code == 200, ok.text
    assert _same_stream(http, single, batch)["pending_frames"] == 1
    one, two = _video(live, single), _video(live, batch)
    assert one.group_hashes == two.group_hashes and one.timestamps == two.timestamps
    answers = [client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": [{"type": "video_file", "video_file": {"file_id": sid}},
                                     {"type": "text", "text": "what moved ?"}]}]) for sid in (single, batch)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage.completion_tokens == answers[1].usage.completion_tokens
    for sid in (single, batch):
        http.delete(f"/v1/video_streams/{sid}")
