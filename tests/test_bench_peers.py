"""`mmkv bench-peers`: the checkpoint both servers serve and its GGUF conversion, the conversations
rendered for each server, the client and the report's figures.

The checkpoint is the small one `mmkv.bench.peer_build` writes (`size="tiny"`): Qwen's real tokenizer,
the released layout, 152k-row embeddings of width 64. The bundled tiny models cannot stand in: their
tokenizer is not one llama.cpp's converter recognises. The conversion and server tests need the peer
(`mmkv bench-peers --build-peer`, under MMKV_PEER_DIR or ~/.cache/mmkv/peer) and skip without it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mmkv.bench import peers
from mmkv.bench.peer_build import PeerError, find_peer, save_checkpoint
from mmkv.bench.peers import MMKV, PEER, Sizes, TurnResult


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("peer-hub"), "qwen2_5_vl", "tiny")


@pytest.fixture(scope="module")
def engine(snapshot):
    from mmkv.engine import Engine

    return Engine.from_pretrained(snapshot, dtype="float32", device="cpu")


def _peer():
    try:
        return find_peer()
    except PeerError as exc:
        pytest.skip(f"llama.cpp peer not built: {exc}")


@pytest.fixture(scope="module")
def converted(snapshot, tmp_path_factory):
    """The checkpoint through the peer's converter, once for the module (two converter runs,
    each importing torch: about 20 s)."""
    from mmkv.bench.peer_build import convert

    peer = _peer()
    return peer, *convert(peer, snapshot, tmp_path_factory.mktemp("gguf"))


# Images of 4 x 4 tokens: llama.cpp brings a Qwen-VL image under 8 tokens up to 8 (Qwen's processor: 4).
SMALL = Sizes(rounds=1, image_px=112, shot_px=112, skill_tokens=64, policy_tokens=32, agent_turns=3)


def test_each_server_gets_the_same_prompt(engine):
    """Every turn of every case, rendered for mmkv (skill parts, state_update parts) and for
    llama.cpp (the skill's text, the erratum's line, adjacent text parts joined), is the same token
    sequence through mmkv's own planner: the two servers are asked the same thing."""
    cases = peers.build_cases(engine.adapter.tokenizer, SMALL)
    skill_ids = {text: engine.add_skill(f"s{i}", text, tenant="t") for i, text in enumerate(peers.skills_in(cases))}
    turns = [turn for case in cases for session in case.sessions for turn in session]
    assert len(cases) == 6 and sum(t.timed for t in turns) == 1 + 1 + 3 + 3 + 1 + 1
    kinds = set()
    for turn in turns:
        mine = engine.splice_plan(peers.for_mmkv(turn.messages, skill_ids), tenant="t")
        theirs = engine.splice_plan(peers.for_peer(turn.messages), tenant="t")
        assert torch.equal(mine.input_ids, theirs.input_ids)
        kinds |= {p["type"] for m in turn.messages if isinstance(m["content"], list) for p in m["content"]}
        kinds |= {p["type"] for m in peers.for_peer(turn.messages) if isinstance(m["content"], list)
                  for p in m["content"]} - {"text", "image_url"}  # llama.cpp's requests hold only these
    assert kinds == {"text", "image_url", "skill", "state_update"}


def test_peer_rendering_joins_text_and_keeps_images():
    """llama.cpp puts a line break between two text parts of a message with an image; the joined
    request has none to add, and images stay where they were."""
    image = peers.image_part(b"png")
    msgs = [{"role": "system", "content": [{"type": "text", "text": "a "}, peers.skill_part("SKILL")]},
            {"role": "user", "content": [{"type": "state_update", "field": "f", "value": "v"},
                                         {"type": "text", "text": "x"}, image, {"type": "text", "text": "y"}]}]
    out = peers.for_peer(msgs)
    assert out[0]["content"] == [{"type": "text", "text": "a SKILL"}]
    assert out[1]["content"][1] is image and out[1]["content"][2] == {"type": "text", "text": "y"}
    assert out[1]["content"][0]["text"].startswith("[STATE UPDATE] f has just changed to v;")
    assert out[1]["content"][0]["text"].endswith("\nx")
    assert peers.for_mmkv(msgs, {"SKILL": "skill-1"})[0]["content"][1] == {"type": "skill", "skill_id": "skill-1"}


