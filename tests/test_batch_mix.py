"""The decode batch under real traffic: rows about images, with shared prefixes, sampled with
seeds, biased, with logprobs and stops, joining and leaving mid-decode, answer exactly as each
request does alone, and the batch's buffers are neither copied per step nor over budget.

Oracles: each row's logits at every step against the same request decoded alone (`adapter.forward`
on its own cache, fed the same tokens; float32, `TOL`), and `Engine.generate` of the same request
(token ids, text and finish reason identical; logprobs within `LOGPROB_TOL`)."""

from __future__ import annotations

import time

import pytest
import torch

from mmkv import Engine
from mmkv.request.batch import DecodeBatch, spare_slots
from mmkv.request.scheduler import Scheduler

from conftest import make_png

TOL = 1e-4
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def engine(request, tiny_dirs):
    return Engine.from_pretrained(tiny_dirs[request.param], dtype=torch.float32, device="cpu")


def _prompts(engine) -> dict[str, list[dict]]:
    """Short text, two questions about one image after one system prompt (a shared prefix), a
    second image, and a long text (longer than every other row: it widens the batch's window)."""
    first = {"type": "image_file", "image_file": {"file_id": engine.add_image(make_png(84, 56, seed=3))}}
    second = {"type": "image_file", "image_file": {"file_id": engine.add_image(make_png(56, 84, seed=5))}}
    system = {"role": "system", "content": "look closely and answer briefly ."}
    return {
        "short": [{"role": "user", "content": "hi ?"}],
        "image": [system, {"role": "user", "content": [first, {"type": "text", "text": "what shape is it ?"}]}],
        "same_prefix": [system, {"role": "user", "content": [first, {"type": "text", "text": "what color ?"}]}],
        "other_image": [{"role": "user", "content": [{"type": "text", "text": "and this one"}, second]}],
        "long": [{"role": "user", "content": "a long question about many things . " * 12}],
    }


class _Alone:
    """One request decoded alone, fed the tokens its batch row is fed: the per-step oracle."""

    def __init__(self, engine, messages):
        self.engine, self.run = engine, engine.start(messages, max_new_tokens=64)
        self.run.prefill()
        self.logits = self.run.first_logits
        self.position = self.run.stream.first_position

    def feed(self, token: int) -> torch.Tensor:
        position = torch.full((3, 1), self.position, dtype=torch.long)
        self.logits = self.engine.adapter.forward(torch.tensor([token]), position, self.run.cache)[0]
        self.position += 1
        return self.logits


class _Row:
    def __init__(self, engine, name: str, messages):
        self.name, self.alone = name, _Alone(engine, messages)
        run = engine.start(messages, max_new_tokens=64)
        run.prefill()
        self.cache, self.token = run.cache, int(torch.argmax(run.first_logits))
        self.position = run.stream.first_position


def _step(batch: DecodeBatch, rows: list[_Row]) -> None:
    """One batched step; every row's logits against its single decoding; greedy next tokens."""
    logits = batch.step([r.token for r in rows], [r.position for r in rows])
    for i, r in enumerate(rows):
        want = r.alone.feed(r.token)
        assert (logits[i] - want).abs().max().item() <= TOL, f"{r.name}: batched row differs from single decoding"
        r.token, r.position = int(torch.argmax(logits[i])), r.position + 1


def test_rows_joining_and_leaving_mid_decode_equal_single_decoding(engine):
    """Rows of every kind join mid-decode (a longer one widens the window to the left, a fifth
    grows the rows), leave from the middle (the last row moves into the hole), and decode past the
    spare slots (the window grows): at every step each row's logits equal its single decoding."""
    prompts = _prompts(engine)
    batch, rows = DecodeBatch(engine.adapter, max_rows=8), []

    def join(name):
        rows.append(_Row(engine, name, prompts[name]))
        batch.add(rows[-1].cache)

    def leave(*names):
        order = batch.remove({i for i, r in enumerate(rows) if r.name in names})
        rows[:] = [rows[i] for i in order]

    join("image")
    _step(batch, rows)
    join("short")
    join("same_prefix")
    _step(batch, rows)
    join("long")  # longer than the window: it widens
    assert batch.pad[-1] == 0 and min(batch.pad[:-1]) > 0
    _step(batch, rows)
    join("other_image")  # a fifth row: the row capacity doubles to 8
    assert batch.row_capacity == 8
    _step(batch, rows)
    leave("image", "short")  # holes at 0 and 1: the last rows move in
    assert [r.name for r in rows] == ["long", "other_image", "same_prefix"]
    for _ in range(spare_slots(batch.length) + 2):  # past the spare slots: the window grows
        _step(batch, rows)
    leave("long")  # the longest row goes: its padding goes with it
    assert min(batch.pad) == 0
    _step(batch, rows)
    leave("other_image")  # one row in eight: the rows shrink
    assert batch.row_capacity <= 2
    _step(batch, rows)
    leave("same_prefix")
    assert len(batch) == 0 and batch.nbytes == 0


