"""The workers of a run, built from its config: the same code for one process and for a rank.

``build_workers`` loads the policy (with LoRA), the reference, the actor, the critic and the
rollout engine that the run's `WorkerPlan` names, in the order ``build_run`` always used, so a rank of a Ray group, seeded the
same way, starts from exactly the weights of the local run (a critic's value head is drawn
from the global RNG right after the policy is loaded). The local backend calls it once in the
driver; the Ray backend calls it in every rank with that rank's data parallelism.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmrl.config import Config
from lmrl.models import apply_lora, build_reference, load_causal_lm
from lmrl.models.critic import load_critic
from lmrl.rollout import build_engine
from lmrl.rollout.engines import engine_options, with_tools
from lmrl.workers.actor import ActorWorker
from lmrl.workers.critic import CriticWorker
from lmrl.workers.plan import WorkerPlan
from lmrl.workers.precision import Precision, PrecisionEngine
from lmrl.workers.reference import ReferenceWorker

__all__ = ["Workers", "build_workers", "seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Workers:
    """What ``build_workers`` made; ``None`` marks a part the run (or this rank) does not use.

    Attributes:
        policy: the actor's model (the ``hf`` engine generates with this very module).
        actor, critic, reference: the workers. ``reference`` is None when no stage needs
            ``ref_log_probs`` (the full KL runs the reference inside the actor's update).
        engine: the rollout engine over ``policy``.
    """

    policy: torch.nn.Module | None
    actor: ActorWorker | None
    critic: CriticWorker | None
    reference: ReferenceWorker | None
    engine: Any


def build_workers(
    cfg: Config,
    plan: WorkerPlan,
    tokenizer,
    device: torch.device,
    *,
    total_steps: int,
    train: bool = True,
    roles: frozenset[str] = frozenset({"actor", "critic"}),
    dp=None,
) -> Workers:
    """Load the models and wrap them in workers.

    Args:
        cfg: the resolved config (the models' paths and settings).
        plan: which workers exist and their updates' shapes (`RunPlan.workers`).
        tokenizer: the policy's tokenizer (the engine decodes stop strings with it).
        device: where the models live.
        total_steps: training steps, for the learning-rate schedules.
        train: False builds only the policy and the engine (``lmrl eval``).
        roles: ``actor`` (policy, reference, actor, engine) and/or ``critic``; a separate
            critic pool builds ``{"critic"}`` only, an async run's rollout group
            ``{"rollout"}`` (a frozen policy and its engine, whose weights come from the
            actor's ranks).
        dp: the data parallelism of this rank (``lmrl.workers.dist``); None = one process.
    """
    policy = actor = critic = reference = engine = None
    # fp32 masters, compute in model.mixed_precision.param_dtype (one error line if the
    # device cannot); every trained model, the reference and hf generation share it
    precision = Precision.from_config(cfg.model, device)
    if "actor" in roles or "rollout" in roles:
        assert cfg.model.path is not None  # load_config requires it
        policy = load_causal_lm(
            cfg.model.path, dtype=precision.master, device=device,
            trust_remote_code=cfg.model.trust_remote_code,
            gradient_checkpointing=plan.gradient_checkpointing and train and "actor" in roles,
        )  # fmt: skip
        policy = precision.prepare(policy)
        if cfg.model.lora_rank > 0:
            policy = apply_lora(policy, cfg.model.lora_rank, cfg.model.lora_alpha,
                                cfg.model.target_modules)  # fmt: skip
        if "actor" not in roles:  # a rollout rank: generates only, weights handed over
            policy.requires_grad_(False).eval()
    if train and "actor" in roles:
        assert policy is not None  # loaded above for the actor's role
        # built before any update: a frozen copy of the initial policy, or LoRA disabled
        if plan.reference != "none":
            frozen = build_reference(policy)  # LoRA: the adapter off, else a frozen copy
            if not frozen.disable_adapter and dp is not None:  # LoRA: the actor's own base
                # fsdp2 shards the copy too
                frozen.model = dp.prepare_frozen(frozen.model, precision)
            reference = ReferenceWorker(
                frozen, plan.ref_micro_batch_size, cfg.rollout.temperature, dp=dp,
                precision=precision,
            )  # fmt: skip
        actor = ActorWorker(
            policy, cfg.actor, rollout_n=cfg.rollout.n,
            max_response_length=cfg.data.max_response_length,
            temperature=cfg.rollout.temperature,
            log_prob_micro_batch_size=plan.log_prob_micro_batch_size,
            total_steps=total_steps, seed=cfg.trainer.seed,
            reference=reference.reference if reference is not None else None, dp=dp,
            precision=precision, update=plan.actor, full_kl=plan.ref_in_update,
        )  # fmt: skip
        policy = actor.model  # as the data parallelism prepared it
        if not plan.ref_stage:
            reference = None  # the full KL runs the reference inside the update: no ref stage
    if train and "critic" in roles and plan.critic:
        assert cfg.critic.model.path is not None  # load_config defaults it to model.path
        critic_model = load_critic(
            cfg.critic.model.path, dtype=precision.master, device=device,
            trust_remote_code=cfg.model.trust_remote_code,
            gradient_checkpointing=plan.gradient_checkpointing,
        )  # fmt: skip
        critic = CriticWorker(
            precision.prepare(critic_model), cfg.critic, rollout_n=cfg.rollout.n,
            max_response_length=cfg.data.max_response_length,
            total_steps=total_steps, seed=cfg.trainer.seed, dp=dp, precision=precision,
            update=plan.critic_update,
        )  # fmt: skip
    if policy is not None:
        # an async run in one process generates ahead with the weights versions the trainer
        # hands over (lmrl.trainer.ahead), never with the weights being updated
        ahead = train and not plan.engine_follows
        engine = build_engine(
            cfg.rollout.name, policy, tokenizer, seed=cfg.trainer.seed,
            **engine_options(cfg), **({"follow": False} if ahead else {}),
        )  # fmt: skip
        engine = with_tools(cfg, engine, tokenizer)
        if precision.mixed and engine.shares_weights:  # hf: the actor's module, its autocast
            engine = PrecisionEngine(engine, precision)
    return Workers(policy=policy, actor=actor, critic=critic, reference=reference, engine=engine)
