"""The RL trainer: one step is the numbered pipeline of DESIGN.md, each stage one timed call.

    1 rollout     prompts -> n responses each (plus a greedy baseline when the estimator
                  needs ``reward_baselines``, i.e. ReMax)
    2 reward      token_level_scores (DAPO dynamic sampling loops 1-2 until the batch is full);
                  scored as rows stop or calls finish (``reward.overlap.rows`` and
                  ``overlap.chunks``), awaited only at 6 under ``reward.overlap.log_probs``
    3 old_log_prob  decoupled (recomputed), bypass (the rollout's own) or rollout correction
                  (which writes its rejections to ``loss_mask``, never over ``response_mask``)
    4 ref         ref_log_probs, when a KL term is on
    5 values      the critic's, when the estimator needs values
    6 adv         KL in the reward (optional), then the registry's estimator (rows no reward
                  function scored left out of the groups and, through ``loss_mask``, the loss)
    7 critic      clipped value loss
    8 actor       the policy loss

With ``async_training.enable`` stages 1-2 run ahead in threads of their own
(``lmrl.trainer.ahead``): the step takes the batch its staleness bound allows and hands the
new weights over after its update.

The trainer builds nothing: ``lmrl.trainer.build.build_run`` hands it the parts, and it never
branches on an algorithm's name (what a stage prepares comes from the registries, through the
parts' ``RunPlan``, which also lists the stages a step runs: `RunPlan.stages`). Around the step: validation, checkpoints with exact resume, metrics, and
the signals and save failures that must never cost finished work.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lmrl.algos import apply_kl_penalty, rollout_importance_weights
from lmrl.batch import Batch, response_tokens_mask
from lmrl.config.schema import TrainerConfig
from lmrl.errors import CheckpointError
from lmrl.models.loading import export_pretrained, resolve_device
from lmrl.models.lora import adapter_export, merged_state
from lmrl.run.checkpoint import load_state, read_weights, rng_state, set_rng_state
from lmrl.run.health import RunHealth
from lmrl.run.loop import RunsOnLoop, resume
from lmrl.run.resume import RunStart
from lmrl.run.timing import StageTimer
from lmrl.trainer.answers import answer_prior
from lmrl.trainer.build import RunParts
from lmrl.trainer.memory_probe import run_memory_probe, wants_probe
from lmrl.trainer.metrics import data_metrics, engine_gap, source_metrics, throughput, to_floats
from lmrl.trainer.parity import ParityProbe
from lmrl.trainer.stages import leave_out_unscored, rollout, scoring_thread, validate

if TYPE_CHECKING:
    from lmrl.data import PromptSampler
    from lmrl.trainer.ahead import RolloutAhead
    from lmrl.workers.roles import ActorRole, TrainedRole

log = logging.getLogger("lmrl.trainer")


def rollout_ahead(parts: RunParts, on_stage=None) -> RolloutAhead | None:
    """The thread that generates ahead under the plan's async schedule, else None."""
    a = parts.plan.asynchronous
    if a is None:
        return None
    from lmrl.trainer.ahead import RolloutAhead

    return RolloutAhead(parts, a.staleness, a.sync_every, parts.total_steps,
                        load=parts.engine.sync_weights, on_stage=on_stage)  # fmt: skip


