"""What an SFT run learned: the task's score on greedy answers, against the answers' prior.

A validation loss can fall a long way while the model learns only the commonest answer. When
the validation rows of ``lmrl sft`` (``data.val_files``, or the rows ``data.val_split`` holds
out) are RL rows (``data_source`` with a built-in scorer, ``reward_model.ground_truth``), or
``reward.custom_reward_function`` names a score function, each validation also answers the
first `MAX_ROWS` of them greedily and scores the answers with that function, else the row's
built-in scorer (``lmrl.rewards.scorers``; the result's ``acc``, else its score):
``val/<source>/acc``, as ``lmrl train`` logs it. Beside it, ``val/<source>/prior_acc``:
the score of the answers' prior, the commonest training answer given to every one of those
prompts (computed once). At the end of the run `SFTScore.verdict` says in one line whether
the model beats the prior, and by how much.

The answers are at most as long as the longest trained response (in tokens); the prompts are
rendered as ``lmrl train`` renders them (``data.prompt_key``, ``data.prompt_template``).
`greedy_texts` is the generation step `lmrl.demos.digits.GreedyAccuracy` shares.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lmrl.batch import Batch, response_tokens_mask
from lmrl.data.dataset import RLDataset, read_records
from lmrl.errors import DataError
from lmrl.rewards.functions import Outcome, RewardFunction
from lmrl.rewards.scorers import SCORERS, get_scorer
from lmrl.rollout import SamplingParams, build_engine

log = logging.getLogger("lmrl.sft")

MAX_ROWS = 64
"""The most validation prompts answered at each validation."""


@torch.no_grad()
def greedy_texts(
    model: torch.nn.Module, engine: Any, tokenizer: Any, prompts: Batch, max_new_tokens: int
) -> tuple[list[str], Batch]:
    """Greedy answers of ``engine`` (over ``model``, put in eval mode and restored) to
    ``prompts``: each answer's text (special tokens kept) and the engine's output batch."""
    training = model.training
    model.eval()
    try:
        sampling = SamplingParams(do_sample=False, max_new_tokens=max_new_tokens)
        out = engine.generate(prompts, 1, sampling)
    finally:
        model.train(training)
    texts = [
        tokenizer.decode(ids[mask], skip_special_tokens=False)
        for ids, mask in zip(out["responses"], response_tokens_mask(out), strict=True)
    ]
    return texts, out


def score_acc(result: float | Mapping[str, Any]) -> float:
    """A scorer's result as a score in [0, 1]: its ``acc`` (else ``score``), or the number."""
    if isinstance(result, Mapping):
        return float(result["acc"] if "acc" in result else result["score"])
    return float(result)


def training_answer(
    row: Any, *, response_key: str, messages_key: str, response_from_ground_truth: bool
) -> str | None:
    """The answer a training row teaches (its response, ground truth or last assistant turn),
    as ``lmrl.data.sft`` reads it; None where the row has none."""
    if not isinstance(row, Mapping):
        return None
    if response_from_ground_truth:
        truth = (row.get("reward_model") or {}).get("ground_truth")
        return None if truth is None else str(truth)
    if isinstance(row.get(response_key), str):
        return row[response_key]
    messages = row.get(messages_key)
    if isinstance(messages, Sequence) and not isinstance(messages, str):
        turns = [m.get("content") for m in messages if isinstance(m, Mapping)
                 and m.get("role") == "assistant"]  # fmt: skip
        if turns and isinstance(turns[-1], str):
            return turns[-1]
    return None


def commonest_answer(
    files: Sequence[str | Path],
    *,
    response_key: str = "response",
    messages_key: str = "messages",
    response_from_ground_truth: bool = False,
    keep: Callable[[str, int], bool] | None = None,
) -> str | None:
    """The most common answer of the training files (the first seen of a tie); None = none.
    ``keep(file, row)`` says which rows are training rows (None = all)."""
    counts: Counter[str] = Counter()
    for path in files:
        for i, row in enumerate(read_records(path)):
            if keep is not None and not keep(str(path), i):
                continue
            answer = training_answer(
                row, response_key=response_key, messages_key=messages_key,
                response_from_ground_truth=response_from_ground_truth,
            )  # fmt: skip
            if answer is not None:
                counts[answer.strip()] += 1
    return counts.most_common(1)[0][0] if counts else None


