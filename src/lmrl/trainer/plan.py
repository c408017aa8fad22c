"""The run's plan: the shape of an RL run, decided once from its config.

`RunPlan.from_config(cfg)` is the one place that reads the config for the run's shape: which
stages exist (the reference: none, a frozen copy, the adapter off, inside the update; the
critic and its values), the training data's draw (one shuffled pool, or ``data.mixture``'s
sources per step), the sampling, the log-prob mode, the async schedule, how scoring
overlaps generation, the update's rows, mini- and micro-batches and epochs, the dtypes, and
what the memory plan needs of the models. Everything else reads the plan:

- ``build_run`` and the worker builders (`lmrl.workers.build`, each Ray rank) build the parts
  the plan names (`WorkerPlan`);
- ``Trainer.step`` runs `RunPlan.stages` and nothing else;
- the memory probe and ``lmrl plan`` (`lmrl.trainer.memory_plan`) size the phases the plan
  lists, so ``lmrl plan`` shows the run that will run (``tests/trainer/test_run_plan.py``
  checks the two against the stages a real step executes, over the estimators, KL placements,
  LoRA, the critic's warm-up, async, the scoring modes and the log-prob modes).

Nothing here loads a model or touches a device: a plan is made away from the GPU machine too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from lmrl.algos import advantage_estimators
from lmrl.config import Config
from lmrl.config.curriculum import Curriculum, parse_curriculum
from lmrl.config.mixture import MixRule, parse_mixture
from lmrl.config.schema import FilterGroupsConfig, RolloutCorrectionConfig
from lmrl.rollout import SamplingParams
from lmrl.rollout.engines import ENGINES
from lmrl.workers.plan import ReferenceKind, WorkerPlan, kl_in_update, update_shape
from lmrl.workers.precision import planned_dtypes

__all__ = ["STAGES", "AsyncSchedule", "ModelsPlan", "RunPlan"]

# the step's stages in order, by the names their timers and ``Trainer(on_stage=...)`` use
STAGES = (
    "gen", "gen_baseline", "reward", "wait_batch", "old_log_prob", "ref", "values", "adv",
    "update_critic", "update_actor",
)  # fmt: skip


@dataclass(frozen=True)
class AsyncSchedule:
    """``async_training``: stages 1-2 run ahead of the update in threads of their own.

    Attributes:
        staleness: batches a generation may run ahead (``ceil(staleness_threshold)``).
        sync_every: steps between two weight hand-overs (``trigger_parameter_sync_step``).
    """

    staleness: int
    sync_every: int


@dataclass(frozen=True)
class ModelsPlan:
    """What the run's models are, as the memory plan sizes them (no weights are read).

    Attributes:
        path, critic_path: the policy's and the critic's model directories.
        lora_rank, target_modules: the actor's LoRA (rank 0 = none).
        strategy, critic_strategy: ``ddp``/``fsdp2`` of the trained models.
        offload, critic_offload: FSDP2's offload setting of each.
        ranks: data-parallel ranks (the Ray cluster's GPUs; 1 in one process).
        backend: ``local`` or ``ray``.
        engine: ``rollout.name``; ``engine_options``: ``rollout.vllm``'s options (its share
            of the device and whether it sleeps), read for an engine that reserves memory.
        rollout_dtype: the engine's own dtype (None = the actor's).
    """

    path: str | None
    critic_path: str | None
    lora_rank: int
    target_modules: str | list[str]
    strategy: str
    critic_strategy: str
    offload: str
    critic_offload: str
    ranks: int
    backend: str
    engine: str
    engine_options: dict
    rollout_dtype: str | None

    def sharded(self, strategy: str) -> bool:
        """FSDP2 shards ``strategy``'s model over the ranks (only under Ray)."""
        return self.backend == "ray" and strategy in ("fsdp2", "fsdp")


