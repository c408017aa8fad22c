"""Stages 1-2 of the step, rollout and reward, with DAPO dynamic sampling; and validation.

Free functions over a run's parts (:class:`lmrl.trainer.build.RunParts`), so the trainer's step
stays the numbered pipeline and ``lmrl eval`` validates without a trainer.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmrl.batch import Batch
from lmrl.data.curriculum import passes
from lmrl.rewards.result import RewardResult, merge_results, scored_rows, split_extras
from lmrl.rollout.merge import concat_rollouts
from lmrl.run.timing import StageTimer
from lmrl.trainer.metrics import source_reward_metrics
from lmrl.trainer.validation import validation_metrics

if TYPE_CHECKING:
    from lmrl.workers.roles import EngineRole

log = logging.getLogger("lmrl.trainer")


def scoring_thread(plan) -> ThreadPoolExecutor | None:
    """The run's thread for rewards in flight, where the plan overlaps scoring with anything
    (``reward.overlap.chunks`` > 1, ``overlap.rows`` or ``overlap.log_probs``), else None. One
    for the whole run: the reward's worker processes live as long as the thread that started
    them."""
    if plan.scoring_thread:
        return ThreadPoolExecutor(1, thread_name_prefix="lmrl-reward")
    return None


class Scoring:
    """A step's reward calls, one at a time in the run's scoring thread, so that scoring
    overlaps what the step does meanwhile: the rest of the generation (the rows that stopped
    while the others decode, ``reward.overlap.rows``; the calls done while the next ones
    generate, ``reward.overlap.chunks``) and, under ``reward.overlap.log_probs``, stages 3-5.
    Every reward call of the step goes through it (ReMax's baseline too): the reward manager
    is never called from two threads at once.

    Args:
        reward: the run's reward scoring (``RewardRole``).
        thread: from `scoring_thread`; None = the calls run in the caller's thread, the
            blocks' at `join` (the synchronous step: generate, then score; a reward function
            of the user's may rely on the main thread).
        sampler: the run's prompt sampler; one that learns from pass rates (``data.curriculum``,
            `lmrl.data.curriculum.CurriculumSampler`) is told each joined batch's passes.
    """

    def __init__(self, reward, thread: ThreadPoolExecutor | None = None, sampler=None) -> None:
        self.reward = reward
        self.thread = thread
        self.sampler = sampler if hasattr(sampler, "observe") else None  # data.curriculum
        self._blocks: list[Future | Batch] = []  # a Batch: scored at join
        self._rows: list[np.ndarray] = []  # each block's rows of the batch
        self._next = 0

    def submit(self, block: Batch, rows: np.ndarray | None = None) -> None:
        """Score ``block``, whose rows are the batch's ``rows`` (default its next rows in
        order): now in the thread, or at `join` without one."""
        if rows is None:
            rows = np.arange(self._next, self._next + len(block))
            self._next += len(block)
        self._rows.append(np.asarray(rows))
        self._blocks.append(self.thread.submit(self.reward, block) if self.thread else block)

    def call(self, batch: Batch) -> RewardResult:
        """Score ``batch`` apart from the blocks (ReMax's baseline), in turn with them."""
        if self.thread is None:
            return self.reward(batch)
        return self.thread.submit(self.reward, batch).result()

    def join(self, batch: Batch, metrics: dict) -> dict[str, np.ndarray]:
        """Wait for the blocks, which together are ``batch``'s rows, and write their scores
        into it in row order (see `record`); returns the numeric extras. A reward's error is
        raised here."""
        try:
            results = [
                b.result() if isinstance(b, Future) else self.reward(b) for b in self._blocks
            ]
        finally:
            self.close()
        merged = merge_results(results, batch["responses"].shape[1])
        order = np.concatenate(self._rows)
        if not np.array_equal(order, np.arange(len(batch))):  # rows scored as they stopped
            if not np.array_equal(np.sort(order), np.arange(len(batch))):
                raise RuntimeError(f"{len(order)} rows scored for a batch of {len(batch)}")
            back = torch.as_tensor(np.argsort(order))
            merged = RewardResult(
                merged.token_level_scores[back],
                {k: np.asarray(v)[back.numpy()] for k, v in merged.extras.items()},
                merged.metrics,
                scored_rows(merged)[back.numpy()],
            )
        numeric = record(batch, merged, metrics)
        if self.sampler is not None:
            self.sampler.observe(passes(
                batch["token_level_scores"].sum(-1).double().cpu().numpy(), numeric.get("acc"),
                self.sampler.curriculum.pass_score, scored_rows(merged),
            ))  # fmt: skip
            metrics |= self.sampler.metrics()
        return numeric

    def close(self) -> None:
        """Drop the step's calls not started (a step that failed)."""
        for block in self._blocks:
            if isinstance(block, Future):
                block.cancel()


def rollout(
    parts, step: int, timer: StageTimer, metrics: dict, thread: ThreadPoolExecutor | None = None
) -> tuple[Batch, Scoring | None]:
    """Stages 1-2 as the trainer runs them, scoring in ``thread`` (see `scoring_thread`): the
    batch, and its scoring still under way when ``reward.overlap.log_probs`` lets stages 3-5
    overlap it (the caller joins it before the advantages), else None with the batch scored
    (see `rollout_and_score`)."""
    plan = parts.plan
    if thread is None or not plan.reward_deferred or plan.filter_groups.enable:
        return rollout_and_score(parts, step, timer, metrics, thread), None  # DAPO: now
    batch, scoring = _generate_scored(parts, step, timer, 0, thread)
    return batch, scoring


def rollout_and_score(
    parts, step: int, timer: StageTimer, metrics: dict, thread: ThreadPoolExecutor | None = None
) -> Batch:
    """Generate ``n`` responses per prompt and score them (stages 1-2).

    With a scoring ``thread`` the samples are scored while the rest generate (see
    `generate`); ``timing_s/reward`` is then the wait after the generation. With
    ``algorithm.filter_groups`` (DAPO dynamic sampling), groups whose responses all have the
    same filter metric are dropped and more prompts are generated until
    ``data.train_batch_size`` groups are kept or ``max_num_gen_batches`` is hit.

    Args:
        parts: the run's parts (engine, reward, train data and sampler, plan).
        step: the global step (0-based) this batch is for; seeds the sampling, so a resumed
            run samples the same responses.
        timer: the step's stage timer.
        metrics: the step's metrics, added to.
        thread: the run's scoring thread (`scoring_thread`), or None to score in this one.
    """
    plan = parts.plan
    fg, n, target = plan.filter_groups, plan.n, plan.train_batch_size
    kept: list[Batch] = []
    kept_groups, gen_batches, total_groups = 0, 0, 0
    while True:
        batch, scoring = _generate_scored(parts, step, timer, gen_batches, thread)
        with timer("reward"):  # what the scoring adds after the generation
            extras = scoring.join(batch, metrics)
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


def _generate_scored(parts, step: int, timer: StageTimer, round_: int, thread):
    """Stage 1 (and ReMax's baseline) with the rows handed to a `Scoring` as they come."""
    scoring = Scoring(parts.reward, thread, parts.sampler)
    try:
        batch, prompts = generate(parts, step, timer, round_, scoring)
        if "reward_baselines" in parts.plan.estimator_needs:
            with timer("gen_baseline"):
                batch["reward_baselines"] = greedy_baseline(parts, prompts, scoring)
    except BaseException:
        scoring.close()
        raise
    return batch, scoring


def generate(
    parts, step: int, timer: StageTimer, round_: int = 0, scoring: Scoring | None = None
) -> tuple[Batch, Batch]:
    """Stage 1: the next prompts from the sampler and their ``n`` responses each, seeded per
    (step, generation round) so a resumed run samples the same responses. Returns the
    rollout and its prompts.

    With ``scoring``, the rows are handed to it as they are generated; when it scores in a
    thread of its own, the prompts are generated in ``reward.overlap.chunks`` calls of whole
    groups, each at its place in the batch (``prompt_offset``), so the samples are those of
    one call, and with ``reward.overlap.rows`` each row as it stops (`_generate_rows`).
    """
    plan, engine = parts.plan, parts.engine
    prompts = parts.train_data.get_batch(parts.sampler.next_batch())
    sampling = dataclasses.replace(plan.sampling, seed=plan.seed + 1_000_003 * step + round_)
    overlapped = scoring is not None and scoring.thread is not None
    chunks = min(plan.reward_chunks, len(prompts)) if overlapped else 1
    rows = overlapped and plan.reward_rows  # the plan knows which engines report rows
    if rows and "uid" not in prompts:  # a row scored early carries its batch's uid
        prompts["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(prompts))], dtype=object)
    with timer("gen"):
        if chunks <= 1 and not rows:
            batch = engine.generate(prompts, plan.n, sampling)
            if scoring is not None:
                scoring.submit(batch)
            return batch, prompts
        assert scoring is not None  # chunks or rows: an overlapped scoring
        blocks = []
        for part in np.array_split(np.arange(len(prompts)), chunks):
            lo, hi = int(part[0]), int(part[-1]) + 1
            call = prompts.index(slice(lo, hi))
            if rows:
                blocks.append(_generate_rows(engine, call, sampling, lo, plan.n, scoring))
            else:
                blocks.append(engine.generate(call, plan.n, sampling, prompt_offset=lo))
                scoring.submit(blocks[-1])
        batch = blocks[0] if len(blocks) == 1 else concat_rollouts(blocks, engine.pad_id)
        return batch, prompts


def _generate_rows(
    engine: EngineRole, prompts: Batch, sampling, offset: int, n: int, scoring: Scoring
) -> Batch:
    """One generation call whose rows are handed to ``scoring`` as they stop
    (``reward.overlap.rows``, through the engine's ``set_row_done``); rows the engine did not
    report are handed over when the call returns."""
    reported = np.zeros(len(prompts) * n, dtype=bool)

    def row_done(rows: torch.Tensor, block: Batch) -> None:
        local = rows.cpu().numpy()
        scoring.submit(block, offset * n + local)
        reported[local] = True

    engine.set_row_done(row_done)
    try:
        out = engine.generate(prompts, n, sampling, prompt_offset=offset)
    finally:
        engine.set_row_done(None)
    rest = np.flatnonzero(~reported)
    if len(rest):
        scoring.submit(out.index(torch.as_tensor(rest)), offset * n + rest)
    return out


def scored_apart(plan) -> bool:
    """Whether a batch can be scored after its generation, apart from it (stage 2 in flight
    while the next batch generates): not under DAPO's dynamic sampling (its scores decide
    whether to generate more) nor ReMax (its baseline is generated and scored with it)."""
    return not plan.filter_groups.enable and "reward_baselines" not in plan.estimator_needs


def greedy_baseline(parts, prompts: Batch, scoring: Scoring | None = None) -> torch.Tensor:
    """ReMax's baseline: the reward of one greedy response per prompt, repeated n times
    (scored in turn with the batch's blocks when ``scoring`` is given)."""
    baseline = parts.engine.generate(prompts, 1, parts.plan.greedy)
    result = scoring.call(baseline) if scoring is not None else parts.reward(baseline)
    return result.token_level_scores.sum(-1).repeat_interleave(parts.plan.n)


def score(reward, batch: Batch, metrics: dict) -> dict[str, np.ndarray]:
    """Score ``batch`` in one call and `record` the result; returns the numeric extras."""
    return record(batch, reward(batch), metrics)


def record(batch: Batch, result: RewardResult, metrics: dict) -> dict[str, np.ndarray]:
    """Write ``token_level_scores`` and ``scored_mask`` (False on the rows no reward function
    scored, see `leave_out_unscored`) into ``batch``; add the manager's numeric extras (means
    over the scored rows) and counters to ``metrics``, with ``reward/unscored_frac``; keep
    its text extras (e.g. verl's ``pred``) in the non-tensor column ``reward_texts`` (a dict
    per sample, {} without text) for the generations log; return the numeric extras
    (per-sample arrays)."""
    device = batch["responses"].device
    batch["token_level_scores"] = result.token_level_scores.to(device)
    scored = scored_rows(result)
    batch["scored_mask"] = torch.as_tensor(scored, dtype=torch.bool, device=device)
    numeric, texts = split_extras(result.extras)
    if not scored.all():  # an unscored row's extras are no measure of the policy
        numeric = {k: np.where(scored, v, np.nan) for k, v in numeric.items()}
    for key, value in numeric.items():
        finite = value[np.isfinite(value)]
        if finite.size:
            metrics[f"reward/{key}/mean"] = float(finite.mean())
    # on every batch, {} where none: DAPO's generation batches are concatenated key for key
    rows = [{k: v[i] for k, v in texts.items() if v[i] is not None} for i in range(len(batch))]
    batch["reward_texts"] = rows
    for key, count in result.metrics.items():
        metrics[key] = metrics.get(key, 0.0) + float(count)
    metrics["reward/unscored_frac"] = float((~scored).mean()) if len(scored) else 0.0
    metrics |= source_reward_metrics(batch, numeric)  # train/<source>/acc, 2+ sources
    return numeric


def leave_out_unscored(batch: Batch) -> tuple[object, torch.Tensor]:
    """The advantage estimator's group ``index`` and ``response_mask`` with the rows no reward
    function scored (``scored_mask`` False) left out: each such row a group of its own and
    masked, so its advantage is 0 and its prompt's group statistics are those of the scored
    rows; and ``loss_mask`` narrowed to the scored rows, so they send no gradient (loss, KL
    and entropy alike). A batch whose rows are all scored is returned as it is."""
    mask = batch["response_mask"]
    if "scored_mask" not in batch or bool(batch["scored_mask"].all()):
        return batch["uid"], mask
    scored = batch["scored_mask"].to(mask.device)
    index = np.asarray(batch["uid"], dtype=object).copy()
    for i in np.flatnonzero(~scored.cpu().numpy()):
        index[i] = f"{index[i]}/unscored/{i}"
    keep = mask.bool() & scored[:, None]
    batch["loss_mask"] = batch["loss_mask"] & keep if "loss_mask" in batch else keep
    return index, keep


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


def validate(parts, outputs: list[Batch] | None = None) -> dict[str, float]:
    """Generate on the validation prompts with ``rollout.val_kwargs`` and score them; each
    generated batch is appended to ``outputs`` when given (the answers' spread reads them).

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
        if outputs is not None:
            outputs.append(out)
        result = parts.reward(out)
        sources += list(out["data_source"])
        uids += list(out["uid"])
        scores += result.token_level_scores.sum(-1).tolist()
        accs += list(result.extras["acc"]) if "acc" in result.extras else []
    return validation_metrics(sources, uids, scores, accs or None, k=plan.val_n)


__all__ = ["Scoring", "concat_rollouts", "filter_metric", "generate", "greedy_baseline", "record",
           "rollout", "rollout_and_score", "score", "scored_apart", "scoring_thread",
           "validate"]  # fmt: skip
