"""The run-level keys every command's ``trainer`` section shares, declared once.

``RunSettings`` holds what the one run loop reads whatever the program (RL, SFT, Flow-GRPO):
names and directory, length, checkpoint and validation cadence, resume, logging, seed and
device. ``TrainerConfig`` (``lmrl train``), ``SFTTrainerConfig`` (``lmrl sft``) and
``FlowTrainerConfig`` (``lmrl train-flow``) inherit it and add their own keys.

The choice this module makes: a command that needs another default redeclares the field with
``default_of(RunSettings, name, value)``, which keeps the key's help text, so a key is
documented in one place and only its default differs (``experiment_name`` ``sft``, the flow
``seed`` 0).
"""

# ruff: noqa: RUF009  (``opt`` returns a ``dataclasses.field``; ruff cannot see that)

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal


def opt(default: Any, help: str) -> Any:
    """A dataclass field with its default and its help text (shown by ``format_help``).

    Args:
        default: the default value; lists, dicts and section instances are deep-copied per
            instance.
        help: one or two sentences: what the key does, its unit, special values.
    Returns:
        A ``dataclasses.field``.
    """
    if isinstance(default, list | dict) or is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def options(items: type, help: str) -> Any:
    """A key holding a mapping of named options (``rollout.vllm``), declared by a dataclass.

    One key for settings that only matter together (one engine's or one tool's): its value is
    a ``dict`` whose names, types, defaults and help are ``items``' fields (declared with
    ``opt``). The loader sets one option at a time (``rollout.vllm.enforce_eager=false``, or a
    mapping in YAML, merged into the defaults), converts it to its type, and refuses a name
    ``items`` does not declare; ``lmrl train --help`` lists the options under the key.

    Args:
        items: the dataclass declaring the options.
        help: what the group is for.
    Returns:
        A ``dataclasses.field`` whose default is ``items()`` as a dict.
    """
    defaults = {f.name: getattr(items(), f.name) for f in fields(items)}
    return field(
        default_factory=lambda: copy.deepcopy(defaults), metadata={"help": help, "items": items}
    )


def default_of(cls: type, name: str, default: Any, help: str | None = None) -> Any:
    """The field ``name`` of the dataclass ``cls`` with another default (and the same help,
    unless ``help`` is given): how a subclass changes a default it inherits."""
    (base,) = (f for f in fields(cls) if f.name == name)
    return opt(default, help if help is not None else base.metadata["help"])


LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]


@dataclass
class RunSettings:
    """The run: its names and directory, length, checkpoints, validation, logging, device."""

    project_name: str = opt("lmrl", "Project name (loggers, default run directory).")
    experiment_name: str = opt("default", "Experiment name (loggers, default run directory).")
    default_local_dir: str | None = opt(
        None,
        "Run directory: resolved config, metrics.jsonl, generations and checkpoints "
        "(global_step_N); null = checkpoints/<project_name>/<experiment_name>.",
    )
    total_training_steps: int | None = opt(
        None, "Stop after this many steps; null = total_epochs worth of steps."
    )
    save_freq: int = opt(
        -1,
        "Write a resumable checkpoint global_step_N every this many steps (and at the end); "
        "<= 0 = end only.",
    )
    test_freq: int = opt(-1, "Validate every this many steps (and at the end); <= 0 = end only.")
    val_before_train: bool = opt(True, "Validate once before the first step.")
    resume_mode: str = opt(
        "auto",
        "auto = resume from the latest checkpoint in the run directory if any; disable = start "
        "fresh; or a checkpoint path.",
    )
    max_ckpt_to_keep: int | None = opt(None, "Keep the newest this many checkpoints; null = all.")
    allow_config_change: bool = opt(
        False,
        "Resuming with settings that differ from the run's config.yaml: false = refuse, naming "
        "each changed key; true = apply them in full (the old file is kept as "
        "config.step<N>.yaml).",
    )
    logger: list[LoggerName] = opt(
        ["console"],
        "Any of console, jsonl, tensorboard, wandb, mlflow (metrics.jsonl is always written).",
    )
    log_generations_freq: int = opt(
        0, "Dump sample generations (prompt, response, score) every this many steps; 0 = never."
    )
    seed: int = opt(42, "Global seed (model init heads, sampling, data order).")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto = cuda when available, else cpu.")

    def rollbacks(self) -> tuple[int, float]:
        """``(rollbacks at most, lr factor of each)`` of the run doctor; a command without
        one (SFT) has none. The RL and Flow-GRPO ``trainer`` sections' keys override it."""
        return 0, 1.0


#: the ``trainer`` keys of ``RunSettings``, in declaration order
RUN_KEYS = tuple(f.name for f in fields(RunSettings))

#: the range checks of the run keys every command shares: ``(key, ok, message)``
RUN_CHECKS = (
    ("trainer.save_freq", lambda x: x >= -1, "must be >= 1, or -1/0 = end only"),
    ("trainer.test_freq", lambda x: x >= -1, "must be >= 1, or -1/0 = end only"),
    ("trainer.total_training_steps", lambda x: x is None or x >= 1, "must be >= 1 (or null)"),
    ("trainer.max_ckpt_to_keep", lambda x: x is None or x >= 1, "must be >= 1 (or null)"),
    ("trainer.log_generations_freq", lambda x: x >= 0, "must be >= 0"),
    ("trainer.resume_mode", lambda x: x != "", "must be auto, disable or a checkpoint path"),
)

__all__ = [
    "RUN_CHECKS",
    "RUN_KEYS",
    "LoggerName",
    "RunSettings",
    "default_of",
    "opt",
    "options",
]
