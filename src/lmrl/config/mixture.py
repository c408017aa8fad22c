"""``data.mixture``: the training sources and how many prompts each gives a step.

A mapping ``source -> rule``, where a source is a training file (its path as written in
``data.train_files``, its file name, or its name without the suffix) or a ``data_source``
value, and a rule is one of:

- a weight (a number >= 0), the same at every step;
- a schedule: a list of ``[step, weight]`` points with increasing steps, linear between
  them and held constant before the first and after the last;
- ``{quota: N}``: exactly ``N`` prompts every step (every source a quota then, their sum the
  prompts a step draws).

Each step, a source's share of the step's prompts is its weight over the sum of the weights;
the counts are rounded by largest remainder (ties to the source listed first), so they sum to
the batch exactly. Weights are exact fractions (a float weight is read as the float it is),
so the counts are the same on every machine and after every resume. A step here is one batch
drawn: the first batch is step 1 (with ``algorithm.filter_groups``, each generation round
draws a batch). Validation data is ``data.val_files``, never drawn for training.

This module only reads and checks the spec (``parse_mixture``); matching sources to rows and
the draw are ``lmrl.data.mixture``'s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from lmrl.config.errors import ConfigError

KEY = "data.mixture"


@dataclass(frozen=True)
class MixRule:
    """One source's rule: a schedule of ``(step, weight)`` points, or a per-step ``quota``."""

    source: str
    points: tuple[tuple[int, Fraction], ...] = ()
    quota: int | None = None

    def weight(self, step: int) -> Fraction:
        """The weight at ``step``: linear between points, constant past the ends."""
        pts = self.points
        if step <= pts[0][0]:
            return pts[0][1]
        for (s0, w0), (s1, w1) in itertools.pairwise(pts):
            if step <= s1:
                return w0 + (w1 - w0) * Fraction(step - s0, s1 - s0)
        return pts[-1][1]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _rule(source: str, value: Any) -> MixRule:
    where = f"{KEY}.{source}={value!r}"
    if isinstance(value, Mapping):
        if set(value) != {"quota"}:
            raise ConfigError(f"{where}: a mapping rule is {{quota: N}} (N prompts every step)")
        quota = value["quota"]
        if not isinstance(quota, int) or isinstance(quota, bool) or quota < 0:
            raise ConfigError(f"{where}: the quota must be an integer >= 0")
        return MixRule(source, quota=quota)
    if _number(value):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{where}: a weight must be a number >= 0")
        return MixRule(source, points=((0, Fraction(value)),))
    if isinstance(value, Sequence) and not isinstance(value, str) and value:
        points: list[tuple[int, Fraction]] = []
        for point in value:
            if (
                not isinstance(point, Sequence) or isinstance(point, str) or len(point) != 2
                or not isinstance(point[0], int) or isinstance(point[0], bool)
                or not _number(point[1])
            ):  # fmt: skip
                raise ConfigError(
                    f"{where}: a schedule is a list of [step, weight] points, e.g. "
                    "[[1, 1.0], [100, 0.2]]"
                )
            step, weight = point
            if step < 0 or not math.isfinite(weight) or weight < 0:
                raise ConfigError(f"{where}: the point {list(point)} needs a step >= 0 and a "
                                  "weight >= 0")  # fmt: skip
            if points and step <= points[-1][0]:
                raise ConfigError(f"{where}: the steps of a schedule must increase "
                                  f"({points[-1][0]} then {step})")  # fmt: skip
            points.append((step, Fraction(weight)))
        return MixRule(source, points=tuple(points))
    forms = "a weight (e.g. 0.5), a schedule [[step, weight], ...] or {quota: N}"
    raise ConfigError(f"{where}: a rule is {forms}")


def parse_mixture(spec: Mapping[str, Any] | None, batch_size: int) -> tuple[MixRule, ...]:
    """The rules of ``data.mixture``, in the order written; ``()`` when it is empty.

    Args:
        spec: the value of ``data.mixture``.
        batch_size: the prompts a step draws (``data.train_batch_size``, or
            ``data.gen_batch_size`` under ``algorithm.filter_groups``).

    Raises:
        ConfigError: one line naming ``data.mixture.<source>`` and its value: a malformed
            rule, a negative weight, a schedule whose steps do not increase, quotas mixed
            with weights or not summing to ``batch_size``, weights that are all zero at a
            step.
    """
    if not spec:
        return ()
    rules = tuple(_rule(str(source), value) for source, value in spec.items())
    quotas = [r for r in rules if r.quota is not None]
    if quotas and len(quotas) != len(rules):
        weighted = next(r for r in rules if r.quota is None)
        raise ConfigError(f"{KEY}.{weighted.source}={spec[weighted.source]!r}: with quotas, "
                          "every source needs one ({quota: N})")  # fmt: skip
    if quotas:
        total = sum(r.quota or 0 for r in rules)
        if total != batch_size:
            raise ConfigError(
                f"{KEY}={dict(spec)!r}: the quotas sum to {total}, not the {batch_size} "
                "prompts a step draws; make them sum to it"
            )
        return rules
    steps = sorted({1} | {s for r in rules for s, _ in r.points if s >= 1})
    for step in steps:  # a sum of piecewise-linear weights >= 0 is least at a point
        if not any(r.weight(step) > 0 for r in rules):
            raise ConfigError(f"{KEY}={dict(spec)!r}: every weight is 0 at step {step}; "
                              "give some source a weight > 0 there")  # fmt: skip
    return rules


def step_counts(rules: Sequence[MixRule], step: int, batch_size: int) -> list[int]:
    """How many of the ``batch_size`` prompts of ``step`` each source gives: its quota, or
    its weight's share rounded by largest remainder (ties to the earlier source)."""
    if rules and rules[0].quota is not None:
        return [r.quota or 0 for r in rules]
    weights = [r.weight(step) for r in rules]
    total = sum(weights, Fraction(0))
    exact = [w * batch_size / total for w in weights]
    counts = [math.floor(x) for x in exact]
    left = batch_size - sum(counts)
    order = sorted(range(len(rules)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return counts
