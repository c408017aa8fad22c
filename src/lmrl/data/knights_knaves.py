"""Knights and Knaves puzzles (Logic-RL's task): knights always tell the truth, knaves lie.

Each of ``n`` people (2-8) makes one statement built from simple forms over "X is a
knight/knave": the statement itself, its negation, ``and``, ``or``, ``if ... then``, ``if and
only if``. A puzzle is kept only when exactly one knight/knave assignment makes every
statement consistent with its speaker (a knight's statement true, a knave's false).

Choice: the uniqueness check is brute force over all ``2^n`` assignments at once, each
statement's truth table held as a ``2^n``-bit integer (bit ``m`` = assignment ``m``, person
``i`` a knight iff bit ``i`` of ``m`` is set), so ``and`` is ``&``, ``not`` is ``~``... and a
puzzle of 8 people costs a few microseconds.
"""

from __future__ import annotations

import random
from typing import Any

NAMES = (
    "Zoey", "Oliver", "Emma", "Liam", "Ava", "Noah", "Mia", "Lucas", "Sofia", "Ethan",
    "Chloe", "Jacob", "Grace", "Henry", "Lily", "Owen", "Ella", "Jack", "Ruby", "Leo",
    "Nora", "Sam", "Ivy", "Max", "Aria", "Ben", "Luna", "Dan", "Maya", "Finn",
)  # fmt: skip

Statement = tuple  # ("is", person, knight: bool) | ("not", s) | (op, s1, s2), op in and/or/imp/iff
_FORMS = (("is", 0.3), ("not", 0.1), ("and", 0.15), ("or", 0.15), ("imp", 0.15), ("iff", 0.15))


def truth_table(statement: Statement, n: int) -> int:
    """The ``2^n``-bit truth table of ``statement`` (bit ``m`` = its value under assignment ``m``)."""
    full = (1 << (1 << n)) - 1
    kind = statement[0]
    if kind == "is":
        _, person, knight = statement
        table = sum(1 << m for m in range(1 << n) if m >> person & 1)
        return table if knight else full & ~table
    if kind == "not":
        return full & ~truth_table(statement[1], n)
    a, b = truth_table(statement[1], n), truth_table(statement[2], n)
    if kind == "and":
        return a & b
    if kind == "or":
        return a | b
    if kind == "imp":
        return (full & ~a) | b
    if kind == "iff":
        return full & ~(a ^ b)
    raise ValueError(f"unknown statement form {kind!r}")


def solutions(statements: list[Statement], n: int) -> int:
    """The bit set of assignments consistent with every speaker (person ``i`` said ``statements[i]``)."""
    full = (1 << (1 << n)) - 1
    consistent = full
    for speaker, statement in enumerate(statements):
        knight = truth_table(("is", speaker, True), n)
        consistent &= full & ~(knight ^ truth_table(statement, n))
    return consistent


def render(statement: Statement, names: list[str]) -> str:
    """The statement in English, e.g. ``"if Zoey is a knight then Emma is a knave"``."""
    kind = statement[0]
    if kind == "is":
        return f"{names[statement[1]]} is a {'knight' if statement[2] else 'knave'}"
    if kind == "not":
        return f"it is not the case that {render(statement[1], names)}"
    a, b = render(statement[1], names), render(statement[2], names)
    return {
        "and": f"{a} and {b}",
        "or": f"{a} or {b}",
        "imp": f"if {a} then {b}",
        "iff": f"{a} if and only if {b}",
    }[kind]


def _random_statement(n: int, rng: random.Random) -> Statement:
    kind = rng.choices([f for f, _ in _FORMS], weights=[w for _, w in _FORMS])[0]
    if kind == "is":
        return ("is", rng.randrange(n), rng.random() < 0.5)
    if kind == "not":
        return ("not", ("is", rng.randrange(n), rng.random() < 0.5))
    p, q = rng.sample(range(n), 2)
    return (kind, ("is", p, rng.random() < 0.5), ("is", q, rng.random() < 0.5))


def solution_text(names: list[str], solution: list[bool]) -> str:
    """Logic-RL's answer layout: ``"(1) Zoey is a knight\\n(2) Emma is a knave"``."""
    return "\n".join(
        f"({i + 1}) {name} is a {'knight' if k else 'knave'}"
        for i, (name, k) in enumerate(zip(names, solution, strict=True))
    )


def generate(
    rng: random.Random, min_people: int = 2, max_people: int = 8
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """One puzzle with a unique solution.

    Args:
        rng: the task's random generator.
        min_people, max_people: the number of people is uniform in this range (2..8).

    Returns:
        ``(prompt content, ground truth, extra)`` with ground truth ``{"names", "solution"
        (True = knight), "solution_text_format"}`` and extra ``{"num_people"}``.
    """
    if not 2 <= min_people <= max_people <= len(NAMES):
        raise ValueError(f"need 2 <= min_people <= max_people <= {len(NAMES)}")
    n = rng.randint(min_people, max_people)
    while True:
        names = rng.sample(NAMES, n)
        statements = [_random_statement(n, rng) for _ in range(n)]
        consistent = solutions(statements, n)
        if consistent and consistent & (consistent - 1) == 0:  # exactly one bit set
            break
    m = consistent.bit_length() - 1
    solution = [bool(m >> i & 1) for i in range(n)]
    said = " ".join(
        f'{name} says, "{render(s, names)[0].upper()}{render(s, names)[1:]}."'
        for name, s in zip(names, statements, strict=True)
    )
    example = "\n".join(f"({i + 1}) {name} is a ..." for i, name in enumerate(names))
    content = (
        "A very special island is inhabited only by knights and knaves. Knights always tell "
        f"the truth, and knaves always lie. You meet {n} inhabitants: {', '.join(names[:-1])} "
        f"and {names[-1]}. {said} So who is a knight and who is a knave? Think in <think> "
        "</think> tags, then give your conclusion in <answer> </answer> tags, one line per "
        f"person, i.e.\n<answer>\n{example}\n</answer>"
    )
    truth = {
        "names": names,
        "solution": solution,
        "solution_text_format": solution_text(names, solution),
    }
    return content, truth, {"num_people": n}
