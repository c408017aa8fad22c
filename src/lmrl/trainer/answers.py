"""The policy's validation answers beside the answers' prior: what the run doctor needs to name a
warm start that gives one answer to every prompt.

A warm start can learn only the commonest answer; RL then stays there (its samples score
alike, so its groups teach nothing), and a flat validation alone points at the recipe. So
`lmrl train` logs, at each validation:

- ``val/<source>/prior_acc``: the score of the answers' prior, the commonest ground truth of
  the training rows of that source given as the answer to every validation row of it, scored
  by the source's built-in scorer (its ``acc``, else its score) as `lmrl sft` does
  (``lmrl.trainer.sft_score``); computed once, when the trainer is built;
- ``val/<source>/answers/distinct`` and ``answers/truths``: how many distinct answers the
  validation gave (their text, special tokens and surrounding space dropped) and how many
  distinct ground truths its rows hold; ``answers/top_share`` and ``answers/truth_top_share``:
  the share of the commonest answer, and of the commonest ground truth.

`lmrl.run.health.RunHealth` compares them. Nothing is logged for a source without ground
truths, or without a built-in scorer, or under ``reward.custom_reward_function`` (its score is
not the built-in one); a source whose ground truths are not plain answers (Countdown's target
and numbers) gets the spread but no prior.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from lmrl.batch import Batch, response_tokens_mask
from lmrl.rewards.scorers import SCORERS
from lmrl.trainer.sft_score import score_acc

__all__ = ["AnswerPrior", "answer_prior"]


def _plain(truth: Any) -> bool:
    """A ground truth that is itself an answer (a string or a number)."""
    return isinstance(truth, str | int | float) and not isinstance(truth, bool)


class AnswerPrior:
    """The answers' prior of a run's validation rows and the spread of its validation answers
    (see the module docstring).

    Args:
        train_rows: the training rows (``data_source``, ``ground_truth``).
        val_rows: the validation rows (``data_source``, ``ground_truth``, ``extra_info``).

    Attributes:
        answers: source -> the commonest training ground truth (the prior's answer).
        metrics: ``val/<source>/prior_acc`` of each source with a prior.
        texts: source -> (the commonest answer of the last validation, the prior's answer).
    """

    def __init__(
        self, train_rows: Sequence[Mapping[str, Any]], val_rows: Sequence[Mapping[str, Any]]
    ) -> None:
        counts: dict[str, Counter[str]] = {}
        for row in train_rows:
            source, truth = row.get("data_source"), row.get("ground_truth")
            if source in SCORERS and _plain(truth):
                counts.setdefault(str(source), Counter())[str(truth).strip()] += 1
        self.answers = {s: c.most_common(1)[0][0] for s, c in counts.items()}
        accs: dict[str, list[float]] = {}
        for row in val_rows:
            source, truth = str(row.get("data_source")), row.get("ground_truth")
            if source in self.answers and truth is not None:
                scorer = SCORERS[source]
                accs.setdefault(source, []).append(
                    score_acc(scorer(self.answers[source], truth, row.get("extra_info")))
                )
        self.metrics = {f"val/{s}/prior_acc": math.fsum(v) / len(v) for s, v in accs.items()}
        self.texts: dict[str, tuple[str, str | None]] = {}

    def spread(self, outputs: Sequence[Batch], tokenizer: Any) -> dict[str, float]:
        """The validation's answers per source (``outputs``: the engine's batches, with
        ``data_source`` and ``ground_truth``): ``val/<source>/answers/*`` and the prior's
        ``prior_acc``; sets `texts`."""
        answers: dict[str, Counter[str]] = {}
        truths: dict[str, Counter[str]] = {}
        for out in outputs:
            mask = response_tokens_mask(out)
            for ids, keep, source, truth in zip(
                out["responses"], mask, out["data_source"], out["ground_truth"], strict=True
            ):
                if truth is None or str(source) not in SCORERS:
                    continue
                text = " ".join(tokenizer.decode(ids[keep], skip_special_tokens=True).split())
                answers.setdefault(str(source), Counter())[text] += 1
                truths.setdefault(str(source), Counter())[" ".join(str(truth).split())] += 1
        metrics: dict[str, float] = {}
        self.texts = {}
        for source, given in answers.items():
            n, top = sum(given.values()), given.most_common(1)[0]
            truth_top = truths[source].most_common(1)[0][1]
            metrics |= {
                f"val/{source}/answers/distinct": float(len(given)),
                f"val/{source}/answers/truths": float(len(truths[source])),
                f"val/{source}/answers/top_share": top[1] / n,
                f"val/{source}/answers/truth_top_share": truth_top / n,
            }
            self.texts[source] = (top[0], self.answers.get(source))
        return metrics | self.metrics


def answer_prior(parts: Any) -> AnswerPrior | None:
    """The run's `AnswerPrior`, or None: no validation or training rows, a score function of
    the user's (``reward.custom_reward_function.path``), or no source with a built-in scorer
    and ground truths."""
    if parts.val_data is None or parts.train_data is None or parts.tokenizer is None:
        return None
    if parts.config.reward.custom_reward_function.path:
        return None
    val = [parts.val_data[i] for i in range(len(parts.val_data))]
    if not any(r["ground_truth"] is not None and r["data_source"] in SCORERS for r in val):
        return None
    train = [parts.train_data[i] for i in range(len(parts.train_data))]
    return AnswerPrior(train, val)
