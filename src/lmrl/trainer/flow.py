"""Flow-GRPO runs (``lmrl train-flow``): the image model's RL loop with checkpoints and resume.

One step: the step's ``data.train_batch_size`` prompts (a `PromptSampler`, shuffled per epoch)
are each sampled ``sampler.n`` times along the SDE (`lmrl.flow.FlowSampler`); the reward scores
the images; `lmrl.flow.flow_advantages` normalizes them within each prompt's group; and
`lmrl.flow.FlowGRPO` updates the model. Validation samples the validation prompts with the
ODE from fixed noise (the same images every time, so the curve shows the model, not the
noise) and writes them as a PNG grid (``samples/step_<N>.png``).

Resume is exact: the noise of step ``N`` comes from a generator seeded with ``(seed, N)``, the
prompt order from the sampler's state, and a checkpoint holds the model's weights, the
optimizer and the sampler; a run killed at any point and restarted with the same command
continues from its last checkpoint and ends with the weights an uninterrupted run ends with.

Metrics (``metrics.jsonl``): ``critic/score/mean`` (the reward of the step's images, the name
``lmrl plot`` draws), ``critic/score/std``, ``flow/zero_spread_groups`` (prompts whose images
all scored the same: they teach nothing), the means of what the reward returns beside its
score (``flow/check/<name>``: the ``geneval`` checks), the update's ``actor/*``,
``val/<source>/reward/mean`` with its checks (``val/<source>/check/<name>``), and timings
(``timing_s/sample``, ``timing_s/reward``, ``timing_s/update``, ``perf/images_per_s``).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmrl.config.flow import FlowConfig
from lmrl.config.loader import save_config
from lmrl.data.sampler import PromptSampler
from lmrl.data.shapes import ATTRIBUTES, NUM_ATTRIBUTES, attribute_vector
from lmrl.errors import CheckpointError, DataError, ModelError
from lmrl.flow.ema import WeightEMA
from lmrl.flow.grpo import FlowGRPO, FlowGRPOConfig, flow_advantages
from lmrl.flow.image_model import ImageFlow
from lmrl.flow.rewards import load_image_reward
from lmrl.flow.rollout import FlowSampler
from lmrl.logging import make_trackers
from lmrl.models.loading import resolve_device
from lmrl.trainer.checkpoint import latest_checkpoint, load_state, read_weights, save_checkpoint
from lmrl.trainer.metrics import zero_spread_fraction
from lmrl.trainer.resume import check_run_dir

log = logging.getLogger("lmrl.flow")

__all__ = ["FlowTrainer", "image_grid", "read_prompts"]


def read_prompts(files: str | list[str]) -> list[dict[str, Any]]:
    """Prompt rows of parquet files: ``{"prompt": text, "attributes": {...}, "data_source"}``.

    Raises:
        DataError: a file that cannot be read, or rows without the attributes the model is
            conditioned on (``reward_model.ground_truth`` with shape, colour, count, position).
    """
    import pyarrow.parquet as pq

    rows = []
    for path in [files] if isinstance(files, str) else files:
        try:
            table = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as err:
            raise DataError(f"cannot read prompt file {path}: {err}") from None
        for i, row in enumerate(table):
            truth = (row.get("reward_model") or {}).get("ground_truth")
            if not isinstance(truth, dict) or any(k not in truth for k in ATTRIBUTES):
                raise DataError(
                    f"{path} row {i}: reward_model.ground_truth must hold the attributes "
                    f"{list(ATTRIBUTES)} that the image model is conditioned on (write the "
                    "prompts with `lmrl tasks shapes --out DIR`)"
                )
            prompt = row.get("prompt")
            if isinstance(prompt, list | np.ndarray):
                prompt = " ".join(str(m.get("content", "")) for m in prompt)
            rows.append(
                {
                    "prompt": str(prompt),
                    "attributes": {k: truth[k] for k in ATTRIBUTES},
                    "data_source": row.get("data_source", "shapes"),
                }
            )
    if not rows:
        raise DataError(f"no prompts in {files}")
    return rows


def image_grid(images: torch.Tensor, columns: int, scale: int = 4) -> np.ndarray:
    """(B, 3, H, W) in [0, 1] -> one (rows*H*scale, columns*W*scale, 3) uint8 array, row-major,
    with a 1-pixel grey border around each image."""
    b, _, h, w = images.shape
    rows = -(-b // columns)
    pad = torch.full((rows * columns, 3, h + 2, w + 2), 0.3)
    pad[:b, :, 1:-1, 1:-1] = images.detach().float().clamp(0, 1).cpu()
    grid = pad.view(rows, columns, 3, h + 2, w + 2).permute(0, 3, 1, 4, 2)
    grid = grid.reshape(rows * (h + 2), columns * (w + 2), 3)
    grid = grid.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    return (grid.numpy() * 255).round().astype(np.uint8)


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


class FlowTrainer:
    """A Flow-GRPO run from a resolved ``FlowConfig``; ``fit()`` runs it all.

    Raises (from the constructor):
        DataError: unreadable prompts, or fewer than ``data.train_batch_size`` of them;
        ModelError: no image model at ``model.path``, or one conditioned on another vector,
            or trainer.device=cuda without CUDA;
        CheckpointError: an unwritable run directory; RewardError: a bad reward.
    """

    def __init__(self, cfg: FlowConfig) -> None:
        self.cfg = cfg
        t = cfg.trainer
        self.run_dir = Path(t.default_local_dir)
        check_run_dir(self.run_dir)
        torch.manual_seed(t.seed)
        self.train_prompts = read_prompts(cfg.data.train_files)
        self.val_prompts = read_prompts(cfg.data.val_files) if cfg.data.val_files else []
        if cfg.data.train_batch_size > len(self.train_prompts):
            raise DataError(
                f"data.train_batch_size={cfg.data.train_batch_size} is more than the "
                f"{len(self.train_prompts)} prompts of {cfg.data.train_files}"
            )
        self.device = resolve_device(t.device)
        model = ImageFlow.load(cfg.model.path)
        if model.config["cond_dim"] != NUM_ATTRIBUTES:
            raise ModelError(
                f"model.path={cfg.model.path} is conditioned on {model.config['cond_dim']} "
                f"values, the prompts' attribute vector has {NUM_ATTRIBUTES}"
            )
        self.image_shape = (
            model.config["channels"],
            model.config["image_size"],
            model.config["image_size"],
        )
        model = model.to(self.device)
        reference: Any = None
        if cfg.model.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model,
                LoraConfig(
                    r=cfg.model.lora_rank,
                    lora_alpha=cfg.model.lora_alpha,
                    target_modules=list(cfg.model.target_modules),
                ),
            )
            reference = "adapter" if cfg.actor.beta > 0 else None
        elif cfg.actor.beta > 0:
            reference = copy.deepcopy(model).requires_grad_(False).eval()
        self.model = model
        s, a = cfg.sampler, cfg.actor
        self.sampler = FlowSampler(
            num_steps=s.num_steps, noise_level=s.noise_level, shift=s.shift,
            sde_start=s.sde_start, sde_steps=s.sde_steps, timestep_fraction=s.timestep_fraction,
            guidance_scale=s.guidance_scale, reduce=s.logprob_reduce,
        )  # fmt: skip
        self.val_sampler = FlowSampler(
            num_steps=s.val_num_steps, noise_level=0.0, shift=s.shift,
            guidance_scale=s.guidance_scale,
        )  # fmt: skip
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=a.optim.lr, weight_decay=a.optim.weight_decay, betas=tuple(a.optim.betas)
        )
        update = FlowGRPOConfig(
            clip_range=a.clip_range, adv_clip_max=a.adv_clip_max,
            norm_adv_by_std=a.norm_adv_by_std, beta=a.beta, std_scale=a.std_scale,
            mini_batch_size=a.ppo_mini_batch_size, micro_batch_size=a.micro_batch_size,
            ppo_epochs=a.ppo_epochs, max_grad_norm=a.max_grad_norm,
        )  # fmt: skip
        self.ema = WeightEMA(params, a.ema_decay, a.ema_every) if a.ema else None
        self.grpo = FlowGRPO(
            model, self.sampler, self.optimizer, update, reference=reference, ema=self.ema
        )
        self.reward = load_image_reward(cfg.reward.name, cfg.reward.path)
        self.prompts = PromptSampler(
            len(self.train_prompts), cfg.data.train_batch_size, seed=cfg.data.seed
        )
        self.global_step = 0
        self.history: list[dict[str, float]] = []
        self._resume()
        save_config(cfg, self.run_dir / "config.yaml", command="lmrl train-flow")
        self.tracker = make_trackers(
            cfg.trainer.logger, self.run_dir, t.project_name, t.experiment_name,
            config_dict=asdict(cfg), total_steps=t.total_training_steps,
            start_step=self.global_step,
        )  # fmt: skip

    # ------------------------------------------------------------------ pieces
    def _cond(self, rows: list[dict]) -> torch.Tensor:
        vectors = np.stack([attribute_vector(r["attributes"]) for r in rows])
        return torch.tensor(vectors, device=self.device)

    def _uncond(self, cond: torch.Tensor) -> torch.Tensor | None:
        return torch.zeros_like(cond) if self.cfg.sampler.guidance_scale != 1.0 else None

    def _score(self, images: torch.Tensor, rows: list[dict]) -> tuple[torch.Tensor, dict]:
        """Rewards of images in [-1, 1], and the means of what the reward returns beside them
        (``flow/check/<name>``: the geneval checks)."""
        pixels = ((images.cpu() + 1) / 2).clamp(0, 1)
        prompts, metadata = [r["prompt"] for r in rows], [r["attributes"] for r in rows]
        scores, extras = self.reward.score(pixels, prompts, metadata)
        return scores, {f"flow/check/{k}": float(v.mean()) for k, v in extras.items()}

    def step(self) -> dict[str, float]:
        """One Flow-GRPO step; returns its metrics."""
        n, step = self.cfg.sampler.n, self.global_step + 1
        rows = [self.train_prompts[i] for i in self.prompts.next_batch()]
        rows_n = [r for r in rows for _ in range(n)]
        cond = self._cond(rows_n)
        gen = torch.Generator(self.device).manual_seed(_seed(self.cfg.trainer.seed, "step", step))
        noise = torch.randn(len(rows_n), *self.image_shape, generator=gen, device=self.device)
        uncond = self._uncond(cond)
        start = time.perf_counter()
        self.model.eval()
        batch = self.sampler.sample(self.model, cond, noise, uncond=uncond, generator=gen)
        sampled = time.perf_counter()
        scores, extra = self._score(batch["images"], rows_n)
        scored = time.perf_counter()
        groups = [i // n for i in range(len(rows_n))]
        adv = flow_advantages(
            scores, groups, self.cfg.actor.adv_clip_max, self.cfg.actor.norm_adv_by_std
        )
        old = (
            self.grpo.old_log_probs(batch, uncond)
            if self.cfg.actor.recompute_old_log_probs
            else None
        )
        metrics = self.grpo.update(batch, adv.to(self.device), old, uncond=uncond, generator=gen)
        done = time.perf_counter()
        metrics.update(extra)
        metrics.update(
            {
                "critic/score/mean": float(scores.mean()),
                "critic/score/std": float(scores.std()),
                "flow/zero_spread_groups": zero_spread_fraction(scores, groups),
                "timing_s/sample": sampled - start,
                "timing_s/reward": scored - sampled,
                "timing_s/update": done - scored,
                "timing_s/step": done - start,
                "perf/images_per_s": len(rows_n) / (done - start),
            }
        )
        self.global_step = step
        return metrics

    @torch.no_grad()
    def validate(self, images_per_prompt: int | None = None) -> dict[str, float]:
        """Reward (and the reward's checks) of ODE samples of the validation prompts from fixed
        noise (``trainer.val_images_per_prompt`` each); writes ``samples/step_<N>.png`` (one row
        per prompt)."""
        if not self.val_prompts:
            return {}
        images_per_prompt = images_per_prompt or self.cfg.trainer.val_images_per_prompt
        rows = [r for r in self.val_prompts for _ in range(images_per_prompt)]
        cond = self._cond(rows)
        gen = torch.Generator().manual_seed(_seed(self.cfg.trainer.seed, "validation"))
        noise = torch.randn(len(rows), *self.image_shape, generator=gen).to(self.device)
        self.model.eval()
        with self.ema.applied() if self.ema is not None else nullcontext():
            images = self.val_sampler.sample(self.model, cond, noise, uncond=self._uncond(cond))
        images = images["images"].cpu()  # one copy to the host: scored, then drawn
        scores, checks = self._score(images, rows)
        out = self.run_dir / "samples" / f"step_{self.global_step}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        from PIL import Image

        Image.fromarray(image_grid(((images + 1) / 2), images_per_prompt)).save(out)
        source = self.val_prompts[0]["data_source"]
        return {
            f"val/{source}/reward/mean": float(scores.mean()),
            **{f"val/{source}/{key.removeprefix('flow/')}": v for key, v in checks.items()},
        }

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """A checkpoint of the run at ``global_step`` (atomic; see `lmrl.trainer.checkpoint`)."""
        weights = {
            k: v.detach().to("cpu", copy=True).contiguous()
            for k, v in self.model.state_dict().items()
        }
        state = {
            "global_step": self.global_step,
            "optimizer": self.optimizer.state_dict(),
            "prompts": self.prompts.state_dict(),
        }
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return save_checkpoint(self.run_dir, self.global_step, {"model": weights}, state)

    def _resume(self) -> None:
        if self.cfg.trainer.resume_mode != "auto":
            return
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return
        try:
            self.model.load_state_dict(read_weights(path / "model.safetensors"))
            state = load_state(path)
            self.optimizer.load_state_dict(state["optimizer"])
            self.prompts.load_state_dict(state["prompts"])
            if self.ema is not None:
                if "ema" not in state:
                    raise ValueError("it holds no EMA (the run started without actor.ema)")
                self.ema.load_state_dict(state["ema"])
        except (RuntimeError, KeyError, ValueError) as err:
            raise CheckpointError(
                f"cannot resume from {path}: {err} (a checkpoint of another model or config? "
                "use another trainer.default_local_dir or trainer.resume_mode=disable)"
            ) from None
        self.global_step = int(state["global_step"])
        log.info("resumed from %s (step %d)", path, self.global_step)

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict[str, Any]:
        """Run to ``trainer.total_training_steps``: validation at the start, every
        ``test_freq`` steps and at the end; checkpoints every ``save_freq`` steps and at the end.

        Returns:
            ``{"history": [metrics per step], "val": {step: metrics}}``.
        """
        t = self.cfg.trainer
        val: dict[int, dict[str, float]] = {}
        try:
            if self.global_step == 0 and self.val_prompts:
                val[0] = self.validate()
                self.tracker.log(val[0], step=0)
            while self.global_step < t.total_training_steps:
                metrics = self.step()
                step = self.global_step
                last = step == t.total_training_steps
                if self.val_prompts and (last or (t.test_freq > 0 and step % t.test_freq == 0)):
                    val[step] = self.validate()
                    metrics.update(val[step])
                self.history.append(metrics)
                self.tracker.log(metrics, step=step)
                if last or (t.save_freq > 0 and step % t.save_freq == 0):
                    self.save()
        finally:
            self.tracker.close()
        return {"history": self.history, "val": val}
