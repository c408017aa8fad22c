"""What the workers are told of the run's shape: the part of the run's plan they build from.

`lmrl.trainer.plan.RunPlan` decides the run's shape once, from the config; the worker builders
(`lmrl.workers.build.build_workers`, every Ray rank's setup) take its `WorkerPlan` and read
none of those decisions from the config again: which reference exists and where it runs,
whether there is a critic, the update's mini- and micro-batches, and whether the engine
follows the actor's weights.

The two rules that a worker constructed on its own (a test, a benchmark) also needs are
functions here, so the plan and such a worker agree by construction: `update_shape` (the
rows of a mini-batch) and `kl_in_update` (the full KL, whose reference runs inside the actor's
update).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lmrl.algos import kl_estimators

__all__ = ["ReferenceKind", "UpdateShape", "WorkerPlan", "kl_in_update", "update_shape"]

ReferenceKind = Literal["none", "frozen_copy", "adapter_off"]


@dataclass(frozen=True)
class UpdateShape:
    """One trained model's update: ``epochs`` passes of mini-batches of ``mini_batch_rows``
    rows (shuffled with ``shuffle``), each in micro-batches of ``micro_batch_rows`` rows.

    Attributes:
        mini_batch_rows: rows of one mini-batch (``ppo_mini_batch_size`` prompts x ``n``).
        micro_batch_rows: rows of one forward/backward; 0 = the whole mini-batch.
        epochs: ``ppo_epochs``.
        shuffle: shuffle the rows before each epoch's split.
    """

    mini_batch_rows: int
    micro_batch_rows: int
    epochs: int
    shuffle: bool

    def micro(self) -> int:
        """The micro-batch's rows (the mini-batch's when none is set)."""
        return self.micro_batch_rows or self.mini_batch_rows


def update_shape(section, n: int) -> UpdateShape:
    """The update of an ``actor`` or ``critic`` config section with ``n`` samples per prompt:
    the one place the mini-batch's row count is worked out."""
    return UpdateShape(
        mini_batch_rows=section.ppo_mini_batch_size * n,
        micro_batch_rows=section.ppo_micro_batch_size or 0,
        epochs=section.ppo_epochs,
        shuffle=bool(section.shuffle),
    )


def kl_in_update(actor_cfg) -> bool:
    """Whether the actor's KL loss reads the reference's logits inside its own update (a KL
    estimator of the full distributions, the registry's ``needs`` says so), so that no stage
    computes ``ref_log_probs`` for it."""
    return bool(actor_cfg.use_kl_loss) and "logits" in kl_estimators.needs(actor_cfg.kl_loss_type)


@dataclass(frozen=True)
class WorkerPlan:
    """The workers a run builds, decided by `lmrl.trainer.plan.RunPlan.from_config`.

    Attributes:
        reference: the reference model: ``none``, a ``frozen_copy`` of the initial policy,
            or the actor with its LoRA adapter off (``adapter_off``).
        ref_stage: stage 4 computes ``ref_log_probs`` (KL in the reward, or a KL loss of
            the sampled tokens).
        ref_in_update: the full KL: the reference's logits are computed inside each of the
            actor's micro-batches.
        critic: a critic is trained (stages 5 and 7).
        actor, critic_update: the updates' shapes (``critic_update`` None without a critic).
        log_prob_micro_batch_size: rows per forward of the old log-probs (None = all).
        ref_micro_batch_size: rows per forward of the reference's (None = all).
        engine_follows: the engine generates with the actor's weights as they are; False in
            an async run in one process, which hands each weights version over itself.
        gradient_checkpointing: the trained models recompute activations in backward.
        separate_critic: under Ray, the critic trains in a pool of its own
            (``resources.critic_workers``), else beside the actor.
        separate_rollout: under Ray, an async run generates in a group of its own
            (``resources.rollout_workers``).
    """

    reference: ReferenceKind
    ref_stage: bool
    ref_in_update: bool
    critic: bool
    actor: UpdateShape
    critic_update: UpdateShape | None
    log_prob_micro_batch_size: int | None
    ref_micro_batch_size: int | None
    engine_follows: bool
    gradient_checkpointing: bool
    separate_critic: bool = False
    separate_rollout: bool = False
