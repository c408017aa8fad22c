"""The search space of ``lmrl sweep`` (`lmrl.sweep`): ``--grid key=v1,v2`` parsed into
axes, and the trials drawn from them (every grid point, or ``--samples N`` random ones; a
``key=log:LOW..HIGH`` range is drawn log-uniformly). Values stay the text the user typed: each
trial's ``key=value`` goes through ``lmrl train``'s own config loading, which parses and checks
it.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from lmrl.config import ConfigError

# keys a sweep sets for every trial: not a grid axis
RESERVED = (
    "trainer.total_training_steps",
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.default_local_dir",
    "trainer.resume_mode",
    "trainer.experiment_name",
)


@dataclass(frozen=True)
class Axis:
    """One swept key: a list of values as typed, or a log-uniform range (random search only).

    Attributes:
        key: the dotted key (either layout, as ``lmrl train`` takes it).
        values: the values' texts, each parsed as ``lmrl train`` parses ``key=value``.
        log_range: ``(low, high)`` of ``key=log:LOW..HIGH``, else None.
    """

    key: str
    values: tuple[str, ...] = ()
    log_range: tuple[float, float] | None = None


def parse_grid(specs: Sequence[str]) -> list[Axis]:
    """``["actor.optim.lr=1e-5,1e-4", "rollout.n=log:..."]`` -> axes.

    A value list is split at commas outside brackets and quotes (``k=[a,b],[c]`` is two
    values). ``k=log:1e-6..1e-3`` is a log-uniform range for ``--samples``.

    Raises:
        ConfigError: not ``key=values``, an empty key or value, a key given twice, a key the
            sweep sets itself, or a malformed range (one message per problem).
    """
    axes, errors, seen = [], [], set()
    for spec in specs:
        key, eq, text = spec.partition("=")
        key = key.strip().lstrip("+")
        if not eq or not key or any(not seg for seg in key.split(".")):
            errors.append(
                f"--grid {spec!r} is not key=v1,v2,...; write e.g. actor.optim.lr=1e-5,1e-4"
            )
            continue
        if key in seen:
            errors.append(f"--grid {key} is given twice; give all its values once: {key}=v1,v2")
            continue
        seen.add(key)
        if key in RESERVED:
            errors.append(f"--grid {key}: the sweep sets this key for every trial (use --steps, "
                          "--test-freq or --out)")  # fmt: skip
            continue
        if text.strip().startswith("log:"):
            low, sep, high = text.strip()[4:].partition("..")
            try:
                lo, hi = float(low), float(high)
            except ValueError:
                lo = hi = math.nan
            if not sep or not (0 < lo < hi < math.inf):
                errors.append(f"--grid {spec!r}: a range is log:LOW..HIGH with 0 < LOW < HIGH, "
                              "e.g. log:1e-6..1e-3")  # fmt: skip
                continue
            axes.append(Axis(key, log_range=(lo, hi)))
            continue
        values = split_values(text)
        if not values or any(not v.strip() for v in values):
            errors.append(f"--grid {spec!r}: an empty value; write {key}=v1,v2,...")
            continue
        axes.append(Axis(key, tuple(v.strip() for v in values)))
    if not specs:
        errors.append("--grid: no key to sweep; give e.g. --grid actor.optim.lr=1e-5,1e-4")
    if errors:
        raise ConfigError(errors)
    return axes


def split_values(text: str) -> list[str]:
    """Split at commas that are outside ``[]``, ``{}``, ``()`` and quotes."""
    out, depth, quote, current = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(current))
            current = []
            continue
        current.append(ch)
    out.append("".join(current))
    return out


def draw_trials(axes: Sequence[Axis], samples: int | None, seed: int = 0) -> list[dict[str, str]]:
    """The trials: every point of the grid, or ``samples`` random ones.

    Without ranges, ``samples`` draws that many distinct grid points (seeded); with a
    ``log:`` range, each trial draws each axis independently (a range log-uniformly, shown
    with 3 significant digits).

    Raises:
        ConfigError: a range without ``samples``, ``samples < 1``, or more samples than the
            grid has points.
    """
    if samples is not None and samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {samples}")
    ranged = [a.key for a in axes if a.log_range is not None]
    rng = random.Random(seed)
    if ranged:
        if samples is None:
            raise ConfigError(f"--grid {ranged[0]}=log:...: a range needs --samples N (random "
                              "search); a grid lists its values: k=v1,v2")  # fmt: skip
        trials = []
        for _ in range(samples):
            trials.append({a.key: _draw(a, rng) for a in axes})
        return trials
    grid = [dict(zip([a.key for a in axes], point, strict=True))
            for point in itertools.product(*(a.values for a in axes))]  # fmt: skip
    if samples is None:
        return grid
    if samples > len(grid):
        raise ConfigError(f"--samples {samples} is more than the grid's {len(grid)} points; "
                          "drop --samples to run every point")  # fmt: skip
    return rng.sample(grid, samples)


def _draw(axis: Axis, rng: random.Random) -> str:
    if axis.log_range is None:
        return rng.choice(axis.values)
    lo, hi = axis.log_range
    return f"{math.exp(rng.uniform(math.log(lo), math.log(hi))):.3g}"


__all__ = ["RESERVED", "Axis", "draw_trials", "parse_grid", "split_values"]
