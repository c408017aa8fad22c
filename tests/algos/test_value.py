"""The clipped value loss: hand-worked values, masking, aggregation, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.algos.agg import LOSS_AGG_MODES, AggNorm
from lmrl.algos.value import value_loss


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def run(vpreds, values, returns, mask, **kw):
    v = vpreds.clone().requires_grad_(True)
    loss, metrics = value_loss(v, values, returns, mask, **kw)
    (grad,) = torch.autograd.grad(loss, v)
    return loss.detach(), metrics, grad


def test_value_loss_by_hand():
    # cliprange 0.2. token 0: vpred 1.0, value 0.5 -> clipped to 0.7; return 2.0:
    #   unclipped (1 - 2)^2 = 1, clipped (0.7 - 2)^2 = 1.69 -> max 1.69 (clipped one counts)
    # token 1: vpred 2.0 = value, return 1.0: both 1 -> 1 (not clipped)
    # token 2: masked (garbage). loss = 0.5 * mean(1.69, 1) = 0.6725; vf_clipfrac = 1/2.
    vpreds = t([[1.0, 2.0, float("nan")]])
    values = t([[0.5, 2.0, 1e9]])
    returns = t([[2.0, 1.0, float("inf")]])
    mask = t([[1, 1, 0]], torch.bool)
    loss, m, grad = run(vpreds, values, returns, mask, cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.6725)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)
    assert not m["vf_clipfrac"].requires_grad
    # token 0 sits on the clipped branch (constant in vpred): gradient 0;
    # token 1: 0.5 * 2 (v - R) / 2 tokens = 0.5; masked token: 0
    torch.testing.assert_close(grad, t([[0.0, 0.5, 0.0]]))


def test_value_loss_other_agg_modes():
    # per-token max errors [[1.69, 1], [4]] -> seq-mean-token-sum: 0.5 * (2.69 + 4) / 2
    vpreds = t([[1.0, 2.0], [3.0, 0.0]])
    values = t([[0.5, 2.0], [3.0, 0.0]])
    returns = t([[2.0, 1.0], [1.0, 0.0]])
    mask = t([[1, 1], [1, 0]], torch.bool)
    loss, _, _ = run(
        vpreds, values, returns, mask, cliprange_value=0.2, loss_agg_mode="seq-mean-token-sum"
    )
    assert loss.item() == pytest.approx(0.5 * (2.69 + 4.0) / 2)
    loss, _, _ = run(
        vpreds, values, returns, mask, cliprange_value=0.2, loss_agg_mode="seq-mean-token-mean"
    )
    assert loss.item() == pytest.approx(0.5 * (2.69 / 2 + 4.0) / 2)


def test_value_loss_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="returns"):
        value_loss(x, x, x[:, :2], x.bool())
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss(x, x, x, x.bool(), cliprange_value=-0.1)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        value_loss(x, x, x, x.bool(), loss_agg_mode="mean")


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(2, 6),
    tt=st.integers(1, 5),
    cut=st.integers(1, 5),
    junk=st.sampled_from([float("nan"), 1e30, float("-inf")]),
)
def test_value_loss_properties(seed, b, tt, cut, junk):
    g = torch.Generator().manual_seed(seed)
    vpreds, values, returns = torch.randn(3, b, tt, generator=g, dtype=torch.float64)
    mask = torch.rand(b, tt, generator=g) < 0.7

    def corrupt(x):
        return torch.where(mask, x, torch.full_like(x, junk))

    cut = min(cut, b - 1)
    norm = AggNorm.from_mask(mask)
    for mode in LOSS_AGG_MODES:
        ref = run(vpreds, values, returns, mask, loss_agg_mode=mode)
        # masked positions change nothing
        got = run(corrupt(vpreds), corrupt(values), corrupt(returns), mask, loss_agg_mode=mode)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[2], got[2])
        assert torch.equal(ref[1]["vf_clipfrac"], got[1]["vf_clipfrac"])
        # micro-batch invariance with the whole batch's normalizers
        a = run(
            vpreds[:cut], values[:cut], returns[:cut], mask[:cut], loss_agg_mode=mode, norm=norm
        )
        z = run(
            vpreds[cut:], values[cut:], returns[cut:], mask[cut:], loss_agg_mode=mode, norm=norm
        )
        torch.testing.assert_close(a[0] + z[0], ref[0])
        torch.testing.assert_close(torch.cat([a[2], z[2]]), ref[2])
