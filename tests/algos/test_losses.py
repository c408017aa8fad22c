"""Policy losses: hand-worked values, the registry contract, and properties (hypothesis)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.algos.agg import LOSS_AGG_MODES, AggNorm, agg_loss
from lmrl.algos.losses import loss_hyperparameters, policy_losses

METRIC_KEYS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")
# every hyperparameter of every loss, with the config's defaults
ALL_HYPERPARAMETERS = {
    "clip_ratio": 0.2,
    "clip_ratio_low": None,
    "clip_ratio_high": None,
    "clip_ratio_c": 3.0,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
    "clip_cov_ratio": 0.0002,
    "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 0.0002,
    "ppo_kl_coef": 1.0,
}
# losses that pick tokens within the (micro-)batch they are given, as verl's do: a batch cut
# into micro-batches picks otherwise than the whole
PICK_PER_BATCH = ("clip_cov",)


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def run(name, old, new, adv, mask, **kw):
    """Loss, metrics and d loss / d log_prob of the named policy loss (torch's generator
    reseeded first: ``clip_cov`` draws its tokens from it)."""
    torch.manual_seed(0)
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = policy_losses.get(name)(old, log_prob, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), metrics, grad


# ------------------------------------------------------------------------------------------
# vanilla (PPO)
# ------------------------------------------------------------------------------------------


def test_vanilla_seed_002_example():
    # seed 002 §3.5: old -2.0, new -1.5 -> ratio e^0.5 = 1.65; A = 0.5, clip 0.2:
    # unclipped -0.5 * 1.65 = -0.825, clipped -0.5 * 1.2 = -0.6, max = -0.6.
    loss, m, grad = run("vanilla", t([[-2.0]]), t([[-1.5]]), t([[0.5]]), t([[True]], torch.bool))
    assert loss.item() == pytest.approx(-0.6)
    assert m["pg_clipfrac"].item() == 1.0  # the clipped branch was taken
    assert m["pg_clipfrac_lower"].item() == 0.0
    assert m["ppo_kl"].item() == pytest.approx(-0.5)  # mean(old - new)
    assert grad.item() == 0.0  # a clipped token sends no gradient


def test_vanilla_dual_clip_bounds_negative_advantage():
    # A = -1 on both tokens. Token 0: ratio 4 > clip_ratio_c = 3: PPO's max(-A r, -A clip(r))
    # = max(4, 1.2) = 4, dual clip takes min(4, -A c = 3) = 3. Token 1: ratio 2 < c: loss 2.
    old = t([[0.0, 0.0]])
    new = t([[math.log(4.0), math.log(2.0)]])
    adv = t([[-1.0, -1.0]])
    mask = t([[1, 1]], torch.bool)
    loss, m, grad = run("vanilla", old, new, adv, mask, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(0.5)  # only token 0
    assert m["pg_clipfrac"].item() == 0.0  # clip(r) never beat the unclipped term here
    # token 0 is a constant (-A c): no gradient; token 1: d(-A r)/d lp = -A r = 2, / 2 tokens
    close(grad, [[0.0, 1.0]])


def test_vanilla_clip_higher_asymmetric_bounds():
    # low 0.2, high 0.28: the ratio is clipped to [0.8, 1.28].
    #   A=+1, r=1.5: max(-1.5, -1.28) = -1.28   (clipped; symmetric 0.2 would give -1.2)
    #   A=+1, r=0.5: max(-0.5, -0.8)  = -0.5    (no clip below for a good action)
    #   A=-1, r=0.5: max(0.5, 0.8)    =  0.8    (clipped at 1 - low)
    #   A=-1, r=1.5: max(1.5, 1.28)   =  1.5, dual clip min(1.5, 3) = 1.5
    new = t([[math.log(1.5), math.log(0.5), math.log(0.5), math.log(1.5)]])
    old = torch.zeros_like(new)
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones_like(new, dtype=torch.bool)
    loss, m, grad = run(
        "vanilla", old, new, adv, mask, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5) / 4)
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)  # tokens 0 and 2
    # gradients (-A r / 4) only where unclipped: tokens 1 and 3
    close(grad, [[0.0, -0.5 / 4, 0.0, 1.5 / 4]])


def test_vanilla_rejects_clip_ratio_c_at_most_one():
    x = torch.zeros(1, 2)
    for c in (1.0, 0.5):
        with pytest.raises(ValueError, match="clip_ratio_c"):
            policy_losses.get("vanilla")(x, x, x, x.bool(), clip_ratio_c=c)


def test_negative_clip_ratio_is_named():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_ratio_high"):
        policy_losses.get("vanilla")(x, x, x, x.bool(), clip_ratio_high=-0.1)


def test_unknown_loss_agg_mode_and_loss_name():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        policy_losses.get("vanilla")(x, x, x, x.bool(), "token-median")
    with pytest.raises(ValueError, match="vanilla"):  # lists the valid names
        policy_losses.get("ppo2")


# ------------------------------------------------------------------------------------------
# GSPO and GMPO on 2x3 tensors
# ------------------------------------------------------------------------------------------


def test_gspo_by_hand():
    # row 0: mask [1,1,0], log_prob - old = [0.2, 0.1] -> s_0 = exp(0.15) = 1.161834, A = +1:
    #        inside [0.8, 1.2], token loss -1.161834 on both tokens (row mean -1.161834).
    # row 1: mask [1,1,1], log_prob - old = [-0.3, -0.3, -0.6] -> s_1 = exp(-0.4) = 0.6703,
    #        A = -1: max(0.6703, 0.8) = 0.8, clipped on all 3 tokens (row mean 0.8).
    # seq-mean-token-mean: (-1.161834 + 0.8) / 2 = -0.180917.
    old = t([[-1.0, -1.0, 7.0], [-0.5, -0.5, -0.5]])
    new = t([[-0.8, -0.9, float("nan")], [-0.8, -0.8, -1.1]])
    adv = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = t([[1, 1, 0], [1, 1, 1]], torch.bool)
    loss, m, grad = run("gspo", old, new, adv, mask)
    assert loss.item() == pytest.approx((-math.exp(0.15) + 0.8) / 2)
    assert m["pg_clipfrac"].item() == pytest.approx(3 / 5)
    assert m["pg_clipfrac_lower"].item() == 0.0
    assert m["ppo_kl"].item() == pytest.approx(-(0.2 + 0.1 - 0.3 - 0.3 - 0.6) / 5)
    # token gradient of -A * sg(s_i) * pi / sg(pi) is -A s_i; row 0: / 2 tokens / 2 seqs
    e = -math.exp(0.15) / 4
    close(grad, [[e, e, 0.0], [0.0, 0.0, 0.0]])
    # the aggregation is GSPO's own, whatever mode is asked for
    loss_tm, _, _ = run("gspo", old, new, adv, mask, loss_agg_mode="token-mean")
    assert loss_tm.item() == pytest.approx(loss.item())


def test_geo_mean_by_hand():
    # clip low 0.2, high 0.4, in log space.
    # row 0: A = +1, mask [1,1,0], d = [0.5, -0.1]: A > 0 caps d at 0.4 -> [0.4, -0.1],
    #        mean 0.15, ratio e^0.15, sequence loss -e^0.15 = -1.161834.
    # row 1: A = -1, mask [1,1,1], d = [-0.5, 0.6, 0.2]: A < 0 floors d at -0.2 ->
    #        [-0.2, 0.6, 0.2], mean 0.2, ratio e^0.2, sequence loss +e^0.2 = 1.221403.
    # loss = mean over the 2 sequences = 0.029784.
    # clipfrac counts d outside [-0.2, 0.4]: token (0,0) with A > 0 -> 1/5;
    # tokens (1,0) and (1,1) with A < 0 -> 2/5 (as in verl: clamp changed d, chosen or not).
    old = t([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    new = t([[-0.5, -1.1, 1e6], [-1.5, -0.4, -0.8]])
    adv = t([[1.0, 1.0, 1e6], [-1.0, -1.0, -1.0]])
    mask = t([[1, 1, 0], [1, 1, 1]], torch.bool)
    loss, m, grad = run("geo_mean", old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.4)
    assert loss.item() == pytest.approx((-math.exp(0.15) + math.exp(0.2)) / 2)
    assert m["pg_clipfrac"].item() == pytest.approx(1 / 5)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(2 / 5)
    assert m["ppo_kl"].item() == pytest.approx(-(0.5 - 0.1 - 0.5 + 0.6 + 0.2) / 5)
    # gradients: clipped tokens 0; others -A_i * ratio_i / |o_i| / 2 sequences
    g0, g1 = -math.exp(0.15) / 4, math.exp(0.2) / 6
    close(grad, [[0.0, g0, 0.0], [0.0, g1, g1]])


def test_geo_mean_rollout_weights_enter_as_geometric_mean():
    # one sequence, ratio 1, A = 1: loss -1 times the geometric mean of weights [4, 1] = 2
    x = torch.zeros(1, 2, dtype=torch.float64)
    loss, _, _ = run(
        "geo_mean",
        x,
        x,
        x + 1,
        torch.ones(1, 2, dtype=torch.bool),
        rollout_is_weights=t([[4.0, 1.0]]),
    )
    assert loss.item() == pytest.approx(-2.0)


# ------------------------------------------------------------------------------------------
# CISPO, SAPO, reinforce
# ------------------------------------------------------------------------------------------


def test_cispo_by_hand():
    # token 0: old -1, new -0.5 -> r = e^0.5 = 1.649, clipped to 1 + 0.28; A = 2:
    #          loss -1.28 * 2 * (-0.5) = 1.28, gradient -1.28 * 2 = -2.56 (the clip does not
    #          kill it: CISPO keeps every token's gradient).
    # token 1: r = 1, A = -1: loss -1 * (-1) * (-1) = -1, gradient +1.
    # token-mean: (1.28 - 1) / 2 = 0.14; gradients / 2.
    old = t([[-1.0, -1.0]])
    new = t([[-0.5, -1.0]])
    adv = t([[2.0, -1.0]])
    mask = t([[1, 1]], torch.bool)
    loss, m, grad = run("cispo", old, new, adv, mask, clip_ratio_low=1.0, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(0.14)
    close(grad, [[-1.28, 0.5]])
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)
    assert m["pg_clipfrac_lower"].item() == 0.0
    assert m["ppo_kl"].item() == pytest.approx(-0.25)  # mean(old - new) = (-0.5 + 0) / 2


def test_sapo_by_hand():
    # gate f(r) = (4 / tau) sigmoid(tau (r - 1)); loss -f(r) A.
    # row 0 (2 tokens): A = +1, r = 1, tau_pos = 1: f = 4 * 0.5 = 2, loss -2; slope f'(1) = 1
    #        so d loss / d lp = -A f'(r) r = -1 per token.
    # row 1 (1 valid token): A = -1, r = e^0.5, tau_neg = 1.05:
    #        f = (4 / 1.05) sigmoid(1.05 (e^0.5 - 1)) = 2.529512, loss +2.529512,
    #        gradient 4 s (1 - s) r with s = sigmoid(1.05 (e^0.5 - 1)) -> 1.471352.
    # seq-mean-token-mean: (-2 + 2.529512) / 2 = 0.264756; gradients / tokens / 2.
    old = t([[-1.0, -1.0], [-1.0, -1.0]])
    new = t([[-1.0, -1.0], [-0.5, 50.0]])
    adv = t([[1.0, 1.0], [-1.0, -1.0]])
    mask = t([[1, 1], [1, 0]], torch.bool)
    loss, m, grad = run("sapo", old, new, adv, mask, tau_pos=1.0, tau_neg=1.05)
    assert loss.item() == pytest.approx(0.26475610180193)
    close(grad, [[-0.25, -0.25], [0.7356759157604019, 0.0]])
    assert m["pg_clipfrac"].item() == 0.0 and m["pg_clipfrac_lower"].item() == 0.0
    # verl's aggregation: a token-mean request still aggregates seq-mean-token-mean
    loss_tm, _, _ = run("sapo", old, new, adv, mask, loss_agg_mode="token-mean")
    assert loss_tm.item() == pytest.approx(loss.item())
    # the temperatures are live: a larger tau_neg changes the negative token's gate
    loss_hot, _, _ = run("sapo", old, new, adv, mask, tau_neg=2.0)
    assert loss_hot.item() != pytest.approx(loss.item())
    with pytest.raises(ValueError, match="tau_neg"):
        run("sapo", old, new, adv, mask, tau_neg=0.0)


def test_reinforce_by_hand():
    # per token -A * lp * w: -1 * (-0.5) * 2 = 1 and -(-2) * (-1) * 1 = -2; token-mean -0.5.
    # gradient -A w / 2 = [-1, 1]. ppo_kl = mean(old - lp) = ((-1 + 0.5) + (-1 + 1)) / 2.
    old = t([[-1.0, -1.0]])
    new = t([[-0.5, -1.0]])
    adv = t([[1.0, -2.0]])
    mask = t([[1, 1]], torch.bool)
    w = t([[2.0, 1.0]])
    loss, m, grad = run("reinforce", old, new, adv, mask, rollout_is_weights=w)
    assert loss.item() == pytest.approx(-0.5)
    close(grad, [[-1.0, 1.0]])
    assert m["ppo_kl"].item() == pytest.approx(-0.25)
    assert m["pg_clipfrac"].item() == 0.0


def test_rollout_weights_scale_per_token_loss():
    # vanilla with ratio 1: per-token loss -A; weights [3, 0] leave only 3 * -A_0 / 2 tokens
    x = torch.zeros(1, 2, dtype=torch.float64)
    loss, _, grad = run(
        "vanilla",
        x,
        x,
        t([[1.0, 5.0]]),
        torch.ones(1, 2, dtype=torch.bool),
        rollout_is_weights=t([[3.0, 0.0]]),
    )
    assert loss.item() == pytest.approx(-1.5)
    close(grad, [[-1.5, 0.0]])


# ------------------------------------------------------------------------------------------
# clip_cov / kl_cov (arXiv:2505.22617)
# ------------------------------------------------------------------------------------------

# four tokens on-policy (ratio 1): mean A = 0.5, mean log_prob = -1.0, so the covariances
# (A - 0.5)(log_prob + 1) are 1.5 * 1.0 = 1.5, -1.5 * 1.0 = -1.5, 0.5 * -1.0 = -0.5 and
# -0.5 * -1.0 = 0.5: only the first lies in clip_cov's default band (1, 5)
COV_LOGP = [[0.0, 0.0, -2.0, -2.0]]
COV_ADV = [[2.0, -1.0, 1.0, 0.0]]


def test_clip_cov_drops_the_gradient_of_a_high_covariance_token():
    lp, adv, mask = t(COV_LOGP), t(COV_ADV), t([[True] * 4], torch.bool)
    loss, m, grad = run("clip_cov", lp, lp, adv, mask, clip_cov_ratio=0.25)
    # the first token dropped; the others -A r with r = 1, token-mean over all four
    close(loss, (1.0 - 1.0 - 0.0) / 4)
    close(grad, [[0.0, 0.25, -0.25, 0.0]])
    assert m["cov_clipfrac"].item() == 0.25 and m["pg_clipfrac"].item() == 0.0
    # with no token in the band, it is PPO's clip: the vanilla loss without its dual clip
    for lb in (1.6, -10.0):  # nothing in (1.6, 5); or every token: ratio 0 still drops one
        loss, m, grad = run("clip_cov", lp, lp, adv, mask, clip_cov_lb=lb, clip_cov_ratio=0.0)
        dropped = 0 if lb > 1.5 else 1
        assert m["cov_clipfrac"].item() == dropped / 4
        if not dropped:
            _, _, want = run("vanilla", lp, lp, adv, mask, clip_ratio_c=1e9)
            torch.testing.assert_close(grad, want)


def test_clip_cov_counts_a_fraction_of_the_valid_tokens_and_skips_clipped_ones():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(8, 16, generator=g, dtype=torch.float64)
    adv = torch.randn(8, 16, generator=g, dtype=torch.float64)
    mask = torch.rand(8, 16, generator=g) < 0.75
    kw = {"clip_cov_lb": -1e9, "clip_cov_ub": 1e9}  # every token eligible
    _, m, grad = run("clip_cov", old, old, adv, mask, clip_cov_ratio=0.5, **kw)
    valid = int(mask.sum())
    assert m["cov_clipfrac"].item() == pytest.approx(int(0.5 * valid) / valid)
    assert int(((grad == 0) & mask).sum()) == int(0.5 * valid)
    # a token the PPO clip took is never drawn: push every ratio out of range
    new = old + torch.where(adv > 0, 1.0, -1.0).to(old.dtype)
    _, m, grad = run("clip_cov", old, new, adv, mask, clip_cov_ratio=1.0, **kw)
    assert m["pg_clipfrac"].item() == 1.0 and m["cov_clipfrac"].item() == 0.0


def test_clip_cov_and_kl_cov_check_their_hyperparameters():
    x = t([[0.1]])
    mask = t([[True]], torch.bool)
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        policy_losses.get("clip_cov")(x, x, x, mask, clip_cov_ratio=1.5)
    with pytest.raises(ValueError, match="clip_cov_lb"):
        policy_losses.get("clip_cov")(x, x, x, mask, clip_cov_lb=5.0, clip_cov_ub=1.0)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        policy_losses.get("kl_cov")(x, x, x, mask, kl_cov_ratio=-0.1)
    with pytest.raises(ValueError, match="ppo_kl_coef"):
        policy_losses.get("kl_cov")(x, x, x, mask, ppo_kl_coef=-1.0)


def test_kl_cov_penalizes_the_tokens_of_largest_covariance():
    lp, adv, mask = t(COV_LOGP), t(COV_ADV), t([[True] * 4], torch.bool)
    # on-policy the penalty |log r| has no gradient at r = 1: the plain policy gradient
    loss, m, grad = run("kl_cov", lp, lp, adv, mask, kl_cov_ratio=0.5)
    close(grad, [[-0.5, 0.25, -0.25, 0.0]])
    assert m["cov_klfrac"].item() == 0.5  # tokens 1 and 4 (covariances 1.5 and 0.5)
    # off-policy by +0.1 each, the two chosen tokens add coef * |log r| (the selection
    # uses the current log-probs, which moved together: the same two)
    new = lp + 0.1
    r = math.exp(0.1)
    loss, m, grad = run("kl_cov", lp, new, adv, mask, kl_cov_ratio=0.5, ppo_kl_coef=2.0)
    close(loss, (-2.0 * r + 2 * 0.1 + 1.0 * r - 1.0 * r + 0.0 + 2 * 0.1) / 4)
    close(grad, [[(-2.0 * r + 2.0) / 4, r / 4, -r / 4, 2.0 / 4]])
    # fewer than one token's worth: nothing penalized, the unclipped surrogate
    loss, m, grad = run("kl_cov", lp, new, adv, mask)
    assert m["cov_klfrac"].item() == 0.0
    close(grad, [[-2.0 * r / 4, r / 4, -r / 4, 0.0]])


# ------------------------------------------------------------------------------------------
# contract over every registry entry
# ------------------------------------------------------------------------------------------


def _random_batch(seed: int, b: int, tt: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, tt, generator=g, dtype=dtype) * 3
    new = old + 0.3 * torch.randn(b, tt, generator=g, dtype=dtype)
    adv = torch.randn(b, tt, generator=g, dtype=dtype)
    mask = torch.rand(b, tt, generator=g) < 0.7
    mask[:, 0] = True
    return old, new, adv, mask


@pytest.mark.parametrize("name", policy_losses.names())
def test_contract(name):
    old, new, adv, mask = _random_batch(0, 4, 5, torch.float32)
    fn = policy_losses.get(name)
    log_prob = new.clone().requires_grad_(True)
    # every loss takes its own declared hyperparameters, as the actor passes them
    hyper = {k: ALL_HYPERPARAMETERS[k] for k in loss_hyperparameters(name)}
    loss, metrics = fn(old, log_prob, adv, mask, "token-mean", rollout_is_weights=None,
                       norm=None, **hyper)  # fmt: skip
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert set(METRIC_KEYS) <= set(metrics)
    for key in METRIC_KEYS:
        assert metrics[key].dim() == 0 and not metrics[key].requires_grad, key
        assert torch.isfinite(metrics[key]), key
    loss.backward()
    assert log_prob.grad is not None and torch.isfinite(log_prob.grad).all()
    assert log_prob.grad.abs().sum() > 0
    assert (log_prob.grad[~mask] == 0).all()

    bad = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="advantages"):
        fn(old, new, bad, mask)
    with pytest.raises(ValueError, match="rollout_is_weights"):
        fn(old, new, adv, mask, rollout_is_weights=bad)
    with pytest.raises(ValueError, match="log_prob"):
        fn(old, new[0], adv, mask)
    # a hyperparameter the loss does not declare is an error naming it
    foreign = next(k for k in ALL_HYPERPARAMETERS if k not in hyper)
    with pytest.raises(TypeError, match=foreign):
        fn(old, new, adv, mask, **{foreign: ALL_HYPERPARAMETERS[foreign]})


def test_a_misspelt_hyperparameter_is_an_error():
    old, new, adv, mask = _random_batch(0, 2, 3)
    with pytest.raises(TypeError, match="clip_ration_high"):
        policy_losses.get("vanilla")(old, new, adv, mask, clip_ration_high=0.28)
    with pytest.raises(TypeError, match="tau_pos"):  # sapo's, not reinforce's
        policy_losses.get("reinforce")(old, new, adv, mask, tau_pos=1.0)


def test_loss_hyperparameters_are_the_declared_keywords():
    clip = ("clip_ratio", "clip_ratio_low", "clip_ratio_high")
    assert loss_hyperparameters("vanilla") == (*clip, "clip_ratio_c")
    assert loss_hyperparameters("gspo") == loss_hyperparameters("cispo") == clip
    assert loss_hyperparameters("geo_mean") == clip
    assert loss_hyperparameters("sapo") == ("tau_pos", "tau_neg")
    assert loss_hyperparameters("reinforce") == ()
    assert loss_hyperparameters("clip_cov") == (*clip, "clip_cov_ratio", "clip_cov_lb",
                                                "clip_cov_ub")  # fmt: skip
    assert loss_hyperparameters("kl_cov") == ("kl_cov_ratio", "ppo_kl_coef")
    for name in policy_losses.names():  # the actor knows every one of them
        assert set(loss_hyperparameters(name)) <= set(ALL_HYPERPARAMETERS), name
    with pytest.raises(ValueError, match="vanilla"):
        loss_hyperparameters("ppo2")


# ------------------------------------------------------------------------------------------
# properties
# ------------------------------------------------------------------------------------------

PROP = settings(max_examples=50, deadline=None)


@PROP
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 4),
    tt=st.integers(1, 5),
    junk=st.sampled_from([float("nan"), 1e30, -1e30, float("inf")]),
)
def test_masked_positions_change_nothing(seed, b, tt, junk):
    old, new, adv, mask = _random_batch(seed, b, tt)
    w = torch.rand(b, tt, generator=torch.Generator().manual_seed(seed + 1), dtype=old.dtype)

    def corrupt(x):
        return torch.where(mask, x, torch.full_like(x, junk))

    for name in policy_losses.names():
        for mode in LOSS_AGG_MODES:
            ref = run(name, old, new, adv, mask, loss_agg_mode=mode, rollout_is_weights=w)
            got = run(
                name,
                corrupt(old),
                corrupt(new),
                corrupt(adv),
                mask,
                loss_agg_mode=mode,
                rollout_is_weights=corrupt(w),
            )
            assert torch.equal(ref[0], got[0]), (name, mode)
            assert torch.equal(ref[2], got[2]), (name, mode)
            for key in METRIC_KEYS:
                assert torch.equal(ref[1][key], got[1][key]), (name, mode, key)


@PROP
@given(seed=st.integers(0, 10_000), b=st.integers(1, 4), tt=st.integers(1, 5))
def test_vanilla_at_ratio_one_is_the_plain_policy_gradient(seed, b, tt):
    old, _, adv, mask = _random_batch(seed, b, tt)
    for mode in LOSS_AGG_MODES:
        loss, m, grad = run("vanilla", old, old, adv, mask, loss_agg_mode=mode)
        assert loss.item() == pytest.approx(agg_loss(-adv, mask, mode).item(), abs=1e-12)
        # the gradient of -A * log_prob, aggregated the same way
        lp = old.clone().requires_grad_(True)
        (expected,) = torch.autograd.grad(agg_loss(-adv * lp, mask, mode), lp)
        torch.testing.assert_close(grad, expected)
        assert m["pg_clipfrac"].item() == 0.0 and m["ppo_kl"].item() == 0.0
        if mode == "token-mean":
            assert loss.item() == pytest.approx(-adv[mask].mean().item(), abs=1e-12)


@PROP
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(2, 7),
    tt=st.integers(1, 5),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=3, unique=True),
    with_weights=st.booleans(),
)
def test_micro_batch_invariance(seed, b, tt, cuts, with_weights):
    # splitting rows into pieces, each with the whole batch's AggNorm, sums to the whole
    old, new, adv, mask = _random_batch(seed, b, tt)
    mask[0] = False  # an empty sequence must not count either
    w = torch.rand(b, tt, dtype=old.dtype) + 0.5 if with_weights else None
    bounds = [0, *sorted(c for c in cuts if c < b), b]
    norm = AggNorm.from_mask(mask)
    for name in policy_losses.names():
        if name in PICK_PER_BATCH:
            continue
        for mode in LOSS_AGG_MODES:
            whole_loss, _, whole_grad = run(
                name, old, new, adv, mask, loss_agg_mode=mode, rollout_is_weights=w
            )
            total = torch.zeros((), dtype=old.dtype)
            grads = []
            for lo, hi in itertools.pairwise(bounds):
                piece = slice(lo, hi)
                loss, _, grad = run(
                    name,
                    old[piece],
                    new[piece],
                    adv[piece],
                    mask[piece],
                    loss_agg_mode=mode,
                    rollout_is_weights=None if w is None else w[piece],
                    norm=norm,
                )
                total = total + loss
                grads.append(grad)
            torch.testing.assert_close(total, whole_loss, msg=f"{name} {mode}")
            torch.testing.assert_close(torch.cat(grads), whole_grad, msg=f"{name} {mode}")
