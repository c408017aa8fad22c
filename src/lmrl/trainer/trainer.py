"""The RL trainer: one step is the numbered pipeline of DESIGN.md, each stage one timed call.

    1 rollout     prompts -> n responses each (plus a greedy baseline when the estimator
                  needs ``reward_baselines``, i.e. ReMax)
    2 reward      token_level_scores (DAPO dynamic sampling loops 1-2 until the batch is full)
    3 old_log_prob  decoupled (recomputed), bypass (the rollout's own) or rollout correction
    4 ref         ref_log_probs, when a KL term is on
    5 values      the critic's, when the estimator needs values
    6 adv         KL in the reward (optional), then the registry's estimator
    7 critic      clipped value loss
    8 actor       the policy loss

The trainer never branches on an algorithm's name: what a stage must prepare comes from the
registries (``advantage_estimators.needs``) and the config's switches.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch

from lmrl.algos import (
    advantage_estimators,
    apply_kl_penalty,
    make_kl_controller,
    rollout_importance_weights,
)
from lmrl.batch import Batch
from lmrl.config import Config, config_to_dict, save_config
from lmrl.data import PromptSampler, RLDataset
from lmrl.logging import make_trackers
from lmrl.models import build_reference, load_causal_lm, load_tokenizer
from lmrl.models.critic import load_critic
from lmrl.models.lora import apply_lora
from lmrl.rewards import load_reward_fn, make_reward_manager
from lmrl.rollout import SamplingParams, build_engine
from lmrl.trainer.checkpoint import (
    check_checkpoint,
    latest_checkpoint,
    load_model_state,
    load_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from lmrl.trainer.metrics import StageTimer, data_metrics, throughput, to_floats
from lmrl.trainer.validation import validation_metrics
from lmrl.workers.actor import ActorWorker
from lmrl.workers.critic import CriticWorker

log = logging.getLogger("lmrl.trainer")


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but CUDA is not available; use trainer.device=cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """Builds every part of a run from a resolved ``Config`` and runs its steps.

    Args:
        cfg: a config from ``lmrl.config.load_config`` (resolved and validated).
        evaluate_only: build for ``validate()`` alone (``lmrl eval``): the run directory is
            read, never written (no config, no trackers, no checkpoints).
    """

    def __init__(self, cfg: Config, *, evaluate_only: bool = False) -> None:
        self.cfg = cfg
        seed_everything(cfg.trainer.seed)
        self.device = resolve_device(cfg.trainer.device)
        self.run_dir = Path(cfg.trainer.default_local_dir)
        if not evaluate_only:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")

        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
        self.train_data = self._dataset(cfg.data.train_files)
        self.val_data = self._dataset(cfg.data.val_files) if cfg.data.val_files else None
        gen_prompts = cfg.data.gen_batch_size if cfg.algorithm.filter_groups.enable else None
        self.sampler = PromptSampler(
            len(self.train_data),
            gen_prompts or cfg.data.train_batch_size,
            seed=cfg.data.seed,
            shuffle=cfg.data.shuffle,
        )
        steps_per_epoch = len(self.train_data) // cfg.data.train_batch_size
        self.total_steps = (
            cfg.trainer.total_training_steps or steps_per_epoch * cfg.trainer.total_epochs
        )

        # models and workers
        policy = load_causal_lm(
            cfg.model.path,
            dtype=cfg.model.dtype,
            device=self.device,
            trust_remote_code=cfg.model.trust_remote_code,
            gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        )
        if cfg.model.lora_rank > 0:
            policy = apply_lora(
                policy, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.target_modules
            )
        self.estimator = advantage_estimators.get(cfg.algorithm.adv_estimator)
        self.estimator_needs = advantage_estimators.needs(cfg.algorithm.adv_estimator)
        self.use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        # built before any update: a frozen copy of the initial policy, or LoRA disabled
        self.ref = build_reference(policy) if self.use_ref else None
        self.actor = ActorWorker(
            policy,
            cfg.actor,
            rollout_n=cfg.rollout.n,
            max_response_length=cfg.data.max_response_length,
            temperature=cfg.rollout.temperature,
            log_prob_micro_batch_size=cfg.rollout.log_prob_micro_batch_size,
            total_steps=self.total_steps,
            seed=cfg.trainer.seed,
        )
        self.critic = None
        if cfg.critic.enable:
            critic_model = load_critic(
                cfg.critic.model.path,
                dtype=cfg.model.dtype,
                device=self.device,
                trust_remote_code=cfg.model.trust_remote_code,
                gradient_checkpointing=cfg.critic.model.enable_gradient_checkpointing,
            )
            self.critic = CriticWorker(
                critic_model,
                cfg.critic,
                rollout_n=cfg.rollout.n,
                max_response_length=cfg.data.max_response_length,
                total_steps=self.total_steps,
                seed=cfg.trainer.seed,
            )
        self.engine = build_engine(cfg.rollout.name, policy, self.tokenizer, seed=cfg.trainer.seed)
        self.sampling = SamplingParams(
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.data.max_response_length,
            do_sample=cfg.rollout.do_sample,
            stop=list(cfg.rollout.stop),
        )
        self.reward_fn = self._reward_manager()
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = (
            make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
            if cfg.algorithm.use_kl_in_reward
            else None
        )
        self.global_step = 0
        self._resume()
        if evaluate_only:
            return
        self.tracker = make_trackers(
            cfg.trainer.logger,
            self.run_dir,
            cfg.trainer.project_name,
            cfg.trainer.experiment_name,
            config_dict=config_to_dict(cfg),
            total_steps=self.total_steps,
            start_step=self.global_step,
        )

    # ------------------------------------------------------------------ building
    def _dataset(self, files) -> RLDataset:
        d = self.cfg.data
        return RLDataset(
            files,
            self.tokenizer,
            prompt_key=d.prompt_key,
            reward_fn_key=d.reward_fn_key,
            max_prompt_length=d.max_prompt_length,
            filter_overlong_prompts=d.filter_overlong_prompts,
            truncation=d.truncation,
        )

    def _reward_manager(self):
        r = self.cfg.reward
        custom = r.custom_reward_function
        reward_fns = (
            load_reward_fn(custom.path, custom.name, kwargs=custom.reward_kwargs)
            if custom.path
            else None
        )
        options = {}
        if r.manager == "dapo":
            options = {
                "overlong_buffer": dataclasses.asdict(r.overlong_buffer),
                "max_response_length": self.cfg.data.max_response_length,
            }
        return make_reward_manager(
            r.manager,
            self.tokenizer,
            reward_fns=reward_fns,
            num_workers=r.num_workers,
            timeout_s=r.timeout_s,
            reward_fn_key=self.cfg.data.reward_fn_key,
            **options,
        )

    # ---------------------------------------------------------------------- step
    def step(self) -> dict[str, float]:
        """One training step; returns its metrics as floats."""
        cfg = self.cfg
        timer = StageTimer(on_enter=_fault_point)
        metrics: dict = {}
        with timer("step"):
            # 1-2. rollout and reward (DAPO dynamic sampling may loop over both)
            batch = self._rollout_and_score(timer, metrics)
            mask = batch["response_mask"]

            # 3. old log-probs: pi_old of the PPO ratio
            mode = cfg.rollout.log_prob_mode
            if mode == "bypass":
                batch["old_log_probs"] = batch["rollout_log_probs"]
            elif self._old_log_prob_is_update_forward(batch):
                metrics["actor/old_log_prob_recomputed"] = 0.0
            else:
                with timer("old_log_prob"):
                    batch["old_log_probs"], _ = self.actor.compute_log_probs(batch)
                metrics["actor/old_log_prob_recomputed"] = 1.0
            if mode == "rollout_correction":
                c = cfg.rollout.correction
                weights, mask, is_metrics = rollout_importance_weights(
                    batch["old_log_probs"], batch["rollout_log_probs"], mask,
                    level=c.level, mode=c.mode, threshold=c.threshold,
                    threshold_lower=c.threshold_lower,
                )  # fmt: skip
                batch["rollout_is_weights"], batch["response_mask"] = weights, mask
                metrics |= {f"rollout_corr/{k}": v for k, v in is_metrics.items()}

            # 4. reference log-probs
            if self.ref is not None:
                with timer("ref"):
                    micro = cfg.ref.log_prob_micro_batch_size or len(batch)
                    batch["ref_log_probs"], _ = self.ref.compute_log_probs(
                        batch, micro, cfg.rollout.temperature
                    )

            # 5. values
            if self.critic is not None:
                with timer("values"):
                    batch["values"] = self.critic.compute_values(batch)

            # 6. advantages (KL in the reward first)
            with timer("adv"):
                rewards = batch["token_level_scores"]
                if self.kl_ctrl is not None:
                    rewards, kl_metrics = apply_kl_penalty(
                        rewards, batch["old_log_probs"], batch["ref_log_probs"], mask,
                        self.kl_ctrl, cfg.algorithm.kl_penalty,
                    )  # fmt: skip
                    metrics |= {f"actor/{k}": v for k, v in kl_metrics.items()}
                batch["token_level_rewards"] = rewards
                a = cfg.algorithm
                batch["advantages"], batch["returns"] = self.estimator(
                    rewards,
                    mask,
                    index=batch["uid"],
                    values=batch.get("values"),
                    reward_baselines=batch.get("reward_baselines"),
                    gamma=a.gamma,
                    lam=a.lam,
                    norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo,
                )

            # 7. critic update
            if self.critic is not None:
                with timer("update_critic"):
                    metrics |= self.critic.update_critic(batch)

            # 8. actor update (after the critic's warm-up)
            if self.global_step >= cfg.trainer.critic_warmup:
                with timer("update_actor"):
                    metrics |= self.actor.update_policy(batch)

        self.global_step += 1
        out = to_floats(metrics)
        out |= data_metrics(batch, cfg.data.max_response_length)
        out |= timer.metrics()
        out["perf/throughput"] = throughput(batch, timer.seconds["step"])
        out["training/step"] = float(self.global_step)
        out["training/epoch"] = float(self.sampler.epoch)
        self.last_batch = batch
        return out

    def _old_log_prob_is_update_forward(self, batch: Batch) -> bool:
        """True when a separate old-log-prob pass would compute exactly what the update's
        own first forward computes: one epoch, one mini-batch (so no optimizer step happens
        before any micro-batch's forward), and nothing needs them before the update."""
        cfg = self.cfg
        return (
            cfg.rollout.log_prob_mode == "decoupled"
            and cfg.actor.ppo_epochs == 1
            and len(batch) <= cfg.actor.ppo_mini_batch_size * cfg.rollout.n
            and not cfg.algorithm.use_kl_in_reward
            and self.global_step >= cfg.trainer.critic_warmup
        )

    def _rollout_and_score(self, timer: StageTimer, metrics: dict) -> Batch:
        """Stages 1-2. With ``algorithm.filter_groups`` (DAPO dynamic sampling), groups whose
        responses all have the same filter metric are dropped and more prompts are generated
        until ``data.train_batch_size`` groups are kept or ``max_num_gen_batches`` is hit."""
        cfg = self.cfg
        fg = cfg.algorithm.filter_groups
        n, target = cfg.rollout.n, cfg.data.train_batch_size
        kept: list[Batch] = []
        kept_groups, gen_batches, total_groups = 0, 0, 0
        while True:
            prompts = self.train_data.get_batch(self.sampler.next_batch())
            # a seed per (step, generation round): a resumed run samples the same responses
            seed = self.cfg.trainer.seed + 1_000_003 * self.global_step + gen_batches
            with timer("gen"):
                batch = self.engine.generate(
                    prompts, n, dataclasses.replace(self.sampling, seed=seed)
                )
            if "reward_baselines" in self.estimator_needs:
                with timer("gen_baseline"):
                    batch["reward_baselines"] = self._greedy_baseline(prompts, n)
            with timer("reward"):
                extras = self._score(batch, metrics)
            if not fg.enable:
                return batch
            gen_batches += 1
            groups = len(batch) // n
            total_groups += groups
            value = self._filter_metric(batch, extras, fg.metric).reshape(groups, n)
            spread = value.max(axis=1) > value.min(axis=1)
            keep = np.repeat(spread, n)
            if keep.any():
                kept.append(batch.index(keep))
                kept_groups += int(spread.sum())
            if kept_groups >= target or 0 < fg.max_num_gen_batches <= gen_batches:
                break
        metrics["filter_groups/gen_batches"] = float(gen_batches)
        metrics["filter_groups/kept_fraction"] = kept_groups / max(total_groups, 1)
        if not kept:
            log.warning(
                "filter_groups: every group had zero spread in %d generation batches; "
                "training on the last batch unfiltered",
                gen_batches,
            )
            return batch
        return concat_rollouts(kept, self.engine.pad_id).index(slice(0, target * n))

    def _greedy_baseline(self, prompts: Batch, n: int) -> torch.Tensor:
        """ReMax's baseline: the reward of one greedy response per prompt, repeated n times."""
        greedy = SamplingParams(
            do_sample=False,
            max_new_tokens=self.cfg.data.max_response_length,
            temperature=self.cfg.rollout.temperature,
            stop=list(self.cfg.rollout.stop),
        )
        baseline = self.engine.generate(prompts, 1, greedy)
        scores = self.reward_fn(baseline).token_level_scores.sum(-1)
        return scores.repeat_interleave(n)

    def _score(self, batch: Batch, metrics: dict) -> dict[str, np.ndarray]:
        result = self.reward_fn(batch)
        batch["token_level_scores"] = result.token_level_scores.to(batch["responses"].device)
        for key, value in result.extras.items():
            finite = np.asarray(value, dtype=np.float64)
            finite = finite[np.isfinite(finite)]
            if finite.size:
                metrics[f"reward/{key}/mean"] = float(finite.mean())
        for key, value in result.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + float(value)
        return result.extras

    @staticmethod
    def _filter_metric(batch: Batch, extras: dict[str, np.ndarray], name: str) -> np.ndarray:
        if name in ("seq_reward", "seq_final_reward"):
            return batch["token_level_scores"].sum(-1).double().cpu().numpy()
        if name not in extras:
            raise ValueError(
                f"algorithm.filter_groups.metric={name!r} is not a score extra; "
                f"valid: seq_reward, seq_final_reward, {', '.join(sorted(extras))}"
            )
        return np.nan_to_num(np.asarray(extras[name], dtype=np.float64))

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Generate on the validation prompts with ``rollout.val_kwargs`` and score them.

        Returns:
            Per data source ``val/<source>/mean@k``, ``pass@k``, ``reward/mean`` and ``acc``
            (when the scorer reports one), ``k = val_kwargs.n``; empty without val files.
        """
        if self.val_data is None:
            return {}
        vk = self.cfg.rollout.val_kwargs
        sampling = SamplingParams(
            temperature=vk.temperature if vk.do_sample else (vk.temperature or 1.0),
            top_p=vk.top_p,
            top_k=vk.top_k,
            max_new_tokens=self.cfg.data.max_response_length,
            do_sample=vk.do_sample,
            stop=list(self.cfg.rollout.stop),
            seed=self.cfg.trainer.seed,
        )
        size = self.cfg.data.val_batch_size or len(self.val_data)
        sources, uids, scores, accs = [], [], [], []
        for start in range(0, len(self.val_data), size):
            indices = list(range(start, min(start + size, len(self.val_data))))
            out = self.engine.generate(self.val_data.get_batch(indices), vk.n, sampling)
            result = self.reward_fn(out)
            sources += list(out["data_source"])
            uids += list(out["uid"])
            scores += result.token_level_scores.sum(-1).tolist()
            accs += list(result.extras["acc"]) if "acc" in result.extras else []
        return validation_metrics(sources, uids, scores, accs or None, k=vk.n)

    # ----------------------------------------------------------------------- fit
    def fit(self) -> list[dict[str, float]]:
        """Run the remaining steps: log each, validate every ``test_freq`` steps (and before
        the first and after the last), checkpoint every ``save_freq`` steps and at the end.
        SIGINT or SIGTERM finishes the current step, saves and returns."""
        t = self.cfg.trainer
        history = []
        start = time.perf_counter()
        if t.val_before_train and self.global_step == 0 and self.val_data is not None:
            self.tracker.log(self.validate(), step=0)
        with _StopOnSignal() as stop:
            while self.global_step < self.total_steps and not stop.requested:
                metrics = self.step()
                last = self.global_step == self.total_steps
                if self.val_data is not None and (last or _every(t.test_freq, self.global_step)):
                    metrics |= self.validate()
                history.append(metrics)
                self.tracker.log(metrics, step=self.global_step)
                if _every(t.log_generations_freq, self.global_step):
                    self.tracker.log_generations(self._generation_rows(), step=self.global_step)
                if _every(t.save_freq, self.global_step):
                    self.save_checkpoint()
            if stop.requested:
                log.warning("signal %s: saving a checkpoint and exiting", stop.requested)
        if self._last_saved != self.global_step:
            self.save_checkpoint()
        log.info("ran %d steps in %.1fs", len(history), time.perf_counter() - start)
        self.close()
        return history

    def _generation_rows(self, limit: int = 8) -> list[dict]:
        """Prompt, response and score of the first samples of the last step's batch."""
        batch = self.last_batch.index(slice(0, limit))
        decode = self.tokenizer.batch_decode
        prompts = decode(batch["prompts"], skip_special_tokens=True)
        responses = [
            self.tokenizer.decode(ids[mask], skip_special_tokens=True)
            for ids, mask in zip(batch["responses"], batch["response_mask"], strict=True)
        ]
        scores = batch["token_level_scores"].sum(-1).tolist()
        return [
            {"prompt": p, "response": r, "score": sc, "data_source": src}
            for p, r, sc, src in zip(prompts, responses, scores, batch["data_source"], strict=True)
        ]

    def close(self) -> None:
        """Stop the reward workers and close the trackers."""
        self.reward_fn.close()
        self.tracker.close()

    # ---------------------------------------------------------------- checkpoints
    def _models(self) -> dict[str, torch.nn.Module]:
        models = {"actor": self.actor.model}
        if self.critic is not None:
            models["critic"] = self.critic.model
        return models

    def state_dict(self) -> dict:
        """Everything but the weights that a resumed run needs to continue exactly."""
        state = {
            "global_step": self.global_step,
            "actor": self.actor.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
        }
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        if self.kl_ctrl is not None:
            state["kl_ctrl"] = self.kl_ctrl.state_dict()
        return state

    def save_checkpoint(self) -> Path:
        path = save_checkpoint(
            self.run_dir, self.global_step, self._models(), self.state_dict(),
            self.cfg.trainer.max_ckpt_to_keep, before_manifest=lambda: _fault_point("save"),
        )  # fmt: skip
        self._last_saved = self.global_step
        log.info("checkpoint saved: %s", path)
        return path

    def _resume(self) -> None:
        """``trainer.resume_mode``: auto (latest complete checkpoint of the run dir, if any),
        disable, or a checkpoint path."""
        self._last_saved = -1
        mode = self.cfg.trainer.resume_mode
        if mode == "disable":
            return
        if mode == "auto":
            path = latest_checkpoint(self.run_dir)
            if path is None:
                return
        else:
            path = Path(mode)
            problem = check_checkpoint(path)
            if problem:
                raise ValueError(f"trainer.resume_mode={mode}: not a usable checkpoint: {problem}")
        state = load_state(path)
        for name, model in self._models().items():
            load_model_state(model, path / f"{name}.safetensors")
        self.actor.load_state_dict(state["actor"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        if self.kl_ctrl is not None:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.global_step = self._last_saved = int(state["global_step"])
        log.info("resumed from %s at step %d", path, self.global_step)


class _StopOnSignal:
    """Within the block, SIGINT/SIGTERM set ``requested`` instead of killing the process."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _every(freq: int, step: int) -> bool:
    """``freq > 0`` and ``step`` is a multiple of it (the config's "<= 0 = never" rule)."""
    return freq > 0 and step % freq == 0


def _fault_point(name: str) -> None:
    """Testing hook: ``LMRL_FAULT=<stage>@<n>`` SIGKILLs the process the n-th time the stage
    named ``<stage>`` starts (stages: gen, reward, old_log_prob, ref, values, adv,
    update_critic, update_actor, save). Used to prove exact resume after a hard kill."""
    spec = os.environ.get("LMRL_FAULT")
    if not spec or not spec.startswith(f"{name}@"):
        return
    _FAULT_COUNTS[name] = _FAULT_COUNTS.get(name, 0) + 1
    if _FAULT_COUNTS[name] == int(spec.split("@", 1)[1]):
        os.kill(os.getpid(), signal.SIGKILL)


_FAULT_COUNTS: dict[str, int] = {}


def concat_rollouts(batches: list[Batch], pad_id: int) -> Batch:
    """Concatenate rollout batches whose prompt and response widths differ.

    Prompts are left-padded and responses right-padded to the widest; ``input_ids``,
    ``attention_mask`` and ``position_ids`` are rebuilt from them; the other (N, T) tensors
    are right-padded with zeros (False for masks).
    """
    width_p = max(b["prompts"].shape[1] for b in batches)
    width_t = max(b["responses"].shape[1] for b in batches)
    rebuilt = ("prompts", "input_ids", "attention_mask", "position_ids")
    aligned = []
    for b in batches:
        p, t = b["prompts"].shape[1], b["responses"].shape[1]
        out = b.select(*b.keys())
        prompt_mask = _pad(b["attention_mask"][:, :p], width_p, False, left=True)
        out["prompts"] = _pad(b["prompts"], width_p, pad_id, left=True)
        for key in b.tensor_keys():
            x = b[key]
            if key not in rebuilt and x.dim() == 2 and x.shape[1] == t:
                out[key] = _pad(x, width_t, pad_id if key == "responses" else 0)
        attention = torch.cat([prompt_mask, out["response_mask"]], dim=1)
        out["input_ids"] = torch.cat([out["prompts"], out["responses"]], dim=1)
        out["attention_mask"] = attention
        out["position_ids"] = (attention.long().cumsum(-1) - 1).clamp(min=0)
        aligned.append(out)
    return Batch.concat(aligned)


def _pad(x: torch.Tensor, width: int, value, left: bool = False) -> torch.Tensor:
    """Pad a (N, L) tensor to (N, width) with ``value``, on the right (or the left)."""
    fill = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
    return torch.cat([fill, x] if left else [x, fill], dim=1)


__all__ = ["Trainer", "concat_rollouts", "resolve_device"]
