"""The ``async_training`` section: generation runs ahead of training by a bounded staleness.

verl's one-step-off and fully-async recipes under verl's own key names. lmrl generates whole
steps' batches (a batch is ``data.train_batch_size`` prompts, as in the synchronous step), so
verl's ``staleness_threshold``, a fraction of a sync interval's samples, is read in whole
batches: any value in (0, 1] is one-step-off, 2 lets a batch lag two updates, and so on.

The choices made here (the why is in docs/async.md):

- The schedule is fixed: the batch of step ``s`` is generated with the weights of version
  ``T * floor(max(s - K, 0) / T)`` (``K = ceil(staleness_threshold)``,
  ``T = trigger_parameter_sync_step``), never "whatever is newest", so a seed gives the same
  run whatever the timing, and a resumed run is exact. A batch's staleness is at most
  ``K + T - 1`` updates.
- The behaviour policy is the rollout's own log-probs. Unless ``rollout.log_prob_mode`` is
  set, an async run uses ``bypass`` (verl's fully-async default: the PPO ratio against the
  rollout's log-probs, its clip the correction); ``rollout_correction`` (AReaL's decoupled
  PPO) is one key away. Measured in docs/async.md: with one update per batch the decoupled
  ratio starts at 1 and its clip never binds, and bypass learned better and faster.
- ``partial_rollout`` is refused: lmrl's engines load new weights between requests, never in
  the middle of one.
- The lag is bounded: ``K + T - 1`` of at least ``trainer.total_training_steps`` (a run of two
  steps or more) is refused, since every batch would come from the initial policy, and so is
  one over ``MAX_STALENESS`` (64), since the generator holds that many batches ahead; a
  threshold that is not a finite number >= 0 is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmrl.config.run import opt

__all__ = [
    "MAX_STALENESS",
    "AsyncTrainingConfig",
    "check_async",
    "log_prob_mode",
    "staleness_bound",
    "weights_version_for",
]


@dataclass
class AsyncTrainingConfig:
    """Generation ahead of training, staleness bounded (verl's one-step-off, fully-async).

    A generator thread (or a Ray rollout group) produces scored batches while the trainer
    updates (docs/async.md)."""

    enable: bool = opt(
        False,
        "Generate (and score) the next batches while the trainer updates. The local backend "
        "generates in a thread with its own copy of the weights; the ray backend on a rollout "
        "worker group of its own (resources.rollout_workers).",
    )
    staleness_threshold: float = opt(
        1.0,
        "Updates a batch's weights may lag behind the trainer's, rounded up to whole batches "
        "(verl's fraction: any value in (0, 1] is one-step-off); 0 = synchronous. The lag "
        "must stay under trainer.total_training_steps and at most 64.",
    )
    trigger_parameter_sync_step: int = opt(
        1,
        "Steps between two pushes of the trainer's weights to the engine (>= 1); a batch's "
        "staleness is at most ceil(staleness_threshold) + this - 1.",
    )
    partial_rollout: bool = opt(
        False,
        "verl's interruption of a generation for new weights: lmrl's engines take new weights "
        "between requests only, so true is refused.",
    )


#: the most updates a batch's weights may lag (``ceil(staleness_threshold) + T - 1``): the
#: generator holds that many scored batches ahead, and each weights version a coming batch
#: needs is a copy of the actor's weights in host memory (``K / T + 1`` at once)
MAX_STALENESS = 64


def staleness_bound(cfg: AsyncTrainingConfig) -> int:
    """The most updates a batch's weights can lag: ``ceil(threshold) + T - 1`` (0 when off).

    A threshold that is not a finite number >= 0 counts as 0 here: ``check_async`` refuses it,
    and resolving the config (``log_prob_mode``) must get that far."""
    if not cfg.enable:
        return 0
    threshold = cfg.staleness_threshold
    lag = math.ceil(threshold) if math.isfinite(threshold) and threshold >= 0 else 0
    return lag + cfg.trigger_parameter_sync_step - 1


def weights_version_for(step: int, staleness: int, sync_every: int) -> int:
    """The weights version (updates done) that generates the batch of ``step``: the newest
    version of the push schedule (multiples of ``sync_every``) that is not newer than
    ``step - staleness`` (version 0 for the first steps). ``step`` minus it is at most
    ``staleness + sync_every - 1``; with ``staleness = 0, sync_every = 1`` it is ``step``
    itself, the synchronous step."""
    return sync_every * (max(step - staleness, 0) // sync_every)


def log_prob_mode(cfg) -> str:
    """``rollout.log_prob_mode`` with null resolved: ``bypass`` for an async run whose
    batches can be stale, ``decoupled`` otherwise. (verl's
    ``async_training.use_rollout_log_probs`` / ``compute_prox_log_prob`` set it explicitly:
    ``bypass`` / ``rollout_correction``, the verl table's rows.)"""
    if cfg.rollout.log_prob_mode is not None:
        return cfg.rollout.log_prob_mode
    a = cfg.async_training
    return "bypass" if staleness_bound(a) > 0 else "decoupled"


def check_async(c, f) -> None:
    """Ranges and combinations of ``async_training`` (a check of ``lmrl.config.checks``)."""
    a = c.async_training
    f.check(
        "async_training.staleness_threshold",
        lambda v: math.isfinite(v) and v >= 0,
        "must be >= 0, a number of updates (1 = one-step-off, 0 = synchronous)",
    )
    f.check("async_training.trigger_parameter_sync_step", lambda v: v >= 1, "must be >= 1")
    f.check("resources.rollout_workers", lambda v: v >= 1, "must be >= 1")
    if not a.enable:
        return
    _lag(c, f)
    if a.partial_rollout:
        f.errors.append(
            "async_training.partial_rollout=true: lmrl's engines take new weights between "
            "requests, never in the middle of one; set async_training.partial_rollout=false"
        )
    if c.rollout.log_prob_mode == "decoupled" and staleness_bound(a) > 0:
        f.warnings.append(
            "rollout.log_prob_mode=decoupled with async_training: stale samples are trained "
            "against the recomputed policy with no correction for the weights that generated "
            "them; leave rollout.log_prob_mode unset (bypass) or set rollout_correction"
        )


def _lag(c, f) -> None:
    """The staleness bound against the run's length (when ``trainer.total_training_steps``
    gives it) and against ``MAX_STALENESS``: past either, the run trains on samples of the
    initial policy for the whole run, or holds that many batches and weight copies ahead."""
    a = c.async_training
    k, t = a.staleness_threshold, a.trigger_parameter_sync_step
    if not (math.isfinite(k) and k >= 0 and t >= 1):
        return  # reported by the range checks
    bound, steps = staleness_bound(a), c.trainer.total_training_steps
    keys = f"async_training.staleness_threshold={k!r}" + (
        f" with async_training.trigger_parameter_sync_step={t}" if t > 1 else ""
    )
    lag = f"lets a batch's weights lag up to {bound} updates"
    if steps is not None and steps >= 2 and bound >= steps:  # one step: the same either way
        f.errors.append(
            f"{keys} {lag}, at least the run's {steps} steps (trainer.total_training_steps): "
            f"every batch would be generated by the initial policy; {_fix(steps - 1, t)}"
        )
    elif bound > MAX_STALENESS:
        f.errors.append(
            f"{keys} {lag}, more than lmrl's cap of {MAX_STALENESS} (the generator would hold "
            "that many batches ahead, and train on samples that many updates old); "
            + _fix(MAX_STALENESS, t)
        )


def _fix(most: int, sync_every: int) -> str:
    """How to bring the staleness bound down to ``most`` updates."""
    if most - sync_every + 1 >= 1:
        return (
            f"set async_training.staleness_threshold <= {most - sync_every + 1} (1 = one-step-off)"
        )
    return (
        "lower async_training.trigger_parameter_sync_step (ceil(staleness_threshold) + "
        f"trigger_parameter_sync_step - 1 must be <= {most})"
    )
