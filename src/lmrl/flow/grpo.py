"""Flow-GRPO's update: GRPO advantages per image, PPO's clipped ratio per denoising step, and a
Gaussian KL to the reference, all from `lmrl.algos`.

Per trained step ``j`` of image ``i`` (``step_mask``): ``r = exp(logp_theta - logp_old)`` of
the sampled next latent, the loss is `lmrl.algos` ``vanilla`` PPO clip with Flow-GRPO's tiny
``clip_range`` (~1e-4, the log-probs being means over a latent's dimensions), and
``token-mean`` over every trained (image, step) of the update (the steps are the "tokens").
The advantage of an image is GRPO's (`lmrl.algos` ``grpo``: its score normalized within the
images of its prompt; Dr.GRPO without the std), clipped to ``[-adv_clip_max, adv_clip_max]``,
and the same for all its steps; with ``std_scale`` it is multiplied per step by ``2.25
sigma_t`` as in the seed's loss (``-2.25 * std_dev_t * advantages * ratio``). With ``beta >
0`` the loss adds ``beta`` times the KL between the policy's and the reference's Gaussian
steps (`lmrl.flow.sde.gaussian_kl`), averaged the same way.

Each step's loss is backpropagated on its own (the model's activations of one step of one
micro-batch at a time), the gradients accumulated over steps and micro-batches, one optimizer
step per mini-batch (`lmrl.models.grad.clip_and_step`, as the text side's workers).

The reference is a velocity model that never trains, or ``"adapter"``: the policy is a PEFT
LoRA model and the reference is the same model with its adapters disabled (no second copy).

Mixed precision (a ``precision`` from ``lmrl.workers.precision``): every velocity of the
policy and the reference is computed under its autocast and returned in fp32, so the
Gaussian steps' means, log-probs, ratios and KL run in fp32 over the fp32 weights; fp16
scales the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmrl.algos.advantages import advantage_estimators
from lmrl.algos.agg import AggNorm
from lmrl.algos.losses import policy_losses
from lmrl.batch import Batch
from lmrl.flow.ema import WeightEMA
from lmrl.flow.rollout import FlowSampler, VelocityModel
from lmrl.flow.sde import gaussian_kl
from lmrl.models.grad import clip_and_step

__all__ = ["FlowGRPO", "FlowGRPOConfig", "flow_advantages"]

# Flow-GRPO's per-step scale of the loss: 2.25 * sigma_t
STD_SCALE = 2.25


@dataclass
class FlowGRPOConfig:
    """The update's settings (Flow-GRPO's defaults where it has one).

    Attributes:
        clip_range: PPO's epsilon on the per-step ratio.
        clip_range_low, clip_range_high: the ratio is clipped to ``[1 - low, 1 + high]``
            (Flow-GRPO's ``clip_range_lt`` / ``clip_range_gt``); None = ``clip_range``.
        adv_clip_max: advantages are clipped to [-adv_clip_max, adv_clip_max].
        norm_adv_by_std: GRPO (True) or Dr.GRPO (False, no division by the group's std).
        beta: weight of the KL to the reference; 0 = no reference needed.
        std_scale: multiply each step's advantage by ``2.25 sigma_t`` (the seed's loss).
        mini_batch_size: images per optimizer step; None = all of them.
        micro_batch_size: images per forward; None (or more than the mini-batch) = the
            mini-batch.
        ppo_epochs: passes over the batch.
        max_grad_norm: gradient clipping; None = none.
    """

    clip_range: float = 1e-4
    clip_range_low: float | None = None
    clip_range_high: float | None = None
    adv_clip_max: float = 5.0
    norm_adv_by_std: bool = True
    beta: float = 0.0
    std_scale: bool = False
    mini_batch_size: int | None = None
    micro_batch_size: int | None = None
    ppo_epochs: int = 1
    max_grad_norm: float | None = 1.0


def flow_advantages(
    scores: torch.Tensor,
    index: Sequence | np.ndarray,
    adv_clip_max: float = 5.0,
    norm_adv_by_std: bool = True,
    global_std: bool = False,
) -> torch.Tensor:
    """GRPO's advantage of each image: (B,) scores, (B,) group labels -> (B,) clipped.

    ``global_std``: the score minus its prompt's mean, over the std of all B scores (Flow-GRPO's
    ``sample.global_std``) instead of its prompt's (``norm_adv_by_std``)."""
    scores = scores.float().reshape(-1, 1)
    mask = torch.ones_like(scores, dtype=torch.bool)
    adv, _ = advantage_estimators.get("grpo")(
        scores, mask, index=np.asarray(index, dtype=object),
        norm_adv_by_std_in_grpo=norm_adv_by_std and not global_std,
    )  # fmt: skip
    if global_std and norm_adv_by_std:
        adv = adv / (scores.std() + 1e-6)
    return adv[:, 0].clamp(-adv_clip_max, adv_clip_max)


