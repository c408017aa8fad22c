"""Reward managers: from a `Batch` of responses to ``token_level_scores``.

A manager decodes each response's tokens (``response_tokens_mask``: a multi-turn rollout's
observations included; special tokens skipped), scores it with its reward functions (the
built-in scorers by ``data_source`` unless the user gives their own), and writes the sample's
score on the last trained response token (``response_mask``) of a zero ``(B, T)`` float32
tensor. Three managers share that interface (`REWARD_MANAGERS`):

- ``naive``: every sample scored on its own; a batched (TRL-style) function gets one-sample
  lists;
- ``batch``: a batched function gets the whole batch in one call (for rewards that look at
  several samples at once); per-sample functions are still called per sample;
- ``dapo``: ``naive`` plus DAPO's overlong penalty
  ``min(-(len - (L_max - buffer)) / buffer * factor, 0)`` added to the score, ``len`` being
  the response's valid token count (seed 004 §7).

Robustness is the design choice: a reward function that raises, hangs, returns NaN/inf, a
wrong type or None, a dict without ``score``, a batch of the wrong length, or whose worker
process dies costs that sample a 0 from that function and a count in ``reward/errors`` or
``reward/timeouts`` (out of ``reward/scored``); a batched function's None for one sample
(or a per-sample ``{"score": None}``: "this function does not score this sample", TRL's
convention) counts in ``reward/no_score`` and adds nothing to the sample's sum. A sample that
no function scores is unscored: ``RewardResult.scored`` is False on it, its extras' ``score``
is NaN (out of the score means), it counts in ``reward/unscored`` (and
``train/<source>/unscored``), and the trainer leaves it out of the advantages' group
statistics and of the loss (``lmrl.trainer.stages.record``). The first error and the first
timeout are logged once per manager on ``logging.getLogger("lmrl.rewards")``.

A reward that fails on (nearly) every sample is a bug, not noise: on the manager's first call,
a function that errs or times out on at least ``max_error_fraction`` of the samples raises
`lmrl.errors.RewardError` quoting its first error, so a run stops at its first step instead
of training on zeros; later calls only count and warn. `RewardManager.check_dataset` finds at
load time the rows the built-in scorers cannot score (an unknown ``data_source``, a missing or
unusable ground truth).

With ``num_workers >= 1`` (default 1) scoring runs in a persistent `ScoringPool` with a
per-call timeout (timeouts run in parallel) and hung workers are replaced; ``num_workers=0``
scores in-process, cheapest, but with no timeout (a hanging function hangs training) and no
protection against crashes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmrl.algos.registry import Registry
from lmrl.batch import Batch, last_true, response_tokens_mask
from lmrl.errors import DataError, RewardError
from lmrl.rewards.functions import Outcome, RewardFunction, describe
from lmrl.rewards.pool import ScoringPool
from lmrl.rewards.result import RewardResult, column
from lmrl.rewards.scorers import SCORERS, BuiltinScorer

log = logging.getLogger("lmrl.rewards")


REWARD_MANAGERS: Registry[Callable[..., RewardManager]] = Registry("reward manager")


def _as_reward_functions(
    reward_fns: RewardFunction | Callable | Sequence[RewardFunction | Callable] | None,
    scorer_options: Mapping[str, Mapping[str, Any]] | None,
) -> list[RewardFunction]:
    if reward_fns is None:
        return [RewardFunction(BuiltinScorer(scorer_options), name="builtin", batched=False)]
    if scorer_options:
        raise ValueError("scorer_options only apply to the built-in scorers, not to reward_fns")
    if isinstance(reward_fns, RewardFunction) or callable(reward_fns):
        reward_fns = [reward_fns]
    fns = [f if isinstance(f, RewardFunction) else RewardFunction(f) for f in reward_fns]
    if not fns:
        raise ValueError("reward_fns is empty")
    names = [f.name for f in fns]
    if len(set(names)) != len(names):
        raise ValueError(f"reward function names must be distinct, got {names}")
    return fns


@REWARD_MANAGERS.register("naive")
class RewardManager:
    """The ``naive`` manager: each sample scored on its own (the base of the others).

    Args:
        tokenizer: decodes the responses (``batch_decode`` with ``skip_special_tokens``).
        reward_fns: a `RewardFunction`, a callable, or a list of them; None = the built-in
            scorers chosen by ``data_source``. A plain callable's convention is detected
            (see ``lmrl.rewards.functions``).
        num_workers: worker processes for scoring (default 1); 0 = in-process, no timeout.
        timeout_s: seconds one call may take in the pool (one sample, or one batched call).
        batch_timeout_s: seconds the pool may spend on one batch in all (the rest of the batch
            then times out); None = no limit beyond the per-call one.
        reward_fn_key: the non-tensor column naming the scorer (verl's ``reward_fn_key``).
        scorer_options: options of the built-in scorers per data source, e.g.
            ``{"gsm8k": {"method": "flexible"}}`` (only without ``reward_fns``).
        max_error_fraction: on the first call, a function that errs or times out on at least
            this fraction of the samples raises `RewardError` (``reward.max_error_fraction``);
            0 = any failure, > 1 = never.

    Raises:
        ValueError: bad arguments (the message names them).
        RewardError: reward functions that cannot reach the worker processes.
    """

    whole_batch_calls = False  # batched functions get the whole batch (True) or one sample

    def __init__(
        self,
        tokenizer: Any,
        *,
        reward_fns: RewardFunction | Callable | Sequence[RewardFunction | Callable] | None = None,
        num_workers: int = 1,
        timeout_s: float | None = 10.0,
        batch_timeout_s: float | None = None,
        reward_fn_key: str = "data_source",
        scorer_options: Mapping[str, Mapping[str, Any]] | None = None,
        max_error_fraction: float = 0.9,
    ):
        if not isinstance(max_error_fraction, int | float) or not max_error_fraction >= 0:
            raise ValueError(
                f"max_error_fraction must be a number >= 0, got {max_error_fraction!r}"
            )
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s!r}")
        self.tokenizer = tokenizer
        self.reward_fns = _as_reward_functions(reward_fns, scorer_options)
        self.uses_builtin = reward_fns is None
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.reward_fn_key = reward_fn_key
        self.max_error_fraction = float(max_error_fraction)
        self.calls = 0  # batches scored so far; the error threshold applies to the first
        # the pool object checks now that the functions can reach worker processes; its
        # processes start on the first call
        self._pool = (
            ScoringPool(self.reward_fns, num_workers, timeout_s, batch_timeout_s)
            if num_workers
            else None
        )
        self._logged: set[str] = set()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_dataset(self, dataset: Any) -> None:
        """Fail at load time on the rows the built-in scorers cannot score.

        Only with the built-in scorers (a custom reward function scores anything): every
        row's data source must have a scorer, and a ground truth the scorer accepts (it scores
        an empty response against it, which also catches a malformed one).

        Args:
            dataset: an `lmrl.data.RLDataset`: ``len``, rows ``dataset[i]`` with
                ``data_source`` and ``ground_truth``, ``dataset.origin(i)`` (file, row) and
                ``dataset.reward_fn_key`` (the data-source column).

        Raises:
            DataError: the first bad row, e.g. ``"train.jsonl: row 3: column 'data_source':
                no built-in scorer for 'mine'; known data sources: ..."`` or ``"...: column
                'reward_model.ground_truth': missing ..."``.
        """
        if not self.uses_builtin:
            return
        scorer = self.reward_fns[0].fn
        for i in range(len(dataset)):
            row = dataset[i]
            file, r = dataset.origin(i)
            source, truth = row["data_source"], row["ground_truth"]
            if source not in SCORERS:
                raise DataError(
                    f"{file}: row {r}: column {dataset.reward_fn_key!r}: no built-in scorer for "
                    f"{source!r}; known data sources: {', '.join(sorted(SCORERS))}; or set "
                    "reward.custom_reward_function.path to score it with your own function"
                )
            where = f"{file}: row {r}: column 'reward_model.ground_truth'"
            if truth is None:
                raise DataError(
                    f"{where}: missing (no reward_model column, or a null ground_truth); the "
                    f"built-in scorer of data_source {source!r} needs one to score against"
                )
            try:
                scorer(source, "", truth, row.get("extra_info"))
            except (ValueError, TypeError, KeyError, AttributeError) as err:
                raise DataError(
                    f"{where}: the built-in scorer of data_source {source!r} cannot use "
                    f"{truth!r:.80} ({type(err).__name__}: {err})"
                ) from None

    # ------------------------------------------------------------------ scoring
    def __call__(self, batch: Batch) -> RewardResult:
        """Score a batch of responses.

        Args:
            batch: with ``responses`` (B, T) and ``response_mask`` (B, T) bool (or
                ``attention_mask`` (B, P+T), whose last T columns are used), and the
                non-tensor columns ``data_source`` (``reward_fn_key``), ``ground_truth``,
                ``extra_info``, optionally ``raw_prompt`` and ``uid``.

        Returns:
            A `RewardResult`.

        Raises:
            ValueError: ``responses`` or both masks are missing, or the shapes differ.
        """
        if "responses" not in batch:
            raise ValueError(f"the batch has no 'responses'; keys: {batch.keys()}")
        responses = batch["responses"]
        B, T = responses.shape
        if "response_mask" not in batch and "attention_mask" not in batch:
            raise ValueError(
                "the batch needs 'response_mask' (or 'attention_mask') to decode responses"
            )
        # decode every token read (a multi-turn rollout's observations too); the score goes
        # on the last trained token
        mask = response_tokens_mask(batch)
        trained = batch["response_mask"].bool() if "response_mask" in batch else mask
        if mask.shape != responses.shape or trained.shape != responses.shape:
            raise ValueError(f"response_mask has shape {tuple(mask.shape)}, responses {(B, T)}")
        ids = [responses[i][mask[i]].tolist() for i in range(B)]
        completions = self.tokenizer.batch_decode(ids, skip_special_tokens=True)

        def column(key: str, default: Any = None) -> list[Any]:
            return list(batch[key]) if key in batch else [default] * B

        # RLDataset keeps the reward_fn_key column as "data_source"
        source_key = self.reward_fn_key if self.reward_fn_key in batch else "data_source"
        scores, extras, metrics = self.score_texts(
            completions,
            data_sources=column(source_key),
            ground_truths=column("ground_truth"),
            extra_infos=column("extra_info"),
            prompts=column("raw_prompt"),
            completion_ids=ids,
            uids=column("uid") if "uid" in batch else None,
        )
        scored = np.isfinite(scores)  # NaN: no reward function scored the sample
        scores = np.where(scored, scores, 0.0)
        lengths = mask.sum(dim=-1)  # DAPO's overlong budget counts every response token
        scores = np.where(scored, self._adjust(scores, lengths.cpu().numpy(), T, extras, metrics),
                          0.0)  # fmt: skip
        token_level_scores = torch.zeros(B, T, dtype=torch.float32, device=responses.device)
        last = last_true(trained).to(responses.device)
        token_level_scores[torch.arange(B, device=responses.device), last] = torch.as_tensor(
            scores, dtype=torch.float32, device=responses.device
        )
        return RewardResult(token_level_scores, extras, metrics, scored=scored)

    def _adjust(
        self,
        scores: np.ndarray,
        lengths: np.ndarray,
        width: int,
        extras: dict[str, np.ndarray],
        metrics: dict[str, float],
    ) -> np.ndarray:
        """Hook for subclasses: change the final scores knowing the response lengths."""
        return scores

    def score_texts(
        self,
        completions: Sequence[str],
        data_sources: Sequence[Any],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Any],
        prompts: Sequence[Any] | None = None,
        completion_ids: Sequence[Sequence[int]] | None = None,
        uids: Sequence[Any] | None = None,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        """Score decoded completions (the tokenizer-free core of ``__call__``).

        Args:
            completions: B decoded responses.
            data_sources, ground_truths, extra_infos: B values each.
            prompts: B raw prompts (for batched functions), default None each.
            completion_ids: B token-id lists (for batched functions), default empty.
            uids: B group ids, passed to batched functions when given.

        Returns:
            ``(scores (B,) float64, extras, metrics)`` as in `RewardResult`; a score is NaN
            where no reward function scored the sample (each returned None).

        Raises:
            RewardError: on the first call, a function failed on at least
                ``max_error_fraction`` of the samples (the message quotes its first error).
        """
        n = len(completions)
        prompts = list(prompts) if prompts is not None else [None] * n
        completion_ids = (
            [list(c) for c in completion_ids] if completion_ids is not None else [[]] * n
        )
        tasks: list[tuple[int, str, tuple]] = []
        owners: list[tuple[int, list[int]]] = []  # per task: (function index, sample indices)
        for f, rf in enumerate(self.reward_fns):
            if not rf.batched:
                for i in range(n):
                    args = (data_sources[i], completions[i], ground_truths[i], extra_infos[i])
                    tasks.append((f, "sample", args))
                    owners.append((f, [i]))
                continue
            groups = [list(range(n))] if self.whole_batch_calls else [[i] for i in range(n)]
            for rows in groups:
                columns = {
                    "data_source": [data_sources[i] for i in rows],
                    "ground_truth": [ground_truths[i] for i in rows],
                    "extra_info": [extra_infos[i] for i in rows],
                    "completion_ids": [completion_ids[i] for i in rows],
                }
                if uids is not None:
                    columns["uid"] = [uids[i] for i in rows]
                args = ([prompts[i] for i in rows], [completions[i] for i in rows], columns)
                tasks.append((f, "batch", args))
                owners.append((f, rows))

        restarts_before = self._pool.restarts if self._pool is not None else 0
        if self._pool is None:
            outcomes = [self.reward_fns[f].call((kind, args)) for f, kind, args in tasks]
        else:
            outcomes = self._pool.run(tasks)

        table: list[list[Outcome | None]] = [[None] * n for _ in self.reward_fns]
        for (f, rows), outcome in zip(owners, outcomes, strict=True):
            per_row = outcome if isinstance(outcome, list) else [outcome]
            for i, o in zip(rows, per_row, strict=True):
                table[f][i] = o
        return self._combine(table, n, data_sources, restarts_before)

    def _combine(
        self, table: list[list[Outcome]], n: int, data_sources: Sequence[Any], restarts_before: int
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        scores = np.zeros(n, dtype=np.float64)
        applies = np.zeros(n, dtype=bool)  # some function scored the sample (or failed on it)
        counts = {"error": 0, "timeout": 0, "none": 0}
        errors_of = dict.fromkeys((str(s) for s in data_sources), 0)  # per data source
        raw: dict[str, list[Any]] = {}
        several = len(self.reward_fns) > 1
        for rf, row in zip(self.reward_fns, table, strict=True):
            prefix = f"{rf.name}/" if several else ""
            failed = [i for i, o in enumerate(row) if o.status in ("error", "timeout")]
            for i, o in enumerate(row):
                applies[i] |= o.status != "none"
                if o.status == "ok":
                    scores[i] += rf.weight * o.score
                else:
                    counts[o.status] += 1
                    errors_of[str(data_sources[i])] += o.status == "error"
                    if o.status in ("error", "timeout") and o.status not in self._logged:
                        self._logged.add(o.status)
                        log.warning(
                            "reward %s (scored 0 and counted in reward/%ss; logged once): %s "
                            "[function %r, sample %d, data_source %r]",
                            o.status,
                            o.status,
                            o.message,
                            rf.name,
                            i,
                            data_sources[i],
                        )
                items = dict(o.extras)
                if several:
                    items["score"] = o.score if o.status == "ok" else None
                for key, value in items.items():
                    raw.setdefault(prefix + key, [None] * n)[i] = value
            self._check_failures(rf, row, failed, data_sources)
        self.calls += 1
        scores[~applies] = np.nan
        extras = {key: column(values) for key, values in raw.items()}
        extras["score"] = scores.copy()
        restarts = (self._pool.restarts if self._pool is not None else 0) - restarts_before
        metrics = {
            "reward/scored": float(n * len(self.reward_fns)),
            "reward/errors": float(counts["error"]),
            "reward/timeouts": float(counts["timeout"]),
            "reward/no_score": float(counts["none"]),
            "reward/unscored": float((~applies).sum()),
            "reward/worker_restarts": float(restarts),
        }
        # reward/errors by data source; the trainer keeps them for a batch of 2+ sources
        metrics |= {f"train/{s}/reward_errors": float(k) for s, k in errors_of.items()}
        unscored_of = dict.fromkeys(errors_of, 0)
        for i in np.flatnonzero(~applies):
            unscored_of[str(data_sources[i])] += 1
        metrics |= {f"train/{s}/unscored": float(k) for s, k in unscored_of.items()}
        return scores, extras, metrics

    def _check_failures(
        self,
        rf: RewardFunction,
        row: list[Outcome],
        failed: list[int],
        data_sources: Sequence[Any],
    ) -> None:
        """Raise on the first call (warn once later) when ``rf`` failed on at least
        ``max_error_fraction`` of the samples."""
        n = len(row)
        if not failed or len(failed) < self.max_error_fraction * n:
            return
        sources = sorted({str(data_sources[i]) for i in failed})
        shown = ", ".join(repr(x) for x in sources[:3]) + (", ..." if len(sources) > 3 else "")
        who = (
            f"the built-in scorer (data_source {shown})"
            if self.uses_builtin
            else f"reward function {describe(rf.fn, rf.name)} (data_source {shown})"
        )
        first = row[failed[0]]
        what = f"{who} failed on {len(failed)} of {n} samples"
        if self.calls == 0:
            fix = "make it faster or raise reward.timeout_s" if first.status == "timeout" else ""
            raise RewardError(
                f"{what} of the first batch; first {first.status}: {first.message}. Fix the "
                f"reward{f' ({fix})' if fix else ''}, or set reward.max_error_fraction above "
                f"{self.max_error_fraction:g} (> 1 = never stop) to train on anyway"
            )
        if f"fraction:{rf.name}" not in self._logged:
            self._logged.add(f"fraction:{rf.name}")
            log.warning(
                "%s of batch %d (reward.max_error_fraction=%g; logged once); first %s: %s",
                what,
                self.calls + 1,
                self.max_error_fraction,
                first.status,
                first.message,
            )


@REWARD_MANAGERS.register("batch")
class BatchRewardManager(RewardManager):
    """The ``batch`` manager: batched functions get the whole batch in one call.

    Same arguments as `RewardManager`; ``timeout_s`` bounds that one call.
    """

    whole_batch_calls = True


@dataclass(frozen=True)
class OverlongBuffer:
    """DAPO's soft overlong punishment (verl's ``reward_model.overlong_buffer``).

    Attributes:
        enable: apply the penalty.
        len: the buffer length (tokens) before ``max_response_length``.
        penalty_factor: the penalty at ``max_response_length``.
        log: also put ``overlong`` (1.0 when penalised) in the extras.
    """

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False


def overlong_penalty(
    lengths: np.ndarray | torch.Tensor,
    max_response_length: int,
    buffer_len: int,
    penalty_factor: float,
) -> np.ndarray:
    """DAPO's overlong penalty ``min(-(len - (L_max - buffer)) / buffer * factor, 0)``.

    Args:
        lengths: (B,) valid response tokens per sample.
        max_response_length: ``L_max``.
        buffer_len: the buffer (tokens).
        penalty_factor: the penalty reached at ``len = L_max``.

    Returns:
        (B,) float64, 0 up to ``L_max - buffer`` tokens, then falling linearly to ``-factor``.
    """
    lengths = np.asarray(lengths, dtype=np.float64)
    exceed = lengths - (max_response_length - buffer_len)
    return np.minimum(-exceed / buffer_len * penalty_factor, 0.0)


@REWARD_MANAGERS.register("dapo")
class DAPORewardManager(RewardManager):
    """The ``dapo`` manager: ``naive`` plus the overlong penalty (seed 004 §7).

    Args:
        max_response_length: ``L_max`` (verl's ``data.max_response_length``); default the
            width ``T`` of the batch's ``responses``.
        overlong_buffer: an `OverlongBuffer` or a dict of its fields; None = disabled.
        **kwargs: as `RewardManager`.

    Raises:
        ValueError: an enabled buffer with ``len <= 0`` or ``len >= max_response_length``.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_response_length: int | None = None,
        overlong_buffer: OverlongBuffer | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(tokenizer, **kwargs)
        if overlong_buffer is None:
            overlong_buffer = OverlongBuffer()
        elif isinstance(overlong_buffer, Mapping):
            unknown = set(overlong_buffer) - {"enable", "len", "penalty_factor", "log"}
            if unknown:
                raise ValueError(f"overlong_buffer: unknown keys {sorted(unknown)}")
            overlong_buffer = OverlongBuffer(**overlong_buffer)
        if overlong_buffer.enable and overlong_buffer.len <= 0:
            raise ValueError(
                f"overlong_buffer.len must be > 0 when enabled, got {overlong_buffer.len}"
            )
        self.overlong_buffer = overlong_buffer
        self.max_response_length = max_response_length
        if max_response_length is not None:
            self._check_lengths(max_response_length)

    def _check_lengths(self, max_response_length: int) -> None:
        if self.overlong_buffer.enable and self.overlong_buffer.len >= max_response_length:
            raise ValueError(
                f"overlong_buffer.len ({self.overlong_buffer.len}) must be smaller than "
                f"max_response_length ({max_response_length})"
            )

    def _adjust(
        self,
        scores: np.ndarray,
        lengths: np.ndarray,
        width: int,
        extras: dict[str, np.ndarray],
        metrics: dict[str, float],
    ) -> np.ndarray:
        buf = self.overlong_buffer
        if not buf.enable:
            return scores
        l_max = self.max_response_length if self.max_response_length is not None else width
        self._check_lengths(l_max)
        penalty = overlong_penalty(lengths, l_max, buf.len, buf.penalty_factor)
        extras["overlong_penalty"] = penalty
        if buf.log:
            extras["overlong"] = (penalty < 0).astype(np.float64)
        return scores + penalty


def make_reward_manager(name: str, tokenizer: Any, **kwargs: Any) -> RewardManager:
    """Build the reward manager registered as ``name`` (``naive``, ``batch``, ``dapo``).

    Args:
        name: the manager (verl's ``reward_model.reward_manager``).
        tokenizer: decodes the responses.
        **kwargs: the manager's keyword arguments (see `RewardManager`, `DAPORewardManager`).

    Raises:
        ValueError: an unknown name (the message lists the valid ones) or bad arguments.
    """
    return REWARD_MANAGERS.get(name)(tokenizer, **kwargs)
