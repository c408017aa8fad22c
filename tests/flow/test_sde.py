"""The SDE step of Flow-GRPO: its log-prob, its limit at zero noise, its marginals, the KL."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from lmrl.flow.sde import gaussian_kl, noise_std, ode_step, schedule, sde_step


def test_schedule_runs_from_noise_to_data_and_shift_spends_steps_near_noise():
    plain, shifted = schedule(10), schedule(10, shift=3.0)
    for times in (plain, shifted):
        assert times[0] == 1 and times[-1] == 0 and len(times) == 11
        assert (times[1:] < times[:-1]).all()
    assert torch.allclose(plain, torch.linspace(1, 0, 11))
    assert (shifted[1:-1] > plain[1:-1]).all()
    with pytest.raises(ValueError, match="num_steps"):
        schedule(0)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_the_step_log_prob_is_the_gaussian_log_density(reduce):
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(6, 3, 4, 4, generator=gen), torch.randn(6, 3, 4, 4, generator=gen)
    t = torch.tensor([1.0, 0.9, 0.7, 0.5, 0.3, 0.1])
    t_next = t - 0.1
    a, cap = 0.7, 0.9
    step = sde_step(x, v, t, t_next, a, cap, generator=gen, reduce=reduce)
    # the same Gaussian written out from the reverse SDE: drift v - sigma^2/2 * score,
    # score = -(x + (1 - t) v) / t, noise sigma sqrt(|dt|), 1 - t at t = 1 replaced by 1 - cap
    tb, dt = t.view(-1, 1, 1, 1), (t_next - t).view(-1, 1, 1, 1)
    sigma = a * torch.sqrt(tb / (1 - torch.where(tb == 1, torch.tensor(cap), tb)))
    score = -(x + (1 - tb) * v) / tb
    mean = x + (v - sigma**2 / 2 * score) * dt
    density = Normal(mean, sigma * torch.sqrt(-dt)).log_prob(step.sample)
    expected = density.sum((1, 2, 3))
    if reduce == "mean":
        expected = expected / (3 * 4 * 4)
    assert torch.allclose(step.mean, mean, atol=1e-5)
    assert torch.allclose(step.log_prob, expected, atol=1e-4)
    # recomputing the log-prob of a given sample gives the same number
    again = sde_step(x, v, t, t_next, a, cap, sample=step.sample, reduce=reduce)
    assert torch.equal(again.log_prob, step.log_prob)


def test_at_zero_noise_the_sde_is_eulers_step():
    gen = torch.Generator().manual_seed(1)
    x, v = torch.randn(5, 2, generator=gen), torch.randn(5, 2, generator=gen)
    t, t_next = torch.full((5,), 0.6), torch.full((5,), 0.5)
    euler = ode_step(x, v, t, t_next)
    assert torch.allclose(sde_step(x, v, t, t_next, 1e-6, 0.9).mean, euler, atol=1e-6)
    exact = sde_step(x, v, t, t_next, 0.0, 0.9)
    assert torch.equal(exact.sample, euler) and (exact.log_prob == 0).all()
    assert torch.allclose(euler, x + v * (t_next - t).unsqueeze(1))


def _gaussian_velocity(mu: float, s: float):
    """The exact velocity field of x_0 ~ N(mu, s^2) in 1-D: E[eps - x_0 | x_t]."""

    def v(x, t):
        t = t.view(-1, 1)
        var = (1 - t) ** 2 * s**2 + t**2
        return -mu + (t - (1 - t) * s**2) / var * (x - (1 - t) * mu)

    return v


def test_the_sde_preserves_the_marginals_of_a_known_flow():
    """Data N(2, 0.5^2): from the same noise, the SDE's samples at t = 0.5 and t = 0 have the
    moments of the exact marginals N((1-t) mu, (1-t)^2 s^2 + t^2), as the ODE's do."""
    mu, s, steps, n = 2.0, 0.5, 200, 200_000
    v = _gaussian_velocity(mu, s)
    times = schedule(steps)
    gen = torch.Generator().manual_seed(0)
    x_sde = x_ode = torch.randn(n, 1, generator=gen)
    halfway = {}
    for j in range(steps):
        t, t_next = times[j].expand(n), times[j + 1].expand(n)
        x_sde = sde_step(x_sde, v(x_sde, t), t, t_next, 0.7, float(times[1]), generator=gen).sample
        x_ode = ode_step(x_ode, v(x_ode, t), t, t_next)
        if j + 1 == steps // 2:
            halfway = {"sde": x_sde.clone(), "ode": x_ode.clone()}
    for t, samples in ((0.5, halfway), (0.0, {"sde": x_sde, "ode": x_ode})):
        want_mean, want_std = (1 - t) * mu, math.sqrt((1 - t) ** 2 * s**2 + t**2)
        for name, x in samples.items():
            assert x.mean().item() == pytest.approx(want_mean, abs=0.02), (name, t)
            assert x.std().item() == pytest.approx(want_std, abs=0.02), (name, t)
    # and the SDE's noise is real: its samples are not the ODE's
    assert (x_sde - x_ode).abs().mean() > 0.1


def test_noise_std_is_capped_at_t_one():
    t = torch.tensor([1.0, 0.5])
    got = noise_std(t, 0.7, t_cap=0.9)
    assert got[0] == pytest.approx(0.7 * math.sqrt(1 / 0.1))
    assert got[1] == pytest.approx(0.7)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_gaussian_kl_is_the_closed_form_and_zero_for_one_model(reduce):
    gen = torch.Generator().manual_seed(2)
    m1, m2 = torch.randn(4, 3, 5, generator=gen), torch.randn(4, 3, 5, generator=gen)
    std = torch.rand(4, 1, 1, generator=gen) + 0.1
    got = gaussian_kl(m1, m2, std, reduce)
    want = kl_divergence(Normal(m1, std.expand_as(m1)), Normal(m2, std.expand_as(m2)))
    want = want.sum((1, 2)) if reduce == "sum" else want.mean((1, 2))
    assert torch.allclose(got, want, atol=1e-5)
    assert (gaussian_kl(m1, m1, std, reduce) == 0).all()