class SFTScore:
    """Scores greedy answers to the validation prompts and the answers' prior (see the module
    docstring).

    Args:
        model: the model trained (answers in eval mode, its mode restored).
        tokenizer: its tokenizer.
        val_files: the validation files.
        prior: returns the commonest training answer (`commonest_answer`; None = none),
            asked once, only when the validation rows can be scored.
        max_new_tokens: the most tokens of an answer.
        prompt_key, prompt_template: how the prompts are read and rendered.
        max_rows: the most validation prompts answered.
        keep: ``keep(file, row)`` says which rows of ``val_files`` are validation rows (the
            rows a held-out split holds out; None = all).
        reward_fn: the score function (``reward.custom_reward_function``); None = the
            built-in scorer of each row's ``data_source``.

    Attributes:
        skipped: why nothing is scored (no ground truth, no scorer...), or None.
        last: the last validation's ``{"score", "prior", "answers"}`` (all sources), or None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        val_files: Sequence[str | Path],
        prior: Callable[[], str | None],
        max_new_tokens: int,
        *,
        prompt_key: str = "prompt",
        prompt_template: str = "chat",
        max_rows: int = MAX_ROWS,
        keep: Callable[[str, int], bool] | None = None,
        reward_fn: RewardFunction | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.reward_fn = reward_fn
        self._said_failure = False
        self.prior: str | None = None
        self.max_new_tokens = max_new_tokens
        self.skipped: str | None = None
        self.last: dict[str, Any] | None = None
        self.rows: list[dict[str, Any]] = []
        self._prior_metrics: dict[str, float] | None = None
        try:
            data = RLDataset(
                list(val_files), tokenizer, prompt_key=prompt_key, prompt_template=prompt_template
            )
        except DataError as err:
            self.skipped = f"the validation rows are not RL rows with a data_source ({err})"
            return
        rows = [data[i] for i in range(len(data)) if keep is None or keep(*data.origin(i))]
        truths = [r for r in rows if r["ground_truth"] is not None]
        scored = rows if reward_fn is not None else [
            r for r in truths if r["data_source"] in SCORERS
        ]  # fmt: skip
        if not rows:
            self.skipped = "no validation rows"
        elif reward_fn is None and not truths:
            self.skipped = "the validation rows have no reward_model.ground_truth"
        elif not scored:
            sources = sorted({str(r["data_source"]) for r in truths})
            self.skipped = f"no built-in scorer for data_source {', '.join(sources)}"
        else:
            self.prior = prior()
            if self.prior is None:
                self.skipped = "the training rows have no answer to take the prior from"
        if self.skipped is not None:
            return
        self.rows = scored[:max_rows]
        self.prompts = data.collate(self.rows)
        self.engine = build_engine("hf", model, tokenizer)

    @property
    def active(self) -> bool:
        return self.skipped is None

    def _per_source(self, accs: Sequence[float], name: str) -> dict[str, float]:
        by_source: dict[str, list[float]] = {}
        for row, acc in zip(self.rows, accs, strict=True):
            by_source.setdefault(str(row["data_source"]), []).append(acc)
        return {f"val/{s}/{name}": math.fsum(v) / len(v) for s, v in by_source.items()}

    def _score(self, texts: Sequence[str]) -> list[float]:
        if self.reward_fn is None:
            return [
                score_acc(get_scorer(r["data_source"])(text, r["ground_truth"], r["extra_info"]))
                for r, text in zip(self.rows, texts, strict=True)
            ]
        return [self._outcome_acc(o) for o in self._call(texts)]

    def _call(self, texts: Sequence[str]) -> list[Outcome]:
        """The score function's outcome for each answer (it never raises)."""
        fn, rows = self.reward_fn, self.rows
        assert fn is not None
        if fn.batched:
            columns = {key: [r[key] for r in rows]
                       for key in ("data_source", "ground_truth", "extra_info")}  # fmt: skip
            return fn.call_batched([r["raw_prompt"] for r in rows], list(texts), columns)
        return [
            fn.call_per_sample(r["data_source"], text, r["ground_truth"], r["extra_info"])
            for r, text in zip(rows, texts, strict=True)
        ]

    def _outcome_acc(self, outcome: Outcome) -> float:
        """An outcome's ``acc`` (else its score); a failure scores 0, said once."""
        if outcome.status == "ok":
            return float(outcome.extras.get("acc", outcome.score))
        if outcome.status != "none" and not self._said_failure:
            self._said_failure = True
            log.warning("sft: the score function failed on a validation answer (%s: %s); "
                        "such answers score 0", outcome.status, outcome.message)  # fmt: skip
        return 0.0

    def __call__(self) -> dict[str, float]:
        """Greedy answers scored: ``val/<source>/acc`` and ``val/<source>/prior_acc``
        ({} when skipped)."""
        if not self.active:
            return {}
        assert self.prior is not None
        texts, _ = greedy_texts(
            self.model, self.engine, self.tokenizer, self.prompts, self.max_new_tokens
        )
        accs = self._score(texts)
        prior_accs = self._score([self.prior] * len(self.rows))
        if self._prior_metrics is None:
            self._prior_metrics = self._per_source(prior_accs, "prior_acc")
        self.last = {
            "score": math.fsum(accs) / len(accs),
            "prior": math.fsum(prior_accs) / len(prior_accs),
            "answers": Counter(_answer_text(t, self.tokenizer) for t in texts),
        }
        return self._per_source(accs, "acc") | self._prior_metrics

    def verdict(self) -> tuple[int, str] | None:
        """The end-of-run line and its log level, from the last validation (None before one
        or when skipped): the model beats the answers' prior, or does not."""
        if self.last is None:
            return None
        score, prior, n = self.last["score"], self.last["prior"], len(self.rows)
        if score > prior:
            return logging.INFO, (
                f"SFT validation score {score:.3f} beats the answers' prior {prior:.3f} by "
                f"{score - prior:.3f} (greedy answers to {n} validation prompts)"
            )
        top, count = self.last["answers"].most_common(1)[0]
        answers = f"answers {top!r} to" if top else "gives an empty answer to"
        return logging.WARNING, (
            f"SFT validation score {score:.3f} does not beat the answers' prior {prior:.3f} "
            f"(always answering {self.prior!r}, the commonest training answer): the model "
            f"{answers} {count} of {n} validation prompts; train longer or check the data"
        )


def _answer_text(text: str, tokenizer: Any) -> str:
    """An answer without its end-of-turn special tokens, for the end-of-run line."""
    for token in tokenizer.all_special_tokens:
        text = text.replace(token, "")
    return text.strip()


__all__ = [
    "MAX_ROWS",
    "SFTScore",
    "commonest_answer",
    "greedy_texts",
    "score_acc",
    "training_answer",
]
