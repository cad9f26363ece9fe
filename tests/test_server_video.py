"""Videos over HTTP with the official openai client: upload once (`/v1/files`), ask about it in
two conversations (the second runs the vision tower 0 times), inline `video_url` data: URLs, and a
bad-video suite: every case a 4xx naming its part, never a 5xx, and the same keep-alive connection
answers a valid request right after."""

from __future__ import annotations

import base64
import http.client
import json
from urllib.parse import urlparse

import mmkv
import pytest
from mmkv.server.app import ServerSettings, create_app
from mmkv.testing.clips import encode_audio_only, encode_clip
from test_server import LiveServer, tiny_dir  # noqa: F401 - fixture
from test_video_decode import BAD

CLIP = encode_clip(8, 4, 64, 48)


def _url(data: bytes, mime="video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def live(tiny_dir):
    server = LiveServer(create_app(mmkv.Engine.from_pretrained(tiny_dir), ServerSettings(served_model_names=("tiny",))))
    yield server
    server.close()


def _ask(client, parts, **kw):
    return client.chat.completions.create(model="tiny", max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": parts + [{"type": "text", "text": "what moved ?"}]}], **kw)


def test_upload_then_ask_twice_with_the_openai_client(live):
    client = live.client()
    uploaded = client.files.create(file=("clip.mp4", CLIP), purpose="vision")
    assert uploaded.id.startswith("vid-") and uploaded.width == 64
    part = {"type": "video_file", "video_file": {"file_id": uploaded.id}}
    first = _ask(client, [part])
    other = client.chat.completions.create(model="tiny", max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": "you watch clips ."},
        {"role": "user", "content": [{"type": "text", "text": "in another chat"}, part,
                                     {"type": "text", "text": "which colour ?"}]}])
    for r in (first, other):
        report = r.model_extra["mmkv"]
        assert report["vision_tower_runs"] == 0 and report["video_tokens_reused"] > 0
        assert r.usage.prompt_tokens_details.cached_tokens >= report["video_tokens_reused"]
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    client.files.delete(uploaded.id)
    with pytest.raises(Exception) as err:
        _ask(client, [part])
    assert getattr(err.value, "status_code", None) == 404


def test_inline_video_url_with_sampling_through_extra_body(live):
    """A part type the openai client has no class for goes through as a plain dict; `mmkv` options
    through extra_body."""
    client = live.client()
    part = {"type": "video_url", "video_url": {"url": _url(CLIP)}, "nframes": 2}
    r = _ask(client, [part], extra_body={"mmkv": {"seam_tokens": 1}})
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens > 0


def _post(conn, path, body: bytes, headers: dict) -> tuple[int, dict]:
    conn.request("POST", path, body=body, headers=headers)
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def _chat(parts) -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": 1, "temperature": 0,
                       "messages": [{"role": "user", "content": parts + [{"type": "text", "text": "hi"}]}]}).encode()


def _multipart(data: bytes, name="clip.mp4") -> tuple[bytes, str]:
    b = "mmkvboundary"
    body = (f"--{b}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nvision\r\n--{b}\r\n"
            f"Content-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n"
            f"Content-Type: video/mp4\r\n\r\n").encode() + data + f"\r\n--{b}--\r\n".encode()
    return body, f"multipart/form-data; boundary={b}"


SUITE = {**{f"inline {k}": ("chat", v[0]) for k, v in BAD.items() if v[0]},
         **{f"upload {k}": ("upload", v[0]) for k, v in BAD.items() if v[0] and k != "png image"},
         "huge duration": ("chat", encode_clip(8, 4, 64, 48)),  # the server below caps duration at 1 s
         "http url": ("url", b""), "audio only upload": ("upload", encode_audio_only())}


@pytest.fixture(scope="module")
def strict(tiny_dir):
    from mmkv.video import VideoLimits
    engine = mmkv.Engine.from_pretrained(tiny_dir, video_limits=VideoLimits(max_duration_s=1.0))
    server = LiveServer(create_app(engine, ServerSettings(served_model_names=("tiny",))))
    yield server
    server.close()


def test_bad_video_suite_never_5xx_and_the_connection_keeps_serving(strict):
    conn = http.client.HTTPConnection(urlparse(strict.base_url).netloc, timeout=60)
    json_h = {"Content-Type": "application/json"}
    for name, (how, data) in SUITE.items():
        if how == "upload":
            body, ctype = _multipart(data)
            status, err = _post(conn, "/v1/files", body, {"Content-Type": ctype})
        else:
            url = "https://example.com/clip.mp4" if how == "url" else _url(data)
            status, err = _post(conn, "/v1/chat/completions", _chat([{"type": "video_url", "video_url": {"url": url}}]),
                                json_h)
        assert 400 <= status < 500, (name, status, err)
        assert err["error"]["param"], (name, err)
        status, ok = _post(conn, "/v1/chat/completions", _chat([]), json_h)
        assert status == 200, (name, ok)
