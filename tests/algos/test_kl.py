"""KL estimators, the straight-through option, controllers and KL in the reward."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    full_kl_from_hidden,
    kl_controllers,
    kl_estimators,
    kl_penalty,
    make_kl_controller,
)


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


# log_prob - ref_log_prob = d at three points: d = 1, -1, 0
LP = t([[0.0, -2.0, -0.7]])
REF = t([[-1.0, -1.0, -0.7]])


def test_estimator_closed_forms():
    assert kl_penalty(LP, REF, "k1").tolist()[0] == pytest.approx([1.0, -1.0, 0.0])
    assert kl_penalty(LP, REF, "abs").tolist()[0] == pytest.approx([1.0, 1.0, 0.0])
    assert kl_penalty(LP, REF, "k2").tolist()[0] == pytest.approx([0.5, 0.5, 0.0])
    # k3 = e^x - x - 1 with x = ref - lp: x = -1 -> e^-1 = 0.367879; x = 1 -> e - 2 = 0.718282
    assert kl_penalty(LP, REF, "k3").tolist()[0] == pytest.approx([math.exp(-1), math.e - 2, 0.0])


def test_aliases_resolve_to_the_same_estimators():
    for alias, canonical in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        assert torch.equal(kl_penalty(LP, REF, alias), kl_penalty(LP, REF, canonical))
    assert kl_estimators.names() == ["abs", "full", "k1", "k2", "k3"]


def test_k3_clamps():
    # x = ref - lp = 3 -> e^3 - 4 = 16.09, clamped to 10.
    # lp = -inf: x = +inf would give inf - inf = NaN; the input clamp to 20 keeps it finite,
    # and e^20 - 21 is clamped to 10.
    # x = -30 is clamped to -20: e^-20 + 19 = 19.000000002 -> 10.
    lp = t([[-3.0, float("-inf"), 0.0, 0.0]])
    ref = t([[0.0, 0.0, -30.0, -1e-3]])
    out = kl_penalty(lp, ref, "k3")
    x = -1e-3
    assert out.tolist()[0] == pytest.approx([10.0, 10.0, 10.0, math.exp(x) - x - 1])


def test_straight_through_has_k3_value_and_k2_gradient():
    lp = t([[0.0, -2.0, -0.7, -0.1]]).requires_grad_(True)
    ref = t([[-1.0, -1.0, -0.7, -0.4]])
    out = kl_penalty(lp, ref, "k3", straight_through=True)
    torch.testing.assert_close(out.detach(), kl_penalty(lp.detach(), ref, "k3"))
    (grad,) = torch.autograd.grad(out.sum(), lp)
    # d/d lp of 0.5 (lp - ref)^2 = lp - ref
    torch.testing.assert_close(grad, (lp - ref).detach())
    # without it, k3's own gradient is 1 - e^(ref - lp): different
    (own,) = torch.autograd.grad(kl_penalty(lp, ref, "k3").sum(), lp)
    torch.testing.assert_close(own, 1 - torch.exp(ref - lp.detach()))


def test_unknown_kind_lists_valid_names():
    with pytest.raises(ValueError, match=r"valid names: abs, full, k1, k2, k3"):
        kl_penalty(LP, REF, "k4")
    with pytest.raises(ValueError, match="ref_log_prob has shape"):
        kl_penalty(LP, REF[:, :2], "k1")


@settings(max_examples=50, deadline=None)
@given(
    d=st.floats(-30, 30, allow_nan=False),
    kind=st.sampled_from(["k1", "abs", "k2", "k3"]),
)
def test_estimators_finite_and_k3_nonnegative(d, kind):
    out = kl_penalty(t([[d]]), t([[0.0]]), kind)
    assert torch.isfinite(out).all()
    if kind in ("abs", "k2", "k3"):
        assert out.item() >= 0.0


# ------------------------------------------------------------------------------------------
# controllers
# ------------------------------------------------------------------------------------------


def test_adaptive_controller_by_hand():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.01, horizon=100)
    # KL 0.02: error = clip(2 - 1, -0.2, 0.2) = 0.2; value *= 1 + 0.2 * 10 / 100 = 1.02
    ctrl.update(0.02, n_steps=10)
    assert ctrl.value == pytest.approx(0.102)
    # KL 0.009 as a 0-dim tensor: error = -0.1; value *= 1 - 0.1 * 10 / 100 = 0.99
    ctrl.update(torch.tensor(0.009), n_steps=10)
    assert ctrl.value == pytest.approx(0.102 * 0.99)
    # far below target: error clipped at -0.2; value *= 1 - 0.2 * 50 / 100 = 0.9
    ctrl.update(0.0, n_steps=50)
    assert ctrl.value == pytest.approx(0.102 * 0.99 * 0.9)
    assert isinstance(ctrl.value, float)


def test_controller_state_dict_round_trip():
    ctrl = AdaptiveKLController(0.1, 0.01, 100)
    ctrl.update(1.0, n_steps=10)
    state = ctrl.state_dict()
    assert state == {"value": pytest.approx(0.102)} and isinstance(state["value"], float)
    fresh = AdaptiveKLController(0.1, 0.01, 100)
    fresh.load_state_dict(state)
    assert fresh.value == ctrl.value
    fresh.update(1.0, n_steps=10)
    ctrl.update(1.0, n_steps=10)
    assert fresh.value == ctrl.value

    fixed = FixedKLController(0.3)
    fixed.update(100.0, n_steps=1000)
    assert fixed.value == 0.3
    other = FixedKLController(0.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.3
    with pytest.raises(ValueError, match="value"):
        other.load_state_dict({"kl_coef": 0.1})


def test_make_kl_controller_validates():
    assert kl_controllers.names() == ["adaptive", "fixed"]
    assert isinstance(make_kl_controller("fixed", 0.001), FixedKLController)
    ctrl = make_kl_controller("adaptive", 0.001, target_kl=0.1, horizon=10000)
    assert isinstance(ctrl, AdaptiveKLController) and ctrl.value == 0.001
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", 0.001, horizon=10)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", 0.001, target_kl=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", 0.001, target_kl=0.1)
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", 0.001, target_kl=0.1, horizon=-5)
    with pytest.raises(ValueError, match="adaptive, fixed"):
        make_kl_controller("pid", 0.001)
    with pytest.raises(ValueError, match="kl_coef"):
        make_kl_controller("fixed", -1.0)


# ------------------------------------------------------------------------------------------
# apply_kl_penalty
# ------------------------------------------------------------------------------------------


def test_apply_kl_penalty_by_hand():
    # k1 = old - ref = [[0.1, 0.2, 0.3], [0.4, -0.2, (masked)]]
    scores = t([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    ref = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    old = t([[-0.9, -0.8, -0.7], [-0.6, -1.2, float("nan")]])
    mask = t([[1, 1, 1], [1, 1, 0]], torch.bool)
    ctrl = AdaptiveKLController(0.5, target_kl=0.1, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="kl")
    # rewards = scores - 0.5 * k1 under the mask; the masked score is untouched
    torch.testing.assert_close(rewards, t([[-0.05, -0.1, 0.85], [-0.2, 2.1, 5.0]]))
    # current KL = mean over sequences of per-sequence means: (0.2 + 0.1) / 2 = 0.15
    assert metrics["reward_kl_penalty"].item() == pytest.approx(0.15)
    assert metrics["reward_kl_penalty_coeff"].item() == pytest.approx(0.5)  # beta before update
    assert metrics["reward_kl_penalty_coeff"].dim() == 0
    # update: error = clip(0.15 / 0.1 - 1, -0.2, 0.2) = 0.2, n_steps = B = 2: 0.5 * 1.04
    assert ctrl.value == pytest.approx(0.52)


def test_apply_kl_penalty_with_k3_and_fixed_controller():
    scores = torch.zeros(1, 2, dtype=torch.float64)
    old = t([[0.0, -2.0]])
    ref = t([[-1.0, -1.0]])
    ctrl = FixedKLController(2.0)
    rewards, metrics = apply_kl_penalty(
        scores, old, ref, torch.ones(1, 2, dtype=torch.bool), ctrl, kl_penalty="low_var_kl"
    )
    k3 = [math.exp(-1), math.e - 2]
    torch.testing.assert_close(rewards, t([[-2 * k3[0], -2 * k3[1]]]))
    assert metrics["reward_kl_penalty"].item() == pytest.approx(sum(k3) / 2)
    assert ctrl.value == 2.0


def test_apply_kl_penalty_checks_shapes_and_kind():
    x = torch.zeros(2, 3)
    ctrl = FixedKLController(0.1)
    with pytest.raises(ValueError, match="ref_log_prob has shape"):
        apply_kl_penalty(x, x, x[:, :2], x.bool(), ctrl)
    with pytest.raises(ValueError, match="valid names"):
        apply_kl_penalty(x, x, x, x.bool(), ctrl, kl_penalty="k9")


# ----------------------------------------------------------------- full (exact) KL


def test_full_kl_matches_the_definition_and_its_gradient():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    ref_logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64)
    ours = kl_penalty(logits, ref_logits, kind="full")
    logp, ref_logp = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    expected = (logp.exp() * (logp - ref_logp)).sum(-1)
    torch.testing.assert_close(ours.double(), expected, atol=1e-6, rtol=1e-5)
    (grad,) = torch.autograd.grad(ours.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(grad.double(), expected_grad, atol=1e-6, rtol=1e-5)
    assert torch.all(kl_penalty(ref_logits, ref_logits, kind="full").abs() < 1e-6)


def test_full_kl_bad_input():
    with pytest.raises(ValueError, match=r"\(B, T, V\) logits"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), kind="full")
    with pytest.raises(ValueError, match="straight_through"):
        kl_penalty(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), kind="full", straight_through=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_full_kl_from_hidden_matches_the_definition_and_its_gradient(temperature, chunk_size):
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    hidden, weight, bias = rand(2, 5, 6), rand(13, 6), rand(13)
    ref_hidden, ref_weight = rand(2, 5, 4), rand(13, 4)  # another width: any reference fits
    for t in (hidden, weight, bias, ref_hidden, ref_weight):
        t.requires_grad_(True)
    ours = full_kl_from_hidden(
        hidden, weight, bias, ref_hidden, ref_weight, None, temperature, chunk_size
    )
    assert ours.shape == (2, 5)
    logp = torch.log_softmax((hidden @ weight.T + bias) / temperature, -1)
    logq = torch.log_softmax((ref_hidden @ ref_weight.T).detach() / temperature, -1)
    expected = (logp.exp() * (logp - logq)).sum(-1)
    torch.testing.assert_close(ours, expected, atol=1e-12, rtol=1e-10)

    g = rand(2, 5)
    got = torch.autograd.grad((ours * g).sum(), (hidden, weight, bias), allow_unused=True)
    want = torch.autograd.grad((expected * g).sum(), (hidden, weight, bias))
    for name, a, b in zip(("hidden", "weight", "bias"), got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=name)
    # the reference is a constant
    assert torch.autograd.grad(ours.sum(), (ref_hidden, ref_weight), allow_unused=True) == (
        None,
        None,
    )


def test_full_kl_from_hidden_is_zero_against_itself_and_bf16_safe():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 4, 8, generator=gen).bfloat16().requires_grad_(True)
    weight = torch.randn(17, 8, generator=gen).bfloat16().requires_grad_(True)
    kl = full_kl_from_hidden(hidden, weight, None, hidden, weight, None, 0.7, chunk_size=5)
    assert kl.dtype == torch.float32 and kl.abs().max() < 1e-6
    kl.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    assert hidden.grad.abs().max() < 1e-5 and weight.grad.abs().max() < 1e-5


def test_full_kl_from_hidden_bad_input():
    h, w = torch.zeros(2, 3, 4), torch.zeros(7, 4)
    with pytest.raises(ValueError, match="vocabulary"):
        full_kl_from_hidden(h, w, None, h, torch.zeros(8, 4), None)
    with pytest.raises(ValueError, match="same positions"):
        full_kl_from_hidden(h, w, None, h[:, :2], w, None)
    with pytest.raises(ValueError, match=r"\(V, H\)"):
        full_kl_from_hidden(h, torch.zeros(7, 5), None, h, w, None)
    with pytest.raises(ValueError, match="bias"):
        full_kl_from_hidden(h, w, torch.zeros(6), h, w, None)
