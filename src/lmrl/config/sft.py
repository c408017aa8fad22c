"""The configuration of ``lmrl sft``: supervised fine-tuning before RL (the warm start).

``SFTConfig`` has five sections: ``data`` (the files, their layout, lengths and batch sizes),
``model`` (the RL schema's ``ModelConfig``), ``reward`` (the score function of validation's
greedy answers, the RL run's ``reward.custom_reward_function``), ``optim`` (the RL ``OptimConfig`` plus
``grad_clip``) and ``trainer`` (length, run directory, checkpoints, validation, logging).
``load_sft_config`` loads it with the same machinery as ``lmrl train`` (YAML file, dotted
``key=value`` overrides, each value converted to its key's type as it is read, did-you-mean on
unknown keys, one ``ConfigError`` naming every bad key): a ``ConfigKind`` hands the loader this
root type, the ``SFT`` rules of the one verl table (``lmrl.config.verl``: verl's
``sft_trainer.yaml`` keys such as ``model.partial_pretrain`` and ``optim.clip_grad``; keys of
verl's GPU stack get a one-line notice) and the resolve/validate steps of this module.

Choices: the data layout is read from the columns (``data.response_key`` present ->
prompt/response; else ``data.messages_key`` -> chat messages), unless
``data.response_from_ground_truth`` asks for verl RL-format rows; a plain-string prompt is one
user turn under the chat template unless ``data.prompt_template=verbatim``, as in ``lmrl
train`` (``lmrl.data.layout``); ``data.micro_batch_size``
null means the whole batch in one forward pass (fastest on CPU for small models).
"""

# ruff: noqa: RUF009  (``opt`` returns a ``dataclasses.field``; ruff cannot see that)

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

from lmrl.config.errors import ConfigError
from lmrl.config.fields import get_path
from lmrl.config.help import key_lines, rename_lines
from lmrl.config.loader import ConfigKind, load_config
from lmrl.config.reward import CustomRewardFunctionConfig
from lmrl.config.run import RUN_CHECKS, RunSettings, default_of, opt
from lmrl.config.schema import ModelConfig, OptimConfig
from lmrl.config.validate import expand_user, range_errors, resolve_run_paths
from lmrl.config.verl import SFT, renames, translate, verl_spellings

# ------------------------------------------------------------------------------------------
# schema
# ------------------------------------------------------------------------------------------


@dataclass
class SFTDataConfig:
    """Supervised examples: the files, their layout, lengths and batch sizes."""

    train_files: str | list[str] | None = opt(
        None, "Training examples: a parquet/JSONL/JSON file or saved dataset, or a list of them."
    )
    val_files: str | list[str] | None = opt(
        None, "Validation examples (same layout); null = data.val_split, or no validation."
    )
    val_split: float = opt(
        0.0,
        "With no data.val_files: hold this share (< 1) or this number (>= 1) of the training "
        "rows out for validation, drawn with data.seed; 0 = none.",
    )
    prompt_key: str = opt(
        "prompt",
        "Column holding the prompt: chat messages (templated) or a string (data.prompt_template).",
    )
    prompt_template: Literal["chat", "verbatim"] = opt(
        "chat",
        "How a plain-string prompt is rendered: chat = one user turn under the tokenizer's chat "
        "template with the generation prompt, its response the assistant turn (verl's SFT "
        "rule; verbatim when the tokenizer has no template); verbatim = the string as it is, "
        "its response followed by EOS. The rule lmrl train applies with the same key; the "
        "renderings used are recorded in final/lmrl_prompt_layout.json and checked by lmrl "
        "train.",
    )
    response_key: str = opt(
        "response", "Column holding the response string (the prompt/response layout)."
    )
    messages_key: str = opt(
        "messages",
        "Column holding a whole chat (list of {role, content}), used when the rows have no "
        "response_key column; every assistant turn is trained on.",
    )
    response_from_ground_truth: bool = opt(
        False,
        "Train on verl RL-format rows: the response is reward_model.ground_truth (as a string), "
        "e.g. the files of `lmrl tasks`.",
    )
    mask_pattern: str | None = opt(
        None,
        "A regular expression: the parts of a response (or assistant turn) it matches are "
        "context, not trained, e.g. tool observations '(?s)<information>.*?</information>' "
        "in multi-turn demonstrations (the state masking of RL); null = train every token.",
    )
    max_length: int = opt(
        1024, "Longest example in tokens (prompt + response, after the template)."
    )
    truncation: Literal["error", "left", "right"] = opt(
        "error",
        "What to do with a longer example: error, or keep its left part (right = cut the end) "
        "or its right part (left = cut the start).",
    )
    train_batch_size: int = opt(32, "Examples per optimizer step.")
    micro_batch_size: int | None = opt(
        None,
        "Examples per forward/backward pass, gradients accumulated (the loss is still the token "
        "mean over the whole batch); null = the whole batch at once.",
    )
    shuffle: bool = opt(True, "Shuffle the training examples every epoch.")
    seed: int | None = opt(None, "Seed of the data order; null = trainer.seed.")


