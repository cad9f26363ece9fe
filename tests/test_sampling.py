"""Sampling parameters (OpenAI semantics), logprobs, the tokens that are never sampled, stop strings
and the validation of every value: each test is a property of the processed distribution or an
exact comparison with greedy / an unconstrained run."""

from __future__ import annotations

import math

import pytest
import torch

from mmkv import Engine, InvalidRequestError
from mmkv.request.sampling import Sampler, SamplingParams, draw, nucleus

MSGS = [{"role": "user", "content": "say something about the red square"}]


@pytest.fixture(scope="module")
def engines(tiny_dirs):
    return {fam: Engine.from_pretrained(tiny_dirs[fam], dtype=torch.float32, device="cpu")
            for fam in ("qwen2_5_vl", "qwen3_vl")}


@pytest.fixture(scope="module")
def engine(engines):
    return engines["qwen2_5_vl"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_processor_only_tokens_are_never_sampled(engines, family):
    """Pushed to the top by +100 bias, the pads and vision markers still never come out, greedy
    or sampled; the answer is what it would be with them absent."""
    eng = engines[family]
    tok = eng.adapter.tokenizer
    vision = {tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                     "<|vision_end|>")}
    assert vision <= set(eng.banned_ids)
    bias = {t: 100.0 for t in vision}
    greedy = eng.generate(MSGS, max_new_tokens=8)
    pushed = eng.generate(MSGS, max_new_tokens=8, logit_bias=bias)
    assert pushed.token_ids == greedy.token_ids
    for seed in range(4):
        r = eng.generate(MSGS, max_new_tokens=12, temperature=2.0, seed=seed, logit_bias=bias)
        assert not vision & set(r.token_ids)
    eng.check_integrity()


def test_tiny_temperatures_are_greedy(engine):
    greedy = engine.generate(MSGS, max_new_tokens=8)
    for t in (1e-40, 1e-37, 1e-6):
        assert engine.generate(MSGS, max_new_tokens=8, temperature=t, seed=1).token_ids == greedy.token_ids


def test_top_k_one_is_greedy_and_top_k_bounds_every_draw(engine):
    greedy = engine.generate(MSGS, max_new_tokens=8)
    assert engine.generate(MSGS, max_new_tokens=8, temperature=1.5, top_k=1, seed=3).token_ids == greedy.token_ids
    for seed in range(3):
        r = engine.generate(MSGS, max_new_tokens=10, temperature=2.0, top_k=3, seed=seed, logprobs=True,
                            top_logprobs=3)
        for lp in r.logprobs:  # the drawn token is one of the 3 most likely of the processed distribution
            assert lp.logprob >= lp.top_logprobs[-1].logprob - 1e-6


def test_logit_bias_steers_greedy(engine):
    greedy = engine.generate(MSGS, max_new_tokens=4)
    first = greedy.token_ids[0]
    banned = engine.generate(MSGS, max_new_tokens=4, logit_bias={str(first): -100})
    assert banned.token_ids[0] != first
    forced = engine.generate(MSGS, max_new_tokens=4, logit_bias={77: 100})
    assert forced.token_ids == [77] * 4


def test_penalties_follow_openai_formula():
    """logits - frequency * count - presence * (count > 0), over the tokens generated so far."""
    params = SamplingParams.build(8, temperature=0.5, presence_penalty=0.7, frequency_penalty=-0.3,
                                  logit_bias={2: 1.5})
    sampler = Sampler(params, banned_ids=[5])
    logits = torch.arange(8, dtype=torch.float32)
    sampler.counts[torch.tensor([1, 3])] = torch.tensor([2.0, 1.0])
    want = logits.clone()
    want[2] += 1.5
    want[1] -= -0.3 * 2 + 0.7
    want[3] -= -0.3 * 1 + 0.7
    want[5] = -math.inf
    torch.testing.assert_close(sampler.processed(logits), want / 0.5)