@dataclass(frozen=True)
class RunPlan:
    """The run's shape (the step never reads the config).

    Attributes:
        n: samples per prompt.
        train_batch_size: prompts per step (groups kept, under dynamic sampling).
        gen_batch_size: prompts per generation round (DAPO's ``gen_batch_size`` when groups
            are filtered, else ``train_batch_size``).
        max_prompt_length, max_response_length: the lengths of a row.
        sampling: training sampling; the step adds a seed per (step, generation round).
        greedy: one greedy sample per prompt (ReMax's baseline).
        val_sampling, val_n, val_batch_size: validation sampling, samples per prompt, and
            prompts per generation call (None = all).
        log_prob_mode: ``decoupled``, ``bypass`` or ``rollout_correction``.
        correction: the rollout-correction settings.
        estimator: the advantage estimator with its hyperparameters bound.
        estimator_needs: batch keys the estimator reads beyond rewards and mask.
        kl_in_reward: KL in the reward (a KL controller, stage 6).
        kl_penalty: the KL estimator of KL-in-reward.
        filter_groups: DAPO dynamic sampling.
        update_rows: rows of one actor mini-batch when the update is a single pass (one epoch,
            and the update's first forward sees the weights the rollout saw); 0 otherwise.
        critic_warmup: steps that update only the critic.
        seed: the run's seed.
        reward_chunks: generation calls per step, each scored as it finishes.
        reward_rows: each sample scored as it stops (where the engine reports rows: the
            ``reports_rows`` trait of `lmrl.rollout.engines.ENGINES`, in one process).
        reward_deferred: the scores are awaited only by the advantages (stages 3-5 overlap
            the scoring).
        workers: what the worker builders build (`lmrl.workers.plan.WorkerPlan`).
        asynchronous: the async schedule, or None for the synchronous step.
        engine_shares_weights: the engine generates with the actor's own module (the ``hf``
            engine in the actor's dtype, following its weights).
        device: ``cpu`` or ``cuda``, the device planned for.
        dtypes: ``(master, compute, rollout)`` dtype names (`planned_dtypes`).
        models: what the memory plan sizes.
        total_epochs, total_training_steps: the run's length (0 steps = epochs of the data).
        mixture: ``data.mixture``'s sources with their weights, schedules or quotas, in the
            order written (``()`` = one shuffled pool of the training rows).
        curriculum: ``data.curriculum``'s rule choosing the prompts within each source by
            their pass rates (None = the seeded epoch order).
    """

    n: int
    train_batch_size: int
    gen_batch_size: int
    max_prompt_length: int
    max_response_length: int
    sampling: SamplingParams
    greedy: SamplingParams
    val_sampling: SamplingParams
    val_n: int
    val_batch_size: int | None
    log_prob_mode: str
    correction: RolloutCorrectionConfig
    estimator: Callable
    estimator_needs: frozenset[str]
    kl_in_reward: bool
    kl_penalty: str
    filter_groups: FilterGroupsConfig
    update_rows: int
    critic_warmup: int
    seed: int
    workers: WorkerPlan
    models: ModelsPlan
    reward_chunks: int = 1
    reward_rows: bool = False
    reward_deferred: bool = False
    asynchronous: AsyncSchedule | None = None
    engine_shares_weights: bool = True
    device: str = "cpu"
    dtypes: tuple[str, str, str] = ("float32", "float32", "float32")
    total_epochs: int = 1
    total_training_steps: int | None = None
    mixture: tuple[MixRule, ...] = ()
    curriculum: Curriculum | None = None

    @property
    def scoring_thread(self) -> bool:
        """The run scores in a thread of its own: scoring overlaps something."""
        return self.reward_chunks > 1 or self.reward_rows or self.reward_deferred

    @property
    def scoring(self) -> str:
        """How scoring overlaps generation, in words (``after`` it when it does not)."""
        modes = [f"{self.reward_chunks} calls"] if self.reward_chunks > 1 else []
        modes += ["rows as they stop"] * self.reward_rows
        modes += ["awaited by the advantages"] * self.reward_deferred
        return ", ".join(modes) or "after the generation"

    @property
    def critic(self) -> bool:
        return self.workers.critic

    def old_log_probs_from_update(self, rows: int, step: int) -> bool:
        """Whether this step's old log-probs are taken from the actor update's own first
        forward instead of a separate pass: the one place that decides it.

        They are, exactly, when the log-probs are decoupled and the update is a single pass over
        one mini-batch (one epoch, no KL in the reward: ``update_rows > 0``) of at most
        ``update_rows`` rows, the actor updates at this step (past ``critic_warmup``), and the
        engine generates with the actor's own module (``engine_shares_weights``; else the
        separate pass also measures the engine's gap).

        Args:
            rows: rows of the step's batch.
            step: steps done before this one.
        """
        return (
            self.log_prob_mode == "decoupled"
            and 0 < rows <= self.update_rows
            and step >= self.critic_warmup
            and self.engine_shares_weights
        )

    @property
    def generation_stages(self) -> tuple[str, ...]:
        """Stages 1-2: the generation (with ReMax's greedy baseline) and its scoring; in the
        step, or under async ahead of it in a thread of their own."""
        baseline = ("gen_baseline",) if "reward_baselines" in self.estimator_needs else ()
        return ("gen", *baseline, "reward")

    def stages(self, step: int = 0, rows: int | None = None) -> tuple[str, ...]:
        """The stages step ``step`` (0-based) runs, in order, by their timers' names
        (`STAGES`); ``rows`` = the batch's rows (default ``train_batch_size * n``; fewer
        under DAPO's dynamic sampling may let the old log-probs come from the update). Under
        async the step waits for its batch (``wait_batch``) while `generation_stages` run
        ahead."""
        rows = self.train_batch_size * self.n if rows is None else rows
        out = ["wait_batch"] if self.asynchronous else list(self.generation_stages)
        if self.log_prob_mode != "bypass" and not self.old_log_probs_from_update(rows, step):
            out.append("old_log_prob")
        if self.workers.ref_stage:
            out.append("ref")
        if self.workers.critic:
            out.append("values")
        out.append("adv")
        if self.workers.critic:
            out.append("update_critic")
        if step >= self.critic_warmup:
            out.append("update_actor")
        return tuple(out)

    @property
    def reference(self) -> str:
        """The reference as ``lmrl plan`` names it: ``none``, ``frozen copy``, ``adapter off``,
        with ``, inside the update`` for the full KL."""
        w = self.workers
        name = w.reference.replace("_", " ")
        return f"{name}, inside the update" if w.ref_in_update else name

    def summary(self) -> str:
        """The plan in a few lines: the stages of a step and the choices behind them."""
        w, a = self.workers, self.asynchronous
        stages = " -> ".join(self.stages(self.critic_warmup))
        if a is not None:
            stages += f" (ahead: {' -> '.join(self.generation_stages)})"
        critic = "yes" if w.critic else "no"
        if self.critic_warmup:
            critic += f" (updates alone for {self.critic_warmup} steps)"
        log_probs = self.log_prob_mode
        if self.old_log_probs_from_update(self.train_batch_size * self.n, self.critic_warmup):
            log_probs += ", old log-probs from the update"
        timing = "off" if a is None else f"staleness {a.staleness}, weights every {a.sync_every}"
        lines = [
            f"data: {self.draw}",
            f"stages: {stages}",
            f"reference: {self.reference}; critic: {critic}",
            f"log-probs: {log_probs}",
            f"scoring: {self.scoring}",
            f"async: {timing}",
            f"update: {w.actor.epochs} epoch(s) of {w.actor.mini_batch_rows}-row mini-batches, "
            f"micro-batches of {w.actor.micro()} rows",
            f"dtypes on {self.device}: master {self.dtypes[0]}, compute {self.dtypes[1]}, "
            f"rollout {self.dtypes[2]}",
        ]
        return "\n".join(lines)

    @property
    def draw(self) -> str:
        """How a step's prompts are drawn, in words: ``one shuffled pool`` or each source of
        ``data.mixture`` with its rule (``digits weight 1 -> 3 at steps 1, 100, sort weight 1``,
        ``digits quota 6, sort quota 2``), then ``data.curriculum``'s rule when it is on."""
        if not self.mixture:
            draw = f"{self.gen_batch_size} prompts a step from one pool of the training rows"
        else:
            rules = ", ".join(_describe(rule) for rule in self.mixture)
            draw = f"{self.gen_batch_size} prompts a step mixed from {rules}"
        return draw if self.curriculum is None else f"{draw}; {self.curriculum.describe()}"

    @classmethod
    def from_config(cls, cfg: Config, device: str | None = None) -> RunPlan:
        """The plan of a resolved config.

        Args:
            cfg: from `lmrl.config.load_config` (validated).
            device: ``cpu`` or ``cuda``, the device the run computes on; None = the one
                ``trainer.device`` names, ``auto`` planned as ``cuda`` (a plan is a GPU
                question).
        """
        r, a, vk, act = cfg.rollout, cfg.algorithm, cfg.rollout.val_kwargs, cfg.actor
        device = device or ("cuda" if cfg.trainer.device == "auto" else cfg.trainer.device)
        device = "cuda" if str(device).startswith("cuda") else "cpu"
        stop = list(r.stop)
        length = cfg.data.max_response_length
        single_pass = act.ppo_epochs == 1 and r.log_prob_mode == "decoupled"
        single_pass = single_pass and not a.use_kl_in_reward
        workers = _worker_plan(cfg)
        mode = r.log_prob_mode
        assert mode is not None, "load_config resolves rollout.log_prob_mode"
        asynchronous = None
        if cfg.async_training.enable:
            at = cfg.async_training
            asynchronous = AsyncSchedule(
                math.ceil(at.staleness_threshold), at.trigger_parameter_sync_step
            )
        master, compute = planned_dtypes(cfg.model.dtype, cfg.model.mixed_precision, device)
        rollout_dtype = r.dtype or master
        traits = ENGINES.traits(r.name)
        shares = "shares_weights" in traits and workers.engine_follows and rollout_dtype == master
        local, overlap = cfg.trainer.backend == "local", cfg.reward.overlap
        rows = overlap["rows"] and local and (
            "reports_rows" in traits or cfg.rollout.multi_turn.enable  # the agent loop does
        )  # fmt: skip
        fg = FilterGroupsConfig(**a.filter_groups)
        gen_batch = (cfg.data.gen_batch_size if fg.enable else None) or cfg.data.train_batch_size
        return cls(
            n=r.n,
            train_batch_size=cfg.data.train_batch_size,
            gen_batch_size=gen_batch,
            max_prompt_length=cfg.data.max_prompt_length,
            max_response_length=length,
            sampling=SamplingParams(
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                max_new_tokens=length,
                do_sample=r.do_sample,
                stop=stop,
                ignore_eos=r.ignore_eos,
            ),
            greedy=SamplingParams(
                do_sample=False, max_new_tokens=length, temperature=r.temperature, stop=stop
            ),
            val_sampling=SamplingParams(
                temperature=vk.temperature if vk.do_sample else (vk.temperature or 1.0),
                top_p=vk.top_p,
                top_k=vk.top_k,
                max_new_tokens=length,
                do_sample=vk.do_sample,
                stop=stop,
                seed=cfg.trainer.seed,
            ),
            val_n=vk.n,
            val_batch_size=cfg.data.val_batch_size,
            log_prob_mode=mode,
            correction=RolloutCorrectionConfig(**r.correction),
            estimator=functools.partial(
                advantage_estimators.get(a.adv_estimator),
                gamma=a.gamma,
                lam=a.lam,
                norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo,
            ),
            estimator_needs=frozenset(advantage_estimators.needs(a.adv_estimator)),
            kl_in_reward=bool(a.use_kl_in_reward),
            kl_penalty=a.kl_penalty,
            filter_groups=fg,
            update_rows=workers.actor.mini_batch_rows if single_pass else 0,
            critic_warmup=cfg.trainer.critic_warmup,
            seed=cfg.trainer.seed,
            workers=workers,
            reward_chunks=int(overlap["chunks"]),
            reward_rows=bool(rows),
            reward_deferred=bool(overlap["log_probs"]),
            asynchronous=asynchronous,
            engine_shares_weights=shares,
            device=device,
            dtypes=(master, compute, rollout_dtype),
            models=_models_plan(cfg),
            total_epochs=cfg.trainer.total_epochs,
            total_training_steps=cfg.trainer.total_training_steps,
            mixture=parse_mixture(cfg.data.mixture, gen_batch),
            curriculum=parse_curriculum(cfg.data.curriculum),
        )


