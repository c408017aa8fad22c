"""Scorers of the four small tasks (``lmrl.data.small_tasks``): partial credit, or exact match.

Every scorer returns ``{"score", "acc"}`` (``acc`` = exact match) and takes ``binary=False``:
with ``binary=True`` the score is the exact match alone (``reward.scorer_options:
{add: {binary: true}}``). The response is cut at the first end marker and stripped first.

Partial credit, chosen so that each task's wrong answers are ranked differently:

- ``count``: 1.0 for the right count, 0.1 for any other non-negative integer, 0 for anything
  else: the "1 for the right number, 0.1 for a number" reward users write for their own
  number-answer tasks (issue 16's report). It pays for the format only.
- ``sort``: the fraction of positions right, divided by the longer length (as ``digits``).
- ``add``: the same, with the positions aligned from the right (units with units), so a sum
  with one wrong carry keeps the credit of its other digits.
- ``compare``: 1.0 for the largest number; another listed number earns 0.5 x its rank from the
  bottom / (count - 1) (the second largest of 3: 0.25, the smallest: 0); anything else 0.
"""

from __future__ import annotations

import re
from typing import Any

from lmrl.rewards.scorers._text import cut_at_end_marker

_INT = re.compile(r"\d+")


def _clean(solution_str: str) -> str:
    return cut_at_end_marker(solution_str).strip()


def _result(score: float, acc: bool, binary: bool) -> dict:
    return {"score": float(acc) if binary else score, "acc": float(acc)}


def positional_credit(pred: str, answer: str, from_right: bool = False) -> float:
    """``#{positions equal} / max(len(pred), len(answer))``; 1.0 when both are empty.

    Args:
        pred, answer: the strings compared.
        from_right: align the last characters (numbers) instead of the first.
    """
    longest = max(len(pred), len(answer))
    if longest == 0:
        return 1.0
    if from_right:
        pred, answer = pred[::-1], answer[::-1]
    return sum(a == b for a, b in zip(pred, answer, strict=False)) / longest


def count_score(
    solution_str: str, ground_truth: Any, extra_info: dict | None = None, binary: bool = False
) -> dict:
    """``count``: 1.0 right, 0.1 another integer, 0 anything else (see the module doc)."""
    pred, answer = _clean(solution_str), str(ground_truth).strip()
    right = pred == answer
    return _result(1.0 if right else 0.1 if _INT.fullmatch(pred) else 0.0, right, binary)


def sort_score(
    solution_str: str, ground_truth: Any, extra_info: dict | None = None, binary: bool = False
) -> dict:
    """``sort``: positions right / the longer length."""
    pred, answer = _clean(solution_str), str(ground_truth).strip()
    return _result(positional_credit(pred, answer), pred == answer, binary)


def add_score(
    solution_str: str, ground_truth: Any, extra_info: dict | None = None, binary: bool = False
) -> dict:
    """``add``: digits right, aligned from the units, / the longer length."""
    pred, answer = _clean(solution_str), str(ground_truth).strip()
    return _result(positional_credit(pred, answer, from_right=True), pred == answer, binary)


def compare_score(
    solution_str: str, ground_truth: Any, extra_info: dict | None = None, binary: bool = False
) -> dict:
    """``compare``: 1.0 the largest; another listed number by its rank (see the module doc).

    The listed numbers come from ``extra_info["numbers"]`` (the task writes them); without
    them only the exact answer earns credit.
    """
    pred, answer = _clean(solution_str), str(ground_truth).strip()
    if pred == answer:
        return _result(1.0, True, binary)
    listed = sorted({int(v) for v in (extra_info or {}).get("numbers") or ()})
    score = 0.0
    if _INT.fullmatch(pred) and str(int(pred)) == pred and int(pred) in listed:
        score = 0.5 * listed.index(int(pred)) / max(1, len(listed) - 1)
    return _result(score, False, binary)


__all__ = ["add_score", "compare_score", "count_score", "positional_credit", "sort_score"]