def test_a_step_a_join_and_a_leave_copy_no_other_row(engine):
    """The batch keeps its buffers across a step, a join of a row no longer than the window, and a
    leave: no per-step copy of the whole cache, no re-layout of every row on a join or a leave;
    when the longest row leaves, the buffers stay inside their stated budget (rows at most 4x the
    live ones, slots at most twice the window with its spare slots)."""
    prompts = _prompts(engine)
    batch, rows = DecodeBatch(engine.adapter, max_rows=8), []
    for name in ("long", "image", "short", "same_prefix"):
        rows.append(_Row(engine, name, prompts[name]))
    for row in rows[:3]:
        batch.add(row.cache)
    storage = batch.layers[0].key_buffer.data_ptr()
    _step(batch, rows[:3])
    order = batch.remove({1})
    assert order == [0, 2]  # the last row moved into the hole
    rows = [rows[i] for i in order] + [rows[3]]
    batch.add(rows[-1].cache)
    _step(batch, rows)
    assert batch.layers[0].key_buffer.data_ptr() == storage, "the buffers were re-laid out"
    order = batch.remove({0})  # the longest row leaves: the window narrows
    rows = [rows[i] for i in order]
    _step(batch, rows)
    assert batch.row_capacity <= 4 * len(batch)
    assert batch.slot_capacity <= 2 * (batch.length + 2 * spare_slots(batch.length))


def _mix(prompts) -> list[tuple[str, dict]]:
    """Every kind of request the batch must keep exact: greedy, seeded sampling (with top_p and
    penalties), logit_bias that bans the end, logprobs, stop strings, images, shared prefixes,
    mixed lengths."""
    return [
        ("image", {"max_new_tokens": 9}),
        ("same_prefix", {"max_new_tokens": 3, "temperature": 1.0, "seed": 11, "logprobs": True, "top_logprobs": 3}),
        ("short", {"max_new_tokens": 14, "temperature": 1.0, "seed": 5, "logit_bias": {"0": -100, "3": 5}}),
        ("other_image", {"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "seed": 2, "presence_penalty": 1.0}),
        ("long", {"max_new_tokens": 12, "stop": ["e"], "logprobs": True}),
        ("image", {"max_new_tokens": 2, "temperature": 1.3, "seed": 9, "frequency_penalty": 0.5}),
        ("same_prefix", {"max_new_tokens": 20, "temperature": 1.0, "seed": 4}),
    ]


def test_the_mix_through_the_scheduler_answers_as_alone(engine):
    """Requests of every kind submitted a few at a time (rows join while others decode and leave
    at different steps) answer exactly as each does alone."""
    prompts = _prompts(engine)
    mix = _mix(prompts)
    banned_end = {str(t): -100 for t in engine.stop_ids}
    mix[2][1]["logit_bias"].update(banned_end)
    alone = [engine.generate(prompts[name], **kw) for name, kw in mix]
    scheduler = Scheduler(engine, max_batch=8).start()
    try:
        futures = []
        for i, (name, kw) in enumerate(mix):
            futures.append(scheduler.submit(prompts[name], **kw))
            if i % 3 == 2:  # the next ones arrive while these decode
                time.sleep(0.05)
        got = [f.result(timeout=120) for f in futures]
    finally:
        scheduler.stop()
    for (name, kw), g, want in zip(mix, got, alone):
        assert (g.token_ids, g.text, g.finish_reason) == (want.token_ids, want.text, want.finish_reason), name
        if kw.get("logprobs"):
            assert len(g.logprobs) == len(want.logprobs)
            for a, b in zip(g.logprobs, want.logprobs):
                assert a.token == b.token and abs(a.logprob - b.logprob) <= LOGPROB_TOL
                assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
    assert len(got[2].token_ids) == 14  # the end banned: it ran to its length
    assert scheduler.decoded_tokens > scheduler.decode_steps  # rows really shared steps


@pytest.mark.parametrize("mode", ["prefill", "shadow"])
def test_bench_mix_outside_the_clients_table_is_refused(mode):
    """`bench-concurrency --mix` changes the clients table; with a mode without it, it is refused
    (exit 2, naming --mix), never ignored."""
    from typer.testing import CliRunner

    from mmkv.cli import app

    result = CliRunner().invoke(app, ["bench-concurrency", "--config", "tiny", "--mode", mode, "--mix"])
    assert result.exit_code == 2 and "--mix changes the clients table" in " ".join(result.output.split()), result.output
