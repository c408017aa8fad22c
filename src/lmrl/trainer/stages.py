"""Stages 1-2 of the step, rollout and reward, with DAPO dynamic sampling; and validation.

Free functions over a run's parts (:class:`lmrl.trainer.run.RunParts`), so the trainer's step
stays the numbered pipeline and ``lmrl eval`` validates without a trainer.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from lmrl.batch import Batch
from lmrl.rewards.result import split_extras
from lmrl.rollout.merge import concat_rollouts
from lmrl.trainer.metrics import StageTimer
from lmrl.trainer.validation import validation_metrics

log = logging.getLogger("lmrl.trainer")


def rollout_and_score(parts, step: int, timer: StageTimer, metrics: dict) -> Batch:
    """Generate ``n`` responses per prompt and score them (stages 1-2).

    With ``algorithm.filter_groups`` (DAPO dynamic sampling), groups whose responses all have
    the same filter metric are dropped and more prompts are generated until
    ``data.train_batch_size`` groups are kept or ``max_num_gen_batches`` is hit.

    Args:
        parts: the run's parts (engine, reward, train data and sampler, plan).
        step: the global step (0-based) this batch is for; seeds the sampling, so a resumed
            run samples the same responses.
        timer: the step's stage timer.
        metrics: the step's metrics, added to.
    """
    plan = parts.plan
    fg, n, target = plan.filter_groups, plan.n, plan.train_batch_size
    kept: list[Batch] = []
    kept_groups, gen_batches, total_groups = 0, 0, 0
    while True:
        batch, prompts = generate(parts, step, timer, gen_batches)
        if "reward_baselines" in plan.estimator_needs:
            with timer("gen_baseline"):
                batch["reward_baselines"] = greedy_baseline(parts, prompts)
        with timer("reward"):
            extras = score(parts.reward, batch, metrics)
        if not fg.enable:
            return batch
        gen_batches += 1
        groups = len(batch) // n
        total_groups += groups
        value = filter_metric(batch, extras, fg.metric).reshape(groups, n)
        spread = value.max(axis=1) > value.min(axis=1)
        keep = np.repeat(spread, n)
        if keep.any():
            kept.append(batch.index(keep))
            kept_groups += int(spread.sum())
        if kept_groups >= target or 0 < fg.max_num_gen_batches <= gen_batches:
            break
    metrics["filter_groups/gen_batches"] = float(gen_batches)
    metrics["filter_groups/kept_fraction"] = kept_groups / max(total_groups, 1)
    if not kept:
        log.warning(
            "filter_groups: every group had zero spread in %d generation batches; "
            "training on the last batch unfiltered",
            gen_batches,
        )
        return batch
    return concat_rollouts(kept, parts.engine.pad_id).index(slice(0, target * n))


def generate(parts, step: int, timer: StageTimer, round_: int = 0) -> tuple[Batch, Batch]:
    """Stage 1 alone: the next prompts from the sampler and their ``n`` responses each,
    seeded per (step, generation round) so a resumed run samples the same responses.
    Returns the rollout and its prompts."""
    plan = parts.plan
    prompts = parts.train_data.get_batch(parts.sampler.next_batch())
    seed = plan.seed + 1_000_003 * step + round_
    with timer("gen"):
        batch = parts.engine.generate(
            prompts, plan.n, dataclasses.replace(plan.sampling, seed=seed)
        )
    return batch, prompts


def scored_apart(plan) -> bool:
    """Whether a batch can be scored after its generation, apart from it (stage 2 in flight
    while the next batch generates): not under DAPO's dynamic sampling (its scores decide
    whether to generate more) nor ReMax (its baseline is generated and scored with it)."""
    return not plan.filter_groups.enable and "reward_baselines" not in plan.estimator_needs


def greedy_baseline(parts, prompts: Batch) -> torch.Tensor:
    """ReMax's baseline: the reward of one greedy response per prompt, repeated n times."""
    baseline = parts.engine.generate(prompts, 1, parts.plan.greedy)
    scores = parts.reward(baseline).token_level_scores.sum(-1)
    return scores.repeat_interleave(parts.plan.n)


def score(reward, batch: Batch, metrics: dict) -> dict[str, np.ndarray]:
    """Write ``token_level_scores`` into ``batch``; add the manager's numeric extras and
    counters to ``metrics``; keep its text extras (e.g. verl's ``pred``) in the non-tensor
    column ``reward_texts`` (a dict per sample, {} without text) for the generations log;
    return the numeric extras (per-sample arrays)."""
    result = reward(batch)
    batch["token_level_scores"] = result.token_level_scores.to(batch["responses"].device)
    numeric, texts = split_extras(result.extras)
    for key, value in numeric.items():
        finite = value[np.isfinite(value)]
        if finite.size:
            metrics[f"reward/{key}/mean"] = float(finite.mean())
    # on every batch, {} where none: DAPO's generation batches are concatenated key for key
    rows = [{k: v[i] for k, v in texts.items() if v[i] is not None} for i in range(len(batch))]
    batch["reward_texts"] = rows
    for key, value in result.metrics.items():
        metrics[key] = metrics.get(key, 0.0) + float(value)
    return numeric


def filter_metric(batch: Batch, extras: dict[str, np.ndarray], name: str) -> np.ndarray:
    """The per-sample value dynamic sampling compares within a group."""
    if name in ("seq_reward", "seq_final_reward"):
        return batch["token_level_scores"].sum(-1).double().cpu().numpy()
    if name not in extras:
        raise ValueError(
            f"algorithm.filter_groups.metric={name!r} is not a score extra; "
            f"valid: seq_reward, seq_final_reward, {', '.join(sorted(extras))}"
        )
    return np.nan_to_num(np.asarray(extras[name], dtype=np.float64))


def validate(parts) -> dict[str, float]:
    """Generate on the validation prompts with ``rollout.val_kwargs`` and score them.

    Returns:
        Per data source ``val/<source>/mean@k``, ``pass@k``, ``reward/mean`` and ``acc``
        (when the scorer reports one), ``k = val_kwargs.n``; empty without validation data.
    """
    data, plan = parts.val_data, parts.plan
    if data is None:
        return {}
    size = plan.val_batch_size or len(data)
    sources, uids, scores, accs = [], [], [], []
    for start in range(0, len(data), size):
        indices = list(range(start, min(start + size, len(data))))
        out = parts.engine.generate(data.get_batch(indices), plan.val_n, plan.val_sampling)
        result = parts.reward(out)
        sources += list(out["data_source"])
        uids += list(out["uid"])
        scores += result.token_level_scores.sum(-1).tolist()
        accs += list(result.extras["acc"]) if "acc" in result.extras else []
    return validation_metrics(sources, uids, scores, accs or None, k=plan.val_n)


__all__ = ["concat_rollouts", "filter_metric", "generate", "greedy_baseline", "rollout_and_score",
           "score", "scored_apart", "validate"]  # fmt: skip
