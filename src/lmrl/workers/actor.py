"""The actor worker: the policy's log-probs and its PPO-style update.

One update is ``ppo_epochs`` passes of (optionally shuffled) mini-batches, each mini-batch
split into micro-batches whose gradients accumulate. Every micro-batch loss is aggregated
with the *mini-batch's* global token and sequence counts (``AggNorm``), so the accumulated
gradient does not depend on the micro-batch size. The loss is::

    policy_loss(registry, loss_mode) - entropy_coeff * entropy + kl_loss_coef * KL(pi || ref)

The worker is a plain class: the local backend calls it in-process, a Ray backend can wrap
the same class as an actor.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from lmrl.algos import AggNorm, agg_loss, kl_penalty, policy_losses
from lmrl.algos.masked import masked_count
from lmrl.batch import Batch
from lmrl.models import compute_log_probs, forward_log_probs
from lmrl.workers.optim import TrainableWorker, clip_and_step

UPDATE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask",
               "advantages", "old_log_probs", "ref_log_probs", "rollout_is_weights")  # fmt: skip


class ActorWorker(TrainableWorker):
    """The policy model with its optimizer.

    Args:
        model: the causal LM being trained (possibly PEFT-wrapped).
        cfg: the ``actor`` config section.
        rollout_n: samples per prompt (``ppo_mini_batch_size`` counts prompts).
        max_response_length: the constant divisor of ``seq-mean-token-sum-norm``.
        temperature: the sampling temperature; log-probs are of ``logits / temperature``.
        log_prob_micro_batch_size: rows per forward pass when computing old log-probs.
        total_steps: training steps, for the learning-rate schedule.
        seed: seeds the mini-batch shuffling (its state is checkpointed).
    """

    def __init__(
        self,
        model: nn.Module,
        cfg,
        *,
        rollout_n: int,
        max_response_length: int,
        temperature: float,
        log_prob_micro_batch_size: int | None,
        total_steps: int,
        seed: int = 0,
    ) -> None:
        super().__init__(model, cfg.optim, total_steps, seed)
        self.cfg = cfg
        self.rollout_n = rollout_n
        self.max_response_length = max_response_length
        self.temperature = temperature
        self.log_prob_micro_batch_size = log_prob_micro_batch_size
        self.loss_fn = policy_losses.get(cfg.policy_loss.loss_mode)
        self.loss_kwargs = {
            "clip_ratio": cfg.clip_ratio,
            "clip_ratio_low": cfg.clip_ratio_low,
            "clip_ratio_high": cfg.clip_ratio_high,
            "clip_ratio_c": cfg.clip_ratio_c,
            "tau_pos": cfg.policy_loss.tau_pos,
            "tau_neg": cfg.policy_loss.tau_neg,
        }

    def compute_log_probs(self, batch: Batch, with_entropy: bool = False):
        """Log-probs (and entropy) of the responses under the current policy, no grad.

        Returns:
            ``(log_probs, entropy)``, (B, T) each (entropy None unless asked).
        """
        micro = self.log_prob_micro_batch_size or len(batch)
        return compute_log_probs(self.model, batch, micro, self.temperature, with_entropy)

    def update_policy(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``ppo_epochs`` x mini-batches x micro-batches of the policy loss; one lr step.

        ``old_log_probs`` absent means the caller proved them equal to this pass's own
        log-probs (one epoch, one mini-batch, unchanged weights): they are taken detached
        from the forward pass, saving a second one.

        Returns:
            Metrics as detached tensors: ``actor/pg_loss``, ``actor/pg_clipfrac``,
            ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``, ``actor/entropy``,
            ``actor/kl_loss``, ``actor/grad_norm``, ``actor/lr``, ``actor/skipped_steps``.
        """
        cfg = self.cfg
        mini_size = cfg.ppo_mini_batch_size * self.rollout_n
        batch = batch.select(*(k for k in UPDATE_KEYS if k in batch))
        if cfg.use_kl_loss and "ref_log_probs" not in batch:
            raise ValueError("actor.use_kl_loss needs ref_log_probs in the batch")
        totals: dict[str, list[torch.Tensor]] = defaultdict(list)
        skipped = 0
        for mini in self.mini_batches(batch, cfg.ppo_epochs, cfg.shuffle, mini_size):
            stats = self._accumulate(mini, cfg.ppo_micro_batch_size or mini_size)
            grad_norm, stepped = clip_and_step(self.params, self.optimizer, cfg.grad_clip)
            skipped += not stepped
            stats["actor/grad_norm"] = grad_norm
            for k, v in stats.items():
                totals[k].append(v)
        metrics = self.finish_update(totals, "actor")
        if cfg.use_kl_loss:
            metrics["actor/kl_coef"] = torch.tensor(cfg.kl_loss_coef)
        metrics["actor/skipped_steps"] = torch.tensor(float(skipped))
        return metrics

    def _accumulate(self, mini: Batch, micro_size: int) -> dict[str, torch.Tensor]:
        """Forward and backward every micro-batch of ``mini``; return its metrics."""
        cfg = self.cfg
        norm = AggNorm.from_mask(mini["response_mask"], loss_scale_factor=self.max_response_length)
        stats: dict[str, torch.Tensor] = defaultdict(int)  # tensors on the model's device
        for micro in mini.split(micro_size):
            mask = micro["response_mask"]
            log_prob, entropy = forward_log_probs(
                self.model, micro, self.temperature, with_entropy=True
            )
            old = micro["old_log_probs"] if "old_log_probs" in micro else log_prob.detach()
            pg_loss, pg_metrics = self.loss_fn(
                old,
                log_prob,
                micro["advantages"],
                mask,
                cfg.loss_agg_mode,
                rollout_is_weights=micro.get("rollout_is_weights"),
                norm=norm,
                **self.loss_kwargs,
            )
            entropy_loss = agg_loss(entropy, mask, cfg.loss_agg_mode, norm)
            loss = pg_loss
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * entropy_loss
            if cfg.use_kl_loss:
                kld = kl_penalty(log_prob, micro["ref_log_probs"], cfg.kl_loss_type)
                kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode, norm)
                loss = loss + cfg.kl_loss_coef * kl_loss
                stats["actor/kl_loss"] = stats["actor/kl_loss"] + kl_loss.detach()
            loss.backward()
            # the micro losses are shares of the mini-batch loss: they add up;
            # per-token fractions are weighted by the micro-batch's share of the tokens.
            share = masked_count(mask) / norm.token_count.clamp(min=1)
            stats["actor/pg_loss"] = stats["actor/pg_loss"] + pg_loss.detach()
            stats["actor/entropy"] = stats["actor/entropy"] + entropy_loss.detach()
            for name, value in pg_metrics.items():
                stats[f"actor/{name}"] = stats[f"actor/{name}"] + share * value
        return dict(stats)