def test_report_math():
    """Median, p90 (linear between order statistics), decode tokens/s and the TTFT ratio."""
    def turn(ms: float, tokens: int = 8, decode_s: float = 0.7) -> TurnResult:
        return TurnResult(ms / 1e3, decode_s, tokens, 100, 96, "")

    rows = peers.summarize({"case": {MMKV: [turn(m) for m in (10, 20, 30, 40, 50)],
                                     PEER: [turn(m, decode_s=0.35) for m in (100, 200, 300, 400, 500)]}})
    mine, theirs = rows
    assert mine["ttft_ms_p50"] == pytest.approx(30) and mine["ttft_ms_p90"] == pytest.approx(46)
    assert theirs["ttft_ms_p90"] == pytest.approx(460)
    assert mine["tokens_s"] == pytest.approx(10.0) and theirs["tokens_s"] == pytest.approx(20.0)
    assert mine["peer_over_mmkv"] == pytest.approx(10.0) and mine["cached_tokens"] == 96
    assert TurnResult(0.1, 0.0, 1, 5, None, "").tokens_per_s is None  # one token: no decode rate
    lines = peers.table_lines(rows)
    assert "10.00x" in lines[1] and lines[2].rstrip().endswith("96")


def test_client_against_mmkv(engine):
    """The client's streamed turn through mmkv's HTTP server: the prompt and completion counts the
    server reports, every banned end token kept out (the answer has exactly max_tokens tokens), a
    cached prefix on the repeated turn, and an erratum turn asking mmkv for its policy."""
    from mmkv.bench.concurrency import _server, _stop

    http, thread, url = _server(engine, 1, served_model_names=(peers.MODEL,))
    try:
        server = peers.Server(MMKV, [], {}, None, port=int(url.rsplit(":", 1)[1]))
        turn = peers.Turn([{"role": "user", "content": "hello , who are you ? " * 4}])
        first, again = (peers.stream_chat(server.url, server.body(turn, 5)) for _ in range(2))
        plan = engine.splice_plan(turn.messages)
        assert first.prompt_tokens == again.prompt_tokens == plan.input_ids.numel()
        assert first.completion_tokens == again.completion_tokens == 5 and first.ttft_s > 0
        assert first.cached_tokens == 0 and again.cached_tokens > 0
        body = server.body(peers.Turn(turn.messages, edit_policy="erratum"), 5)
        assert body["mmkv"] == {"edit_policy": "erratum"} and body["logit_bias"] == {"151645": -100, "151643": -100}
        assert "mmkv" not in peers.Server(PEER, [], {}, None).body(peers.Turn(turn.messages, edit_policy="erratum"), 5)
    finally:
        _stop({"mmkv": (http, thread, url)})


