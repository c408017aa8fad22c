"""``build_run(cfg)``: a run's parts, assembled once, in the order that fails cheapest first.

The trainer runs the step over these parts and never builds anything itself, so the step can
be tested with fake parts and a distributed backend can hand in worker groups instead of
in-process workers. Order: the run directory and the resume decision (no model loaded yet),
the tokenizer and data (checked against a warm start's prompt layout), the models and
workers, the rollout engine, the reward manager (which checks every data source and ground
truth against its scorers), the trackers last.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from lmrl.algos import make_kl_controller
from lmrl.config import Config, ConfigError, config_to_dict
from lmrl.config.mixture import step_counts
from lmrl.data import PromptSampler, RLDataset
from lmrl.data.curriculum import CurriculumSampler
from lmrl.data.layout import check_warm_start
from lmrl.data.mixture import MixtureSampler, source_rows
from lmrl.logging import make_trackers
from lmrl.models import (
    load_tokenizer,
    resolve_device,
)
from lmrl.run.checkpoint import load_model_state
from lmrl.run.resume import RunStart, open_run
from lmrl.trainer.plan import RunPlan
from lmrl.trainer.stages import validate
from lmrl.workers.build import build_workers, seed_everything
from lmrl.workers.reward import build_reward
from lmrl.workers.roles import ActorRole, CriticRole, EngineRole, ReferenceRole, RewardRole

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lmrl.algos.kl import KLController
    from lmrl.logging.trackers import Tracker
    from lmrl.workers.backend import RayBackend

log = logging.getLogger("lmrl.trainer")


@dataclass(frozen=True)
class RunParts:
    """Everything a run is made of. ``None`` marks a part the run does not use.

    Attributes:
        config: the resolved config the parts were built from (written as ``config.yaml``
            once the run starts).
        plan: the run's shape (`lmrl.trainer.plan.RunPlan`), decided once from ``config``.
        run_dir: the run directory.
        resume_from: the checkpoint to resume from, or None for a fresh start.
        config_changes: ``(key, old, new)`` accepted with ``trainer.allow_config_change``.
        tokenizer: the policy's tokenizer.
        train_data, sampler: training prompts and their resumable order (None for eval).
        val_data: validation prompts, or None.
        policy: the actor's model (the ``hf`` engine generates with this very module).
        actor, critic, reference: the workers (critic and reference when used), each of its
            role's ``Protocol`` (``lmrl.workers.roles``): in-process workers, or a Ray group's
            stand-ins with the same methods.
        engine: the rollout engine (``EngineRole``).
        reward: the reward scoring (``RewardRole``).
        kl_ctrl: the KL-in-reward controller, when ``algorithm.use_kl_in_reward``.
        trackers: the loggers (None for eval).
        total_steps: training steps of the whole run.
        backend: the Ray backend (``lmrl.workers.backend.RayBackend``) whose groups hold the
            workers under ``trainer.backend=ray`` (then ``actor``, ``critic``, ``reference``,
            ``engine`` and ``reward`` are its stand-ins and ``policy`` is None); None locally.
    """

    config: Config
    plan: RunPlan
    run_dir: Path
    resume_from: Path | None
    config_changes: list[tuple[str, Any, Any]]
    tokenizer: PreTrainedTokenizerBase | None
    train_data: RLDataset | None
    sampler: PromptSampler | None
    val_data: RLDataset | None
    policy: torch.nn.Module | None
    actor: ActorRole | None
    critic: CriticRole | None
    reference: ReferenceRole | None
    engine: EngineRole
    reward: RewardRole
    kl_ctrl: KLController | None
    trackers: Tracker | None
    total_steps: int
    backend: RayBackend | None = None

    @property
    def start(self) -> RunStart:
        """The run directory, config and resume point, as the run loop takes them."""
        return RunStart(
            self.run_dir, "lmrl train", self.config, self.resume_from, self.config_changes
        )

    def close(self) -> None:
        """Stop the reward workers, close the trackers, free a rollout engine with state of
        its own (vLLM), stop the Ray workers and the Ray instance the run started (safe to
        call twice)."""
        try:
            self.reward.close()
            if self.trackers is not None:
                self.trackers.close()
            self.engine.close()
        finally:
            if self.backend is not None:
                self.backend.close()


def build_run(cfg: Config, purpose: Literal["train", "eval"] = "train") -> RunParts:
    """Assemble a run from a resolved config.

    Args:
        cfg: from ``lmrl.config.load_config`` (validated).
        purpose: ``train`` builds everything; ``eval`` builds only what validation needs
            (policy, engine, reward, validation data) and writes nothing.
    Raises:
        lmrl.errors.LmrlError: the run directory, the checkpoint, a changed config, the data,
            the model or the reward function, each naming what to fix.
    """
    train = purpose == "train"
    # load_config fills the run directory and requires the model
    assert cfg.trainer.default_local_dir is not None and cfg.model.path is not None
    run_dir = Path(cfg.trainer.default_local_dir)
    resume_from, changes, start_step = None, [], 0
    if train:
        start = open_run(cfg, "lmrl train")
        resume_from, changes = start.resume_from, start.config_changes
        start_step = start.start_step
    seed_everything(cfg.trainer.seed)
    device = resolve_device(cfg.trainer.device)
    plan = RunPlan.from_config(cfg, device.type)
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
    train_data = _dataset(cfg, cfg.data.train_files, tokenizer) if train else None
    val_data = _dataset(cfg, cfg.data.val_files, tokenizer) if cfg.data.val_files else None
    if train_data is not None:  # a warm start from lmrl sft saw its prompts laid out as these
        layout = train_data.layout.merged(val_data.layout if val_data is not None else None)
        check_warm_start(cfg.model.path, layout)
    sampler, total_steps = None, 0
    if train_data is not None:
        sampler = _sampler(cfg, train_data, plan)
        per_epoch = len(train_data) // plan.train_batch_size
        total_steps = plan.total_training_steps or per_epoch * plan.total_epochs

    backend = None
    actor: ActorRole | None
    critic: CriticRole | None
    reference: ReferenceRole | None
    engine: EngineRole
    if train and plan.models.backend == "ray":  # the workers live in Ray processes
        from lmrl.workers.backend import RayBackend

        backend = RayBackend(cfg, plan.workers, total_steps)
        policy = None
        actor, critic, reference = backend.actor, backend.critic, backend.reference
        engine = backend.engine
    else:
        w = build_workers(cfg, plan.workers, tokenizer, device, total_steps=total_steps,
                          train=train)  # fmt: skip
        policy, actor, critic, reference, engine = (
            w.policy, w.actor, w.critic, w.reference, w.engine
        )  # fmt: skip
    reward = backend.reward if backend is not None else build_reward(cfg, tokenizer, device)
    try:
        for data in (train_data, val_data):
            if data is not None:
                reward.check_dataset(data)
        kl = cfg.algorithm.kl_ctrl
        kl_ctrl = (
            make_kl_controller(kl["type"], kl["kl_coef"], kl["target_kl"], kl["horizon"])
            if train and plan.kl_in_reward
            else None
        )
        trackers = None
        if train:
            trackers = make_trackers(
                cfg.trainer.logger, run_dir, cfg.trainer.project_name,
                cfg.trainer.experiment_name, config_dict=config_to_dict(cfg),
                total_steps=total_steps, start_step=start_step,
            )  # fmt: skip
    except BaseException:
        reward.close()
        if backend is not None:
            backend.close()
        raise
    return RunParts(
        config=cfg, plan=plan, run_dir=run_dir, resume_from=resume_from,
        config_changes=changes, tokenizer=tokenizer, train_data=train_data, sampler=sampler,
        val_data=val_data, policy=policy, actor=actor, critic=critic, reference=reference,
        engine=engine, reward=reward, kl_ctrl=kl_ctrl, trackers=trackers,
        total_steps=total_steps, backend=backend,
    )  # fmt: skip


def _sampler(cfg: Config, data: RLDataset, plan: RunPlan) -> PromptSampler:
    """The prompt order: one shuffled pool, or the sources of the plan's mixture per step;
    with the plan's curriculum, prompts chosen by their pass rates within each source."""
    d, rules, batch_size = cfg.data, plan.mixture, plan.gen_batch_size
    seed = cfg.trainer.seed if d.seed is None else d.seed  # resolving fills it
    curriculum = plan.curriculum
    if curriculum is not None and not rules:  # one source: every training prompt
        return CurriculumSampler(curriculum, ["all"], [np.arange(len(data))],
                                 lambda step: [batch_size], batch_size, seed=seed,
                                 shuffle=d.shuffle)  # fmt: skip
    if not rules:
        return PromptSampler(len(data), batch_size, seed=seed, shuffle=d.shuffle)
    files = [d.train_files] if isinstance(d.train_files, str) else list(d.train_files or [])
    names = [r.source for r in rules]
    args = (names, source_rows(data.rows, files, names),
            functools.partial(step_counts, rules, batch_size=batch_size), batch_size)  # fmt: skip
    if curriculum is not None:  # the mixture picks the sources, the curriculum their prompts
        return CurriculumSampler(curriculum, *args, seed=seed, shuffle=d.shuffle)
    return MixtureSampler(*args, seed=seed, shuffle=d.shuffle)


