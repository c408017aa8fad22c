"""Warnings for runs that are failing while they run: each said once, with its likely fix.

A run that does not learn rarely crashes. Its metrics say so long before the last step: the
policy's entropy collapses while the score stays flat (it sharpens onto what it already
does), most prompt groups score all alike (their GRPO advantages are 0 and they teach
nothing), the policy starts from a near-uniform model (nothing to reinforce), or a warm start's
loss does not drop, or validation stays flat while the train score keeps rising (the policy
polishes partial credit), or the policy's samples score far below its validation answers (RL
will spend its first steps sharpening toward what greedy decoding already does), or validation
does not move at all over several validations whatever the train score does, or the policy
collapses (its entropy under a floor while validation falls from its best), or the reward
climbs while the responses run to the length limit (the common reward hack). `RunHealth`
watches the RL metrics step by step and `SFTHealth` the SFT loss; each returns the warnings
that became true at this step, and never the same one twice. A collapse also sets
``RunHealth.collapse``, which the run doctor (`lmrl.run.doctor`, ``trainer.max_rollbacks``)
acts on; after a rollback, `RunHealth.rewind` forgets the abandoned steps.

The thresholds are deliberately loose: a warning is a hint to look at the plot
(``lmrl plot RUN_DIR``), not a verdict.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

__all__ = ["ZERO_SPREAD_KEY", "RunHealth", "SFTHealth", "validation_score"]

ZERO_SPREAD_KEY = "critic/score/zero_spread_frac"
ENTROPY_KEY = "actor/entropy"
SCORE_KEY = "critic/score/mean"
CLIP_KEY = "response_length/clip_ratio"
ZERO_SPREAD_ADVICE = (
    "Try algorithm.filter_groups.enable=true (DAPO's dynamic sampling), a larger rollout.n, a "
    "reward with partial credit, or prompts nearer the model's level"
)


class RunHealth:
    """Watch an RL run's metrics; `check` returns the new warnings of this step.

    Args:
        vocab_size: the policy's vocabulary (a near-uniform policy has ``log(vocab)`` nats).
        window: steps compared at the start and now (score trend, sustained zero spread).
        zero_spread_advice: what the all-alike-groups warning suggests (the RL trainer's keys
            by default; ``lmrl train-flow`` gives its own).
    """

    def __init__(
        self, vocab_size: int | None, window: int = 5, zero_spread_advice: str | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self.zero_spread_advice = zero_spread_advice or ZERO_SPREAD_ADVICE
        self.window = window
        self.said: set[str] = set()
        self.first_entropy: float | None = None
        self.first_scores: list[float] = []
        self.recent_scores: deque[float] = deque(maxlen=window)
        self.recent_spread: deque[float] = deque(maxlen=window)
        self.validations: list[tuple[float, float]] = []  # (train score, validation score)
        self.val_history: list[tuple[int, float]] = []  # (global step, validation score)
        self.recent_clip: deque[float] = deque(maxlen=window)
        self.first_clip: list[float] = []
        self.steps = 0
        self.val_reward_before: float | None = None
        self.collapse: tuple[int, float, float] | None = None  # (best step, best, now)

    def baseline(self, val_metrics: Mapping[str, float]) -> None:
        """The validation before the first step (``val/<source>/reward/mean``): what the
        first steps' train scores are compared with."""
        self.val_reward_before = _val_mean(val_metrics, "/reward/mean")
        val = validation_score(val_metrics)
        if val is not None:
            self.val_history.append((0, val))

    def rewind(self, step: int) -> None:
        """Forget what came after global step ``step`` (the run was rolled back there): the
        validations after it, the recent windows, the collapse, so each can be said again."""
        self.val_history = [(s, v) for s, v in self.val_history if s <= step]
        for window in (self.recent_scores, self.recent_spread, self.recent_clip):
            window.clear()
        self.collapse = None
        self.said -= {"val_collapse", "val_stuck", "length_hack"}

    def check(self, metrics: Mapping[str, float]) -> list[str]:
        """The warnings that hold after this step's ``metrics`` and were not said before."""
        self.steps += 1
        out: list[str] = []
        entropy = metrics.get(ENTROPY_KEY)
        score = metrics.get(SCORE_KEY)
        if score is not None and math.isfinite(score):
            if len(self.first_scores) < self.window:
                self.first_scores.append(score)
                if len(self.first_scores) == self.window:
                    out += self._sampling_gap()
            self.recent_scores.append(score)
        if entropy is not None and math.isfinite(entropy):
            if self.first_entropy is None:
                self.first_entropy = entropy
                out += self._uniform(entropy)
            out += self._collapse(entropy)
        spread = metrics.get(ZERO_SPREAD_KEY)
        if spread is not None and math.isfinite(spread):
            self.recent_spread.append(spread)
            out += self._zero_spread()
        clip = metrics.get(CLIP_KEY)
        if clip is not None and math.isfinite(clip) and score is not None and math.isfinite(score):
            if len(self.first_clip) < self.window:
                self.first_clip.append(clip)
            self.recent_clip.append(clip)
            out += self._length_hack()
        val = validation_score(metrics)
        if val is not None and score is not None:
            self.validations.append((score, val))
            out += self._val_flat()
        if val is not None:
            self.val_history.append((int(metrics.get("training/step", self.steps)), val))
            out += self._val_stuck()
            out += self._val_collapse(entropy)
        return out

    def _val_stuck(self, last: int = 6, band: float = 0.02) -> list[str]:
        """Validation within ``band`` of where it was ``last`` validations ago, every time,
        while the train score did not rise (that case is `_val_flat`'s, with its own advice)."""
        if len(self.val_history) <= last or "val_flat" in self.said:
            return []
        (since, anchor), recent = self.val_history[-last - 1], self.val_history[-last:]
        if any(abs(v - anchor) > band for _, v in recent):
            return []
        if len(self.validations) > last:  # the train score rising: `_val_flat`'s case
            train_now = sum(t for t, _ in self.validations[-last:]) / last
            if train_now >= self.validations[-last - 1][0] + 0.05:
                return []
        return self._say(
            "val_stuck",
            f"validation has stayed at {anchor:.3f} (within {band}) over the last {last} "
            f"validations (steps {since}-{recent[-1][0]}), whatever the train score did: the "
            "recipe is not moving what validation counts. Try a sweep over actor.optim.lr and "
            "rollout.temperature (lmrl sweep, docs/sweep.md), a larger rollout.n, or check "
            "that the reward pays for what validation counts",
        )

    def _val_collapse(
        self, entropy: float | None, floor: float = 0.5, drop: float = 0.1
    ) -> list[str]:
        """Entropy under ``floor`` (and under half the first step's) while validation fell
        from its best by ``drop`` (absolute, or a third of the best when that is smaller)."""
        if entropy is None or self.first_entropy is None or len(self.val_history) < 2:
            return []
        if entropy > min(floor, 0.5 * self.first_entropy) and entropy > 0.05:
            return []
        best_step, best = max(self.val_history, key=lambda sv: (sv[1], -sv[0]))
        step, now = self.val_history[-1]
        if best - now < min(drop, best / 3) or best <= 0:
            return []
        self.collapse = (best_step, best, now)
        return self._say(
            "val_collapse",
            f"the policy collapsed: its entropy is {entropy:.3f} nats (from "
            f"{self.first_entropy:.2f}) while validation fell from {best:.3f} (step "
            f"{best_step}) to {now:.3f} (step {step}). Try a lower actor.optim.lr, a KL term "
            "(actor.use_kl_loss=true), or trainer.max_rollbacks=2, which rolls back to the best "
            "validated checkpoint and goes on at a lower lr",
        )

    def _length_hack(self, limit: float = 0.5, rise: float = 0.3) -> list[str]:
        """The train score rose while the share of responses cut at the length limit rose
        by ``rise`` to at least ``limit``."""
        if len(self.first_clip) < self.window or len(self.recent_clip) < self.window:
            return []
        if len(self.first_scores) < self.window or len(self.recent_scores) < self.window:
            return []
        clip_then = sum(self.first_clip) / self.window
        clip_now = sum(self.recent_clip) / self.window
        before = sum(self.first_scores) / self.window
        now = sum(self.recent_scores) / self.window
        if clip_now < max(limit, clip_then + rise) or now <= before + 0.05 * max(abs(before), 1):
            return []
        return self._say(
            "length_hack",
            f"the train score rose from {before:.3f} to {now:.3f} while the responses cut at "
            f"data.max_response_length went from {clip_then:.0%} to {clip_now:.0%}: the "
            "reward may be paying for length (the common reward hack). Read the samples "
            "(trainer.log_generations_freq), score a truncated response as wrong, or add "
            "DAPO's soft length penalty (reward.manager=dapo, reward.overlong_buffer.enable=true)",
        )

    def _val_flat(self, last: int = 8, rise: float = 0.05, gain: float = 0.02) -> list[str]:
        """Validation flat over the last ``last`` validations while the train score rose."""
        if len(self.validations) < 2 * last:
            return []
        earlier, recent = self.validations[:-last], self.validations[-last:]
        best_before = max(v for _, v in earlier)
        if max(v for _, v in recent) > best_before + gain:
            return []
        train_then = sum(s for s, _ in earlier[-last:]) / last
        train_now = sum(s for s, _ in recent) / last
        if train_now < train_then + rise:
            return []
        return self._say(
            "val_flat",
            f"the train score rose from {train_then:.3f} to {train_now:.3f} over the last "
            f"{last} validations while validation stayed at {best_before:.3f}: the policy "
            "improves what it already gets partly right, not what validation counts. Look at "
            "the reward (partial credit can pay most of the score for a wrong answer), a "
            "larger rollout.n, and the model's size (docs/learning.md)",
        )

    def _sampling_gap(self, ratio: float = 0.6, gap: float = 0.1) -> list[str]:
        """The first steps' train score far below the validation before training."""
        val = self.val_reward_before
        if val is None or val <= 0:
            return []
        train = sum(self.first_scores) / len(self.first_scores)
        if train >= ratio * val or val - train < gap:
            return []
        return self._say(
            "sampling_gap",
            f"the first {self.window} steps' mean train score ({train:.3f}) is far below the "
            f"validation score before training ({val:.3f}): the policy's samples are much "
            "worse than its validation (greedy) answers, so RL will first sharpen toward what "
            "greedy decoding already does and greedy validation will not move meanwhile. Try "
            "rollout.temperature=0.7, or a longer warm start (docs/learning.md)",
        )

    def _say(self, key: str, text: str) -> list[str]:
        if key in self.said:
            return []
        self.said.add(key)
        return [text]

    def _uniform(self, entropy: float) -> list[str]:
        if not self.vocab_size or self.vocab_size < 2:
            return []
        uniform = math.log(self.vocab_size)
        if entropy < 0.8 * uniform:
            return []
        return self._say(
            "uniform",
            f"the policy starts near uniform: its entropy is {entropy:.2f} nats, against "
            f"{uniform:.2f} for a uniform choice over its {self.vocab_size} tokens, so RL has "
            "nothing to reinforce. Warm it up first (lmrl sft; a from-scratch tiny model "
            "needs optim.lr ~1e-3, not a pretrained model's 1e-5 to 1e-4)",
        )

    def _collapse(self, entropy: float) -> list[str]:
        start = self.first_entropy
        if start is None or self.steps < 2 * self.window or start <= 0.2:
            return []
        if entropy > min(0.25 * start, 0.5):
            return []
        if len(self.recent_scores) < self.window or len(self.first_scores) < self.window:
            return []
        before = sum(self.first_scores) / len(self.first_scores)
        now = sum(self.recent_scores) / len(self.recent_scores)
        if now > before + 0.1 * max(abs(before), 0.1):
            return []  # sharpening while the score rises: what training should do
        return self._say(
            "collapse",
            f"the policy's entropy fell from {start:.2f} to {entropy:.2f} nats in "
            f"{self.steps} steps while the mean score stayed at {before:.3f} -> {now:.3f}: it "
            "is sharpening onto what it already does, not learning. Try Clip-Cov "
            "(actor.policy_loss.loss_mode=clip_cov, actor.policy_loss.clip_cov_ratio=0.1 for "
            "short answers), rollout.temperature=0.7 with a lower actor.optim.lr (1e-4 for a "
            "tiny model), or a larger rollout.n; clip-higher acts only with several updates "
            "per batch (docs/learning.md)",
        )

    def _zero_spread(self) -> list[str]:
        if len(self.recent_spread) < self.window:
            return []
        if min(self.recent_spread) < 0.8:
            return []
        share = sum(self.recent_spread) / len(self.recent_spread)
        return self._say(
            "zero_spread",
            f"{share:.0%} of the prompt groups scored all alike over the last {self.window} "
            f"steps: their advantages are 0 and they teach nothing. {self.zero_spread_advice}",
        )


