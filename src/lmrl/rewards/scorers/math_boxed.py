"""Scorer for ``\\boxed{}`` answers (MATH and similar), checked with math-verify.

Choice: the *last* ``\\boxed{...}`` (or ``\\fbox{...}``) of the completion is the answer, read
with balanced braces; a completion without one scores 0. Equivalence (``\\frac12`` = ``0.5``,
``x^2-1`` = ``(x-1)(x+1)``...) is decided by ``math_verify.verify`` on both sides parsed as
LaTeX. math-verify's own signal-based timeouts only work in the main thread; elsewhere they
are switched off (the reward pool's per-sample timeout still applies there).
"""

from __future__ import annotations

import threading
from typing import Any

from lmrl.rewards.scorers._text import cut_at_end_marker

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (braces balanced).

    Also accepts verl's ``\\boxed 5`` form (a space and a token). Returns None when there is
    no complete box.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if text.startswith(" ", i):
        token = text[i + 1 :].split("$")[0].split()
        return token[0] if token else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """1.0 if the last boxed answer is equivalent to ``ground_truth``, else 0.0.

    Args:
        solution_str: the decoded response.
        ground_truth: the reference answer in LaTeX without the box, e.g. ``"\\frac{1}{2}"``
            (a number is accepted too).
        extra_info: unused.

    Returns:
        ``{"score": 1.0 or 0.0, "acc": same}``.
    """
    from math_verify import LatexExtractionConfig, parse, verify

    answer = last_boxed(cut_at_end_marker(solution_str))
    if answer is None or not answer.strip():
        return {"score": 0.0, "acc": 0.0}
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    config = [LatexExtractionConfig()]
    gold = parse(f"\\boxed{{{ground_truth}}}", config, parsing_timeout=timeout)
    pred = parse(f"\\boxed{{{answer}}}", config, parsing_timeout=timeout)
    if not gold or not pred:
        return {"score": 0.0, "acc": 0.0}
    ok = float(bool(verify(gold, pred, timeout_seconds=timeout)))
    return {"score": ok, "acc": ok}