class FlowGRPO:
    """The Flow-GRPO update of a velocity model (see the module docstring).

    Args:
        model: the policy's velocity model (trainable parameters in ``optimizer``).
        sampler: the `FlowSampler` that made the trajectories (its noise level, schedule,
            guidance and log-prob reduction).
        optimizer: over the model's trainable parameters.
        config: `FlowGRPOConfig`.
        reference: a frozen velocity model, ``"adapter"`` (the PEFT policy with adapters
            disabled), or None (then ``config.beta`` must be 0).
        ema: a `WeightEMA` of the trained weights, stepped after every optimizer step.
        precision: a ``lmrl.workers.precision.Precision``; None = the model's own dtype.

    Raises:
        ValueError: ``beta > 0`` without a reference, or bad batch sizes.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        sampler: FlowSampler,
        optimizer: torch.optim.Optimizer,
        config: FlowGRPOConfig | None = None,
        reference: VelocityModel | str | None = None,
        ema: WeightEMA | None = None,
        precision=None,
    ) -> None:
        self.model, self.sampler, self.optimizer, self.ema = model, sampler, optimizer, ema
        self.precision = precision
        self.velocity = in_precision(model, precision)  # what the sampler calls
        self.scaler = precision.loss_scaler() if precision is not None else None
        self.config = config or FlowGRPOConfig()
        if self.config.beta > 0 and reference is None:
            raise ValueError("beta > 0 needs a reference model (or reference='adapter')")
        if isinstance(reference, str) and reference != "adapter":
            raise ValueError(f"reference must be a model, 'adapter' or None, got {reference!r}")
        self.reference = reference
        self._loss = policy_losses.get("vanilla")

    # ------------------------------------------------------------------ reference
    def _reference(self, x, t, cond):
        if self.reference == "adapter":
            with self.model.disable_adapter():
                return self.velocity(x, t, cond)
        return in_precision(self.reference, self.precision)(x, t, cond)

    @torch.no_grad()
    def reference_means(self, batch: Batch, step: int, uncond=None) -> torch.Tensor:
        """The reference's Gaussian mean at step ``step`` of ``batch``'s trajectories."""
        return self.sampler.step_log_probs(self._reference, batch, step, uncond=uncond).mean

    @torch.no_grad()
    def old_log_probs(self, batch: Batch, uncond=None) -> torch.Tensor:
        """(B, K) log-probs of the trajectories' trained steps under the current model (0 on
        the others): the recomputed ``old_log_probs``, equal to the rollout's on-policy."""
        out = torch.zeros_like(batch["log_probs"])
        mask = batch["step_mask"]
        for j in range(mask.shape[1]):
            if mask[:, j].any():
                out[:, j] = self.sampler.step_log_probs(
                    self.velocity, batch, j, uncond=uncond
                ).log_prob
        return out * mask

    # ------------------------------------------------------------------ update
    def update(
        self,
        batch: Batch,
        advantages: torch.Tensor,
        old_log_probs: torch.Tensor | None = None,
        uncond: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> dict[str, float]:
        """Train on ``batch`` (from `FlowSampler.sample`) with per-image ``advantages`` (B,).

        Args:
            old_log_probs: (B, K) the ratio's anchor; None = the rollout's ``log_probs``
                (bypass: on-policy they are equal, see `old_log_probs`).
            uncond: (B, ...) unconditional conditioning for classifier-free guidance.
            generator: shuffles the images between epochs (a CPU or a CUDA generator).

        Returns:
            metrics averaged over the optimizer steps: ``actor/pg_loss``, ``actor/pg_clipfrac``,
            ``actor/ppo_kl``, ``actor/kl_loss`` (with a reference), ``actor/grad_norm``.
        """
        cfg = self.config
        n = len(batch)
        if advantages.shape != (n,):
            raise ValueError(f"advantages must be ({n},), got {tuple(advantages.shape)}")
        mini = cfg.mini_batch_size or n
        micro = min(cfg.micro_batch_size or mini, mini)
        if n % mini or mini % micro:
            raise ValueError(
                f"mini_batch_size={mini} must divide the batch ({n}) and micro_batch_size="
                f"{micro} the mini-batch"
            )
        old = batch["log_probs"] if old_log_probs is None else old_log_probs
        work = Batch(
            {
                "old": old.float(),
                "adv": advantages.float(),
                "row": torch.arange(n, device=old.device),
            },
            # which steps of each image train, read once here: the micro-batches then choose
            # their steps on the host, without reading the device back
            {"steps": batch["step_mask"].cpu().numpy()},
        )
        sums: dict[str, float] = {}
        updates = 0
        self.model.train()
        shuffle_on = generator.device if generator is not None else "cpu"
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=generator, device=shuffle_on)
            for start in range(0, n, mini):
                rows = order[start : start + mini]
                metrics = self._mini_batch(batch.index(rows), work.index(rows), micro, uncond)
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                updates += 1
        return {key: value / updates for key, value in sums.items()}

    def _mini_batch(self, batch: Batch, work: Batch, micro: int, uncond) -> dict[str, float]:
        cfg = self.config
        mask = batch["step_mask"]
        if not np.stack(work["steps"]).any():
            return {}
        norm = AggNorm.from_mask(mask)
        total = mask.sum()
        keys = ["actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"]
        keys += ["actor/kl_loss"] if cfg.beta > 0 else []
        stats = dict.fromkeys(keys, torch.zeros((), device=mask.device))  # one read per mini-batch
        self.optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(batch), micro):
            part = batch.index(slice(start, start + micro))
            extra = work.index(slice(start, start + micro))
            un = None if uncond is None else uncond[extra["row"]]
            counts = part["step_mask"].sum(0)
            for j in np.flatnonzero(np.stack(extra["steps"]).any(0)).tolist():
                m = part["step_mask"][:, j : j + 1]
                weight = counts[j] / total  # this step's share of the token-mean
                step = self.sampler.step_log_probs(self.velocity, part, j, uncond=un)
                adv = extra["adv"].unsqueeze(1)
                if cfg.std_scale:
                    adv = adv * STD_SCALE * step.sigma.reshape(-1, 1)
                loss, pg = self._loss(
                    extra["old"][:, j : j + 1], step.log_prob.unsqueeze(1), adv, m,
                    "token-mean", norm=norm, clip_ratio=cfg.clip_range,
                    clip_ratio_low=cfg.clip_range_low, clip_ratio_high=cfg.clip_range_high,
                )  # fmt: skip
                stats["actor/pg_loss"] = stats["actor/pg_loss"] + loss.detach()
                stats["actor/pg_clipfrac"] = stats["actor/pg_clipfrac"] + pg["pg_clipfrac"] * weight
                stats["actor/ppo_kl"] = stats["actor/ppo_kl"] + pg["ppo_kl"] * weight
                if cfg.beta > 0:
                    ref_mean = self.reference_means(part, j, un)
                    kl = gaussian_kl(step.mean, ref_mean, step.std, self.sampler.reduce)
                    kl_loss = (kl * m[:, 0]).sum() / total
                    stats["actor/kl_loss"] = stats["actor/kl_loss"] + kl_loss.detach()
                    loss = loss + cfg.beta * kl_loss
                (loss if self.scaler is None else self.scaler.scale_loss(loss)).backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.scaler is not None:
            self.scaler.unscale(params)
        stats["actor/grad_norm"], stepped = clip_and_step(params, self.optimizer, cfg.max_grad_norm)
        if self.scaler is not None:
            self.scaler.update(stepped)
        if self.ema is not None:
            self.ema.step()
        return {key: float(value) for key, value in stats.items()}


def in_precision(model: VelocityModel, precision) -> VelocityModel:
    """``model`` called under ``precision``'s autocast, its velocity returned in fp32; the
    model itself without mixed precision."""
    if precision is None or not precision.mixed:
        return model

    def velocity(x, t, cond):
        with precision.autocast():
            return model(x, t, cond).float()

    return velocity