@dataclass
class SFTRewardConfig:
    """How validation scores greedy answers (rows with a ground truth, or any row with a
    score function): the built-in scorers, or the function ``lmrl train`` is given."""

    custom_reward_function: CustomRewardFunctionConfig = opt(
        CustomRewardFunctionConfig(),
        "User score function, as in lmrl train (reward.custom_reward_function).",
    )


@dataclass
class SFTOptimConfig(OptimConfig):
    """AdamW with linear warmup, a constant or cosine schedule, and gradient clipping."""

    grad_clip: float = opt(1.0, "Clip the global gradient norm to this value (> 0).")


@dataclass
class SFTTrainerConfig(RunSettings):
    """The run: its length, directory, checkpoints, validation, logging, device."""

    experiment_name: str = default_of(RunSettings, "experiment_name", "sft")
    val_before_train: bool = default_of(RunSettings, "val_before_train", False)
    seed: int = default_of(
        RunSettings, "seed", 42, "Global seed (data order, dropout, LoRA initialization)."
    )
    total_epochs: int = opt(1, "Passes over the training examples.")


@dataclass
class SFTConfig:
    """A supervised fine-tuning run (``lmrl sft``): data, model, scoring, optimizer, run."""

    data: SFTDataConfig = opt(SFTDataConfig(), "Examples.")
    model: ModelConfig = opt(ModelConfig(), "The model fine-tuned.")
    reward: SFTRewardConfig = opt(SFTRewardConfig(), "Scoring of greedy validation answers.")
    optim: SFTOptimConfig = opt(
        SFTOptimConfig(lr=1e-4, lr_warmup_steps_ratio=0.05, lr_scheduler="cosine"),
        "Optimizer and schedule.",
    )
    trainer: SFTTrainerConfig = opt(SFTTrainerConfig(), "The run.")


# ------------------------------------------------------------------------------------------
# resolve, validate, load
# ------------------------------------------------------------------------------------------


def resolve_sft_config(cfg: SFTConfig) -> SFTConfig:
    """A copy of ``cfg`` with its derived defaults filled (the loader converted the types).

    Filled when null: ``data.seed`` (``trainer.seed``) and ``trainer.default_local_dir``
    (``checkpoints/<project_name>/<experiment_name>``). A leading ``~`` in paths is expanded.
    Idempotent. An ``SFTConfig`` edited in code goes through the loader's type conversion
    with ``config_from_dict(asdict(cfg), kind=SFT_CONFIG)``.
    """
    cfg = copy.deepcopy(cfg)
    resolve_run_paths(cfg)
    fn = cfg.reward.custom_reward_function
    fn.path = expand_user(fn.path)
    return cfg


