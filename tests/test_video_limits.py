"""Per-request video limits, beside the per-video ones: at most `max_videos_per_request` video
parts (the server's, counted before any is decoded) and at most `max_video_tokens_per_request`
video tokens over every video a request references (the engine's, checked once they are known and
before any group is computed). Each refusal is a 400 naming the part that crosses the limit and
leaves nothing behind: no video registered, no vision tower run, no KV stored. Through the Python
API and over HTTP."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import mmkv.server.app as server_app
import mmkv.server.serve as server_serve
from mmkv import Engine
from mmkv.cli import app as cli
from mmkv.errors import VideoTooLargeError
from mmkv.server.app import ServerSettings, create_app
from mmkv.testing.clips import encode_clip

CLIPS = [encode_clip(8, 4, 64, 48, seed=s) for s in range(3)]  # the same shape: the same tokens each
CORRUPT = "data:video/mp4;base64," + base64.b64encode(b"\x00\x00\x00\x18ftypmp42 not a video").decode()


def _url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def clip_tokens(tiny_dirs) -> int:
    probe = Engine.from_pretrained(tiny_dirs["qwen2_5_vl"])
    return probe.video_info(probe.add_video(CLIPS[0])).video_tokens


@pytest.fixture(scope="module")
def engine(tiny_dirs, clip_tokens):
    """Room for exactly two of the clips in one request."""
    return Engine.from_pretrained(tiny_dirs["qwen2_5_vl"], max_video_tokens_per_request=2 * clip_tokens)


def _state(engine) -> tuple:
    stats = engine.stats()
    engine.check_integrity()
    return (sorted(engine.registry.videos.videos), stats["video_cache_entries"], engine.registry.vision_tower_runs,
            engine.registry.videos.store_bytes)


def _ask(parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts,
                                         {"type": "text", "text": "what moved ?"}]}]


def _file(video_id: str) -> dict:
    return {"type": "video_file", "video_file": {"file_id": video_id}}


def test_python_api_refuses_the_part_past_the_total_and_leaves_nothing(engine):
    """An upload and two inline clips hold three clips' tokens: the second inline one (content[3])
    crosses the limit of two; nothing it or the others would have registered or computed remains."""
    uploaded = engine.add_video(CLIPS[0])
    before = _state(engine)
    with pytest.raises(VideoTooLargeError) as err:
        engine.generate(_ask([_file(uploaded), {"type": "video", "video": CLIPS[1]},
                              {"type": "video", "video": CLIPS[2]}]), max_new_tokens=2)
    assert err.value.param == "messages[0].content[3]" and "max_video_tokens_per_request" in err.value.message
    assert _state(engine) == before


def test_python_api_accepts_exactly_the_limit_and_counts_a_repeat_twice(engine):
    """Two clips fill the limit exactly and are answered; the same upload three times holds three
    clips' tokens in the prompt and is refused at its third place."""
    uploaded = engine.add_video(CLIPS[0])
    ok = engine.generate(_ask([_file(uploaded), {"type": "video", "video": CLIPS[1]}]), max_new_tokens=2)
    assert ok.video_tokens_reused > 0
    before = _state(engine)
    with pytest.raises(VideoTooLargeError) as err:
        engine.splice_plan(_ask([_file(uploaded)] * 3))
    assert err.value.param == "messages[0].content[3]"
    assert _state(engine) == before


def test_a_streams_window_counts_as_it_is_now(engine, clip_tokens):
    """A live stream's window counts its tokens at the time of the request: within the limit it is
    answered; grown past it, the same question is refused naming the stream's part."""
    side = 448
    stream = engine.create_stream(fps=2.0, window_groups=64)
    frame = np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8)
    engine.append_frames(stream, [(frame, 0.0), (frame, 0.5)])
    per_group = engine.video_info(stream).video_tokens
    assert per_group <= 2 * clip_tokens
    engine.generate(_ask([_file(stream)]), max_new_tokens=1)
    groups = 2 * clip_tokens // per_group + 1
    engine.append_frames(stream, [(frame, 0.5 * k) for k in range(2, 2 * groups)])
    assert engine.video_info(stream).video_tokens > 2 * clip_tokens
    before = _state(engine)
    with pytest.raises(VideoTooLargeError) as err:
        engine.generate(_ask([_file(stream)]), max_new_tokens=1)
    assert err.value.param == "messages[0].content[1]"
    assert _state(engine) == before
    engine.remove_video(stream)


