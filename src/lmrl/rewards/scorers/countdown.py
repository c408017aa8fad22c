"""Scorer of the ``countdown`` task: an equation in ``<answer>`` tags that reaches the target.

As TinyZero's scorer: 1.0 for a right equation, a format score (0.1) for an ``<answer>`` that is
not one, 0 without ``<answer>...</answer>``. The equation (the last ``<answer>`` of the
completion) is read by a small exact parser, never ``eval``: ASCII integers, ``+ - * /`` and
parentheses, no unary minus, optionally followed by ``= <target>``. It is right when it uses
each given number exactly once (as a multiset: ``[3, 3, 5]`` needs two 3s) and its exact
rational value (``fractions.Fraction``, so ``7/2*2`` is 7) equals the target. An equation
longer than 1000 characters is not read.
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction
from typing import Any

from lmrl.rewards.scorers._text import cut_at_end_marker, last_tag_content

MAX_EQUATION_CHARS = 1000
_TOKEN_RE = re.compile(r"\s*(?:([0-9]+)|([-+*/()=]))")


class _Parser:
    """Recursive-descent parser of ``expr := term (('+'|'-') term)*``, ``term := factor
    (('*'|'/') factor)*``, ``factor := INT | '(' expr ')'`` over exact fractions."""

    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.pos = 0
        self.numbers: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ValueError("unexpected end of equation")
        self.pos += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.factor()
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise ValueError("division by zero")
            else:
                value = value / rhs
        return value

    def factor(self) -> Fraction:
        token = self.take()
        if token == "(":
            value = self.expr()
            if self.take() != ")":
                raise ValueError("missing ')'")
            return value
        if token.isdigit():
            self.numbers.append(int(token))
            return Fraction(int(token))
        raise ValueError(f"unexpected {token!r}")


def evaluate_equation(equation: str) -> tuple[Fraction, list[int], int | None] | None:
    """Parse ``equation`` into (exact value, integers used, right-hand side or None).

    Returns None when it is not a well-formed equation (a foreign character, a unicode digit,
    unbalanced parentheses, a division by zero, more than one ``=``, too long).
    """
    if len(equation) > MAX_EQUATION_CHARS:
        return None
    tokens, pos = [], 0
    text = equation.strip()
    while pos < len(text):
        match = _TOKEN_RE.match(text, pos)
        if match is None:
            return None
        tokens.append(match.group(1) or match.group(2))
        pos = match.end()
    rhs = None
    if "=" in tokens:
        eq = tokens.index("=")
        tail = tokens[eq + 1 :]
        if len(tail) != 1 or not tail[0].isdigit():
            return None
        rhs = int(tail[0])
        tokens = tokens[:eq]
    parser = _Parser(tokens)
    try:
        value = parser.expr()
    except (ValueError, RecursionError):
        return None
    if parser.pos != len(tokens):
        return None
    return value, parser.numbers, rhs


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    format_score: float = 0.1,
    score: float = 1.0,
) -> dict:
    """Score a Countdown completion.

    Args:
        solution_str: the decoded response, e.g. ``"<think>...</think><answer>(5+3)*2</answer>"``.
        ground_truth: ``{"target": 16, "numbers": [5, 3, 2]}``.
        extra_info: unused.
        format_score: score of an ``<answer>`` that is not a right equation.
        score: score of a right equation.

    Returns:
        ``{"score": ..., "acc": 1.0 or 0.0}``.

    Raises:
        ValueError: ``ground_truth`` lacks ``target`` or ``numbers``.
    """
    if not isinstance(ground_truth, dict) or "target" not in ground_truth:
        raise ValueError(
            f"ground_truth must be a dict with target and numbers, got {ground_truth!r}"
        )
    target = Fraction(int(ground_truth["target"]))
    numbers = Counter(int(n) for n in ground_truth["numbers"])
    equation = last_tag_content(cut_at_end_marker(solution_str), "answer")
    if equation is None:
        return {"score": 0.0, "acc": 0.0}
    parsed = evaluate_equation(equation)
    if parsed is None:
        return {"score": float(format_score), "acc": 0.0}
    value, used, rhs = parsed
    right = Counter(used) == numbers and value == target and (rhs is None or rhs == target)
    return {"score": float(score if right else format_score), "acc": float(right)}
