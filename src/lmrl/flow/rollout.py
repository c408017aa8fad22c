"""Flow-GRPO's rollout: sample images (or points) along an SDE trajectory, keeping every step.

A velocity model is called as ``model(x, t, cond) -> v``: ``x`` (B, ...) latents, ``t`` (B,)
times in [0, 1], ``cond`` (B, ...) the prompts' conditioning (class ids, attribute ids, text
embeddings). `FlowSampler.sample` returns a `lmrl.batch.Batch` whose "tokens" are the ``K``
denoising steps:

- ``latents`` (B, K, ...): ``x`` before each step; ``next_latents`` (B, K, ...): after it;
- ``log_probs`` (B, K): each step's log-prob under the sampling policy (0 on ODE steps);
- ``timesteps`` (B, K) and ``next_timesteps`` (B, K): each step's ``t`` and ``t_next``;
- ``step_mask`` (B, K) bool: the steps that train (SDE steps, cut by ``timestep_fraction``);
- ``images`` (B, ...): the final sample; ``cond`` (B, ...): the conditioning.

Which steps are stochastic: all of them by default (Flow-GRPO), or a window of ``sde_steps``
consecutive steps starting at ``sde_start`` with ODE steps elsewhere (Flow-GRPO-Fast /
MixGRPO: one or two SDE steps in a deterministic trajectory cost one or two training steps).
With ``window_range = (lo, hi)`` each call of `FlowSampler.sample` places the window anew, its
start drawn uniformly from ``lo .. hi - sde_steps`` with the call's generator (Flow-GRPO-Fast's
``sde_window_range``; the same generator state gives the same window). Only SDE steps can train
(an ODE step has no log-prob); ``timestep_fraction`` keeps the first part of them.

Classifier-free guidance: with ``guidance_scale != 1`` and ``uncond`` given, the velocity is
``v_u + w (v_c - v_u)`` (both in one batched call).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmrl.batch import Batch
from lmrl.flow.sde import ode_step, schedule, sde_step

__all__ = ["FlowSampler", "VelocityModel", "velocity"]

VelocityModel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def velocity(
    model: VelocityModel,
    x: torch.Tensor,
    t: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor | None = None,
    guidance_scale: float = 1.0,
) -> torch.Tensor:
    """The model's velocity at (x, t), with classifier-free guidance when ``uncond`` is given
    and ``guidance_scale != 1`` (conditional and unconditional rows in one call)."""
    if uncond is None or guidance_scale == 1.0:
        return model(x, t, cond)
    both = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([cond, uncond]))
    v_c, v_u = both.chunk(2)
    return v_u + guidance_scale * (v_c - v_u)


@dataclass
class FlowSampler:
    """Sampling settings (see the module docstring).

    Attributes:
        num_steps: denoising steps ``K``.
        noise_level: ``a`` of the SDE's ``sigma_t = a sqrt(t / (1 - t))``.
        shift: the schedule's SD3 shift (1 = uniform in t).
        sde_start: first SDE step (0-based).
        sde_steps: SDE steps from ``sde_start``; None = to the end.
        timestep_fraction: fraction of the SDE steps that train (the first ones).
        window_range: ``(lo, hi)``: each rollout draws the window's start from
            ``lo .. hi - sde_steps`` (needs ``sde_steps``); None = the window at ``sde_start``.
        guidance_scale: classifier-free guidance weight ``w`` (1 = none).
        reduce: ``"mean"`` (Flow-GRPO) or ``"sum"`` log-prob over a latent's dimensions.
    """

    num_steps: int = 10
    noise_level: float = 0.7
    shift: float = 1.0
    sde_start: int = 0
    sde_steps: int | None = None
    timestep_fraction: float = 1.0
    window_range: tuple[int, int] | None = None
    guidance_scale: float = 1.0
    reduce: str = "mean"

    def __post_init__(self) -> None:
        self.times = schedule(self.num_steps, self.shift)
        # the schedule's second time, standing in for t = 1 in the noise level (read once)
        self.t_cap = float(self.times[1])
        if not 0 <= self.sde_start < self.num_steps:
            raise ValueError(f"sde_start must be in [0, {self.num_steps}), got {self.sde_start}")
        if self.sde_steps is not None and self.sde_steps < 1:
            raise ValueError(f"sde_steps must be >= 1 or None, got {self.sde_steps}")
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if self.noise_level < 0:
            raise ValueError(f"noise_level must be >= 0, got {self.noise_level}")
        if self.window_range is not None:
            lo, hi = self.window_range
            if self.sde_steps is None:
                raise ValueError("window_range needs sde_steps (the size of the window)")
            if not 0 <= lo <= hi - self.sde_steps or hi > self.num_steps:
                raise ValueError(
                    f"window_range must hold a window of {self.sde_steps} steps inside the "
                    f"{self.num_steps} steps (0 <= lo <= hi - sde_steps, hi <= num_steps), got "
                    f"{tuple(self.window_range)}"
                )

    def window_start(self, generator: torch.Generator | None = None) -> int:
        """The first SDE step of a rollout: ``sde_start``, or with ``window_range`` a start
        drawn with ``generator`` (see the module docstring)."""
        if self.window_range is None:
            return self.sde_start
        lo, hi = self.window_range
        device = generator.device if generator is not None else "cpu"
        high = hi - int(self.sde_steps) + 1
        return int(torch.randint(lo, high, (1,), generator=generator, device=device))

    def sde_mask(self, start: int | None = None) -> torch.Tensor:
        """(K,) bool: the steps that are stochastic in a window from ``start`` (default
        ``sde_start``)."""
        start = self.sde_start if start is None else start
        end = self.num_steps if self.sde_steps is None else start + self.sde_steps
        steps = torch.arange(self.num_steps)
        return (steps >= start) & (steps < min(end, self.num_steps))

    def train_mask(self, start: int | None = None) -> torch.Tensor:
        """(K,) bool: the SDE steps that train (the first ``timestep_fraction`` of them)."""
        sde = self.sde_mask(start)
        keep = max(1, math.ceil(self.timestep_fraction * int(sde.sum())))
        return sde & (torch.cumsum(sde.long(), 0) <= keep)

    @torch.no_grad()
    def sample(
        self,
        model: VelocityModel,
        cond: torch.Tensor,
        noise: torch.Tensor,
        *,
        uncond: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Batch:
        """One trajectory per row of ``noise`` (B, ...), conditioned on ``cond`` (B, ...).

        Returns:
            a `Batch` with the keys of the module docstring.
        """
        b, k = noise.shape[0], self.num_steps
        start = self.window_start(generator)
        sde = self.sde_mask(start)
        x = noise.float()
        latents, nexts, log_probs = [], [], []
        for j in range(k):
            t = self.times[j].expand(b).to(x.device)
            t_next = self.times[j + 1].expand(b).to(x.device)
            v = velocity(model, x, t, cond, uncond, self.guidance_scale)
            latents.append(x)
            if sde[j]:
                step = sde_step(
                    x, v, t, t_next, self.noise_level, self.t_cap,
                    generator=generator, reduce=self.reduce,
                )  # fmt: skip
                x, lp = step.sample, step.log_prob
            else:
                x, lp = ode_step(x, v, t, t_next), torch.zeros(b, device=x.device)
            nexts.append(x)
            log_probs.append(lp)
        times = self.times.to(x.device)
        return Batch(
            {
                "latents": torch.stack(latents, 1),
                "next_latents": torch.stack(nexts, 1),
                "log_probs": torch.stack(log_probs, 1),
                "timesteps": times[:-1].expand(b, k).clone(),
                "next_timesteps": times[1:].expand(b, k).clone(),
                "step_mask": self.train_mask(start).to(x.device).expand(b, k).clone(),
                "images": x,
                "cond": cond,
            }
        )

    def step_log_probs(
        self,
        model: VelocityModel,
        batch: Batch,
        step: int,
        *,
        uncond: torch.Tensor | None = None,
    ):
        """Recompute step ``step`` of the trajectories in ``batch`` under ``model``.

        Returns:
            the `lmrl.flow.sde.SdeStep` of that step (``log_prob`` (B,) and ``mean`` carry the
            model's gradient).
        """
        x = batch["latents"][:, step]
        t, t_next = batch["timesteps"][:, step], batch["next_timesteps"][:, step]
        v = velocity(model, x, t, batch["cond"], uncond, self.guidance_scale)
        return sde_step(
            x, v, t, t_next, self.noise_level, self.t_cap,
            sample=batch["next_latents"][:, step], reduce=self.reduce,
        )  # fmt: skip
