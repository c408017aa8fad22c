"""The configuration of ``lmrl train-flow``: Flow-GRPO on a flow-matching image model.

``FlowConfig`` has six sections: ``model`` (the image model's directory, LoRA), ``data``
(prompt files, prompts per step), ``sampler`` (images per prompt, steps, the SDE's noise
level and window, guidance), ``actor`` (the update: clip range, advantage clip, KL weight,
batch sizes, the optimizer), ``reward`` (a built-in image reward or a file) and ``trainer``
(length, run directory, checkpoints, validation, logging). It loads with the machinery of
``lmrl train`` (YAML file, dotted ``key=value`` overrides converted to their types, did-you-mean
on unknown keys, one ``ConfigError`` naming every bad key), and Flow-GRPO's own spellings
(``sample.noise_level``, ``train.clip_range``, ``train.beta``, ``train.learning_rate``...)
translate through the ``FLOW`` rules of the one table in ``lmrl.config.verl``.
"""

# ruff: noqa: RUF009  (``opt`` returns a ``dataclasses.field``; ruff cannot see that)

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

from lmrl.config.checks import did_you_mean
from lmrl.config.errors import ConfigError
from lmrl.config.help import key_lines, rename_lines
from lmrl.config.loader import ConfigKind, load_config
from lmrl.config.names import IMAGE_REWARDS
from lmrl.config.run import RUN_CHECKS, RunSettings, default_of, opt
from lmrl.config.schema import MixedPrecisionConfig
from lmrl.config.validate import range_errors, resolve_run_paths
from lmrl.config.verl import FLOW, renames, translate, verl_spellings

__all__ = ["FLOW_CONFIG", "FlowConfig", "format_flow_help", "load_flow_config"]


@dataclass
class FlowModelConfig:
    """The image model trained, and LoRA."""

    path: str | None = opt(
        None,
        "Directory of an image model: a diffusers StableDiffusion3Pipeline (SD3, SD3.5: "
        "model_index.json), or an lmrl ImageFlow (written by `lmrl demo --task flow`).",
    )
    lora_rank: int = opt(
        0,
        "LoRA rank; 0 = train every weight (Flow-GRPO's SD3: 32). The reference is the "
        "adapter-off model.",
    )
    lora_alpha: int | None = opt(
        None, "LoRA alpha (scale alpha / rank); null = 2 x lora_rank (Flow-GRPO's SD3: 32, 64)."
    )
    target_modules: list[str] | None = opt(
        None,
        "Module names LoRA adapts (a name or a dotted suffix of one); each must match a module. "
        "null = the model's: SD3's joint attention projections as Flow-GRPO (attn.to_q/k/v, "
        "attn.to_out.0, attn.add_q/k/v_proj, attn.to_add_out); ImageFlow's attention "
        "projections and convolutions (to_q, to_k, to_v, to_out.0, conv1, conv2).",
    )
    lora_path: str | None = opt(
        None,
        "A PEFT adapter directory the LoRA starts from (an SD3 run's final/; Flow-GRPO's "
        "train.lora_path); its rank and target modules must be model.lora_rank's and "
        "model.target_modules'.",
    )
    resolution: int | None = opt(
        None,
        "Image side in pixels (SD3: sampled as latents of side resolution/8; Flow-GRPO: 512); "
        "null = the model's default.",
    )
    negative_prompt: str = opt(
        "", "Text of classifier-free guidance's unconditional input (text pipelines)."
    )
    max_sequence_length: int = opt(128, "T5 tokens of a prompt (SD3; Flow-GRPO: 128).")
    mixed_precision: MixedPrecisionConfig = opt(
        MixedPrecisionConfig(),
        "Compute dtype over the model's float32 weights (the velocity and the Gaussian "
        "log-probs stay float32); as lmrl train's model.mixed_precision.",
    )