def test_frequency_penalty_breaks_repetition(engine):
    """A positive frequency penalty lowers each repeat, so greedy cannot repeat one token forever."""
    looped = engine.generate(MSGS, max_new_tokens=6, logit_bias={77: 5})
    damped = engine.generate(MSGS, max_new_tokens=6, logit_bias={77: 5}, frequency_penalty=2.0,
                             presence_penalty=2.0)
    assert looped.token_ids.count(77) > damped.token_ids.count(77)


def test_logprobs_are_the_processed_distribution(engine):
    r = engine.generate(MSGS, max_new_tokens=6, logprobs=True, top_logprobs=5)
    assert len(r.logprobs) == len(r.token_ids)
    masked = r.first_logits.clone()
    masked[engine.banned_ids] = -math.inf  # never sampled, so not part of the distribution
    first = torch.log_softmax(masked, dim=-1)
    assert r.logprobs[0].logprob == pytest.approx(float(first[r.token_ids[0]]), abs=1e-5)
    for tid, lp in zip(r.token_ids, r.logprobs):
        tops = [t.logprob for t in lp.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)  # greedy took the most likely
        assert lp.bytes == list(engine.token_texts(tid)[1])
        assert sum(math.exp(t) for t in tops) <= 1 + 1e-5
    t = 1.7
    s = engine.generate(MSGS, max_new_tokens=1, temperature=t, seed=5, logprobs=True)
    want = torch.log_softmax(masked / t, dim=-1)[s.token_ids[0]]
    assert s.logprobs[0].logprob == pytest.approx(float(want), abs=1e-5)
    assert engine.generate(MSGS, max_new_tokens=3).logprobs is None


