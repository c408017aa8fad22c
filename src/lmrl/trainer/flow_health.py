"""The health checks of an image run (``lmrl train-flow``): the RL run's (`RunHealth`), and a
user's reward hacked.

Beside a reward that is not geneval the run logs the geneval checks of the same images: the
prompt fidelity (``flow/fidelity/score`` each step, ``val/<source>/fidelity/score`` at each
validation). A reward that climbs while that fidelity falls pays for images that stop
following their prompts (the "upper half bluer" reward: every image a blue band by step 10).
`FlowHealth` names it with both figures as soon as it shows, at a validation (the validation
reward and fidelity against the first validation's) or between two (the train reward and
fidelity of the last ``window`` steps against the first ``window``), sets ``collapse`` (the
rollback's flag, the step of the best fidelity) and names it in place of the zero-spread
warning's hint to check the images. Before it shows, that warning quotes the reward and the
fidelity so far (where the fidelity is logged).

The run doctor (``trainer.max_rollbacks``) keeps the checkpoint of the best validation by
`FlowHealth.validation_score`: the prompt fidelity where it is logged, since a hacked reward
is highest exactly where the images are worst; else the reward.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

from lmrl.run.health import RunHealth

__all__ = ["FIDELITY_KEY", "FLOW_ZERO_SPREAD", "FlowHealth"]

FIDELITY_KEY = "flow/fidelity/score"
FLOW_ZERO_SPREAD = (
    "The images of a prompt all score alike when the reward saturates (a user's reward at its "
    "maximum while the images stop following their prompts): check the images against their "
    "prompts (the geneval checks, flow/check/*), try a reward with finer grades, more images "
    "per prompt (sampler.n), or a KL to the start (actor.beta)"
)
FIDELITY_ZERO_SPREAD = (
    "The reward went from {r0:.2f} to {r1:.2f} while the prompt fidelity of the same images "
    "(" + "flow/fidelity/score" + ", the geneval checks) went from {f0:.2f} to {f1:.2f}: a "
    "saturated reward with a falling fidelity is a hacked one. Try a reward with finer grades, "
    "more images per prompt (sampler.n), or the fidelity in the reward (a sum or a gate)"
)
HACK_FIX = (
    "Put the prompt fidelity into the reward (a sum with lmrl.flow.geneval.geneval, or a gate "
    "on it), or go on from the checkpoint of the best fidelity (trainer.max_rollbacks=2 rolls "
    "the run back to it at a lower lr); a KL to the start protects the prompts only near "
    "actor.beta=1, where it also stops the reward (docs/flow.md)"
)


def _mean(values: list[float] | deque[float]) -> float:
    return sum(values) / len(values)


def _val_mean(metrics: Mapping[str, float], suffix: str) -> float | None:
    values = [v for k, v in metrics.items()
              if k.startswith("val/") and k.endswith(suffix) and math.isfinite(v)]  # fmt: skip
    return sum(values) / len(values) if values else None


def _hacked(reward: tuple[float, float], fidelity: tuple[float, float]) -> bool:
    """The reward rose (by 0.05, or a tenth, whichever is more) while the fidelity fell (by
    0.1, or a fifth, whichever is more)."""
    (r0, r1), (f0, f1) = reward, fidelity
    return r1 - r0 >= max(0.05, 0.1 * abs(r0)) and f0 - f1 >= max(0.1, 0.2 * f0)


class FlowHealth(RunHealth):
    """`RunHealth` for an image run, plus the reward hacked (see the module docstring).

    Args:
        window: steps compared at the start and now.
    """

    def __init__(self, window: int = 5) -> None:
        super().__init__(None, window, zero_spread_advice=FLOW_ZERO_SPREAD)
        self.first_pairs: list[tuple[float, float]] = []  # (train reward, fidelity)
        self.recent_pairs: deque[tuple[float, float]] = deque(maxlen=window)
        self.pairs_seen = 0
        self.val_pairs: list[tuple[int, float, float]] = []  # (step, reward, fidelity)
        self.hack: str | None = None

    def baseline(self, val_metrics: Mapping[str, float]) -> list[str]:
        out = super().baseline(val_metrics)
        return out + self._watch(val_metrics, 0)

    @staticmethod
    def validation_score(val_metrics: Mapping[str, float]) -> float | None:
        """What the run doctor ranks validations by: the mean of ``val/<source>/fidelity/score``
        where it is logged, else of ``val/<source>/reward/mean`` (None: not validated)."""
        fidelity = _val_mean(val_metrics, "/fidelity/score")
        return fidelity if fidelity is not None else _val_mean(val_metrics, "/reward/mean")

    def rewind(self, step: int) -> None:
        super().rewind(step)
        self.val_pairs = [p for p in self.val_pairs if p[0] <= step]
        # the train pairs of the steps kept (one a step, from step 1); the window fills again
        self.first_pairs = self.first_pairs[:step]
        self.pairs_seen = len(self.first_pairs)
        self.recent_pairs.clear()
        self.hack = self.cause = None
        self.said.discard("reward_hack")

    def check(self, metrics: Mapping[str, float]) -> list[str]:
        """`RunHealth.check`, the reward hacked first (the zero-spread warning names it)."""
        out = self._watch(metrics, int(metrics.get("training/step", self.steps + 1)))
        return out + super().check(metrics)

    def _watch(self, metrics: Mapping[str, float], step: int) -> list[str]:
        reward, fidelity = metrics.get("critic/score/mean"), metrics.get(FIDELITY_KEY)
        if reward is not None and fidelity is not None and math.isfinite(reward + fidelity):
            if len(self.first_pairs) < self.window:
                self.first_pairs.append((reward, fidelity))
            self.recent_pairs.append((reward, fidelity))
            self.pairs_seen += 1
        val_r, val_f = _val_mean(metrics, "/reward/mean"), _val_mean(metrics, "/fidelity/score")
        if val_r is not None and val_f is not None:
            self.val_pairs.append((step, val_r, val_f))
        if self.recent_pairs:  # the zero-spread warning quotes the fidelity, not a hint
            (r0, f0), (r1, f1) = self.first_pairs[0], self.recent_pairs[-1]
            self.zero_spread_advice = FIDELITY_ZERO_SPREAD.format(r0=r0, r1=r1, f0=f0, f1=f1)
        return self._reward_hack(step)

    def _reward_hack(self, step: int) -> list[str]:
        figures = None
        if len(self.val_pairs) >= 2:
            (s0, r0, f0), (s1, r1, f1) = self.val_pairs[0], self.val_pairs[-1]
            if _hacked((r0, r1), (f0, f1)):
                figures = (
                    f"the validation reward climbed from {r0:.2f} to {r1:.2f} while the "
                    f"validation images' prompt fidelity (val/<source>/fidelity/score, the "
                    f"geneval checks) fell from {f0:.2f} to {f1:.2f} (steps {s0} -> {s1})"
                )
        w = self.window
        if figures is None and self.pairs_seen >= 2 * w and len(self.first_pairs) == w:
            r0, f0 = (
                _mean([r for r, _ in self.first_pairs]),
                _mean([f for _, f in self.first_pairs]),
            )
            r1, f1 = _mean([r for r, _ in self.recent_pairs]), _mean([f for _, f in self.recent_pairs])  # fmt: skip
            if _hacked((r0, r1), (f0, f1)):
                figures = (
                    f"the reward climbed from {r0:.2f} to {r1:.2f} while the prompt fidelity of "
                    f"the same images ({FIDELITY_KEY}, the geneval checks) fell from {f0:.2f} to "
                    f"{f1:.2f} (the first {w} steps against the last {w}, at step {step})"
                )
        if figures is None:
            return []
        if self.val_pairs:
            best_step, _, best = max(self.val_pairs, key=lambda p: (p[2], -p[0]))
            self.collapse = (best_step, best, self.val_pairs[-1][2])
            where = f"; the best fidelity was at step {best_step} ({best:.2f})"
        else:
            self.collapse = (0, f0, f1)
            where = ""
        self.hack = f"the reward is being hacked: {figures}{where}"
        self.cause = f"{self.hack}. {HACK_FIX}"
        return self._say(
            "reward_hack",
            f"{self.hack}: the images stop following their prompts while the reward pays more. "
            f"{HACK_FIX}",
        )