def _chat(client, parts):
    return client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "temperature": 0,
                                                      "messages": _ask(parts)})


def test_http_video_count_is_checked_before_anything_is_decoded(engine):
    """Three video parts over a limit of two: a 400 naming the third, though the first is corrupt
    (decoding it would have been a 400 invalid_video naming content[1], as with two parts)."""
    settings = ServerSettings(served_model_names=("tiny",), max_videos_per_request=2)
    corrupt = {"type": "video_url", "video_url": {"url": CORRUPT}}
    with TestClient(create_app(engine, settings)) as client:
        before = _state(engine)
        over = _chat(client, [corrupt] * 3)
        assert over.status_code == 400, over.text
        error = over.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_request", "messages[0].content[3]")
        assert "at most 2 videos per request" in error["message"]
        two = _chat(client, [corrupt] * 2)
        assert (two.status_code, two.json()["error"]["code"], two.json()["error"]["param"]) == \
            (400, "invalid_video", "messages[0].content[1]")
        assert _state(engine) == before
        fine = _chat(client, [{"type": "video_url", "video_url": {"url": _url(CLIPS[0])}}] * 2)
        assert fine.status_code == 200, fine.text


def test_http_video_tokens_past_the_total_are_a_400_naming_the_part(engine):
    """An upload and two inline clips over HTTP: 400 video_too_large naming the part that crosses,
    nothing registered or computed, and the same upload with one inline clip answered after."""
    with TestClient(create_app(engine, ServerSettings(served_model_names=("tiny",)))) as client:
        upload = client.post("/v1/files", files={"file": ("a.mp4", CLIPS[0], "video/mp4")},
                             data={"purpose": "vision"})
        assert upload.status_code == 200, upload.text
        uploaded = _file(upload.json()["id"])
        inline = [{"type": "video_url", "video_url": {"url": _url(c)}} for c in CLIPS[1:]]
        before = _state(engine)
        over = _chat(client, [uploaded, *inline])
        assert over.status_code == 400, over.text
        error = over.json()["error"]
        assert (error["code"], error["param"]) == ("video_too_large", "messages[0].content[3]")
        assert "max_video_tokens_per_request" in error["message"]
        assert _state(engine) == before
        assert _chat(client, [uploaded, inline[0]]).status_code == 200


def test_mmkv_serve_flags_reach_the_settings(monkeypatch):
    """--max-videos-per-request reaches the server's settings, --max-video-tokens-per-request the
    engine's; a negative value is refused before the server starts."""
    captured, real_create_app = [], server_app.create_app
    monkeypatch.setattr(server_app, "create_app",
                        lambda engine, settings: captured.append((engine, settings))
                        or real_create_app(engine, settings))
    monkeypatch.setattr(server_serve, "serve", lambda *args, **kwargs: None)
    result = CliRunner().invoke(cli, ["serve", "--store-dir", "none", "--max-videos-per-request", "3",
                                      "--max-video-tokens-per-request", "999"])
    assert result.exit_code == 0, result.output
    engine, settings = captured[0]
    assert (settings.max_videos_per_request, engine.settings.max_video_tokens_per_request) == (3, 999)
    for flag in ("--max-videos-per-request", "--max-video-tokens-per-request"):
        refused = CliRunner().invoke(cli, ["serve", "--store-dir", "none", flag, "-1"])
        assert refused.exit_code == 2 and "_per_request must be >= 0" in refused.output, refused.output