def test_conversion_keeps_the_weights(snapshot, converted):
    """llama.cpp's converter on the checkpoint: the text model (qwen2vl, its sizes, the tokenizer's
    tokens, the chat template) and the projector (Qwen2.5-VL, its window pattern), weights equal to
    the checkpoint's in float32."""
    gguf = pytest.importorskip("gguf", reason="the bench extra (pip install 'mmkv[bench]') reads GGUF files")
    from safetensors.torch import load_file

    _, model, mmproj = converted

    def field(reader, key):
        f = reader.fields[key]
        return f.contents() if hasattr(f, "contents") else f.parts[-1]

    text = gguf.GGUFReader(model)
    assert field(text, "general.architecture") == "qwen2vl"
    assert field(text, "qwen2vl.block_count") == 1 and field(text, "qwen2vl.embedding_length") == 64
    assert field(text, "qwen2vl.rope.dimension_sections")[:3] == [4, 6, 6]
    assert "<|im_start|>" in field(text, "tokenizer.chat_template")
    tokens = text.fields["tokenizer.ggml.tokens"]  # read two entries, not 152k strings

    def token(i: int) -> str:
        return bytes(tokens.parts[tokens.data[i]]).decode()
    assert len(tokens.data) == 152064 and token(151644) == "<|im_start|>" and token(151655) == "<|image_pad|>"
    weights = {}
    for shard in snapshot.glob("*.safetensors"):
        weights.update(load_file(shard))
    embd = next(t for t in text.tensors if t.name == "token_embd.weight")
    embd = torch.from_numpy(embd.data.copy()).reshape(152064, 64)
    assert torch.equal(embd, weights["model.embed_tokens.weight"].float())
    proj = gguf.GGUFReader(mmproj)
    assert field(proj, "clip.projector_type") == "qwen2.5vl_merger" and field(proj, "clip.vision.n_wa_pattern") == 2
    assert field(proj, "clip.vision.block_count") == 4


def test_both_servers_agree(converted, engine, tmp_path):
    """llama-server on the converted checkpoint beside mmkv on the original: the same prompt token
    count for text, images and a skill, and the same greedy tokens with log-probabilities within
    1e-2 (float32 both)."""
    from mmkv.bench.concurrency import _server, _stop

    peer, model, mmproj = converted
    http, thread, url = _server(engine, 1, served_model_names=(peers.MODEL,))
    llama = peers.peer_server(peer, model, mmproj, 1, 4096, tmp_path)
    try:
        llama.start(timeout=120)
        mine = peers.Server(MMKV, [], {}, None, port=int(url.rsplit(":", 1)[1]))
        checks = peers.probes(engine.adapter.tokenizer, peers.Pictures(), SMALL)
        for s in (mine, llama):
            s.add_skills(peers.skills_in([peers.Case("probes", [[t for _, t in checks]])]))
        rows = peers.agreement([mine, llama], checks)
    finally:
        llama.stop()
        _stop({"mmkv": (http, thread, url)})
    report = json.dumps(rows)
    for row in rows:
        c = peers.compare(row)
        assert c["same_prompt"] and c["same_answer"] and c["compared_tokens"] >= 2, report
        assert c["max_dlogprob"] < 1e-2, report  # float32 both; the kernels sum in other orders


def test_compare_skips_merged_entries():
    """llama.cpp reports a token ending inside a UTF-8 character with the next one as one entry:
    the same answer bytes, only the tokens reported alike compared; a parting answer gives mmkv's
    top-2 gap where it parts."""
    mine = {"prompt_tokens": 9, "bytes": [[227, 152], [230, 166, 130], [115]], "logprobs": [-1.0, -2.0, -3.0],
            "runner_up": [-1.5, -2.1, -3.5]}
    theirs = {"prompt_tokens": 9, "bytes": [[227, 152, 230, 166, 130], [115]], "logprobs": [-2.01, -3.02],
              "runner_up": [None, None]}
    c = peers.compare({MMKV: mine, PEER: theirs})
    assert c["same_answer"] and c["compared_tokens"] == 1 and c["max_dlogprob"] == pytest.approx(0.02)
    parted = peers.compare({MMKV: mine, PEER: {**theirs, "bytes": [[227, 152, 230, 166, 130], [116]]}})
    assert not parted["same_answer"] and parted["common_bytes"] == 5 and parted["gap_at_split"] == pytest.approx(0.5)


