"""`mmkv eval --task episodes`: the full arm answers as transformers' own generate does, and the
table follows from the per-request records."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmkv.engine import Engine
from mmkv.vqa_eval import episodes as E
from mmkv.vqa_eval.episodes_eval import run_episodes, to_request

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "samples" / "models" / "qwen2_5_vl-tiny"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    engine = Engine.from_pretrained(MODEL)
    return run_episodes(engine=engine, limit=1, out=tmp_path_factory.mktemp("ep"), progress=False), engine


def test_full_arm_answers_like_transformers_generate(report):
    rep, engine = report
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(MODEL, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(MODEL, local_files_only=True).eval()
    eps = {ep.id: ep for ep in E.load_split(ROOT / "samples" / "vqa" / "episodes")}
    checked = 0
    for row in rep["requests"]:
        ep = eps[row["id"]]
        if ep.type in E.TEXT_TYPES:
            continue  # (the engine request splits the system turn into a skill: its own tokenization)
        assert row["arms"]["full"]["answer"] == E.ask(model, processor, ep)  # the task's own answer budget
        checked += 1
    assert checked == 3


def test_table_follows_from_records(report):
    rep, _ = report
    assert rep["n"] == len(E.SPLIT_TYPES) and set(rep["summary"]) == set(E.SPLIT_TYPES)
    for t, s in rep["summary"].items():
        rows = [r for r in rep["requests"] if r["type"] == t]
        for arm in ("full", "splice"):
            assert s[arm]["accuracy"]["k"] == sum(r["arms"][arm]["answer"] == r["label"] for r in rows)
        assert s["splice"]["agreement"]["k"] == sum(r["arms"]["splice"]["answer"] == r["arms"]["full"]["answer"]
                                                    for r in rows)
        assert s["full"]["agreement"]["k"] == len(rows)  # the reference agrees with itself
    # the splice arm reused the uploaded images and skills: only KV that existed before the request
    assert all(r["arms"]["splice"]["cached_tokens"] > 0 for r in rep["requests"])
    assert all(r["arms"]["full"]["cached_tokens"] == 0 for r in rep["requests"])


def test_request_keeps_the_rendered_text(report):
    """Moving the system body into a skill and the images to ids changes no character of the prompt."""
    _, engine = report
    ep = E.build(__import__("random").Random(5), "erratum_gate")
    msgs = to_request(engine, ep, "t")
    system = msgs[0]["content"]
    assert system[1]["type"] == "skill" and system[0]["text"] + ep.messages[0]["content"][0]["text"].split("\n", 1)[1] \
        == ep.messages[0]["content"][0]["text"]
