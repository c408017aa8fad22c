"""The Countdown task: reach a target with + - * / using each given number exactly once.

Generation (TinyZero's task, our generator): draw 3-4 numbers, build a random expression
tree over all of them (exact fractions, no division by zero) and take its value as the target
when it is a whole number in range. The target is then confirmed reachable by `solve`, a
brute-force search over every way of combining the numbers pairwise (exact fractions),
whose solution is stored as ``extra_info["solution"]``.
"""

from __future__ import annotations

import random
from fractions import Fraction

_OPS = ("+", "-", "*", "/")


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction | None:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return None if b == 0 else a / b


def solve(numbers: list[int], target: int) -> str | None:
    """An equation reaching ``target`` that uses every number exactly once, or None.

    Brute force: repeatedly replace two of the remaining values by ``a op b`` (both orders
    for ``-`` and ``/``) until one value is left. Exact fractions, so ``6 / 4 * 2`` counts.

    Args:
        numbers: the numbers, e.g. ``[5, 3, 2]``.
        target: e.g. ``16``.

    Returns:
        A fully parenthesised equation such as ``"((5 + 3) * 2)"``, or None.
    """
    goal = Fraction(target)
    seen: set[tuple[Fraction, ...]] = set()

    def search(items: list[tuple[Fraction, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == goal else None
        key = tuple(sorted(v for v, _ in items))
        if key in seen:
            return None
        seen.add(key)
        for i in range(len(items)):
            for j in range(len(items)):
                if i == j:
                    continue
                (a, ea), (b, eb) = items[i], items[j]
                rest = [items[k] for k in range(len(items)) if k not in (i, j)]
                for op in _OPS:
                    if op in "+*" and i > j:  # commutative: one order is enough
                        continue
                    value = _apply(op, a, b)
                    if value is None:
                        continue
                    found = search([*rest, (value, f"({ea} {op} {eb})")])
                    if found is not None:
                        return found
        return None

    return search([(Fraction(n), str(n)) for n in numbers])


def _random_value(values: list[int], rng: random.Random) -> Fraction | None:
    """The value of a random expression tree using each of ``values`` once (None on x/0)."""
    items = [Fraction(v) for v in values]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        value = _apply(rng.choice(_OPS), items[i], items[j])
        if value is None:
            return None
        items = [items[k] for k in range(len(items)) if k not in (i, j)] + [value]
    return items[0]


def generate(
    rng: random.Random,
    min_numbers: int = 3,
    max_numbers: int = 4,
    max_number: int = 99,
    max_target: int = 99,
) -> tuple[str, dict, dict]:
    """One Countdown puzzle.

    Args:
        rng: the task's random generator.
        min_numbers, max_numbers: how many numbers (3-4 by default).
        max_number: numbers are drawn from ``1..max_number``.
        max_target: targets lie in ``1..max_target``.

    Returns:
        ``(prompt content, ground truth {"target", "numbers"}, extra {"solution"})``.
    """
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_numbers, max_numbers))]
        value = _random_value(numbers, rng)
        if value is None or value.denominator != 1 or not 1 <= value <= max_target:
            continue
        target = int(value)
        solution = solve(numbers, target)
        if solution is None:  # cannot happen: the random expression is one
            raise RuntimeError(f"countdown: {numbers} -> {target} built but not solvable")
        content = (
            f"Using the numbers {numbers}, create an equation that equals {target}. "
            "You can use + - * / and each number exactly once. Show your reasoning in "
            "<think> </think> tags and give the equation in <answer> </answer> tags, "
            "for example <answer> (1 + 2) / 3 </answer>."
        )
        return content, {"target": target, "numbers": numbers}, {"solution": solution}