@dataclass
class FlowDataConfig:
    """Prompts: verl-style parquet rows whose ``reward_model.ground_truth`` holds the
    attributes (the ``shapes`` task's files, for an ImageFlow), or Flow-GRPO's prompt files
    as they ship: ``train.txt`` (one prompt a line: PickScore, OCR) and
    ``train_metadata.jsonl`` (GenEval: rows with ``prompt``, ``tag``, ``include``...; the row
    is the reward's metadata)."""

    train_files: str | list[str] | None = opt(
        None,
        "Prompt files for training, or a Flow-GRPO dataset directory (its train.txt or "
        "train_metadata.jsonl).",
    )
    val_files: str | list[str] | None = opt(
        None,
        "Prompt files for validation, or a Flow-GRPO dataset directory (its test.txt or "
        "test_metadata.jsonl); null = none.",
    )
    train_batch_size: int = opt(16, "Prompts per step (each sampled sampler.n times).")
    seed: int | None = opt(None, "Prompt order; null = trainer.seed.")


@dataclass
class FlowSamplerConfig:
    """The rollout: images per prompt, the SDE, guidance."""

    n: int = opt(8, "Images per prompt (the group of GRPO's advantage), >= 2.")
    num_steps: int = opt(10, "Denoising steps of a rollout.")
    noise_level: float = opt(0.7, "The SDE's a in sigma_t = a sqrt(t / (1 - t)) (Flow-GRPO: 0.7).")
    shift: float | None = opt(
        None,
        "SD3's schedule shift (1 = uniform in t); null = the model's (its scheduler's shift: "
        "SD3 3.0; ImageFlow 1).",
    )
    sde_start: int = opt(0, "First stochastic step (the others before it are ODE steps).")
    sde_steps: int | None = opt(
        None, "Stochastic steps from sde_start, ODE after (Flow-GRPO-Fast: 1-2); null = all."
    )
    sde_window_range: list[int] | None = opt(
        None,
        "[lo, hi]: each step places its window of sampler.sde_steps anew, starting at random in "
        "lo..hi - sde_steps (Flow-GRPO-Fast's sde_window_range); null = at sampler.sde_start.",
    )
    timestep_fraction: float = opt(1.0, "Fraction of the stochastic steps that train.")
    guidance_scale: float = opt(1.0, "Classifier-free guidance weight (1 = none).")
    logprob_reduce: Literal["mean", "sum"] = opt(
        "mean", "A step's log-prob: mean over the image's dimensions (Flow-GRPO) or the sum."
    )
    val_num_steps: int = opt(10, "Denoising steps of validation samples (the ODE, no noise).")


@dataclass
class FlowOptimConfig:
    """AdamW at a constant learning rate."""

    lr: float = opt(1e-4, "Learning rate.")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    betas: list[float] = opt([0.9, 0.999], "AdamW betas.")


@dataclass
class FlowActorConfig:
    """The Flow-GRPO update."""

    clip_range: float = opt(1e-4, "PPO's epsilon on each step's ratio (tiny: log-probs are means).")
    clip_range_low: float | None = opt(
        None, "The ratio's lower clip is 1 - this (Flow-GRPO: clip_range_lt); null = clip_range."
    )
    clip_range_high: float | None = opt(
        None, "The ratio's upper clip is 1 + this (Flow-GRPO: clip_range_gt); null = clip_range."
    )
    adv_clip_max: float = opt(5.0, "Advantages are clipped to [-adv_clip_max, adv_clip_max].")
    norm_adv_by_std: bool = opt(True, "GRPO (true) or Dr.GRPO (false: no division by the std).")
    global_std: bool = opt(
        False,
        "Divide by the std of the whole step's rewards instead of each prompt's (the mean stays "
        "each prompt's; Flow-GRPO's sample.global_std).",
    )
    beta: float = opt(0.0, "Weight of the KL to the reference (the model as it started).")
    std_scale: bool = opt(False, "Scale each step's loss by 2.25 sigma_t (the seed's code).")
    ppo_mini_batch_size: int | None = opt(
        None, "Images per optimizer step; null = all the step's images (one update)."
    )
    micro_batch_size: int = opt(32, "Images per forward pass (gradient accumulation).")
    ppo_epochs: int = opt(1, "Passes over a step's images.")
    recompute_old_log_probs: bool = opt(
        False,
        "Recompute the ratio's anchor with a forward per trained step; false = the rollout's "
        "log-probs (bypass: on-policy they agree within 1e-5).",
    )
    max_grad_norm: float = opt(1.0, "Clip the gradient norm to this (> 0).")
    ema: bool = opt(
        False, "Keep an EMA of the trained weights; validation samples with it (Flow-GRPO)."
    )
    ema_decay: float = opt(0.9, "The EMA's decay once warmed up, in [0, 1) (Flow-GRPO: 0.9).")
    ema_every: int = opt(8, "Optimizer steps between updates of the EMA (Flow-GRPO: 8).")
    optim: FlowOptimConfig = opt(FlowOptimConfig(), "Optimizer.")