def test_threads_are_the_same_for_both(snapshot, tmp_path):
    """Both servers get the thread count: OMP / MKL threads for mmkv, -t / -tb for llama-server."""
    mine = peers.mmkv_server(snapshot, 3, tmp_path)
    assert mine.env["OMP_NUM_THREADS"] == mine.env["MKL_NUM_THREADS"] == "3"
    fake = peers.Peer(tmp_path, tmp_path, tmp_path / "llama-server", {})
    theirs = peers.peer_server(fake, tmp_path / "m.gguf", tmp_path / "p.gguf", 3, 4096, tmp_path)
    argv = theirs.argv
    assert argv[argv.index("-t") + 1] == argv[argv.index("-tb") + 1] == "3"
    assert mine.env["OMP_WAIT_POLICY"] == theirs.env["OMP_WAIT_POLICY"] == "PASSIVE" and "--poll" in argv
    assert mine.port != theirs.port
    assert mine.argv[mine.argv.index("--port") + 1] == str(mine.port)
    assert argv[argv.index("--port") + 1] == str(theirs.port)


# ---- aiperf against both servers --------------------------------------------------------------------
def test_aiperf_datasets_are_new_per_rate(snapshot, tmp_path):
    """Per rate, two single_turn datasets of the same requests that differ only in their
    screenshots (one of its own per request; 3 repeated), none shown at an earlier rate; the
    tokenizer aiperf reads is the checkpoint's own, offline from its hub cache."""
    tok = _tokenizer(snapshot)
    pictures = []
    for rate in range(2):
        sets = peers.aiperf_datasets(tmp_path, tok, SMALL, 5, rate)
        assert list(sets) == list(peers.AIPERF_DATA)
        lines = {name: [json.loads(x) for x in path.read_text().splitlines()] for name, path in sets.items()}
        unique, repeated = (lines[name] for name in peers.AIPERF_DATA)
        assert [x["text"] for x in unique] == [x["text"] for x in repeated] and len(unique) == 5
        images = {name: [open(x["image"], "rb").read() for x in rows] for name, rows in lines.items()}
        assert len(set(images[peers.AIPERF_DATA[0]])) == 5
        assert images[peers.AIPERF_DATA[1]] == [images[peers.AIPERF_DATA[1]][k % 3] for k in range(5)]
        assert len(set(images[peers.AIPERF_DATA[1]])) == 3
        pictures.append(set(images[peers.AIPERF_DATA[0]]) | set(images[peers.AIPERF_DATA[1]]))
    assert len(pictures[0]) == len(pictures[1]) == 8 and not pictures[0] & pictures[1]
    name, env = peers.aiperf_tokenizer(snapshot)
    assert name == "mmkv-peer/qwen2_5_vl-tiny" and env["HF_HUB_OFFLINE"] == "1"
    probe = "from transformers import AutoTokenizer; import sys; print(AutoTokenizer.from_pretrained(sys.argv[1])" \
            ".encode('what is in this picture ?'))"
    out = subprocess.run([sys.executable, "-c", probe, name], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(tok.encode("what is in this picture ?")), out.stderr[-2000:]


def test_aiperf_runs_both_servers_alike(snapshot, tmp_path, monkeypatch):
    """aiperf's runs: per rate and dataset one for each server, the servers' order alternating; the
    two runs differ only in the server's URL and their output folder (the same dataset, seed, rate,
    completion length and banned end tokens, the checkpoint's tokenizer offline); one table row each."""
    from mmkv.bench import serve

    calls = []

    def fake_profile(cmd, out_dir, env=None):
        calls.append((cmd, out_dir, env))
        return {"ttft_ms": {50: 10.0, 90: 20.0, 99: 30.0}, "req_s": 0.5, "tokens_s": 4.0, "requests": 3, "errors": 0,
                "prompt_tokens": 99.0, "cached_share": 0.25}

    monkeypatch.setattr(serve, "profile", fake_profile)
    servers = [peers.Server(MMKV, [], {}, None), peers.Server(PEER, [], {}, None)]
    lines = []
    rows = peers.aiperf_bench(servers, snapshot, _tokenizer(snapshot), SMALL, (0.25, 0.5), 3, 8, 7, tmp_path,
                              lines.append)
    assert [(r["server"], r["data"], r["rate"]) for r in rows] == [
        (MMKV, peers.AIPERF_DATA[0], 0.25), (PEER, peers.AIPERF_DATA[0], 0.25),
        (PEER, peers.AIPERF_DATA[1], 0.25), (MMKV, peers.AIPERF_DATA[1], 0.25),
        (MMKV, peers.AIPERF_DATA[0], 0.5), (PEER, peers.AIPERF_DATA[0], 0.5),
        (PEER, peers.AIPERF_DATA[1], 0.5), (MMKV, peers.AIPERF_DATA[1], 0.5)]
    by_url = {s.url: s.name for s in servers}

    def arg(cmd, flag):
        return cmd[cmd.index(flag) + 1]
    for (a, a_dir, env), (b, b_dir, _) in zip(calls[::2], calls[1::2]):
        assert {by_url[arg(a, "--url")], by_url[arg(b, "--url")]} == {MMKV, PEER}
        assert a_dir != b_dir and a_dir.parent == b_dir.parent and arg(a, "--output-artifact-dir") == str(a_dir)
        same = [x for x in a if x not in (arg(a, "--url"), str(a_dir))]
        assert same == [x for x in b if x not in (arg(b, "--url"), str(b_dir))]
        assert arg(a, "--input-file") == str(a_dir.parent / "dataset.jsonl")
        assert arg(a, "--arrival-pattern") == "poisson" and arg(a, "--random-seed") == "7"
        assert arg(a, "--model") == peers.MODEL and arg(a, "--tokenizer") == "mmkv-peer/qwen2_5_vl-tiny"
        assert arg(a, "--prompt-output-tokens-mean") == "8" and arg(a, "--request-count") == "3"
        assert json.loads(arg(a, "--extra-inputs"))["logit_bias"] == {"151645": -100, "151643": -100}
        assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HUB_CACHE"] == str(snapshot.parents[2])
    assert [float(arg(c, "--request-rate")) for c, _, _ in calls] == [0.25] * 4 + [0.5] * 4
    assert len(lines) == 1 + 8 and lines[1] == f"| {MMKV} | {peers.AIPERF_DATA[0]} | 0.25 | 3 (0) | 99 | 10 | 20 | 30 | " \
        "0.50 | 4.0 | 25.0% |"


def _tokenizer(snapshot):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(snapshot)


def test_aiperf_rates_are_checked(tmp_path):
    """--aiperf-rates takes positive numbers: anything else is refused, naming the option, before a
    server starts or a checkpoint is written."""
    pytest.importorskip("aiperf", reason="the bench extra (pip install 'mmkv[bench]') holds aiperf")
    from typer.testing import CliRunner

    from mmkv.cli import app

    for bad in ("0,0.5", "fast", ""):
        out = CliRunner().invoke(app, ["bench-peers", "--aiperf", "--aiperf-rates", bad, "--work-dir", str(tmp_path)])
        assert out.exit_code == 2 and "--aiperf-rates" in out.output, out.output
    assert not any(tmp_path.iterdir())


def test_missing_peer_names_a_command_that_builds_it(tmp_path, monkeypatch):
    """build-path finding: with no peer, the error named `mmkv bench-peers --build-peer DIR`, which
    the command refuses (--build-peer is a flag; the folder is --peer-dir). The command it names
    now builds into that folder."""
    import shlex

    from typer.testing import CliRunner

    from mmkv.cli import app

    root = tmp_path / "peer"
    with pytest.raises(PeerError) as err:
        find_peer(root)
    command = shlex.split(str(err.value).split("`")[1])
    assert command[:2] == ["mmkv", "bench-peers"]
    built = []
    monkeypatch.setattr(peers, "build_peer", lambda where, jobs, version: built.append(where) or
                        peers.Peer(where, where, where, {"version": "x"}))
    out = CliRunner().invoke(app, command[1:])
    assert out.exit_code == 0, out.output
    assert built == [root]
