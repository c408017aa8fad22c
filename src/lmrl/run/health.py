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
climbs while the responses run to the length limit (the common reward hack), or the entropy
climbs steadily while the score falls (a divergence). Two causes are named at the first
validation already (before the first step): the policy's validation score does not beat the
answers' prior (``val/<source>/prior_acc``: the commonest training answer given to every
prompt), or its validation answers collapse onto a few strings where the ground truths
spread (``val/<source>/answers/*``); no learning rate or temperature moves such a policy, so
the warnings that would advise a sweep name this cause instead (where an earlier validation
had neither, RL drove the policy there: said apart, with RL's fix). `RunHealth`
watches the RL metrics step by step and `SFTHealth` the SFT loss; each returns the warnings
that became true at this step, and never the same one twice. A collapse or a divergence also
sets ``RunHealth.collapse``, which the run doctor (`lmrl.run.doctor`, ``trainer.max_rollbacks``)
acts on; after a rollback, `RunHealth.rewind` forgets the abandoned steps.

The thresholds are deliberately loose: a warning is a hint to look at the plot
(``lmrl plot RUN_DIR``), not a verdict.
"""

from __future__ import annotations

import itertools
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
WARM_START_FIX = (
    "RL cannot move such a policy (its samples score alike, so its groups teach nothing) and no "
    "learning rate or temperature changes that: a sweep will not help. Fix the warm start: a "
    "longer or better SFT (lmrl sft until its last line says it beats the answers' prior), "
    "easier prompts, or a curriculum (data.curriculum.enable=true, or data.mixture with a "
    "schedule, the easy source first); docs/learning.md"
)
RL_ANSWERS_FIX = (
    "Its samples now score alike, so its groups teach nothing. Try a lower actor.optim.lr, a KL "
    "to the warm start (actor.use_kl_loss=true, or algorithm.use_kl_in_reward=true), or "
    "trainer.max_rollbacks=2, which rolls a collapsed run back to its best validated "
    "checkpoint at a lower lr"
)
PRIOR_MARGIN = 0.01
"""Validation within this of the answers' prior (or under it) does not beat the prior."""


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
        self.entropy_run: deque[float] = deque(maxlen=2 * window)  # the divergence's windows
        self.score_run: deque[float] = deque(maxlen=2 * window)
        # source -> (the commonest validation answer, the answers' prior): set by the program
        # before each validation's metrics are checked (`lmrl.trainer.answers`)
        self.answer_texts: dict[str, tuple[str, str | None]] = {}
        # what the warnings that would advise a sweep say instead, once a cause is known
        self.cause: str | None = None
        self.answers_fine: dict[str, int] = {}  # source -> first step its answers were fine

    def baseline(self, val_metrics: Mapping[str, float]) -> list[str]:
        """The validation before the first step (``val/<source>/reward/mean``): what the
        first steps' train scores are compared with. Returns its warnings: a policy that does
        not beat the answers' prior, or whose answers collapse (`_answers`)."""
        self.val_reward_before = _val_mean(val_metrics, "/reward/mean")
        val = validation_score(val_metrics)
        if val is not None:
            self.val_history.append((0, val))
        return self._answers(val_metrics, 0)

    def rewind(self, step: int) -> None:
        """Forget what came after global step ``step`` (the run was rolled back there): the
        validations after it, the recent windows, the collapse, so each can be said again."""
        self.val_history = [(s, v) for s, v in self.val_history if s <= step]
        for window in (self.recent_scores, self.recent_spread, self.recent_clip,
                       self.entropy_run, self.score_run):  # fmt: skip
            window.clear()
        self.collapse = self.cause = None
        self.answers_fine = {s: v for s, v in self.answers_fine.items() if v <= step}
        self.said -= {"val_collapse", "val_stuck", "length_hack", "diverge", "rl_answers"}

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
            self.score_run.append(score)
        if entropy is not None and math.isfinite(entropy):
            if self.first_entropy is None:
                self.first_entropy = entropy
                out += self._uniform(entropy)
            out += self._collapse(entropy)
            self.entropy_run.append(entropy)
            out += self._diverge()
        step = int(metrics.get("training/step", self.steps))
        if validation_score(metrics) is not None:  # the cause first: the others name it
            out += self._answers(metrics, step)
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
            self.val_history.append((step, val))
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
        advice = self.cause or (
            "the recipe is not moving what validation counts. Try a sweep over actor.optim.lr "
            "and rollout.temperature (lmrl sweep, docs/sweep.md), a larger rollout.n, or check "
            "that the reward pays for what validation counts"
        )
        return self._say(
            "val_stuck",
            f"validation has stayed at {anchor:.3f} (within {band}) over the last {last} "
            f"validations (steps {since}-{recent[-1][0]}), whatever the train score did: "
            f"{advice}",
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
        advice = self.cause or (
            "the policy improves what it already gets partly right, not what validation "
            "counts. Look at the reward (partial credit can pay most of the score for a wrong "
            "answer), a larger rollout.n, and the model's size (docs/learning.md)"
        )
        return self._say(
            "val_flat",
            f"the train score rose from {train_then:.3f} to {train_now:.3f} over the last "
            f"{last} validations while validation stayed at {best_before:.3f}: {advice}",
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
        advice = self.zero_spread_advice if self.cause is None else _sentence(self.cause)
        return self._say(
            "zero_spread",
            f"{share:.0%} of the prompt groups scored all alike over the last {self.window} "
            f"steps: their advantages are 0 and they teach nothing. {advice}",
        )

    def _answers(self, metrics: Mapping[str, float], step: int) -> list[str]:
        """At a validation: its score does not beat the answers' prior (``val/<source>/acc``
        within `PRIOR_MARGIN` of ``prior_acc``, or under it, the prior above 0), or its
        answers collapse onto a few strings (``val/<source>/answers/*``: at most a quarter as
        many distinct answers as distinct ground truths, or one answer for half of them while
        the commonest ground truth is under a quarter and under half that share; at least 4
        distinct ground truths). Either sets `cause` (cleared at a validation without one):
        the warm start's, unless an earlier validation of that source had neither, when RL
        drove the policy there (said apart, with RL's fix)."""
        sources = _answer_sources(metrics)
        if not sources:  # nothing logged to judge by: the cause stays as it is
            return []
        out: list[str] = []
        causes: list[str] = []
        rl_causes: list[str] = []
        where = "before the first step" if step == 0 else f"at step {step}"
        for source in sources:
            val = f"val/{source}/"
            acc, prior = metrics.get(val + "acc"), metrics.get(val + "prior_acc")
            distinct, truths = metrics.get(val + "answers/distinct"), metrics.get(val + "answers/truths")  # fmt: skip
            share = metrics.get(val + "answers/top_share")
            truth_share = metrics.get(val + "answers/truth_top_share")
            top, prior_answer = self.answer_texts.get(source, (None, None))
            parts: list[str] = []
            if acc is not None and prior is not None and prior > 0 and acc <= prior + PRIOR_MARGIN:
                how = (
                    "equals" if abs(acc - prior) < 5e-4
                    else "is below" if acc < prior else f"is within {PRIOR_MARGIN} of"
                )  # fmt: skip
                always = f"always answering {_quote(prior_answer)}, " if prior_answer else ""
                parts.append(f"validation on {source} {acc:.3f} {how} the answers' prior "
                             f"{prior:.3f} ({always}the commonest training answer)")  # fmt: skip
            named = (
                f" ({_quote(top) if top else 'an empty answer'} is {share:.0%} of them)"
                if top is not None and share is not None else ""
            )  # fmt: skip
            if (
                distinct is not None and truths is not None and share is not None
                and truth_share is not None and truths >= 4
                and (4 * distinct <= truths
                     or (share >= 0.5 and truth_share <= min(0.25, share / 2)))
            ):  # fmt: skip
                parts.append(
                    f"its validation answers on {source} collapse onto {distinct:.0f} distinct "
                    f"string{'s' if distinct != 1 else ''}{named} where the ground truths hold "
                    f"{truths:.0f} (the commonest is {truth_share:.0%} of them)"
                )
                keys = {"prior", "answers"} if len(parts) == 2 else {"answers"}
            elif parts:
                parts[0] += f"; it gives {_quote(top)} to {share:.0%} of them" if top else ""
                keys = {"prior"}
            else:
                self.answers_fine.setdefault(source, step)
                continue
            fine = self.answers_fine.get(source)
            if fine is not None:  # fine at an earlier validation: RL drove it here
                rl_causes.append(f"{'; '.join(parts)}, where at step {fine} it did not")
                out += self._say(
                    "rl_answers",
                    f"RL drove the policy onto a few answers {where}: {rl_causes[-1]}. "
                    f"{RL_ANSWERS_FIX}",
                )
                continue
            causes.append("; ".join(parts))
            if keys - self.said:
                self.said |= keys
                head = (
                    "the policy does not beat the answers' prior" if "prior" in keys
                    else "the policy's answers collapse onto a few strings"
                )  # fmt: skip
                out.append(f"{head} {where}: {causes[-1]}. {WARM_START_FIX}")
        self.cause = (
            f"the cause is the warm start ({'; '.join(causes)}). {WARM_START_FIX}" if causes
            else f"the cause is RL's ({'; '.join(rl_causes)}). {RL_ANSWERS_FIX}" if rl_causes
            else None
        )  # fmt: skip
        return out

    def _diverge(
        self, rise: float = 1.3, gain: float = 0.2, steady: float = 0.7, fall: float = 0.05
    ) -> list[str]:
        """Over the last ``2 * window`` steps the entropy climbed steadily (its later half's
        mean at least ``rise`` times and ``gain`` nats above the earlier half's, and up at
        ``steady`` of the steps) while the mean train score fell (by ``fall``, or a tenth of
        it when that is more). Sets ``collapse``: the run doctor rolls a divergence back."""
        n, half = 2 * self.window, self.window
        if len(self.entropy_run) < n or len(self.score_run) < n:
            return []
        e, s = list(self.entropy_run), list(self.score_run)
        e_then, e_now = sum(e[:half]) / half, sum(e[half:]) / (n - half)
        s_then, s_now = sum(s[:half]) / half, sum(s[half:]) / (n - half)
        ups = sum(b > a for a, b in itertools.pairwise(e))
        if e_now < max(rise * e_then, e_then + gain) or ups < steady * (n - 1):
            return []
        if s_then - s_now < max(fall, 0.1 * abs(s_then)):
            return []
        if self.val_history:
            best_step, best = max(self.val_history, key=lambda sv: (sv[1], -sv[0]))
            self.collapse = (best_step, best, self.val_history[-1][1])
        else:
            self.collapse = (0, s_then, s_now)
        return self._say(
            "diverge",
            f"the policy is diverging: its entropy climbed from {e_then:.2f} to {e_now:.2f} "
            f"nats over the last {n} steps (up at {ups} of {n - 1}) while the mean train score "
            f"fell from {s_then:.3f} to {s_now:.3f}. Lower actor.optim.lr (by 3-10x), add a KL "
            "to the warm start (actor.use_kl_loss=true actor.kl_loss_coef=0.01, or "
            "algorithm.use_kl_in_reward=true), or trainer.max_rollbacks=2, which rolls back to "
            "the best validated checkpoint and goes on at a lower lr",
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

    def baseline(self, val_metrics: Mapping[str, float]) -> list[str]:
        """Nothing to compare with before the first step (the loss is watched alone)."""
        return []

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


def _answer_sources(metrics: Mapping[str, float]) -> list[str]:
    """The sources whose validation logged the answers' prior or the answers' spread."""
    out: list[str] = []
    for key in metrics:
        for suffix in ("/prior_acc", "/answers/distinct"):
            if key.startswith("val/") and key.endswith(suffix):
                source = key[len("val/") : -len(suffix)]
                if source not in out:
                    out.append(source)
    return out


def _quote(text: str | None, limit: int = 40) -> str:
    """An answer as the warnings quote it (cut to ``limit`` characters)."""
    text = text or ""
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _sentence(text: str) -> str:
    """``text`` with its first letter a capital."""
    return text[:1].upper() + text[1:]


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