@dataclass
class FlowRewardConfig:
    """The reward of an image: a built-in one, or a function of a file."""

    name: str = opt(
        "geneval",
        "Built in: geneval (mean of colour/count/shape/position checks), geneval_strict, "
        "brightness, colourfulness, compressibility; or the function's name in path.",
    )
    path: str | None = opt(
        None, "A Python file whose function `name` (images, prompts, metadata) -> scores."
    )
    max_error_fraction: float = opt(
        0.9,
        "Stop the run when the first batch's scoring fails (raises, returns no numbers, NaN) "
        "on at least this fraction of images, quoting the first error; later batches score "
        "a failed image 0 and count it in reward/errors. > 1 = never stop.",
    )


@dataclass
class FlowTrainerConfig(RunSettings):
    """The run: its length, directory, checkpoints, validation, logging, device."""

    experiment_name: str = default_of(RunSettings, "experiment_name", "flow_grpo")
    total_training_steps: int = default_of(
        RunSettings, "total_training_steps", 20, "Flow-GRPO steps."
    )
    save_freq: int = default_of(RunSettings, "save_freq", 10)
    seed: int = default_of(
        RunSettings, "seed", 0, "Global seed (noise, prompt order, LoRA initialization)."
    )
    val_images_per_prompt: int = opt(
        4, "Validation images per prompt (ODE samples from fixed noise), >= 1."
    )
    max_rollbacks: int = opt(
        0,
        "Run doctor: when the reward is hacked (it climbs while the prompt fidelity of the "
        "same images falls), go back to the validated checkpoint of the best prompt fidelity "
        "(of the best reward where no fidelity is logged; each new best is saved) and on at "
        "actor.optim.lr x rollback_lr_factor, at most this many times over the run; the "
        "abandoned checkpoints move to RUN_DIR/rolled_back/. 0 = off; > 0 needs "
        "data.val_files and trainer.test_freq > 0.",
    )
    rollback_lr_factor: float = opt(
        0.1, "What each rollback multiplies the learning rate by, in (0, 1)."
    )

    def rollbacks(self) -> tuple[int, float]:
        """``trainer.max_rollbacks`` and ``rollback_lr_factor``: the run doctor's budget."""
        return self.max_rollbacks, self.rollback_lr_factor


@dataclass
class FlowConfig:
    """A Flow-GRPO run (``lmrl train-flow``)."""

    model: FlowModelConfig = opt(FlowModelConfig(), "The image model.")
    data: FlowDataConfig = opt(FlowDataConfig(), "Prompts.")
    sampler: FlowSamplerConfig = opt(FlowSamplerConfig(), "Rollouts.")
    actor: FlowActorConfig = opt(FlowActorConfig(), "The update.")
    reward: FlowRewardConfig = opt(FlowRewardConfig(), "The reward.")
    trainer: FlowTrainerConfig = opt(FlowTrainerConfig(), "The run.")


def resolve_flow_config(cfg: FlowConfig) -> FlowConfig:
    """A copy with ``data.seed`` and the run directory filled and ``~`` expanded."""
    cfg = copy.deepcopy(cfg)
    resolve_run_paths(cfg)
    return cfg


