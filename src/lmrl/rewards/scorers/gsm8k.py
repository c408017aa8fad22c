"""Scorer for GSM8K-style answers (``gsm8k`` and the built-in ``arithmetic`` task).

Two extraction modes, as verl's ``gsm8k`` scorer:

- ``strict`` (default): the completion must contain exactly one ``#### <number>``. Choice: a
  second ``####`` makes the answer invalid (score 0) instead of taking the last one, so a
  policy cannot hedge by writing several answers.
- ``flexible``: the last number anywhere in the completion.

Only ASCII digits count (``#### ４２`` is no answer): a number is ``-?[0-9][0-9,]*(\\.[0-9]+)?``
with an optional ``$``; commas are dropped and the value is compared exactly with the ground
truth (``18.00`` equals ``18``).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from lmrl.rewards.scorers._text import cut_at_end_marker

_NUMBER = r"-?[0-9][0-9,]*(?:\.[0-9]+)?"
_STRICT_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")(?!\d)")
_ANY_NUMBER_RE = re.compile(r"(?<!\d)(" + _NUMBER + r")(?!\d)")
METHODS = ("strict", "flexible")


def parse_number(text: str) -> Fraction | None:
    """The exact value of an ASCII number like ``"-1,234.50"``, or None if it is not one."""
    cleaned = text.replace(",", "").replace("$", "").strip()
    if not re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", cleaned):
        return None
    return Fraction(cleaned)


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer string the given mode reads from a completion, or None.

    Args:
        solution_str: the decoded response.
        method: ``"strict"`` (exactly one ``#### N``) or ``"flexible"`` (last number).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    text = cut_at_end_marker(solution_str)
    if method == "strict":
        if text.count("####") != 1:
            return None
        match = _STRICT_RE.search(text)
        return None if match is None else match.group(1)
    numbers = _ANY_NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict:
    """Score a GSM8K-style completion against the integer (or decimal) answer.

    Args:
        solution_str: the decoded response.
        ground_truth: the answer, e.g. ``"72"``, ``"1,234"`` or ``72``.
        extra_info: unused.
        method: ``"strict"`` or ``"flexible"`` (see the module docstring).
        format_score: score of an answer that was found but is wrong.
        score: score of a right answer.

    Returns:
        ``{"score": score | format_score | 0.0, "acc": 1.0 or 0.0}``.

    Raises:
        ValueError: ``ground_truth`` is not a number.
    """
    truth = parse_number(str(ground_truth))
    if truth is None:
        raise ValueError(f"ground_truth {ground_truth!r} is not a number")
    answer = extract_answer(solution_str, method)
    if answer is None:
        return {"score": 0.0, "acc": 0.0}
    value = parse_number(answer)
    if value is not None and value == truth:
        return {"score": float(score), "acc": 1.0}
    return {"score": float(format_score), "acc": 0.0}