class SFTHealth:
    """Warn once when a warm start's training loss has not dropped after a fair number of
    steps (a quarter of the run, at least ``min_steps``).

    Args:
        total_steps: the run's steps.
        min_steps: steps before the first verdict.
    """

    # the loss has no collapse the run doctor answers (its rollback is RL's)
    collapse: tuple[int, float, float] | None = None

    def __init__(self, total_steps: int, min_steps: int = 20) -> None:
        self.after = max(min_steps, total_steps // 4)
        self.losses: list[float] = []
        self.said = False

    def rewind(self, step: int) -> None:
        """Nothing to forget: an SFT run is never rolled back."""

    def baseline(self, val_metrics: Mapping[str, float]) -> None:
        """Nothing to compare with before the first step (the loss is watched alone)."""

    def check(self, metrics: Mapping[str, float]) -> list[str]:
        """The warning, once, when ``sft/loss`` has not dropped (``sft/lr`` named in it)."""
        loss, lr = metrics.get("sft/loss"), metrics.get("sft/lr")
        if loss is None or not math.isfinite(loss):
            return []
        self.losses.append(loss)
        n = len(self.losses)
        if self.said or n < self.after:
            return []
        k = max(3, self.after // 5)
        first = sum(self.losses[:k]) / k
        recent = sum(self.losses[-k:]) / k
        if recent < 0.9 * first:
            return []
        self.said = True
        rate = f" at optim.lr={lr:g}" if lr is not None else ""
        return [
            f"the SFT loss has not dropped after {n} steps{rate} ({first:.3f} -> "
            f"{recent:.3f}): the model is not learning the warm start. A from-scratch model "
            "needs optim.lr ~1e-3; check that the responses are in the data (data.response_key)"
        ]


def _val_mean(metrics: Mapping[str, float], suffix: str) -> float | None:
    """The mean over data sources of the finite ``val/<source><suffix>`` values, if any."""
    values = [
        v for k, v in metrics.items()
        if k.startswith("val/") and k.endswith(suffix) and math.isfinite(v)
    ]  # fmt: skip
    return sum(values) / len(values) if values else None


def validation_score(metrics: Mapping[str, float]) -> float | None:
    """The mean over data sources of ``val/<source>/acc`` (else ``reward/mean``), if validated."""
    acc = _val_mean(metrics, "/acc")
    return acc if acc is not None else _val_mean(metrics, "/reward/mean")
