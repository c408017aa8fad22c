"""Scorer of the built-in ``digits`` task: partial credit per position.

Choice: the response (stripped of surrounding whitespace, cut at the first end marker) is
compared position by position with the answer, and the number of matches is divided by the
*longer* of the two lengths, so that every extra character costs as much as a wrong one. A
tiny model learning the task from scratch gets a dense signal (one right digit = 1/len), while
only the exact answer reaches 1.0. ``acc`` is the exact match.
"""

from __future__ import annotations

from typing import Any

from lmrl.rewards.scorers._text import cut_at_end_marker
from lmrl.rewards.scorers.small_tasks import positional_credit


def compute_score(
    solution_str: str, ground_truth: Any, extra_info: dict | None = None, binary: bool = False
) -> dict:
    """Fraction of positions right, extra length penalised; plus exact-match ``acc``.

    ``score = #{i < min(n, m): pred[i] == answer[i]} / max(n, m)`` with ``n = len(pred)``,
    ``m = len(answer)`` (1.0 when both are empty).

    Args:
        solution_str: the decoded response, e.g. ``"31284<|im_end|>"``.
        ground_truth: the answer string, e.g. ``"31284"`` (an int is read as its decimal form).
        extra_info: unused.
        binary: score the exact match alone (``reward.scorer_options: {digits: {binary:
            true}}``).

    Returns:
        ``{"score": float in [0, 1], "acc": 1.0 or 0.0}``.
    """
    answer = str(ground_truth).strip()
    pred = cut_at_end_marker(solution_str).strip()
    longest = max(len(pred), len(answer))
    if longest == 0:
        return {"score": 1.0, "acc": 1.0}
    acc = float(pred == answer)
    return {"score": acc if binary else positional_credit(pred, answer), "acc": acc}