def evaluate(cfg: Config, checkpoint: Path) -> dict[str, float]:
    """``lmrl eval``: validation of ``checkpoint``'s policy, on the parts alone.

    Builds what validation needs (nothing is written), loads the checkpoint's actor weights
    and validates; the reward workers are stopped whatever happens.

    Raises:
        lmrl.errors.ConfigError: the config has no ``data.val_files``.
    """
    if not cfg.data.val_files:
        raise ConfigError("no validation data: set data.val_files=...")
    parts = build_run(cfg, purpose="eval")
    try:
        assert parts.policy is not None, "an eval build holds the policy in this process"
        load_model_state(parts.policy, Path(checkpoint) / "actor.safetensors")
        return validate(parts)
    finally:
        parts.close()


def _dataset(cfg: Config, files, tokenizer) -> RLDataset:
    d, mt = cfg.data, cfg.rollout.multi_turn
    template_kwargs = {}
    if mt.enable and mt.format == "chat" and mt.tools:  # the template renders the tools
        from lmrl.tools.loading import tool_schemas

        template_kwargs["tools"] = tool_schemas(mt.tools, mt.tool_path)
    return RLDataset(
        files, tokenizer, prompt_key=d.prompt_key, reward_fn_key=d.reward_fn_key,
        max_prompt_length=d.max_prompt_length, filter_overlong_prompts=d.filter_overlong_prompts,
        truncation=d.truncation, chat_template_kwargs=template_kwargs,
        prompt_template=d.prompt_template,
    )  # fmt: skip


__all__ = ["RunParts", "build_run", "evaluate", "seed_everything"]
