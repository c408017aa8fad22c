"""``data.curriculum``: difficulty-aware sampling, prompts chosen by their recent pass rate.

One key holding options (``data.curriculum.NAME=value``). A prompt's record is the pass rate
of each of its last ``history`` groups (a sample passes when the reward's ``acc`` extra is
true, or without an ``acc`` when its score is >= ``pass_score``); the sampler
(`lmrl.data.curriculum.CurriculumSampler`) reads it when it draws:

- ``skip_solved``: the prompts come in their seeded epoch order, and one whose last
  ``history`` groups were all passed, or all failed, sits out when its turn comes, up to
  ``cooldown`` turns in a row (then it is drawn again, to re-check); a batch is always full
  (prompts that sat out fill it when too few others are left in a whole pass).
- ``target``: each step draws without replacement, weighting a prompt by the closeness of
  its recent pass rate to ``target_pass_rate`` (1 at the target, falling linearly to 0.05 at
  the farthest rate; a prompt not yet seen counts as at the target), in the spirit of AdaRFT.

With ``data.mixture`` the mixture picks each source's count and the curriculum picks that
source's prompts. This module only reads and checks the options (`parse_curriculum`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from lmrl.config.errors import ConfigError
from lmrl.config.run import opt

KEY = "data.curriculum"
MODES = ("skip_solved", "target")


@dataclass
class CurriculumOptions:
    """The options of ``data.curriculum``."""

    enable: bool = opt(False, "Choose prompts by their recent pass rate (docs/learning.md).")
    mode: Literal["skip_solved", "target"] = opt(
        "skip_solved",
        "skip_solved = a prompt whose last groups all passed or all failed sits out its turns "
        "(up to cooldown); target = draw prompts weighted by closeness of their pass rate to "
        "target_pass_rate.",
    )
    history: int = opt(1, "Groups remembered per prompt (>= 1).")
    cooldown: int = opt(
        2, "skip_solved: turns in a row a settled prompt sits out before it is re-checked (>= 1)."
    )
    target_pass_rate: float = opt(0.5, "target: the pass rate drawn most (0 to 1).")
    pass_score: float = opt(
        1.0, "A sample passes when its acc extra is true, or without acc when its score >= this."
    )


@dataclass(frozen=True)
class Curriculum:
    """The checked options of ``data.curriculum`` (see the module docstring)."""

    mode: str = "skip_solved"
    history: int = 1
    cooldown: int = 2
    target_pass_rate: float = 0.5
    pass_score: float = 1.0

    def describe(self) -> str:
        """The rule in words, for the run's plan: ``prompts by pass rate: skip_solved
        (history 1, cooldown 2)`` or ``... target 0.5 (history 1)``."""
        if self.mode == "target":
            return (
                f"prompts by pass rate: target {self.target_pass_rate:g} (history {self.history})"
            )
        return (
            f"prompts by pass rate: skip_solved (history {self.history}, cooldown {self.cooldown})"
        )


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_curriculum(spec: Mapping[str, Any] | None) -> Curriculum | None:
    """The checked options, or None when ``data.curriculum.enable`` is false.

    Raises:
        ConfigError: one line naming ``data.curriculum.<option>`` and its value: an unknown
            option, an unknown mode, ``history`` or ``cooldown`` below 1, ``target_pass_rate``
            outside [0, 1], a ``pass_score`` that is not a finite number.
    """
    spec = dict(spec or {})
    names = {f.name for f in fields(CurriculumOptions)}
    for name in spec:
        if name not in names:
            raise ConfigError(f"{KEY}.{name}: unknown option; valid: {', '.join(sorted(names))}")
    if not spec.get("enable", False):
        return None
    out = Curriculum(**{k: v for k, v in spec.items() if k != "enable"})

    def bad(name: str, rule: str) -> ConfigError:
        return ConfigError(f"{KEY}.{name}={getattr(out, name)!r}: {rule}")

    if out.mode not in MODES:
        raise bad("mode", f"must be one of {', '.join(MODES)}")
    for name in ("history", "cooldown"):
        if not _integer(getattr(out, name)) or getattr(out, name) < 1:
            raise bad(name, "must be an integer >= 1")
    rate = out.target_pass_rate
    if not _number(rate) or not 0.0 <= rate <= 1.0:
        raise bad("target_pass_rate", "must be a number from 0 to 1")
    if not _number(out.pass_score) or not math.isfinite(out.pass_score):
        raise bad("pass_score", "must be a finite number")
    return out


def check_curriculum(c, f) -> None:
    """``data.curriculum``'s options, and the runs it does not combine with (a check of
    ``lmrl.config.checks``)."""
    try:
        cur = parse_curriculum(c.data.curriculum)
    except ConfigError as err:
        f.errors.append(str(err))
        return
    if cur is not None and c.async_training.enable:
        f.errors.append(
            f"{KEY}.enable=true: does not combine with async_training.enable (the pass rates of "
            "batches generated ahead arrive out of turn); turn one of them off"
        )
