"""Four small tasks for tiny models learning from scratch (issue 16's study of when RL learns).

Each is short enough for a byte-level ~2M-parameter model (prompts under 20 characters,
answers of 1-4 characters) and differs from ``digits`` in what a wrong answer looks like, so
that a recipe is tested on more than the task it was tuned on:

- ``count``: ``"4373931 count 3"`` -> ``"3"``: how often a digit occurs in 5-9 digits
  (0-4 times). The answer is one small integer, the shape of a user's own "answer is a
  number" task; most wrong answers are off by one. The digit comes last, next to the answer:
  asked first (``"count 3 in 4373931"``), the ~2M model's SFT stayed near chance (0.20-0.34
  greedy exact match after 800-2000 steps); asked last, 0.68 after 300 (docs/learning.md).
- ``sort``: ``"sort dbfa"`` -> ``"abdf"``: 3-6 lowercase letters (repeats allowed) in
  alphabetical order: a whole-string answer built position by position.
- ``add``: ``"47+85"`` -> ``"132"``: two numbers below 100; ~70% of the sums carry,
  and the answer's digits depend on each other through the carries.
- ``compare``: ``"max 47 5 81"`` -> ``"81"``: the largest of 3 distinct numbers of 1-2
  digits; any listed number is a plausible wrong answer, so a guess is right 1/3 of the time.

Their scorers (``lmrl.rewards.scorers.small_tasks``) give partial credit by default and exact
match with ``binary=true`` (``reward.scorer_options``).
"""

from __future__ import annotations

import random
import string

from lmrl.errors import DataError

Example = tuple[str, str, dict]


def generate_count(rng: random.Random, min_len: int = 5, max_len: int = 9) -> Example:
    """``"4373931 count 3"`` -> ``"3"`` (the digit occurs 0-4 times).

    The count is drawn first (uniform in 0..min(4, length)), so small and large counts are
    equally common rather than mostly 0-1.
    """
    if not 1 <= min_len <= max_len:
        raise DataError(f"count: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    length = rng.randint(min_len, max_len)
    target = rng.choice(string.digits)
    count = rng.randint(0, min(4, length))
    others = [d for d in string.digits if d != target]
    chars = [target] * count + [rng.choice(others) for _ in range(length - count)]
    rng.shuffle(chars)
    return f"{''.join(chars)} count {target}", str(count), {"digit": target}


def generate_sort(rng: random.Random, min_len: int = 3, max_len: int = 6) -> Example:
    """``"sort dbfa"`` -> ``"abdf"``: lowercase letters, repeats allowed."""
    if not 1 <= min_len <= max_len:
        raise DataError(f"sort: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    letters = "".join(
        rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len))
    )
    return f"sort {letters}", "".join(sorted(letters)), {}


def _carries(a: int, b: int) -> int:
    """How many columns of ``a + b`` carry."""
    carries = carry = 0
    while a or b:
        carry = int(a % 10 + b % 10 + carry >= 10)
        carries += carry
        a, b = a // 10, b // 10
    return carries


def generate_add(
    rng: random.Random, min_digits: int = 1, max_digits: int = 2, min_carries: int = 0
) -> Example:
    """``"47+85"`` -> ``"132"``: operands of ``min_digits``-``max_digits`` digits (drawn
    uniformly among those numbers), at least ``min_carries`` carries (~70% of the
    default's sums carry)."""
    if not 1 <= min_digits <= max_digits:
        raise DataError(f"add: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    if not 0 <= min_carries <= max_digits:
        raise DataError(f"add: need 0 <= min_carries <= max_digits, got {min_carries}")
    low, high = 10 ** (min_digits - 1), 10**max_digits - 1
    while True:
        a, b = rng.randint(low, high), rng.randint(low, high)
        if _carries(a, b) >= min_carries:
            return f"{a}+{b}", str(a + b), {"carries": _carries(a, b)}


def generate_compare(
    rng: random.Random, min_count: int = 3, max_count: int = 3, max_digits: int = 2
) -> Example:
    """``"max 47 5 81"`` -> ``"81"``: ``min_count``-``max_count`` distinct numbers of 1 to
    ``max_digits`` digits (the number of digits is drawn first, so short and long numbers
    are equally common)."""
    if not 2 <= min_count <= max_count:
        raise DataError(f"compare: need 2 <= min_count <= max_count, got {min_count}, {max_count}")
    if max_digits < 1:
        raise DataError(f"compare: need max_digits >= 1, got {max_digits}")
    size, numbers = rng.randint(min_count, max_count), []
    while len(numbers) < size:
        digits = rng.randint(1, max_digits)
        value = rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)
        if value not in numbers:
            numbers.append(value)
    return (
        f"max {' '.join(map(str, numbers))}",
        str(max(numbers)),
        {"numbers": [str(v) for v in numbers]},
    )


__all__ = ["generate_add", "generate_compare", "generate_count", "generate_sort"]
