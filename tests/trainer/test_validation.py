"""Validation metrics: the pass@k estimator by hand and by enumeration, per-source metrics."""

from __future__ import annotations

import itertools
import math

import pytest

from lmrl.trainer.validation import mean_at_k, pass_at_k, validation_metrics


# ----------------------------------------------------------------------------- pass_at_k
@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # c / n
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 0, 3, 0.0),
        (5, 3, 3, 1.0),  # n - c = 2 < k = 3: every 3-subset holds a pass
        (5, 5, 1, 1.0),
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (10, 1, 5, 0.5),  # 1 - C(9,5)/C(10,5) = 1 - 126/252
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_exact_edges():
    assert pass_at_k(7, 0, 4) == 0.0
    assert pass_at_k(7, 4, 4) == 1.0  # n - c = 3 < 4
    assert pass_at_k(7, 7, 7) == 1.0


def test_pass_at_k_matches_subset_enumeration():
    """The fraction of k-subsets holding at least one pass, for every (n, c, k) with n <= 7."""
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_stable():
    # 1 - C(n-c, k)/C(n, k) by big integers, against the product form
    n, c, k = 1000, 3, 100
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert 0.0 < pass_at_k(10_000, 1, 1) == pytest.approx(1e-4, rel=1e-9)


@pytest.mark.parametrize(
    ("n", "c", "k", "arg"), [(0, 0, 1, "n"), (3, 4, 1, "c"), (3, -1, 1, "c"), (3, 1, 4, "k")]
)
def test_pass_at_k_rejects_bad_arguments(n, c, k, arg):
    with pytest.raises(ValueError, match=f"{arg} must"):
        pass_at_k(n, c, k)


def test_mean_at_k_is_the_mean_over_subsets():
    scores = [0.0, 1.0, 0.5, 0.25]
    for k in range(1, 5):
        subsets = list(itertools.combinations(scores, k))
        brute = sum(sum(s) / k for s in subsets) / len(subsets)
        assert mean_at_k(scores, k) == pytest.approx(brute)
    with pytest.raises(ValueError, match="k must"):
        mean_at_k(scores, 5)


# --------------------------------------------------------------------- validation_metrics
def test_validation_metrics_hand_built():
    # digits: prompt a has 4 samples, 2 correct; prompt b has 4 samples, 0 correct.
    # gsm8k: prompt c has 4 samples, all correct (partial-credit scores, acc decides).
    sources = ["digits"] * 8 + ["gsm8k"] * 4
    uids = ["a", "a", "b", "a", "b", "b", "a", "b", "c", "c", "c", "c"]
    accs = [1, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1]
    scores = [1.0, 0.1, 0.1, 1.0, 0.0, 0.1, 0.1, 0.1, 0.9, 0.9, 0.9, 0.9]
    m = validation_metrics(sources, uids, scores, [float(a) for a in accs], k=2)

    assert set(m) == {
        f"val/{s}/{name}" for s in ("digits", "gsm8k")
        for name in ("mean@2", "pass@2", "acc", "reward/mean")
    }  # fmt: skip
    # a: mean 2.2/4 = 0.55, pass@2 = 1 - C(2,2)/C(4,2) = 5/6; b: mean 0.3/4 = 0.075, pass 0
    assert m["val/digits/mean@2"] == pytest.approx((0.55 + 0.075) / 2)
    assert m["val/digits/pass@2"] == pytest.approx((5 / 6 + 0.0) / 2)
    assert m["val/digits/acc"] == pytest.approx(2 / 8)
    assert m["val/digits/reward/mean"] == pytest.approx(2.5 / 8)
    # scores below 1 but acc == 1: the sample passes
    assert m["val/gsm8k/pass@2"] == 1.0
    assert m["val/gsm8k/acc"] == 1.0
    assert m["val/gsm8k/mean@2"] == pytest.approx(0.9)


def test_validation_metrics_without_accs_uses_score_ge_1():
    sources = ["d"] * 6
    uids = [0, 0, 0, 1, 1, 1]
    scores = [1.0, 0.5, 0.0, 0.99, 0.0, 0.0]
    m = validation_metrics(sources, uids, scores, None, k=1)
    assert "val/d/acc" not in m
    # prompt 0: 1 of 3 pass -> 1/3; prompt 1: 0.99 does not pass -> 0
    assert m["val/d/pass@1"] == pytest.approx((1 / 3 + 0) / 2)
    assert m["val/d/mean@1"] == pytest.approx((0.5 + 0.33) / 2)
    assert m["val/d/reward/mean"] == pytest.approx(2.49 / 6)


def test_validation_metrics_greedy_one_sample_per_prompt():
    m = validation_metrics(["d", "d", "d", "d"], [0, 1, 2, 3], [1, 0, 1, 1], [1, 0, 1, 1], k=1)
    assert m["val/d/pass@1"] == m["val/d/acc"] == m["val/d/mean@1"] == 0.75


def test_validation_metrics_mean_at_k_weights_prompts_equally():
    # uneven groups: prompt 0 has 2 samples (both 1), prompt 1 has 4 (all 0)
    m = validation_metrics(["d"] * 6, [0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], None, k=2)
    assert m["val/d/mean@2"] == 0.5  # per prompt: (1 + 0) / 2
    assert m["val/d/reward/mean"] == pytest.approx(2 / 6)  # per sample


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"uids": [0, 0, 1]}, "uids has 3 entries"),
        ({"accs": [1.0]}, "accs has 1 entries"),
        ({"data_sources": ["d", "e", "d", "d"]}, "two data sources"),
        ({"k": 3}, "fewer than k=3"),
        ({"k": 0}, "k must be >= 1"),
    ],
)
def test_validation_metrics_rejects_bad_input(kwargs, match):
    args = {
        "data_sources": ["d"] * 4,
        "uids": [0, 0, 1, 1],
        "scores": [1.0, 0.0, 0.0, 0.0],
        "accs": [1.0, 0.0, 0.0, 0.0],
        "k": 2,
    }
    with pytest.raises(ValueError, match=match):
        validation_metrics(**(args | kwargs))


def test_validation_metrics_rejects_empty():
    with pytest.raises(ValueError, match="no samples"):
        validation_metrics([], [], [], None, k=1)