def _window_errors(s: FlowSamplerConfig) -> list[str]:
    """What is wrong with ``sampler.sde_window_range`` (none when it is null)."""
    window = s.sde_window_range
    if window is None:
        return []
    if len(window) != 2:
        return [f"sampler.sde_window_range={window} must be two steps [lo, hi]"]
    if s.sde_steps is None:
        return [
            "sampler.sde_window_range needs sampler.sde_steps, the size of the window it places "
            "(Flow-GRPO: sample.sde_window_size)"
        ]
    if s.sde_start != 0:
        return [
            f"sampler.sde_start={s.sde_start} and sampler.sde_window_range both place the SDE "
            "window: give one of them"
        ]
    lo, hi = window
    if not 0 <= lo <= hi - s.sde_steps or hi > s.num_steps:
        return [
            f"sampler.sde_window_range={window} must hold a window of sampler.sde_steps="
            f"{s.sde_steps} inside the sampler.num_steps={s.num_steps} steps (0 <= lo <= "
            "hi - sde_steps, hi <= num_steps)"
        ]
    return []


def _rollback_errors(t: FlowTrainerConfig, data: FlowDataConfig) -> list[str]:
    """The rollback's needs, as ``lmrl train``'s: validation to rank the checkpoints by, and
    its lr factor only with a rollback to apply it."""
    if t.max_rollbacks > 0 and (not data.val_files or t.test_freq <= 0):
        return [
            f"trainer.max_rollbacks={t.max_rollbacks} (the rollback) needs validation to find "
            "the best checkpoint: set data.val_files and trainer.test_freq > 0"
        ]
    default = FlowTrainerConfig.rollback_lr_factor
    if t.max_rollbacks == 0 and t.rollback_lr_factor != default and 0 < t.rollback_lr_factor < 1:
        return [
            f"trainer.rollback_lr_factor={t.rollback_lr_factor!r} changes nothing: "
            "trainer.max_rollbacks=0 turns the rollback off; set trainer.max_rollbacks > 0 "
            "(e.g. 2) or leave trainer.rollback_lr_factor out"
        ]
    return []


