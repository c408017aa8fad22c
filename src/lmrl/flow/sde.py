"""The flow-matching sampler made stochastic: one denoising step as a Gaussian with a log-prob.

Convention (rectified flow, as SD3 and Flow-GRPO): ``x_t = (1 - t) x_0 + t eps``, ``t = 1`` is
noise and ``t = 0`` data; the model predicts the velocity ``v = eps - x_0``, and sampling runs
``t`` from 1 down to 0 (``dt = t_next - t < 0``). The deterministic sampler is Euler's step
``x_next = x + v dt`` (`ode_step`).

Flow-GRPO (Liu et al. 2025, arXiv:2505.05470) replaces it with the reverse-time SDE that has
the same marginals: with the score of a rectified flow, ``grad log p_t(x) = -(x + (1 - t) v) / t``,
the step is

    x_next = x + [v + sigma_t^2 / (2 t) (x + (1 - t) v)] dt + sigma_t sqrt(-dt) z,   z ~ N(0, I)
    sigma_t = a sqrt(t / (1 - t))                       (a = ``noise_level``, 0.7 in the paper)

so each step is ``N(mean, (sigma_t sqrt(-dt))^2 I)`` and its log-density is the policy's
log-prob of the action ``x_next`` (`sde_step`). At ``t = 1``, ``1 - t`` is replaced by
``1 - t_cap`` (the schedule's second value) so that the first step's noise stays finite. With
``a -> 0`` the mean is Euler's step.

``reduce`` chooses the log-prob of a step: ``"sum"`` over the latent's dimensions is the exact
log-density; ``"mean"`` (Flow-GRPO's code) divides it by the number of dimensions, which keeps
ratios near 1 for any image size (hence its clip range of ~1e-4).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["SdeStep", "gaussian_kl", "noise_std", "ode_step", "schedule", "sde_step"]

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def schedule(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """The ``num_steps + 1`` times ``1 = t_0 > t_1 > ... > t_K = 0`` of a sampler.

    Uniform in ``s``, then shifted as SD3 does (``t = shift s / (1 + (shift - 1) s)``; a shift
    above 1 spends more steps near the noise).

    Raises:
        ValueError: ``num_steps < 1`` or ``shift <= 0``.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * s / (1 + (shift - 1) * s)).float()


def _column(t: torch.Tensor | float, x: torch.Tensor) -> torch.Tensor:
    """``t`` (a scalar or (B,)) shaped to broadcast against ``x`` (B, ...)."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    if t.dim() == 0:
        t = t.expand(x.shape[0])
    return t.reshape(-1, *([1] * (x.dim() - 1)))


def noise_std(t: torch.Tensor, noise_level: float, t_cap: float) -> torch.Tensor:
    """``sigma_t = noise_level * sqrt(t / (1 - t))``, with ``1 - t_cap`` where ``t = 1``."""
    denom = 1 - torch.where(t >= 1, torch.as_tensor(t_cap, dtype=t.dtype), t)
    return noise_level * torch.sqrt(t / denom)


class SdeStep(NamedTuple):
    """One SDE step: ``sample`` (B, ...) the next latent; ``log_prob`` (B,); ``mean`` (B, ...)
    the Gaussian's mean (carries the model's gradient); ``std`` (B, 1, ...) its standard
    deviation ``sigma_t sqrt(-dt)``; ``sigma`` (B, 1, ...) ``sigma_t`` (Flow-GRPO scales its loss
    by ``2.25 sigma_t``)."""

    sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    sigma: torch.Tensor


def sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    t: torch.Tensor | float,
    t_next: torch.Tensor | float,
    noise_level: float,
    t_cap: float,
    *,
    sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    reduce: str = "mean",
) -> SdeStep:
    """One step of the marginal-preserving SDE from ``t`` to ``t_next < t``.

    Args:
        x: (B, ...) the latent at ``t``.
        v: (B, ...) the model's velocity at (x, t).
        t, t_next: scalars or (B,) times, ``0 <= t_next < t <= 1``.
        noise_level: ``a`` of ``sigma_t = a sqrt(t / (1 - t))``; 0 gives Euler's step.
        t_cap: the schedule's second time, standing in for ``t`` in ``1 - t`` at ``t = 1``.
        sample: (B, ...) the next latent whose log-prob is wanted (a recomputation); None =
            draw one.
        generator: the random generator of the draw.
        reduce: ``"mean"`` or ``"sum"`` of the per-dimension log-density.

    Returns:
        `SdeStep`. With ``noise_level = 0`` the step is deterministic and its log-prob 0.

    Raises:
        ValueError: an unknown ``reduce``.
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    x, v = x.float(), v.float()
    tc, tn = _column(t, x), _column(t_next, x)
    dt = tn - tc
    sigma = noise_std(tc, noise_level, t_cap)
    mean = x + (v + sigma**2 / (2 * tc) * (x + (1 - tc) * v)) * dt
    std = sigma * torch.sqrt(-dt)
    if noise_level == 0:
        out = mean if sample is None else sample.float()
        return SdeStep(out, torch.zeros(x.shape[0], device=x.device), mean, std, sigma)
    if sample is None:
        z = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        sample = mean + std * z
    sample = sample.float().detach()
    dims = tuple(range(1, x.dim()))
    log_density = -((sample - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    log_prob = log_density.sum(dims) if reduce == "sum" else log_density.mean(dims)
    return SdeStep(sample, log_prob, mean, std, sigma)


def ode_step(x: torch.Tensor, v: torch.Tensor, t, t_next) -> torch.Tensor:
    """Euler's step of the probability-flow ODE: ``x + v (t_next - t)``."""
    x = x.float()
    return x + v.float() * (_column(t_next, x) - _column(t, x))


def gaussian_kl(
    mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, reduce: str = "mean"
) -> torch.Tensor:
    """KL between two Gaussian steps of one standard deviation: ``||mean - ref_mean||^2 /
    (2 std^2)``, summed or averaged (``reduce``, as the log-prob) over the latent's dimensions.

    ``std`` is the step's own (``sigma_t sqrt(-dt)``). Flow-GRPO's code divides by
    ``sigma_t^2`` instead, which is this KL times ``-dt`` per step (a rescaled ``beta``).

    Returns:
        (B,) KL per sample.
    """
    dims = tuple(range(1, mean.dim()))
    per_dim = (mean.float() - ref_mean.float()) ** 2 / (2 * std**2)
    return per_dim.sum(dims) if reduce == "sum" else per_dim.mean(dims)
