"""Ranking a sweep's trials: their validation and train scores, and the early-stopping rule
(`lmrl.sweep`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

from lmrl.run import health

log = logging.getLogger("lmrl.trainer")

FLAT = 0.01  # a validation change at most this large is flat
SCORE_KEY = "critic/score/mean"  # the train score
SLOPE_SCALE = 0.01  # a train slope of this much per step fills half the flat band


# ------------------------------------------------------------------------------ ranking
def validation_score(metrics: Mapping[str, float], metric: str | None = None) -> float | None:
    """The validation score of one validation's metrics (see the module docstring)."""
    if metric is not None:
        value = metrics.get(metric)
        return float(value) if value is not None and math.isfinite(value) else None
    return health.validation_score(metrics)  # the score the health checks and doctor read


def slope(points: Mapping[int, float]) -> float | None:
    """Least-squares slope of ``{step: value}`` per step; None with fewer than 2 steps."""
    if len(points) < 2:
        return None
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def rank_score(
    val: Mapping[int, float], train: Mapping[int, float], flat: float = FLAT
) -> tuple[float | None, str]:
    """A trial's ranking number and what decided it (``val``, ``train`` or ``none``).

    Validation decides when it moved: the number is the gain per step. Where it is flat, the
    train score's slope ``s`` orders the trial inside the flat band, as ``(flat / span) *
    s / (|s| + SLOPE_SCALE)`` (span = steps between the first and last validation): strictly
    between every trial whose validation fell and every one whose validation rose by more
    than ``flat`` over the same span. Without validation, the number is the train slope.

    Args:
        val: validation score by step (0 = before the first step).
        train: train score by step.
        flat: validation that moved at most this much from first to last is flat.

    Returns:
        ``(gain per step, "val")``; ``(train slope in the flat band, "train")``; ``(train
        slope, "train")`` without validation; ``(0.0, "val")`` flat without a train score;
        ``(None, "none")`` when nothing was measured.
    """
    train_slope = slope(train)
    if len(val) < 2:
        return (train_slope, "train") if train_slope is not None else (None, "none")
    first, last = min(val), max(val)
    gain = val[last] - val[first]
    if abs(gain) > flat:
        return gain / (last - first), "val"
    if train_slope is None:
        return 0.0, "val"
    band = flat / (last - first)
    return band * train_slope / (abs(train_slope) + SLOPE_SCALE), "train"


class SuccessiveHalving:
    """ASHA's stopping rule (``ray.tune.schedulers.ASHAScheduler``'s ``_Bracket``) for trials
    run one after another.

    Rungs at ``first * eta**k`` steps below ``last``. At the highest rung a trial has reached
    and not yet been judged at, it stops if its score is below the ``(1 - 1/eta)`` quantile of
    the scores recorded there before it (none recorded: it continues); its score is recorded.
    """

    def __init__(self, first: int, last: int, eta: int = 2) -> None:
        self.eta = eta
        self.rungs: dict[int, dict[int, float]] = {}
        milestone = first
        while milestone < last:
            self.rungs[milestone] = {}
            milestone *= eta

    def keep(self, trial: int, step: int, score: float) -> bool:
        """Record ``score`` at the rung ``step`` reached; False = stop the trial."""
        import numpy as np

        for milestone in sorted(self.rungs, reverse=True):
            recorded = self.rungs[milestone]
            if step < milestone or trial in recorded:
                continue
            cutoff = (np.nanpercentile(list(recorded.values()), (1 - 1 / self.eta) * 100)
                      if recorded else None)  # fmt: skip
            recorded[trial] = score
            return cutoff is None or score >= cutoff
        return True