@pytest.mark.parametrize("seed", range(4))
def test_logprobs_stream_with_their_text_each_token_once(engine, seed):
    greedy = engine.generate(MSGS, max_new_tokens=16, temperature=2.0, seed=seed)
    stop = greedy.text[len(greedy.text) // 2:][:3] if len(greedy.text) > 4 else None
    events = []
    r = engine.generate(MSGS, max_new_tokens=16, temperature=2.0, seed=seed, stop=stop, logprobs=True,
                        top_logprobs=1, on_text=lambda d: events.append(("text", d)),
                        on_logprobs=lambda lps: events.append(("lp", lps)))
    streamed = [lp for kind, x in events if kind == "lp" for lp in x]
    assert streamed == r.logprobs and len(r.logprobs) == len(r.token_ids)
    assert "".join(x for kind, x in events if kind == "text") == r.text
    for i, (kind, _) in enumerate(events):
        if kind == "lp" and i + 1 < len(events):
            assert events[i + 1][0] == "text"  # logprobs come right before the delta they belong to


def _first_stop(tokenizer, ids: list[int], stops: list[str]) -> int:
    """Where a stop cuts when the text is searched after every token that ends a character (the
    decode of each prefix of `ids`): the earliest match of the first prefix holding one."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if text.endswith("\ufffd") and k < len(ids):
            continue  # inside a multi-byte character
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return min(found)
    return -1


@pytest.mark.parametrize("seed", range(6))
def test_incremental_stop_matching_equals_a_full_search(engine, seed):
    """Sampled at temperature 2 (odd bytes, split characters): the text is the tokens' decode, and a
    stop string cuts where searching the whole text after each token would."""
    full = engine.generate(MSGS, max_new_tokens=24, temperature=2.0, seed=seed)
    if full.finish_reason == "length":
        assert full.text == engine.adapter.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    assert len(full.text) > 6
    for stop in (full.text[3:5], [full.text[-3:], "\x00never"], [full.text[4:6], full.text[2:7]]):
        cut = engine.generate(MSGS, max_new_tokens=24, temperature=2.0, seed=seed, stop=stop)
        at = _first_stop(engine.adapter.tokenizer, full.token_ids, [stop] if isinstance(stop, str) else stop)
        assert cut.finish_reason == "stop" and cut.text == full.text[:at]
        assert cut.token_ids == full.token_ids[:len(cut.token_ids)]


BAD = [
    ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1e30), ("seed", 1.5), ("seed", True), ("seed", "7"),
    ("temperature", -0.1), ("temperature", 2.01), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "1"), ("top_p", 0.0), ("top_p", 1.5), ("top_p", None), ("top_k", -1), ("top_k", 2.0),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", float("nan")),
    ("frequency_penalty", 3), ("frequency_penalty", "0"),
    ("logit_bias", {str(i): 1 for i in range(301)}), ("logit_bias", {10**9: 1}), ("logit_bias", {"-1": 1}),
    ("logit_bias", {"abc": 1}), ("logit_bias", {1: 101}), ("logit_bias", {1: float("nan")}), ("logit_bias", [1]),
    ("logit_bias", {True: 1}), ("logprobs", "yes"), ("top_logprobs", 21), ("top_logprobs", -1),
    ("stop", ["a", "b", "c", "d", "e"]), ("stop", "x" * 257), ("stop", ""), ("stop", [1]), ("stop", 5),
]


@pytest.mark.parametrize("param,value", BAD)
def test_bad_sampling_values_name_their_param_and_change_nothing(engine, param, value):
    before = engine.stats()
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(MSGS, max_new_tokens=2, **{param: value})
    assert info.value.param == param
    assert engine.stats() == before


def test_top_logprobs_needs_logprobs(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(MSGS, max_new_tokens=2, top_logprobs=3)
    assert info.value.param == "top_logprobs"


def test_extreme_valid_values_answer(engine):
    r = engine.generate(MSGS, max_new_tokens=4, temperature=2.0, top_p=1e-9, top_k=10**9, seed=-(2**63),
                        presence_penalty=-2, frequency_penalty=2, logit_bias={str(i): -100 for i in range(300)},
                        logprobs=True, top_logprobs=20, stop=["z" * 256] * 4)
    assert len(r.logprobs) == len(r.token_ids) and all(len(lp.top_logprobs) == 20 for lp in r.logprobs)
    assert all(math.isfinite(lp.logprob) for lp in r.logprobs)


# ---- the draw and the nucleus (mmkv.request.sampling.draw / nucleus) ---------------------------

def test_draw_follows_the_probabilities_and_never_a_zero():
    """200k seeded draws: each index's frequency within 0.005 of its probability (5 standard
    deviations at most), a zero-probability index never; the same seed draws the same sequence."""
    probs = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.0, 0.4])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(200_000):
        counts[draw(probs, g)] += 1
    assert counts[1] == counts[4] == 0
    assert (counts / 200_000 - probs).abs().max() < 0.005
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [draw(probs, a) for _ in range(50)] == [draw(probs, b) for _ in range(50)]
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [draw(probs * 3.0, a) for _ in range(50)] == [draw(probs, b) for _ in range(50)]  # any total


def test_draw_at_the_top_of_the_range_takes_the_last_index_with_mass(monkeypatch):
    probs = torch.tensor([0.25, 0.75, 0.0, 0.0])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert draw(probs, None) == 1


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0, 0.0])  # flat (0.0: all equal) to peaked
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_nucleus_is_the_full_sort_rule(spread, top_p):
    """The top-k tries give the same set as sorting the whole vocabulary (ties aside: none here
    but the all-equal case, compared by size)."""
    g = torch.Generator().manual_seed(int(spread * 10))
    probs = torch.softmax(torch.randn(40_000, generator=g) * spread, dim=-1)
    values, ids = nucleus(probs, top_p)
    sorted_probs, order = torch.sort(probs, descending=True)
    keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
    assert values.numel() == int(keep.sum()) >= 1
    assert torch.equal(values, probs[ids]) and bool((values[:-1] >= values[1:]).all())
    if spread:
        assert set(ids.tolist()) == set(order[keep].tolist())
