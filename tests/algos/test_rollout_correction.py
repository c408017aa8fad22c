"""Rollout importance weights: each level and mode by hand, metrics, masking, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.algos.rollout_correction import LEVELS, MODES, rollout_importance_weights

# Raw token weights w = pi_old / pi_rollout: row 0 [3, 0.25, 1.5], row 1 [0.8, 1.2, (masked)].
# Sequence products: 1.125 and 0.96; geometric means 1.125^(1/3) = 1.040042, 0.96^(1/2) =
# 0.979796.
W = [[3.0, 0.25, 1.5], [0.8, 1.2, 1.0]]
OLD = torch.log(torch.tensor(W, dtype=torch.float64)) - 1.0
ROLLOUT = torch.full((2, 3), -1.0, dtype=torch.float64)
ROLLOUT[1, 2] = float("nan")  # masked garbage
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def rw(**kw):
    return rollout_importance_weights(OLD, ROLLOUT, MASK, **kw)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def t_(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_token_truncate():
    w, mask, m = rw(level="token", mode="truncate", threshold=2.0)
    close(w, [[2.0, 0.25, 1.5], [0.8, 1.2, 0.0]])
    assert torch.equal(mask, MASK)
    assert not w.requires_grad
    assert m["is_weight_mean"].item() == pytest.approx(5.75 / 5)
    assert m["is_weight_max"].item() == pytest.approx(2.0)
    # ESS = (sum w)^2 / (n sum w^2) = 5.75^2 / (5 * 8.3925)
    assert m["is_eff_sample_size"].item() == pytest.approx(5.75**2 / (5 * 8.3925))
    assert m["is_truncated_fraction"].item() == pytest.approx(1 / 5)
    assert m["is_masked_fraction"].item() == 0.0
    # mismatch KL(rollout || old): k1 = mean(log rollout - log old) = -log(prod w) / 5,
    # k3 = mean(w - log w - 1) = (sum w - log prod w - 5) / 5, prod w = 1.08, sum w = 6.75
    assert m["mismatch_kl"].item() == pytest.approx(-math.log(1.08) / 5)
    assert m["mismatch_k3"].item() == pytest.approx((6.75 - math.log(1.08) - 5) / 5)


def test_token_mask():
    # keep w in [1/2, 2]: 3 and 0.25 leave the mask
    w, mask, m = rw(level="token", mode="mask", threshold=2.0)
    close(w, [[0.0, 0.0, 1.5], [0.8, 1.2, 0.0]])
    assert mask.tolist() == [[False, False, True], [True, True, False]]
    assert m["is_masked_fraction"].item() == pytest.approx(2 / 5)
    assert m["is_weight_mean"].item() == pytest.approx(3.5 / 3)
    assert m["is_truncated_fraction"].item() == 0.0
    # an explicit lower bound: [0.2, 2] keeps 0.25 as well
    w, mask, _ = rw(level="token", mode="mask", threshold=2.0, threshold_lower=0.2)
    close(w, [[0.0, 0.25, 1.5], [0.8, 1.2, 0.0]])


def test_sequence_levels():
    w, mask, _ = rw(level="sequence", mode="truncate", threshold=2.0)
    close(w, [[1.125] * 3, [0.96, 0.96, 0.0]])
    assert torch.equal(mask, MASK)
    w, _, _ = rw(level="sequence", mode="truncate", threshold=1.1)
    close(w, [[1.1] * 3, [0.96, 0.96, 0.0]])
    # rejection with [1/1.1, 1.1] = [0.909, 1.1]: row 0 (1.125) goes, row 1 (0.96) stays
    w, mask, m = rw(level="sequence", mode="mask", threshold=1.1)
    close(w, [[0.0] * 3, [0.96, 0.96, 0.0]])
    assert mask.tolist() == [[False] * 3, [True, True, False]]
    assert m["is_masked_fraction"].item() == pytest.approx(3 / 5)
    assert m["is_eff_sample_size"].item() == pytest.approx(1.0)  # equal weights left


def test_geometric_level():
    g0, g1 = 1.125 ** (1 / 3), 0.96**0.5
    w, _, _ = rw(level="geometric", mode="truncate", threshold=2.0)
    close(w, [[g0] * 3, [g1, g1, 0.0]])
    # rejection with [1/1.03, 1.03] = [0.9709, 1.03]: row 0 (1.0400) goes, row 1 (0.9798) stays
    w, mask, _ = rw(level="geometric", mode="mask", threshold=1.03)
    close(w, [[0.0] * 3, [g1, g1, 0.0]])
    assert mask.tolist() == [[False] * 3, [True, True, False]]


def test_equal_weights_have_ess_one_and_clamp_keeps_finite():
    old = torch.full((3, 4), -1.0)
    w, _, m = rollout_importance_weights(old, old - 0.3, torch.ones(3, 4, dtype=torch.bool))
    assert m["is_eff_sample_size"].item() == pytest.approx(1.0)
    close(w, [[math.exp(0.3)] * 4] * 3)
    # a log-weight of 1000 is clamped to 20 before exp: finite, then truncated to 2
    w, _, _ = rollout_importance_weights(t_([[0.0, 1000.0]]), t_([[0.0, 0.0]]), t_([[1, 1]]) > 0)
    close(w, [[1.0, 2.0]])
    w, _, _ = rollout_importance_weights(
        t_([[0.0, 1000.0]]), t_([[0.0, 0.0]]), t_([[1, 1]]) > 0, mode="mask", threshold=1e9
    )
    close(w, [[1.0, math.exp(20.0)]])  # e^20 < 1e9 kept: the clamp, not inf


def test_bad_input():
    with pytest.raises(ValueError, match="level"):
        rw(level="tok")
    with pytest.raises(ValueError, match="mode"):
        rw(mode="clip")
    with pytest.raises(ValueError, match="threshold"):
        rw(threshold=0.0)
    with pytest.raises(ValueError, match="threshold_lower"):
        rw(mode="mask", threshold=2.0, threshold_lower=3.0)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        rollout_importance_weights(OLD, ROLLOUT[:, :2], MASK)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 4),
    tt=st.integers(1, 5),
    level=st.sampled_from(LEVELS),
    mode=st.sampled_from(MODES),
    junk=st.sampled_from([float("nan"), 1e30, float("-inf")]),
)
def test_properties(seed, b, tt, level, mode, junk):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, tt, generator=g, dtype=torch.float64) * 3
    rollout = old + 0.3 * torch.randn(b, tt, generator=g, dtype=torch.float64)
    mask = torch.rand(b, tt, generator=g) < 0.7

    def corrupt(x):
        return torch.where(mask, x, torch.full_like(x, junk))

    w, mask_out, m = rollout_importance_weights(old, rollout, mask, level, mode, threshold=1.5)
    w2, mask_out2, m2 = rollout_importance_weights(
        corrupt(old), corrupt(rollout), mask, level, mode, threshold=1.5
    )
    assert torch.equal(w, w2) and torch.equal(mask_out, mask_out2)
    for key in m:
        assert torch.equal(m[key], m2[key]), key
        assert m[key].dim() == 0 and torch.isfinite(m[key]), key
    # weights: zero outside the returned mask, within bounds inside it
    assert (mask_out <= mask).all()
    assert (w[~mask_out] == 0).all()
    assert (w[mask_out] <= 1.5).all() and (w[mask_out] > 0).all()
    if mode == "mask":
        assert (w[mask_out] >= 1 / 1.5).all()
    if level != "token":  # whole sequences go or stay
        kept_rows = (mask_out | ~mask).all(-1) | ~mask_out.any(-1)
        assert kept_rows.all()
    ess = m["is_eff_sample_size"].item()
    assert 0.0 <= ess <= 1.0 + 1e-12
    if mask_out.any():
        assert ess > 0.0