class Trainer(RunsOnLoop):
    """Runs the step over a run's parts, with validation, checkpoints and resume.

    Args:
        parts: from ``build_run(cfg)``; a checkpoint in ``parts.resume_from`` is loaded here.
        cfg: the ``trainer`` config section (cadence of validation, saves and logs).
        on_stage: called with each stage's name as it starts (``gen``, ``reward``, ...,
            ``update_actor``, and ``save`` once a checkpoint's files are written, before its
            manifest): the seam for fault-injection tests.
    """

    def __init__(
        self, parts: RunParts, cfg: TrainerConfig, on_stage: Callable[[str], None] | None = None
    ) -> None:
        if parts.actor is None or parts.sampler is None:
            raise ValueError(
                "Trainer needs the parts of a training run: build_run(cfg) builds them "
                "(build_run(cfg, 'eval') has no actor or sampler)"
            )
        self.parts = parts
        self.actor: ActorRole = parts.actor  # the roles the step calls, of their Protocols
        self.sampler: PromptSampler = parts.sampler
        self.cfg = self.settings = cfg
        tokenizer = parts.tokenizer
        self.health = RunHealth(len(tokenizer) if tokenizer is not None else None)
        self.answers = answer_prior(parts)  # the answers' prior, beside each validation
        self.parity = ParityProbe(cfg.parity_threshold)  # names the engine gap's cause, once
        self.on_stage = on_stage or (lambda name: None)
        self.run_dir = parts.run_dir
        self.total_steps = parts.total_steps
        self.global_step = 0
        self.last_batch: Batch | None = None
        # async_training: stages 1-2 run ahead in threads (lmrl.trainer.ahead); else None
        self.ahead = rollout_ahead(parts, self.on_stage)
        # reward.overlap: the run's scoring thread, else None
        self._scoring = scoring_thread(parts.plan)
        self._pushed = False  # the weights the first batch ahead needs are handed over
        resume(self)
        self.probe_metrics: dict[str, float] = {}
        if wants_probe(cfg.memory_probe, str(resolve_device(cfg.device)), cfg.backend):
            self.probe_metrics = run_memory_probe(parts, parts.plan.max_prompt_length)

    # ---------------------------------------------------------------------- step
    def step(self) -> dict[str, float]:
        """One training step; returns its metrics as floats."""
        p, plan = self.parts, self.parts.plan
        timer = StageTimer(on_enter=self.on_stage)
        metrics: dict = {}
        with timer("step"), contextlib.ExitStack() as stack:
            # 1-2. rollout and reward (DAPO dynamic sampling may loop over both); with
            # async_training they ran ahead, with the weights of a version this step allows;
            # with reward.overlap.log_probs the scoring is still under way (joined at 6)
            scoring = None
            if self.ahead is None:
                batch, scoring = rollout(p, self.global_step, timer, metrics, self._scoring)
                if scoring is not None:
                    stack.callback(scoring.close)
            else:
                batch = self._take(metrics, timer)
            mask = batch["response_mask"]

            # 3. old log-probs: pi_old of the PPO ratio
            own = plan.old_log_probs_from_update(len(batch), self.global_step)
            if plan.log_prob_mode == "bypass":
                batch["old_log_probs"] = batch["rollout_log_probs"]
            elif own:  # the update's first forward computes exactly these
                metrics["actor/old_log_prob_recomputed"] = 0.0
            else:
                with timer("old_log_prob"):
                    batch["old_log_probs"], _ = self.actor.compute_log_probs(batch)
                metrics["actor/old_log_prob_recomputed"] = 1.0
                if "rollout_log_probs" in batch:
                    metrics |= engine_gap(batch["old_log_probs"], batch["rollout_log_probs"], mask)
                    if not metrics.get("async/staleness"):  # a stale batch's gap is no fault
                        metrics |= self.parity(batch, metrics, p)  # the first large gap
            if plan.log_prob_mode == "rollout_correction":
                c = plan.correction
                weights, loss_mask, is_metrics = rollout_importance_weights(
                    batch["old_log_probs"], batch["rollout_log_probs"], mask,
                    level=c.level, mode=c.mode, threshold=c.threshold,
                    threshold_lower=c.threshold_lower,
                )  # fmt: skip
                batch["rollout_is_weights"], batch["loss_mask"] = weights, loss_mask
                metrics |= {f"rollout_corr/{k}": v for k, v in is_metrics.items()}

            # 4. reference log-probs
            if p.reference is not None:
                with timer("ref"):
                    batch["ref_log_probs"] = p.reference.compute_log_probs(batch)

            # 5. values
            if p.critic is not None:
                with timer("values"):
                    batch["values"] = p.critic.compute_values(batch)

            # 6. advantages (KL in the reward first)
            if scoring is not None:
                with timer("reward"):  # what the scoring adds after stages 3-5
                    scoring.join(batch, metrics)
            with timer("adv"):
                rewards = batch["token_level_scores"]
                if p.kl_ctrl is not None:
                    rewards, kl_metrics = apply_kl_penalty(
                        rewards, batch["old_log_probs"], batch["ref_log_probs"], mask,
                        p.kl_ctrl, plan.kl_penalty,
                    )  # fmt: skip
                    metrics |= {f"actor/{k}": v for k, v in kl_metrics.items()}
                batch["token_level_rewards"] = rewards
                index, scored = leave_out_unscored(batch)  # rows no reward function scored
                batch["advantages"], batch["returns"] = plan.estimator(
                    rewards, scored, index=index, values=batch.get("values"),
                    reward_baselines=batch.get("reward_baselines"),
                )  # fmt: skip

            # 7. critic update
            if p.critic is not None:
                with timer("update_critic"):
                    metrics |= p.critic.update_critic(batch)

            # 8. actor update (after the critic's warm-up)
            if self.global_step >= plan.critic_warmup:
                with timer("update_actor"):
                    metrics |= self.actor.update_actor(batch, old_log_probs_from_update=own)

        self.global_step += 1
        if self.ahead is not None:  # the new version, if a batch to come is generated with it
            self.ahead.push(self.global_step, self._snapshot)
        out = source_metrics(to_floats(metrics), batch, plan.max_response_length)
        out |= data_metrics(batch, plan.max_response_length)
        out |= timer.metrics()
        out["perf/throughput"] = throughput(batch, timer.seconds["step"])
        if self.ahead is not None:
            out["async/trainer_idle_frac"] = timer.seconds["wait_batch"] / timer.seconds["step"]
        out["training/step"] = float(self.global_step)
        out.setdefault("training/epoch", float(self.sampler.epoch))  # async: the batch's own
        out |= self.probe_metrics  # the first step's only
        self.probe_metrics = {}
        self.last_batch = batch
        return out

    def _push_start(self) -> None:
        """Hand the current weights over once (a start or a resume): the version the next
        batch to generate may need."""
        if self.ahead is not None and not self._pushed:
            self.ahead.push(self.global_step, self._snapshot)
            self._pushed = True

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """The actor's weights now, copied: in one process on a CPU ``model_state`` shares
        the parameters' storage, and a version handed over must not move with the next
        update (a Ray group's weights arrive as copies already)."""
        state = self.actor.model_state()
        if self.parts.backend is not None:
            return state
        return {k: v.clone() for k, v in state.items()}

    def _take(self, metrics: dict, timer: StageTimer) -> Batch:
        """The batch generated ahead for this step (async_training), with its metrics."""
        assert self.ahead is not None, "a batch is taken only from the thread generating ahead"
        self._push_start()
        with timer("wait_batch"):
            batch, ahead_metrics = self.ahead.take(self.global_step)
        metrics |= ahead_metrics
        return batch

    def validate(self) -> dict[str, float]:
        """Validation metrics of the current policy (see ``lmrl.trainer.stages.validate``);
        with async_training, on the engine between two batches, with the current weights.
        Beside them the answers' prior and the answers' spread (``lmrl.trainer.answers``),
        whose texts the health checks quote."""
        outputs: list[Batch] | None = [] if self.answers is not None else None
        if self.ahead is None:
            metrics = validate(self.parts, outputs)
        else:
            metrics = self.ahead.exclusive(
                self.actor.model_state(), lambda: validate(self.parts, outputs)
            )
        if self.answers is not None and outputs and metrics:
            metrics |= self.answers.spread(outputs, self.parts.tokenizer)
            self.health.answer_texts = dict(self.answers.texts)
        return metrics

    @property
    def has_validation(self) -> bool:
        return self.parts.val_data is not None

    @property
    def start(self) -> RunStart:
        return self.parts.start

    @property
    def trackers(self):
        return self.parts.trackers

    def generations(self, limit: int = 8) -> list[dict]:
        """Prompt, response, score and the reward's text extras of the first samples of the
        last step's batch."""
        tok = self.parts.tokenizer
        if self.last_batch is None or tok is None:
            return []
        batch = self.last_batch.index(slice(0, limit))
        prompts = tok.batch_decode(batch["prompts"], skip_special_tokens=True)
        responses = [
            tok.decode(ids[mask], skip_special_tokens=True)
            for ids, mask in zip(batch["responses"], response_tokens_mask(batch), strict=True)
        ]
        scores = batch["token_level_scores"].sum(-1).tolist()
        texts = batch.get("reward_texts", [{}] * len(batch))  # the reward's text extras
        return [
            {**text, "prompt": p, "response": r, "score": sc, "data_source": src}
            for p, r, sc, src, text in zip(
                prompts, responses, scores, batch["data_source"], texts, strict=True
            )
        ]

    def close(self) -> None:
        """Stop the threads generating ahead and scoring, the reward workers, and close the
        trackers."""
        try:
            if self._scoring is not None:
                self._scoring.shutdown(wait=False, cancel_futures=True)
            if self.ahead is not None:
                self.ahead.close()
        finally:
            self.parts.close()

    # ---------------------------------------------------------------- checkpoints
    def _trained(self) -> dict:
        """The trained workers by checkpoint name (in-process, or a Ray group's stand-ins)."""
        workers: dict[str, TrainedRole] = {"actor": self.actor}
        if self.parts.critic is not None:
            workers["critic"] = self.parts.critic
        return workers

    def checkpoint_weights(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: worker.model_state() for name, worker in self._trained().items()}

    def state_dict(self) -> dict:
        """Everything but the weights that a resumed run needs to continue exactly."""
        p = self.parts
        state = {
            "global_step": self.global_step,
            "actor": self.actor.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
            "parity": self.parity.state_dict(),  # whether it probed: once per run, resumed too
        }
        if p.critic is not None:
            state["critic"] = p.critic.state_dict()
        if p.kl_ctrl is not None:
            state["kl_ctrl"] = p.kl_ctrl.state_dict()
        if self.ahead is not None:  # the batches in flight, and the sampler after them
            self._push_start()
            state["ahead"] = self.ahead.state_dict(self.global_step)
            state["sampler"] = state["ahead"].pop("sampler")
        return state

    def export(self) -> Path:
        """Write ``run_dir/final``: the policy as a plain Hugging Face model directory (LoRA
        merged, tokenizer included), the ``model.path`` of a next run or of ``lmrl eval``."""
        m = self.parts.config.model
        weights = self.actor.model_state()
        out, extra = self.run_dir / "final", None
        if m.lora_rank > 0:
            extra = adapter_export(weights, m)  # final/adapter: the adapter in PEFT's format
            weights = merged_state(weights, m.lora_alpha / m.lora_rank)
        base = m.path or ""  # required: the config's checks refuse a run without it
        return export_pretrained(out, weights, base, self.parts.tokenizer, m.trust_remote_code,
                                 extra=extra)  # fmt: skip

    def lower_lr(self, factor: float) -> float:
        """Multiply the actor's learning rate by ``factor`` from now on (the run doctor's
        rollback); the scale is in the actor's checkpoint state. Returns the scale now.

        ``scale_lr`` is a method of every trained worker (`lmrl.workers.optim.TrainableWorker`
        and a Ray group's stand-in) beside the roles' verl-named methods: it sets one scalar,
        where a round trip through ``state_dict`` would ship the whole optimizer state."""
        return self.actor.scale_lr(factor)

    def load_checkpoint(self, path: Path) -> None:
        """Restore the workers' weights and state, the sampler, the KL controller, the parity
        probe's ``done`` and the RNGs."""
        p = self.parts
        state = load_state(path)
        for name, worker in self._trained().items():
            try:
                worker.load_model_state(read_weights(path / f"{name}.safetensors"))
            except KeyError as err:  # the checkpoint is of another model
                raise CheckpointError(f"{path / name}.safetensors: {err}") from None
        self.actor.load_state_dict(state["actor"])
        if p.critic is not None:
            p.critic.load_state_dict(state["critic"])
        if p.kl_ctrl is not None:
            p.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.sampler.load_state_dict(state["sampler"])
        self.parity.load_state_dict(state.get("parity"))  # absent in older checkpoints
        set_rng_state(state["rng"])
        self.global_step = int(state["global_step"])
        if self.ahead is not None:
            self.ahead.load_state_dict(state.get("ahead"), self.global_step)
            self._pushed = False


__all__ = ["Trainer"]
