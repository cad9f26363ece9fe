"""The evaluation's statistics against known values: exact binomial intervals (closed forms and
R's binom.test), the one-sided pass rule, exact McNemar and sign tests, the item-clustered
bootstrap, flip directions, and the error decomposition's margins and split."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import binom

from mmkv.vqa_eval.decompose import answer_set_kl, decompose, margin
from mmkv.vqa_eval.stats import (clopper_pearson, cluster_bootstrap, flip_directions, lower_bound, mcnemar_exact,
                                 sign_test, verdict)


def test_clopper_pearson_closed_forms():
    # k = n: the lower end solves p^n = alpha / 2; k = 0: the upper end is 1 - (alpha / 2)^(1/n).
    for n in (10, 360, 2160):
        assert clopper_pearson(n, n) == pytest.approx((0.025 ** (1 / n), 1.0), abs=1e-9)
        assert clopper_pearson(0, n) == pytest.approx((0.0, 1 - 0.025 ** (1 / n)), abs=1e-9)
    assert clopper_pearson(360, 360)[0] == pytest.approx(0.98981, abs=1e-5)  # issue 17: not [1.000, 1.000]


def test_clopper_pearson_reference_values():
    # The textbook value (R: binom.test(5, 10)$conf.int = 0.1870860 0.8129140).
    assert clopper_pearson(5, 10) == pytest.approx((0.1870860, 0.8129140), abs=1e-6)
    # The defining property: at the lower end P(X >= k) = 2.5%, at the upper end P(X <= k) = 2.5%.
    for k, n in ((356, 360), (2140, 2160), (3, 40)):
        low, high = clopper_pearson(k, n)
        assert binom.sf(k - 1, n, low) == pytest.approx(0.025, rel=1e-6)
        assert binom.cdf(k, n, high) == pytest.approx(0.025, rel=1e-6)


def test_one_sided_lower_bound_and_verdict():
    assert lower_bound(360, 360) == pytest.approx(0.05 ** (1 / 360), abs=1e-9)  # 0.99171
    assert lower_bound(2000, 2000) == pytest.approx(0.05 ** (1 / 2000), abs=1e-9)  # 0.99850
    # 360/360 cannot show 0.99 two-sided, but one-sided it can: that is what the rule certifies.
    ok = verdict([1.0] * 400, [f"i{i % 80}" for i in range(400)], target=0.99)
    assert ok.exact_lower == pytest.approx(0.05 ** (1 / 400)) and ok.passed
    bad = verdict([1.0] * 396 + [0.0] * 4, [f"i{i % 80}" for i in range(400)], target=0.99)
    assert bad.exact_lower < 0.99 and not bad.passed
    small = verdict([1.0] * 200, [f"i{i}" for i in range(200)], target=0.99)
    assert small.exact_lower == pytest.approx(0.05 ** (1 / 200)) and not small.passed  # 0.985: n too small


def test_mcnemar_and_sign_test_exact_values():
    # 4 flips against 0 (issue 17's two models): exact two-sided p = 2 * 0.5^4 = 0.125, not shown.
    m = mcnemar_exact([False] * 4 + [True] * 356, [True] * 360)
    assert (m["only_a"], m["only_b"], m["n"]) == (0, 4, 360) and m["p"] == pytest.approx(0.125)
    assert mcnemar_exact([True, False], [True, False])["p"] == 1.0  # no discordant pair
    assert sign_test(13, 0) == pytest.approx(2 * 0.5 ** 13)  # 13 of 13 count flips go down: p = 2.4e-4
    assert sign_test(3, 3) == pytest.approx(1.0)


def test_cluster_bootstrap_resamples_items_not_requests():
    # Every item either always agrees or never does: clustering must widen the interval.
    flags = [1.0] * 50 + [0.0] * 50
    clustered = cluster_bootstrap(flags, [f"a{i // 10}" for i in range(100)], seed=1)
    independent = cluster_bootstrap(flags, [f"r{i}" for i in range(100)], seed=1)
    assert clustered[1] - clustered[0] > 2 * (independent[1] - independent[0])
    assert cluster_bootstrap([1.0] * 30, [f"c{i % 3}" for i in range(30)]) == (1.0, 1.0)
    # Unequal cluster sizes: the statistic is the pooled request mean, not the mean of item means.
    assert cluster_bootstrap([1, 1, 1, 0], ["a", "a", "a", "b"], n_boot=1)[0] in (0.0, 0.75, 1.0)


def test_flip_directions_count_down_and_up():
    pairs = [("three", "two"), ("four", "three"), ("two", "one"), ("one", "three"), ("two", "two")]
    d = flip_directions(pairs, "count")
    assert d["flips"] == 4 and (d["down"], d["up"], d["one_step_down"]) == (3, 1, 3)
    assert d["by_direction"]["three -> two"] == 1 and d["sign_p"] == pytest.approx(0.625)
    assert "down" not in flip_directions([("red", "blue")], "color")


def test_margin_kl_and_exact_split():
    full = torch.tensor([3.0, 1.0, 0.5, -2.0])
    arm = torch.tensor([1.5, 2.0, 0.5, -2.0])
    oracle = torch.tensor([2.5, 1.2, 0.5, -2.0])
    assert margin(full, 0) == pytest.approx(2.0) and margin(arm, 0) == pytest.approx(-0.5)
    assert answer_set_kl(full, full, [0, 1, 2]) == pytest.approx(0.0, abs=1e-12)
    assert answer_set_kl(full, arm, [0, 1, 2]) > 0
    d = decompose(full, arm, oracle, [0, 1, 2])
    assert d["first_token_flip"] and d["full_margin"] == pytest.approx(2.0)
    assert d["rotation"] + d["isolation"] == pytest.approx(d["margin_change"])  # the split is exact
    assert d["rotation"] == pytest.approx(-0.5 - 1.3) and d["isolation"] == pytest.approx(1.3 - 2.0)