def _describe(rule: MixRule) -> str:
    """One source's rule in words: its quota, its weight, or its schedule's points."""
    if rule.quota is not None:
        return f"{rule.source} quota {rule.quota}"
    weights = [f"{float(w):g}" for _, w in rule.points]
    if len(rule.points) == 1:
        return f"{rule.source} weight {weights[0]}"
    steps = [str(s) for s, _ in rule.points]
    return f"{rule.source} weight {' -> '.join(weights)} at steps {', '.join(steps)}"


def _reference(cfg: Config) -> ReferenceKind:
    """The reference model: none without a KL term; with LoRA the adapter off, else a frozen
    copy of the initial policy."""
    if not (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):
        return "none"
    return "adapter_off" if cfg.model.lora_rank > 0 else "frozen_copy"


def _worker_plan(cfg: Config) -> WorkerPlan:
    in_update = kl_in_update(cfg.actor)
    n, ray = cfg.rollout.n, cfg.trainer.backend == "ray"
    return WorkerPlan(
        reference=_reference(cfg),
        ref_stage=bool(cfg.algorithm.use_kl_in_reward or (cfg.actor.use_kl_loss and not in_update)),
        ref_in_update=in_update,
        critic=bool(cfg.critic.enable),
        actor=update_shape(cfg.actor, n),
        critic_update=update_shape(cfg.critic, n) if cfg.critic.enable else None,
        log_prob_micro_batch_size=cfg.rollout.log_prob_micro_batch_size,
        ref_micro_batch_size=cfg.ref.log_prob_micro_batch_size,
        # an async run in one process generates ahead with the weights versions the trainer
        # hands over (lmrl.trainer.ahead), never with the weights being updated
        engine_follows=not (cfg.async_training.enable and cfg.trainer.backend == "local"),
        gradient_checkpointing=bool(cfg.model.enable_gradient_checkpointing),
        separate_critic=ray and bool(cfg.critic.enable and cfg.resources.critic_workers > 0),
        separate_rollout=ray and bool(cfg.async_training.enable),
    )


def _models_plan(cfg: Config) -> ModelsPlan:
    res = cfg.resources
    ranks = res.n_gpus_per_node * res.nnodes if cfg.trainer.backend == "ray" else 1
    return ModelsPlan(
        path=cfg.model.path,
        critic_path=cfg.critic.model.path or cfg.model.path,
        lora_rank=cfg.model.lora_rank,
        target_modules=cfg.model.target_modules,
        strategy=cfg.actor.strategy,
        critic_strategy=cfg.critic.strategy,
        offload=cfg.actor.offload,
        critic_offload=cfg.critic.offload,
        ranks=ranks,
        backend=cfg.trainer.backend,
        engine=cfg.rollout.name,
        engine_options=dict(cfg.rollout.vllm),  # read where the engine reserves memory
        rollout_dtype=cfg.rollout.dtype,
    )
