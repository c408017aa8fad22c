"""Scorer of Knights and Knaves puzzles, with Logic-RL's reward scheme.

``score = format + answer`` with

- format: +1 when the tags are well formed, else -1;
- answer: +2 when every person's role is right, -1.5 when the answer is complete but wrong,
  -2 when it cannot be read (or the format is wrong).

A response therefore scores 3 (right), -0.5 (well formed, wrong), -1 (well formed, unreadable)
or -3 (malformed).

Choices (ours, since the response here excludes the prompt, where Logic-RL may have put
``<think>``): the format is right when ``<answer>`` and ``</answer>`` each appear exactly once,
in that order, ``<think>``/``</think>`` at most once each, and a present ``</think>`` comes before
``<answer>`` (after ``<think>`` when that is present too). The answer is read as Logic-RL does:
the words knight/knave must appear exactly once per person (a hedged answer that names both
roles for someone cannot be read) and each person needs a ``NAME is a knight|knave`` statement.

The ground truth is Logic-RL's: a dict with ``solution_text_format`` (``"(1) Zoey is a
knight\\n(2) Oliver is a knave"``); ours also carries ``names`` and ``solution`` (bools,
True = knight), used when the text form is absent.
"""

from __future__ import annotations

import re
from typing import Any

from lmrl.rewards.scorers._text import cut_at_end_marker

_GT_LINE_RE = re.compile(r"\(\d+\)\s*(.+?)\s+is\s+an?\s+(knight|knave)", re.IGNORECASE)
_ROLE_WORD_RE = re.compile(r"knight|knave", re.IGNORECASE)


def parse_ground_truth(ground_truth: Any) -> dict[str, str]:
    """``{name: "knight" | "knave"}`` in the puzzle's order.

    Raises:
        ValueError: neither ``solution_text_format`` nor ``names``/``solution`` can be read.
    """
    if not isinstance(ground_truth, dict):
        raise ValueError(f"ground_truth must be a dict, got {type(ground_truth).__name__}")
    text = ground_truth.get("solution_text_format")
    if text:
        roles = {name.strip(): role.lower() for name, role in _GT_LINE_RE.findall(text)}
        if roles:
            return roles
    names, solution = ground_truth.get("names"), ground_truth.get("solution")
    if names is None or solution is None or len(names) != len(solution) or not len(names):
        raise ValueError(
            "ground_truth needs solution_text_format or names and solution, got "
            f"{sorted(ground_truth)}"
        )
    return {str(n): "knight" if bool(k) else "knave" for n, k in zip(names, solution, strict=True)}


def format_ok(text: str) -> bool:
    """Whether the think/answer tags of a response are well formed (see the module docstring)."""
    counts = {tag: text.count(tag) for tag in ("<think>", "</think>", "<answer>", "</answer>")}
    if counts["<answer>"] != 1 or counts["</answer>"] != 1:
        return False
    if counts["<think>"] > 1 or counts["</think>"] > 1:
        return False
    a_open, a_close = text.find("<answer>"), text.find("</answer>")
    if a_open > a_close:
        return False
    if counts["</think>"]:
        t_close = text.find("</think>")
        if t_close > a_open:
            return False
        if counts["<think>"] and text.find("<think>") > t_close:
            return False
    elif counts["<think>"]:
        return False
    return True


def parse_answer(answer_text: str, names: list[str]) -> dict[str, str] | None:
    """``{name: role}`` read from the answer block, or None when it cannot be read."""
    if len(_ROLE_WORD_RE.findall(answer_text)) != len(names):
        return None
    roles = {}
    for name in names:
        pattern = rf"\b{re.escape(name)}\b\s+is\s+an?\s+(knight|knave)\b"
        match = re.search(pattern, answer_text, re.IGNORECASE)
        if match is None:
            return None
        roles[name] = match.group(1).lower()
    return roles


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    format_reward: float = 1.0,
) -> dict:
    """Logic-RL's reward for a Knights and Knaves answer.

    Args:
        solution_str: the decoded response, e.g.
            ``"<think>...</think><answer>(1) Zoey is a knight\\n(2) Oliver is a knave</answer>"``.
        ground_truth: see ``parse_ground_truth``.
        extra_info: unused.
        format_reward: magnitude of the format part (+/-).

    Returns:
        ``{"score": format + answer, "acc": 1.0 if all roles right, "format": 1.0 or 0.0}``.
    """
    truth = parse_ground_truth(ground_truth)
    text = cut_at_end_marker(solution_str)
    fmt = format_ok(text)
    format_score = format_reward if fmt else -abs(format_reward)
    answer_score, right = -2.0, False
    if fmt:
        answer_text = text[text.find("<answer>") + len("<answer>") : text.find("</answer>")]
        pred = parse_answer(answer_text, list(truth)) if answer_text.strip() else None
        if pred is not None:
            right = pred == truth
            answer_score = 2.0 if right else -1.5
    return {"score": format_score + answer_score, "acc": float(right), "format": float(fmt)}
