"""The actor worker: the policy's log-probs and its PPO-style update.

One update is ``ppo_epochs`` passes of (optionally shuffled) mini-batches, each mini-batch
split into micro-batches whose gradients accumulate. Every micro-batch loss is aggregated
with the *mini-batch's* global token and sequence counts (``AggNorm``), so the accumulated
gradient does not depend on the micro-batch size. The loss is::

    policy_loss(registry, loss_mode) - entropy_coeff * entropy + kl_loss_coef * KL(pi || ref)

over the tokens of ``loss_mask`` when the batch has one (rollout correction's rejection in
mask mode, a subset of the response), else of ``response_mask``. The KL is a sampled-token
estimator of ``ref_log_probs``, or with ``kl_loss_type=full`` the exact KL over the vocabulary
against the reference model, computed in each micro-batch. The policy loss receives exactly
the hyperparameters it declares (``lmrl.algos.losses.loss_hyperparameters``), read from the
config once at construction.

The worker is a plain class: the local backend calls it in-process, a Ray backend can wrap
the same class as an actor.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from lmrl.algos import AggNorm, agg_loss, kl_penalty, policy_losses
from lmrl.algos.losses import loss_hyperparameters
from lmrl.algos.masked import masked_count
from lmrl.batch import Batch
from lmrl.batch.schema import TensorKey
from lmrl.batch.schema import keys as schema_keys
from lmrl.models import Reference, compute_log_probs, forward_log_probs
from lmrl.models.forward import compute_device, forward_log_probs_and_kl
from lmrl.models.layout import with_row_layout
from lmrl.workers.optim import TrainableWorker
from lmrl.workers.plan import UpdateShape, kl_in_update, update_shape

UPDATE_KEYS = schema_keys(read_by="actor_update")  # what the update moves to the device


def policy_loss_kwargs(cfg) -> dict[str, float | None]:
    """The hyperparameters the configured policy loss declares, with their ``actor`` values.

    The PPO clip settings are ``actor`` fields, every other loss hyperparameter a field of
    ``actor.policy_loss`` (a new loss's field needs no line here); each loss gets the ones its
    signature names (e.g. ``reinforce`` none, ``sapo`` ``tau_pos`` and ``tau_neg``).

    Raises:
        ValueError: the loss declares a hyperparameter the ``actor`` config does not hold.
    """
    values = {
        "clip_ratio": cfg.clip_ratio,
        "clip_ratio_low": cfg.clip_ratio_low,
        "clip_ratio_high": cfg.clip_ratio_high,
        "clip_ratio_c": cfg.clip_ratio_c,
        # a loss's own hyperparameters: every field of ``actor.policy_loss`` but the choice
        **{k: v for k, v in cfg.policy_loss.items() if k != "loss_mode"},
    }
    names = loss_hyperparameters(cfg.policy_loss["loss_mode"])
    unknown = [n for n in names if n not in values]
    if unknown:
        raise ValueError(
            f"policy loss {cfg.policy_loss['loss_mode']!r} takes {unknown}, which the actor "
            f"config does not hold (it holds {sorted(values)})"
        )
    return {n: values[n] for n in names}


class ActorWorker(TrainableWorker):
    """The policy model with its optimizer (an ``lmrl.workers.roles.ActorRole``).

    Args:
        model: the causal LM being trained (possibly PEFT-wrapped).
        cfg: the ``actor`` config section.
        rollout_n: samples per prompt (``ppo_mini_batch_size`` counts prompts).
        max_response_length: the constant divisor of ``seq-mean-token-sum-norm``.
        temperature: the sampling temperature; log-probs are of ``logits / temperature``.
        log_prob_micro_batch_size: rows per forward pass when computing old log-probs.
        total_steps: training steps, for the learning-rate schedule.
        seed: seeds the mini-batch shuffling (its state is checkpointed).
        reference: the reference policy (a frozen model, or this LoRA actor with its adapter
            disabled); required by ``use_kl_loss`` with ``kl_loss_type=full``, which runs it
            in every micro-batch. Sampled-token KL losses read ``ref_log_probs`` instead.
        dp: this rank's data parallelism (``lmrl.workers.dist``): every rank gets the whole
            batch and trains on its share of each mini-batch; None = one process.
        precision: master and compute dtypes (``lmrl.workers.precision``); None = the
            model's own dtype, no autocast.

    Raises:
        ValueError: an unknown loss or KL name, or the full KL without ``reference``.
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
        reference: Reference | None = None,
        dp=None,
        precision=None,
        update: UpdateShape | None = None,
        full_kl: bool | None = None,
    ) -> None:
        super().__init__(model, cfg.optim, total_steps, seed, dp, precision)
        self.cfg = cfg
        self.rollout_n = rollout_n
        # the run's plan hands both in; a worker made on its own works them out by the same rule
        self.update = update if update is not None else update_shape(cfg, rollout_n)
        self.max_response_length = max_response_length
        self.temperature = temperature
        self.log_prob_micro_batch_size = log_prob_micro_batch_size
        self.loss_fn = policy_losses.get(cfg.policy_loss["loss_mode"])
        self.loss_kwargs = policy_loss_kwargs(cfg)
        self.full_kl = kl_in_update(cfg) if full_kl is None else full_kl
        if self.full_kl and reference is None:
            raise ValueError(
                "actor.kl_loss_type=full computes the KL against the reference model in each "
                "micro-batch: pass ActorWorker(..., reference=<lmrl.models.Reference>)"
            )
        self.reference = reference

    def compute_log_probs(
        self, batch: Batch, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of the responses under the current policy, no grad.

        Returns:
            ``(log_probs, entropy)``, (B, T) each (entropy None unless asked).
        """
        micro = self.log_prob_micro_batch_size or len(batch)
        with self.dp.full_params(self.model), self.autocast():
            return compute_log_probs(self.model, batch, micro, self.temperature, with_entropy)

    def update_actor(
        self, batch: Batch, *, old_log_probs_from_update: bool = False
    ) -> dict[str, torch.Tensor]:
        """``ppo_epochs`` x mini-batches x micro-batches of the policy loss; one lr step.

        Args:
            batch: ``input_ids``, ``attention_mask``, ``responses``, ``response_mask``,
                ``advantages`` (B, T); ``old_log_probs`` (B, T) unless
                ``old_log_probs_from_update``; ``ref_log_probs`` for a sampled-token KL loss;
                optionally ``position_ids``, ``rollout_is_weights`` and ``loss_mask`` (bool
                (B, T), a subset of ``response_mask``: the tokens that train).
            old_log_probs_from_update: the caller knows the old log-probs equal this pass's own
                (one epoch of one mini-batch, weights unchanged since the rollout): they are
                taken detached from the update's forward, saving a pass, and any
                ``old_log_probs`` in the batch is ignored.

        Returns:
            Metrics as detached tensors: ``actor/pg_loss``, ``actor/pg_clipfrac``,
            ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``, ``actor/entropy``,
            ``actor/kl_loss``, ``actor/grad_norm``, ``actor/lr``, ``actor/skipped_steps``.

        Raises:
            ValueError: ``old_log_probs`` missing without the flag, the flag with more than
                one epoch or mini-batch, ``ref_log_probs`` missing for a sampled-token KL
                loss, or a ``loss_mask`` that is not a bool subset of ``response_mask``.
        """
        cfg, shape = self.cfg, self.update
        mini_size = shape.mini_batch_rows
        keys = UPDATE_KEYS
        if old_log_probs_from_update:
            if shape.epochs != 1 or len(batch) > mini_size:
                raise ValueError(
                    "old_log_probs_from_update holds for one epoch of one mini-batch only (the "
                    f"weights change at each optimizer step); got actor.ppo_epochs="
                    f"{shape.epochs} and {len(batch)} rows for mini-batches of {mini_size}"
                )
            keys = tuple(k for k in UPDATE_KEYS if k != "old_log_probs")
        elif "old_log_probs" not in batch:
            raise ValueError(
                "the batch has no old_log_probs: compute them (ActorWorker.compute_log_probs), "
                "or pass old_log_probs_from_update=True when this one-pass update's own "
                "log-probs are the old ones"
            )
        # the driver's batch lives on the CPU; the loss needs it where the model computes
        # with the host's layout of its rows (lmrl.models.layout): no micro-batch reads the device
        batch = with_row_layout(batch.select(*(k for k in keys if k in batch)))
        batch = batch.to(compute_device(self.model))
        if cfg.use_kl_loss and not self.full_kl and "ref_log_probs" not in batch:
            raise ValueError("actor.use_kl_loss needs ref_log_probs in the batch")
        if "loss_mask" in batch:
            _check_loss_mask(batch["loss_mask"], batch["response_mask"])
        totals: dict[str, list[torch.Tensor]] = defaultdict(list)
        skipped = 0
        for mini in self.mini_batches(batch, shape.epochs, shape.shuffle, mini_size):
            stats = self._accumulate(mini, shape.micro(), old_log_probs_from_update)
            grad_norm, stepped = self.step(cfg.grad_clip)
            skipped += not stepped
            stats["actor/grad_norm"] = grad_norm
            for k, v in stats.items():
                totals[k].append(v)
        metrics = self.finish_update(totals, "actor")
        if cfg.use_kl_loss:
            metrics["actor/kl_coef"] = torch.tensor(cfg.kl_loss_coef)
        metrics["actor/skipped_steps"] = torch.tensor(float(skipped))
        return metrics

    def _accumulate(
        self, mini: Batch, micro_size: int, own_old_log_probs: bool = False
    ) -> dict[str, torch.Tensor]:
        """Forward and backward every micro-batch of ``mini``; return its metrics.

        ``own_old_log_probs``: the old log-probs are this forward's own, detached.
        """
        dp = self.dp
        mask_key: TensorKey = "loss_mask" if "loss_mask" in mini else "response_mask"
        # the normalizers count the whole mini-batch (every rank holds it), so each rank's
        # loss is its share of the mini-batch loss and the shares' gradients add up
        norm = AggNorm.from_mask(mini[mask_key], loss_scale_factor=self.max_response_length)
        stats: dict[str, torch.Tensor] = {}  # sums over the micro-batches, on the model's device
        micros = dp.micro_batches(dp.shard(mini), micro_size)
        for i, micro in enumerate(micros):
            with dp.sync_grads(self.model, last=i == len(micros) - 1):
                self._micro_step(micro, mask_key, norm, own_old_log_probs, stats)
        dp.reduce_grads(self.params)
        return dp.reduce_stats(dict(stats))

    def _micro_step(self, micro: Batch, mask_key: TensorKey, norm: AggNorm,
                    own_old_log_probs: bool, stats: dict[str, torch.Tensor]) -> None:  # fmt: skip
        """Forward and backward of one micro-batch; its metrics added to ``stats``."""
        cfg = self.cfg
        mask = micro[mask_key]
        kld = None
        with self.autocast():  # the forward in the compute dtype; log-probs come back fp32
            if self.full_kl:
                assert self.reference is not None  # __init__ refuses full_kl without one
                log_prob, entropy, kld = forward_log_probs_and_kl(
                    self.model, self.reference, micro, self.temperature, with_entropy=True
                )
            else:
                log_prob, entropy = forward_log_probs(
                    self.model, micro, self.temperature, with_entropy=True
                )
        assert entropy is not None  # asked for with_entropy=True
        if not self.full_kl and cfg.use_kl_loss:
            kld = kl_penalty(log_prob, micro["ref_log_probs"], cfg.kl_loss_type)
        old = log_prob.detach() if own_old_log_probs else micro["old_log_probs"]
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
        if kld is not None:
            kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode, norm)
            loss = loss + cfg.kl_loss_coef * kl_loss
            stats["actor/kl_loss"] = stats.get("actor/kl_loss", 0) + kl_loss.detach()
        self.backward(loss)
        # the micro losses are shares of the mini-batch loss: they add up;
        # per-token fractions are weighted by the micro-batch's share of the tokens.
        share = masked_count(mask) / norm.token_count.clamp(min=1)
        stats["actor/pg_loss"] = stats.get("actor/pg_loss", 0) + pg_loss.detach()
        # the entropy metric is per token whatever loss_agg_mode is (verl logs the loss term,
        # which under seq-mean-token-sum-norm scales with the batch: not comparable, and it
        # would read as a near-uniform policy to the run-health checks)
        token_mean = agg_loss(entropy.detach(), mask, "token-mean", norm)
        stats["actor/entropy"] = stats.get("actor/entropy", 0) + token_mean
        for name, value in pg_metrics.items():
            stats[f"actor/{name}"] = stats.get(f"actor/{name}", 0) + share * value


def _check_loss_mask(loss_mask: torch.Tensor, response_mask: torch.Tensor) -> None:
    """A ``loss_mask`` is bool, shaped like ``response_mask``, and True only inside it."""
    if loss_mask.dtype != torch.bool or loss_mask.shape != response_mask.shape:
        raise ValueError(
            f"loss_mask must be bool {tuple(response_mask.shape)} like response_mask, got "
            f"{loss_mask.dtype} {tuple(loss_mask.shape)}"
        )
    if (loss_mask & ~response_mask.bool()).any():
        raise ValueError("loss_mask is True outside response_mask: it must be a subset of it")
