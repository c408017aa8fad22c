"""What a reward manager returns (`RewardResult`) and how its per-sample extras are read:
numeric columns become metrics, text ones (verl's ``pred``) go to the generations log
(`split_extras`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["RewardResult", "column", "merge_results", "scored_rows", "split_extras"]


@dataclass
class RewardResult:
    """What a reward manager returns for a batch of ``B`` responses of width ``T``.

    Attributes:
        token_level_scores: (B, T) float32, zero except the sample's score on its last valid
            response token (on token 0 for an empty response).
        extras: per-sample values, each an array of length ``B``: ``score`` (the reward
            functions' weighted sum, before any penalty), the functions' extra keys (e.g.
            ``acc``; NaN where a sample has none; a text one such as ``pred`` is an object
            array of str or None, see `split_extras`), ``overlong_penalty`` for ``dapo``.
        metrics: batch-level counts: ``reward/scored`` (samples times reward functions),
            ``reward/errors``, ``reward/timeouts``, ``reward/no_score`` (out of
            ``reward/scored``), ``reward/unscored`` (samples no function scored),
            ``reward/worker_restarts``.
        scored: (B,) bool, False on a sample no reward function scored (each returned None:
            it does not apply); such a sample's score is 0 and is not trained on. None = all
            scored.
    """

    token_level_scores: torch.Tensor
    extras: dict[str, np.ndarray]
    metrics: dict[str, float]
    scored: np.ndarray | None = None

    @property
    def scored_mask(self) -> np.ndarray:
        """(B,) bool: ``scored``, all True when it is None."""
        return scored_rows(self)

    @property
    def scores(self) -> torch.Tensor:
        """(B,) the final score of each sample (the row sums of ``token_level_scores``)."""
        return self.token_level_scores.sum(dim=-1)


def scored_rows(result: Any) -> np.ndarray:
    """(B,) bool: the rows of a reward's result that some function scored (its ``scored``;
    all True for a result without one, e.g. a stand-in reward's)."""
    scored = getattr(result, "scored", None)
    if scored is None:
        return np.ones(len(result.token_level_scores), dtype=bool)
    return np.asarray(scored, dtype=bool)


def split_extras(
    extras: Mapping[str, Sequence[Any] | np.ndarray],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A reward's extras (`RewardResult.extras`) as ``(numeric, text)``, each column of
    length ``B``.

    A column is text when any of its values is a string (verl's ``math_dapo`` returns
    ``{"score": 1.0, "acc": True, "pred": "\\frac12"}``: ``acc`` is numeric, ``pred`` text).
    Numbers (bools too) become metrics, text goes to the generations log.

    Returns:
        ``numeric``: float64 (B,) arrays, NaN where a sample has no value;
        ``text``: object (B,) arrays of ``str`` or None.
    """
    numeric: dict[str, np.ndarray] = {}
    text: dict[str, np.ndarray] = {}
    for key, column in extras.items():
        values = np.asarray(column)
        if values.dtype != object:
            numeric[key] = values.astype(np.float64)
        elif any(isinstance(v, str | bytes) for v in values):
            out = np.empty(len(values), dtype=object)
            out[:] = [None if v is None else str(v) for v in values]
            text[key] = out
        else:
            numeric[key] = np.array(
                [np.nan if v is None else float(v) for v in values], dtype=np.float64
            )
    return numeric, text


def column(values: list[Any]) -> np.ndarray:
    """A float array when every value is a number or None (None -> NaN), else an object array."""
    if all(v is None or isinstance(v, float) for v in values):
        return np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def merge_results(results: Sequence[RewardResult], width: int | None = None) -> RewardResult:
    """The results of consecutive row blocks of one batch, as one result.

    Args:
        results: one per block, in row order; their widths ``T`` may differ (blocks generated
            apart are as wide as their own longest response).
        width: the merged ``T``; default the widest. Scores are right-padded with zeros.
    Returns:
        Scores, extras, counters and ``scored`` of every row: a key one block lacks (an extra
        no sample of it returned) is None on that block's rows (numbers and None stay a
        numeric extra), and the counters are summed.
    """
    width = max(r.token_level_scores.shape[1] for r in results) if width is None else width
    if len(results) == 1 and results[0].token_level_scores.shape[1] == width:
        return results[0]
    scores = torch.cat([
        torch.nn.functional.pad(r.token_level_scores, (0, width - r.token_level_scores.shape[1]))
        for r in results
    ])  # fmt: skip
    keys = list(dict.fromkeys(k for r in results for k in r.extras))
    extras = {k: np.concatenate([_extra_column(r, k) for r in results]) for k in keys}
    metrics: dict[str, float] = {}
    for r in results:
        for k, v in r.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    scored = None
    if any(getattr(r, "scored", None) is not None for r in results):
        scored = np.concatenate([scored_rows(r) for r in results])
    return RewardResult(token_level_scores=scores, extras=extras, metrics=metrics, scored=scored)


def _extra_column(result: RewardResult, key: str) -> np.ndarray:
    """``result.extras[key]`` (B,), or an object array of None where the result has no such key."""
    if key in result.extras:
        return np.asarray(result.extras[key])
    out = np.empty(len(result.token_level_scores), dtype=object)
    out[:] = None
    return out
