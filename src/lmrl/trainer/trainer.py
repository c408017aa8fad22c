"""The RL trainer: one step is the numbered pipeline of DESIGN.md, each stage one timed call.

    1 rollout     prompts -> n responses each (plus a greedy baseline when the estimator
                  needs ``reward_baselines``, i.e. ReMax)
    2 reward      token_level_scores (DAPO dynamic sampling loops 1-2 until the batch is full)
    3 old_log_prob  decoupled (recomputed), bypass (the rollout's own) or rollout correction
                  (which writes its rejections to ``loss_mask``, never over ``response_mask``)
    4 ref         ref_log_probs, when a KL term is on
    5 values      the critic's, when the estimator needs values
    6 adv         KL in the reward (optional), then the registry's estimator
    7 critic      clipped value loss
    8 actor       the policy loss

The trainer builds nothing: ``lmrl.trainer.run.build_run`` hands it the parts, and it never
branches on an algorithm's name (what a stage prepares comes from the registries, through the
parts' ``StepPlan``). Around the step: validation, checkpoints with exact resume, metrics, and
the signals and save failures that must never cost finished work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from lmrl.algos import apply_kl_penalty, rollout_importance_weights
from lmrl.batch import Batch, response_tokens_mask
from lmrl.config import save_config
from lmrl.config.schema import TrainerConfig
from lmrl.errors import CheckpointError, WorkerError
from lmrl.models.loading import export_pretrained
from lmrl.models.lora import merged_state
from lmrl.trainer.checkpoint import (
    latest_checkpoint,
    load_state,
    read_weights,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from lmrl.trainer.health import RunHealth
from lmrl.trainer.metrics import StageTimer, data_metrics, engine_gap, throughput, to_floats
from lmrl.trainer.resume import keep_old_config
from lmrl.trainer.run import RunParts
from lmrl.trainer.signals import EXIT_CODES, StopOnSignal
from lmrl.trainer.stages import rollout_and_score, validate

log = logging.getLogger("lmrl.trainer")


class Trainer:
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
        self.parts = parts
        self.cfg = cfg
        tokenizer = getattr(parts, "tokenizer", None)
        self.health = RunHealth(len(tokenizer) if tokenizer is not None else None)
        self.on_stage = on_stage or (lambda name: None)
        self.run_dir = parts.run_dir
        self.total_steps = parts.total_steps
        self.global_step = 0
        self.stopped_by: str | None = None  # the signal that interrupted fit(), if any
        self.last_batch: Batch | None = None
        self._last_saved = -1
        self._tracker_failed = False
        if parts.resume_from is not None:
            self._load_checkpoint(parts.resume_from)

    @property
    def exit_code(self) -> int:
        """0 after a finished run; 130 (SIGINT) or 143 (SIGTERM) after an interrupted one."""
        return EXIT_CODES.get(self.stopped_by, 130) if self.stopped_by else 0

    # ---------------------------------------------------------------------- step
    def step(self) -> dict[str, float]:
        """One training step; returns its metrics as floats."""
        p, plan = self.parts, self.parts.plan
        timer = StageTimer(on_enter=self.on_stage)
        metrics: dict = {}
        with timer("step"):
            # 1-2. rollout and reward (DAPO dynamic sampling may loop over both)
            batch = rollout_and_score(p, self.global_step, timer, metrics)
            mask = batch["response_mask"]

            # 3. old log-probs: pi_old of the PPO ratio
            own = (
                plan.log_prob_mode == "decoupled"
                and 0 < len(batch) <= plan.update_rows
                and self.global_step >= plan.critic_warmup
                and getattr(p.engine, "shares_weights", True)  # else: the gap, below
            )
            if plan.log_prob_mode == "bypass":
                batch["old_log_probs"] = batch["rollout_log_probs"]
            elif own:  # the update's first forward computes exactly these
                metrics["actor/old_log_prob_recomputed"] = 0.0
            else:
                with timer("old_log_prob"):
                    batch["old_log_probs"], _ = p.actor.compute_log_probs(batch)
                metrics["actor/old_log_prob_recomputed"] = 1.0
                if "rollout_log_probs" in batch:
                    metrics |= engine_gap(batch["old_log_probs"], batch["rollout_log_probs"], mask)
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
            with timer("adv"):
                rewards = batch["token_level_scores"]
                if p.kl_ctrl is not None:
                    rewards, kl_metrics = apply_kl_penalty(
                        rewards, batch["old_log_probs"], batch["ref_log_probs"], mask,
                        p.kl_ctrl, plan.kl_penalty,
                    )  # fmt: skip
                    metrics |= {f"actor/{k}": v for k, v in kl_metrics.items()}
                batch["token_level_rewards"] = rewards
                batch["advantages"], batch["returns"] = plan.estimator(
                    rewards, mask, index=batch["uid"], values=batch.get("values"),
                    reward_baselines=batch.get("reward_baselines"),
                )  # fmt: skip

            # 7. critic update
            if p.critic is not None:
                with timer("update_critic"):
                    metrics |= p.critic.update_critic(batch)

            # 8. actor update (after the critic's warm-up)
            if self.global_step >= plan.critic_warmup:
                with timer("update_actor"):
                    metrics |= p.actor.update_policy(batch, old_log_probs_from_update=own)

        self.global_step += 1
        out = to_floats(metrics)
        out |= data_metrics(batch, plan.max_response_length)
        out |= timer.metrics()
        out["perf/throughput"] = throughput(batch, timer.seconds["step"])
        out["training/step"] = float(self.global_step)
        out["training/epoch"] = float(p.sampler.epoch)
        self.last_batch = batch
        return out

    def validate(self) -> dict[str, float]:
        """Validation metrics of the current policy (see ``lmrl.trainer.stages.validate``)."""
        return validate(self.parts)

    # ----------------------------------------------------------------------- fit
    def fit(self) -> list[dict[str, float]]:
        """Run the remaining steps: log each, validate every ``test_freq`` steps (and before
        the first and after the last), checkpoint every ``save_freq`` steps and at the end.

        A run that reaches its last step also writes ``run_dir/final`` (`export_final`).
        The first SIGINT/SIGTERM finishes the current step, saves and returns (``stopped_by``
        and ``exit_code`` say so); a second one stops at once (``StopNow``). A periodic save
        that fails is logged and retried at the next one; a failed final save raises
        ``CheckpointError``. A Ray worker that dies or fails raises ``WorkerError`` naming it
        and the last good checkpoint.
        """
        t, p = self.cfg, self.parts
        history: list[dict[str, float]] = []
        start = time.perf_counter()
        try:
            self.start()
            with StopOnSignal() as stop:
                if t.val_before_train and self.global_step == 0 and p.val_data is not None:
                    before = self.validate()
                    self.health.baseline(before)
                    self.log_metrics(before, step=0)
                while self.global_step < self.total_steps and not stop.requested:
                    metrics = self.step()
                    step = self.global_step
                    if p.val_data is not None and (
                        step == self.total_steps or _every(t.test_freq, step)
                    ):
                        metrics |= self.validate()
                    history.append(metrics)
                    self.log_metrics(metrics, step=step)
                    for warning in self.health.check(metrics):
                        log.warning("%s", warning)
                    if _every(t.log_generations_freq, step):
                        p.trackers.log_generations(self._generation_rows(), step=step)
                    if _every(t.save_freq, step):
                        self._save(final=False)
                self.stopped_by = stop.requested
                if self._last_saved != self.global_step and self.global_step > 0:
                    self._save(final=True)
                if history and self.global_step >= self.total_steps:
                    self.export_final()
        except WorkerError as err:  # a Ray worker died or failed: nothing more can run
            last = latest_checkpoint(self.run_dir)
            resume = (
                f"the last good checkpoint is {last}; run the same command to resume from it"
                if last is not None
                else "no checkpoint was written yet"
            )
            raise WorkerError(f"{err}; {resume}") from None
        finally:
            self.close()
        if self.stopped_by:
            log.warning("%s: stopped after step %d (saved); run the same command to resume",
                        self.stopped_by, self.global_step)  # fmt: skip
        log.info("ran %d steps in %.1fs", len(history), time.perf_counter() - start)
        return history

    def start(self) -> None:
        """The run really starts: write ``config.yaml`` (keeping a changed one's old file)."""
        changes = self.parts.config_changes
        if changes:
            kept = keep_old_config(self.run_dir, self.global_step)
            for key, old, new in changes:
                log.warning("resumed with %s changed: %r -> %r", key, old, new)
            log.warning("the previous settings are kept in %s", kept)
        save_config(self.parts.config, self.run_dir / "config.yaml")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log to the trackers; a tracker that cannot write (a full disk) never stops the run."""
        try:
            self.parts.trackers.log(metrics, step=step)
        except OSError as err:
            if not self._tracker_failed:
                log.error("could not write metrics (%s); training goes on", err)
            self._tracker_failed = True

    def _generation_rows(self, limit: int = 8) -> list[dict]:
        """Prompt, response and score of the first samples of the last step's batch."""
        batch, tok = self.last_batch.index(slice(0, limit)), self.parts.tokenizer
        prompts = tok.batch_decode(batch["prompts"], skip_special_tokens=True)
        responses = [
            tok.decode(ids[mask], skip_special_tokens=True)
            for ids, mask in zip(batch["responses"], response_tokens_mask(batch), strict=True)
        ]
        scores = batch["token_level_scores"].sum(-1).tolist()
        return [
            {"prompt": p, "response": r, "score": sc, "data_source": src}
            for p, r, sc, src in zip(prompts, responses, scores, batch["data_source"], strict=True)
        ]

    def close(self) -> None:
        """Stop the reward workers and close the trackers."""
        self.parts.close()

    # ---------------------------------------------------------------- checkpoints
    def _trained(self) -> dict:
        """The trained workers by checkpoint name (in-process, or a Ray group's stand-ins)."""
        workers = {"actor": self.parts.actor}
        if self.parts.critic is not None:
            workers["critic"] = self.parts.critic
        return workers

    def state_dict(self) -> dict:
        """Everything but the weights that a resumed run needs to continue exactly."""
        p = self.parts
        state = {
            "global_step": self.global_step,
            "actor": p.actor.state_dict(),
            "sampler": p.sampler.state_dict(),
            "rng": rng_state(),
        }
        if p.critic is not None:
            state["critic"] = p.critic.state_dict()
        if p.kl_ctrl is not None:
            state["kl_ctrl"] = p.kl_ctrl.state_dict()
        return state

    def save_checkpoint(self) -> Path:
        """Write ``global_step_<N>`` now (atomically); returns its path."""
        weights = {name: worker.model_state() for name, worker in self._trained().items()}
        path = save_checkpoint(
            self.run_dir, self.global_step, weights, self.state_dict(),
            self.cfg.max_ckpt_to_keep, before_manifest=lambda: self.on_stage("save"),
        )  # fmt: skip
        self._last_saved = self.global_step
        log.info("checkpoint saved: %s", path)
        return path

    def export_final(self) -> Path:
        """Write ``run_dir/final``: the policy as a plain Hugging Face model directory (LoRA
        merged, tokenizer included), the ``model.path`` of a next run or of ``lmrl eval``.

        Raises:
            CheckpointError: it cannot be written (the checkpoints are unaffected).
        """
        m, out = self.parts.config.model, self.run_dir / "final"
        weights = self.parts.actor.model_state()
        if m.lora_rank > 0:
            weights = merged_state(weights, m.lora_alpha / m.lora_rank)
        try:
            export_pretrained(out, weights, m.path, self.parts.tokenizer, m.trust_remote_code)
        except OSError as err:
            raise CheckpointError(f"the final model could not be written to {out}: {err}; "
                                  "the last checkpoint holds the same weights") from None  # fmt: skip
        log.info("final model written: %s", out)
        return out

    def _save(self, final: bool) -> None:
        try:
            self.save_checkpoint()
        except OSError as err:
            where = f"{self.run_dir / f'global_step_{self.global_step}'}"
            if final:
                last = f"step {self._last_saved}" if self._last_saved >= 0 else "none"
                raise CheckpointError(
                    f"the final checkpoint could not be written to {where}: {err}; "
                    f"last good checkpoint: {last}"
                ) from None
            log.error("checkpoint %s could not be written (%s); training goes on and the next "
                      "save retries", where, err)  # fmt: skip

    def _load_checkpoint(self, path: Path) -> None:
        p = self.parts
        state = load_state(path)
        for name, worker in self._trained().items():
            try:
                worker.load_model_state(read_weights(path / f"{name}.safetensors"))
            except KeyError as err:  # the checkpoint is of another model
                raise CheckpointError(f"{path / name}.safetensors: {err}") from None
        p.actor.load_state_dict(state["actor"])
        if p.critic is not None:
            p.critic.load_state_dict(state["critic"])
        if p.kl_ctrl is not None:
            p.kl_ctrl.load_state_dict(state["kl_ctrl"])
        p.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.global_step = self._last_saved = int(state["global_step"])
        log.info("resumed from %s at step %d", path, self.global_step)


def _every(freq: int, step: int) -> bool:
    """``freq > 0`` and ``step`` is a multiple of it (the config's "<= 0 = never" rule)."""
    return freq > 0 and step % freq == 0


__all__ = ["Trainer"]