def validate_sft_config(cfg: SFTConfig, *, notices: list[str] | None = None) -> None:
    """Check the ranges a single key's type cannot catch.

    Args:
        cfg: the config, its values of their keys' types (as the loader builds it).
        notices: accepted for the loader's interface; no SFT check only warns.
    Raises:
        ConfigError: every problem found, each naming the key and the fix.
    """
    checks = (
        ("data.max_length", lambda x: x >= 2, "must be >= 2 (a prompt token and a response token)"),
        ("data.train_batch_size", lambda x: x >= 1, "must be >= 1"),
        ("data.micro_batch_size", lambda x: x is None or x >= 1, "must be >= 1 (or null)"),
        (
            "data.val_split",
            lambda x: x >= 0 and (x < 1 or x == int(x)),
            "must be a share in [0, 1) or a whole number of rows",
        ),
        ("model.lora_rank", lambda x: x >= 0, "must be >= 0 (0 = full fine-tuning)"),
        ("optim.lr", lambda x: x >= 0, "must be >= 0"),
        ("optim.weight_decay", lambda x: x >= 0, "must be >= 0"),
        ("optim.lr_warmup_steps_ratio", lambda x: 0 <= x <= 1, "must be in [0, 1]"),
        ("optim.min_lr_ratio", lambda x: 0 <= x <= 1, "must be in [0, 1]"),
        (
            "optim.betas",
            lambda x: len(x) == 2 and all(0 <= b < 1 for b in x),
            "must be two numbers in [0, 1), e.g. [0.9, 0.95]",
        ),
        ("optim.grad_clip", lambda x: x > 0, "must be > 0 (e.g. 1.0)"),
        ("trainer.total_epochs", lambda x: x >= 1, "must be >= 1"),
        *RUN_CHECKS,
    )
    errors = range_errors(cfg, checks)
    if cfg.model.lora_rank > 0 and not cfg.model.lora_alpha > 0:
        errors.append(f"model.lora_alpha={cfg.model.lora_alpha!r} must be > 0 when LoRA is on")
    for key in ("data.prompt_key", "data.response_key", "data.messages_key"):
        if not get_path(cfg, key):
            errors.append(f"{key} must name a column, got an empty string")
    if cfg.data.val_split and cfg.data.val_files:
        errors.append(
            f"data.val_split={cfg.data.val_split!r} holds training rows out for validation, "
            f"but data.val_files={cfg.data.val_files!r} is validation already; set one of them"
        )
    if cfg.data.mask_pattern is not None:
        try:
            re.compile(cfg.data.mask_pattern)
        except re.error as err:
            errors.append(f"data.mask_pattern={cfg.data.mask_pattern!r} is not a regex: {err}")
    if errors:
        raise ConfigError(errors)


SFT_CONFIG = ConfigKind(
    SFTConfig,
    partial(translate, target=SFT),
    partial(verl_spellings, target=SFT),
    resolve_sft_config,
    validate_sft_config,
    "lmrl sft",
)

#: keys ``load_sft_config`` insists on by default
REQUIRED_FOR_SFT = ("model.path", "data.train_files")


def load_sft_config(
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    required: Sequence[str] = REQUIRED_FOR_SFT,
    notices: list[str] | None = None,
) -> SFTConfig:
    """Build an SFT run's config from the defaults, a YAML file and ``key=value`` overrides.

    Args:
        config_file: a YAML file (our layout or verl's SFT layout), or None.
        overrides: dotted ``key=value`` strings (values parsed as YAML), later wins.
        required: keys that must not be null (default ``model.path`` and ``data.train_files``).
        notices: if given, one-line notices (verl keys that change nothing) are appended.
    Returns:
        The resolved, validated ``SFTConfig``.
    Raises:
        ConfigError: every problem found (unknown key with a did-you-mean, wrong type, bad
            range, missing required key), each naming the key.
    """
    return load_config(config_file, overrides, required=required, notices=notices, kind=SFT_CONFIG)


def format_sft_help(width: int = 100) -> str:
    """The text of ``lmrl sft --help``: every section and key, its default and its doc."""
    lines = key_lines(SFTConfig, "lmrl sft", "optim.lr=1e-4", width)
    lines += rename_lines(renames(SFT), "verl SFT keys are accepted and translated:")
    lines += ["  keys of verl's GPU stack (FSDP, Liger, sequence parallel...) get a notice."]
    return "\n".join(lines) + "\n"


__all__ = [
    "REQUIRED_FOR_SFT",
    "SFT_CONFIG",
    "SFTConfig",
    "SFTDataConfig",
    "SFTOptimConfig",
    "SFTRewardConfig",
    "SFTTrainerConfig",
    "format_sft_help",
    "load_sft_config",
    "resolve_sft_config",
    "validate_sft_config",
]
