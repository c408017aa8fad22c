"""The scoring half of ``lmrl train``'s schema: ``reward`` and ``reward_model``.

How a generated batch is scored: the reward manager and a user's score function, the worker
processes and their timeout, what the scoring overlaps (``reward.overlap``), DAPO's overlong
penalty, and a learned reward model. ``lmrl.config.schema`` re-exports these classes and
states the conventions (``opt``, verl's defaults, ``null = X``).
"""

# ruff: noqa: RUF009  (``opt`` returns a ``dataclasses.field``; ruff cannot see that)

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lmrl.config.run import opt, options


@dataclass
class CustomRewardFunctionConfig:
    """A user score function loaded from a Python file."""

    path: str | None = opt(
        None, "Python file defining the score function; null = the built-in scorers."
    )
    name: str = opt("compute_score", "Name of the function in that file.")
    reward_kwargs: dict[str, Any] = opt({}, "Extra keyword arguments passed to the function.")


@dataclass
class OverlongBufferConfig:
    """The options of ``reward.overlong_buffer``: DAPO's soft overlong penalty
    (reward.manager=dapo)."""

    enable: bool = opt(False, "Penalize responses that run into the last `len` tokens.")
    len: int = opt(
        0,
        "Buffer length in tokens: the penalty grows linearly from 0 at "
        "max_response_length - len to penalty_factor at max_response_length.",
    )
    penalty_factor: float = opt(1.0, "Largest penalty subtracted from the score.")


@dataclass
class ScoringOverlap:
    """The options of ``reward.overlap``: what the scoring runs beside; any may combine."""

    rows: bool = opt(
        False,
        "Score each sample the moment it stops, while the other rows go on (the hf engine, "
        "the agent loop; vLLM, Ray: per call). Per-sample managers only (naive, dapo).",
    )
    chunks: int = opt(
        1,
        "Generate a step's prompts in this many calls (whole groups) and score each call's "
        "samples while the next generates; same samples. 1 = one call; >= 1.",
    )
    log_probs: bool = opt(
        False,
        "Also overlap the scoring with the old and reference log-probs and values: only the "
        "advantages wait for it (verl's reward_model.launch_reward_fn_async).",
    )


@dataclass
class RewardConfig:
    """Scoring: the reward manager, a custom score function, parallelism."""

    manager: Literal["naive", "batch", "dapo"] = opt(
        "naive",
        "naive scores one sample at a time; batch calls the score function once per batch; "
        "dapo adds the overlong penalty.",
    )
    custom_reward_function: CustomRewardFunctionConfig = opt(
        CustomRewardFunctionConfig(), "User score function."
    )
    num_workers: int = opt(
        1,
        "Worker processes scoring in parallel, with a per-sample timeout; 0 = in-process "
        "(cheapest, but a hanging reward function hangs training).",
    )
    timeout_s: float = opt(10.0, "Seconds one sample's scoring may take before it scores 0.")
    overlap: dict[str, Any] = options(
        ScoringOverlap,
        "What the scoring overlaps (docs/async.md); set one as reward.overlap.NAME. The "
        "defaults score after the generation, with nothing overlapped.",
    )
    max_error_fraction: float = opt(
        0.9,
        "Stop the run when the first step's scoring fails (raises, times out, returns no "
        "number) on at least this fraction of samples, quoting the first error; later steps "
        "only warn. > 1 = never stop.",
    )
    overlong_buffer: dict[str, Any] = options(
        OverlongBufferConfig,
        "DAPO's overlong penalty (reward.manager=dapo); set one as reward.overlong_buffer.NAME.",
    )
    scorer_options: dict[str, dict[str, Any]] = opt(
        {},
        "Options of the built-in scorers per data_source, e.g. {digits: {binary: true}} "
        "(exact match instead of partial credit) or {gsm8k: {method: flexible}}.",
    )


@dataclass
class RewardModelModelConfig:
    """The reward model's weights: a sequence-classification model with one label."""

    path: str | None = opt(
        None, "Directory of an AutoModelForSequenceClassification with num_labels=1."
    )
    input_tokenizer: str | None = opt(
        None,
        "The policy's tokenizer when it differs from the reward model's: responses are decoded "
        "and re-tokenized with the reward model's own tokenizer (and its chat template); "
        "null = the reward model reads the policy's token ids as they are.",
    )
    trust_remote_code: bool = opt(False, "Allow the reward model's own modelling code.")


@dataclass
class RewardModelConfig:
    """A learned reward: a sequence-classification model's score of each (prompt, response)."""

    enable: bool = opt(False, "Score responses with a reward model (reward_model.model.path).")
    model: RewardModelModelConfig = opt(RewardModelModelConfig(), "The reward model.")
    micro_batch_size: int | None = opt(
        None, "Sequences per reward-model forward pass; null = all at once."
    )
    max_length: int | None = opt(
        None, "Truncate longer (prompt + response) inputs from the left; null = no limit."
    )
    coef: float = opt(1.0, "Weight of the reward model's score in the reward.")
    rule_reward: bool = opt(
        True,
        "true = the score functions' reward plus coef * the model's score; false = the "
        "model's score alone (verl's behaviour with a reward model; data sources need no "
        "scorer).",
    )