def validate_flow_config(cfg: FlowConfig, *, notices: list[str] | None = None) -> None:
    """Check the ranges a key's type cannot catch.

    Raises:
        ConfigError: every problem found, each naming the key.
    """
    s = cfg.sampler
    checks = (
        ("model.lora_rank", lambda x: x >= 0, "must be >= 0 (0 = full fine-tuning)"),
        ("model.lora_alpha", lambda x: x is None or x > 0, "must be > 0 (or null)"),
        ("model.resolution", lambda x: x is None or x >= 1, "must be >= 1 (or null)"),
        ("model.max_sequence_length", lambda x: x >= 1, "must be >= 1"),
        ("data.train_batch_size", lambda x: x >= 1, "must be >= 1"),
        ("sampler.n", lambda x: x >= 2, "must be >= 2 (GRPO compares the images of a prompt)"),
        ("sampler.num_steps", lambda x: x >= 1, "must be >= 1"),
        ("sampler.val_num_steps", lambda x: x >= 1, "must be >= 1"),
        ("sampler.noise_level", lambda x: x > 0, "must be > 0 (0 leaves no log-prob to train)"),
        ("sampler.shift", lambda x: x is None or x > 0, "must be > 0 (or null)"),
        ("sampler.sde_start", lambda x: 0 <= x < s.num_steps, "must be in [0, sampler.num_steps)"),
        ("sampler.sde_steps", lambda x: x is None or x >= 1, "must be >= 1 (or null)"),
        ("sampler.timestep_fraction", lambda x: 0 < x <= 1, "must be in (0, 1]"),
        ("actor.clip_range", lambda x: x > 0, "must be > 0"),
        ("actor.clip_range_low", lambda x: x is None or x > 0, "must be > 0 (or null)"),
        ("actor.clip_range_high", lambda x: x is None or x > 0, "must be > 0 (or null)"),
        ("actor.adv_clip_max", lambda x: x > 0, "must be > 0"),
        ("actor.beta", lambda x: x >= 0, "must be >= 0"),
        ("actor.micro_batch_size", lambda x: x >= 1, "must be >= 1"),
        ("actor.ppo_mini_batch_size", lambda x: x is None or x >= 1, "must be >= 1 (or null)"),
        ("actor.ppo_epochs", lambda x: x >= 1, "must be >= 1"),
        ("actor.max_grad_norm", lambda x: x > 0, "must be > 0"),
        ("actor.optim.lr", lambda x: x >= 0, "must be >= 0"),
        ("actor.optim.weight_decay", lambda x: x >= 0, "must be >= 0"),
        (
            "actor.optim.betas",
            lambda x: len(x) == 2 and all(0 <= b < 1 for b in x),
            "must be two numbers in [0, 1), e.g. [0.9, 0.999]",
        ),
        ("reward.max_error_fraction", lambda x: x >= 0, "must be >= 0 (> 1 = never stop)"),
        *RUN_CHECKS,
        ("trainer.val_images_per_prompt", lambda x: x >= 1, "must be >= 1"),
        ("actor.ema_decay", lambda x: 0 <= x < 1, "must be in [0, 1)"),
        ("actor.ema_every", lambda x: x >= 1, "must be >= 1"),
        ("trainer.max_rollbacks", lambda x: x >= 0, "must be >= 0 (0 = no rollback)"),
        ("trainer.rollback_lr_factor", lambda x: 0 < x < 1, "must be in (0, 1), e.g. 0.1"),
    )
    errors = range_errors(cfg, checks) + _window_errors(s) + _rollback_errors(cfg.trainer, cfg.data)
    if cfg.model.lora_path is not None and cfg.model.lora_rank == 0:
        errors.append(
            "model.lora_path needs a LoRA: set model.lora_rank to the adapter's rank (Flow-GRPO: "
            "use_lora=true)"
        )
    if cfg.reward.path is None and cfg.reward.name not in IMAGE_REWARDS:
        errors.append(
            f"reward.name={cfg.reward.name!r} is not a built-in image reward"
            f"{did_you_mean(cfg.reward.name, IMAGE_REWARDS)}; valid names: "
            f"{', '.join(IMAGE_REWARDS)}; or name a function of a file given as reward.path"
        )
    images = cfg.data.train_batch_size * s.n
    mini, micro = cfg.actor.ppo_mini_batch_size or images, cfg.actor.micro_batch_size
    if mini >= 1 and images % mini:
        errors.append(
            f"actor.ppo_mini_batch_size={mini} must divide the images of a step "
            f"(data.train_batch_size * sampler.n = {images})"
        )
    elif mini >= 1 and micro >= 1 and mini % min(micro, mini):  # sampler.n=0: 0 images
        errors.append(
            f"actor.micro_batch_size={cfg.actor.micro_batch_size} must divide the mini-batch "
            f"({mini} images)"
        )
    if errors:
        raise ConfigError(errors)


FLOW_CONFIG = ConfigKind(
    FlowConfig,
    partial(translate, target=FLOW),
    partial(verl_spellings, target=FLOW),
    resolve_flow_config,
    validate_flow_config,
    "lmrl train-flow",
)

REQUIRED_FOR_FLOW = ("model.path", "data.train_files")


def load_flow_config(
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    required: Sequence[str] = REQUIRED_FOR_FLOW,
    notices: list[str] | None = None,
) -> FlowConfig:
    """Build a Flow-GRPO run's config from the defaults, a YAML file and overrides.

    Raises:
        ConfigError: every problem found, each naming the key and the fix.
    """
    return load_config(config_file, overrides, required=required, notices=notices, kind=FLOW_CONFIG)


def format_flow_help(width: int = 100) -> str:
    """The text of ``lmrl train-flow --help``: every key, its default and its doc."""
    lines = key_lines(FlowConfig, "lmrl train-flow", "sampler.noise_level=0.7", width)
    lines += rename_lines(renames(FLOW), "Flow-GRPO's config keys are accepted and translated:")
    return "\n".join(lines)
