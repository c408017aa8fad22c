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
score (``flow/check/<name>``: the ``geneval`` checks), beside a reward of another kind the
geneval checks of the same images (``flow/fidelity/*``: do they still follow their prompts?),
the update's ``actor/*``,
``val/<source>/reward/mean`` with its checks (``val/<source>/check/<name>``), and timings
(``timing_s/sample``, ``timing_s/reward``, ``timing_s/update``, ``perf/images_per_s``).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from lmrl.config.flow import FlowConfig
from lmrl.data.sampler import PromptSampler
from lmrl.data.shapes import ATTRIBUTES, NUM_ATTRIBUTES
from lmrl.errors import DataError, ModelError, RewardError
from lmrl.flow.ema import WeightEMA
from lmrl.flow.geneval import check_geneval_rows, geneval_coverage, geneval_scores
from lmrl.flow.grpo import FlowGRPO, FlowGRPOConfig, flow_advantages
from lmrl.flow.image_model import ImageFlow
from lmrl.flow.pipelines import AttributePipeline, load_lora_weights, load_pipeline
from lmrl.flow.rewards import load_image_reward
from lmrl.flow.rollout import FlowSampler
from lmrl.logging import make_trackers
from lmrl.logging.plot import image_grid
from lmrl.models.loading import resolve_device, write_dir_atomically
from lmrl.run.checkpoint import load_state, read_weights, rng_state, set_rng_state
from lmrl.run.health import ZERO_SPREAD_KEY
from lmrl.run.loop import RunsOnLoop, resume
from lmrl.run.resume import RunStart, open_run
from lmrl.trainer.flow_health import FlowHealth
from lmrl.trainer.metrics import zero_spread_fraction
from lmrl.workers.precision import Precision

log = logging.getLogger("lmrl.flow")
FLOW_COMMAND = "lmrl train-flow"

__all__ = ["FlowParts", "FlowTrainer", "build_flow", "image_grid", "read_prompts"]


def read_prompts(files: str | list[str], split: str = "train") -> list[dict[str, Any]]:
    """Prompt rows ``{"prompt": text, "metadata": {...}, "data_source", ["attributes"]}`` of
    prompt files, each by its suffix (a directory is a Flow-GRPO dataset: its ``<split>.txt`` or
    ``<split>_metadata.jsonl``, ``split`` ``train`` or ``test``):

    - ``.parquet``: verl rows whose ``reward_model.ground_truth`` holds the attributes an
      ImageFlow is conditioned on (``attributes``, also the reward's ``metadata``);
    - ``.txt``: one prompt a line (Flow-GRPO's PickScore and OCR ``train.txt``);
    - ``.jsonl``: one JSON object a line with a ``prompt`` (Flow-GRPO's GenEval
      ``train_metadata.jsonl``: ``tag``, ``include`` [{class, count, color?, position?}]...);
      the whole row is the reward's ``metadata``.

    A text file's ``data_source`` is its folder's name (``geneval``, ``pickscore``, ``ocr``).

    Raises:
        DataError: a file that cannot be read, of another format, or rows without what their
            format needs.
    """
    rows = []
    for path in [files] if isinstance(files, str) else files:
        if Path(path).is_dir():
            path = _dataset_file(Path(path), split)
        suffix = Path(path).suffix.lower()
        if suffix == ".parquet":
            rows += _parquet_prompts(path)
        elif suffix in (".txt", ".jsonl"):
            rows += _text_prompts(Path(path), suffix)
        else:
            raise DataError(
                f"prompt file {path}: not a prompt format (.parquet verl rows, .txt one prompt a "
                "line, or .jsonl rows with a prompt as Flow-GRPO's train_metadata.jsonl)"
            )
    if not rows:
        raise DataError(f"no prompts in {files}")
    return rows


def _dataset_file(folder: Path, split: str) -> str:
    for name in (f"{split}.txt", f"{split}_metadata.jsonl"):
        if (folder / name).is_file():
            return str(folder / name)
    raise DataError(
        f"prompt directory {folder}: no {split}.txt or {split}_metadata.jsonl (a Flow-GRPO "
        "dataset directory holds one of them)"
    )


def _parquet_prompts(path: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path).to_pylist()
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read prompt file {path}: {err}") from None
    rows = []
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
        attributes = {k: truth[k] for k in ATTRIBUTES}
        rows.append(
            {
                "prompt": str(prompt),
                "attributes": attributes,
                "metadata": attributes,
                "data_source": row.get("data_source", "shapes"),
            }
        )
    return rows


def _text_prompts(path: Path, suffix: str) -> list[dict[str, Any]]:
    import json

    try:
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"cannot read prompt file {path}: {err}") from None
    source = path.parent.name or "prompts"
    if suffix == ".txt":
        return [{"prompt": p, "metadata": {}, "data_source": source} for p in lines if p]
    rows = []
    numbered: list[tuple[int, dict]] = []  # (line, row), for the check of a GenEval file
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise DataError(
                f'{path} line {i + 1}: not a JSON object with a "prompt" string (the rows of '
                "Flow-GRPO's train_metadata.jsonl)"
            )
        rows.append({"prompt": row["prompt"], "metadata": row, "data_source": source})
        numbered.append((i + 1, row))
    check_geneval_rows(path, numbered)
    return rows


def _means(prefix: str, columns: dict[str, torch.Tensor]) -> dict[str, float]:
    """``{prefix/name: mean of the column's finite values}`` (a check judged on no image of
    the batch is left out)."""
    out = {}
    for name, values in columns.items():
        finite = values[values.isfinite()]
        if finite.numel():
            out[f"{prefix}/{name}"] = float(finite.mean())
    return out


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


@dataclass(frozen=True)
class FlowParts:
    """What a Flow-GRPO run is made of (`build_flow`); tests may hand in fakes (any image
    model, reward or sampler of the same methods).

    Attributes:
        config: the resolved ``FlowConfig``.
        start: the run directory, resume point and config changes.
        train_prompts, val_prompts: prompt rows (`read_prompts`; ``val_prompts`` may be []).
        pipeline: the image pipeline (`lmrl.flow.pipelines`): prompts to conditioning,
            samples to pixels, what ``final/`` holds.
        model: the velocity model trained (LoRA-wrapped when ``model.lora_rank > 0``).
        image_shape: ``(C, H, W)`` of its samples (pixels, or an SD3 model's latents).
        device: where it computes.
        sampler, val_sampler: the SDE sampler of training and the ODE sampler of validation.
        optimizer: AdamW over the trained parameters.
        update: the Flow-GRPO update (``lmrl.flow.FlowGRPO``).
        ema: the weights' moving average, or None.
        reward: the image reward (``score(pixels, prompts, metadata) -> (scores, extras)``).
        prompt_order: the resumable order of the training prompts.
        trackers: the loggers of ``trainer.logger``.
        fidelity: the geneval checks scored beside a reward of another kind (``flow/fidelity/*``:
            does the image still follow its prompt?), or None (the reward is geneval, or the
            prompts hold nothing the detector can judge).
    """

    config: FlowConfig
    start: RunStart
    train_prompts: list[dict[str, Any]]
    val_prompts: list[dict[str, Any]]
    pipeline: Any
    model: torch.nn.Module
    image_shape: tuple[int, int, int]
    device: torch.device
    sampler: FlowSampler
    val_sampler: FlowSampler
    optimizer: torch.optim.Optimizer
    update: FlowGRPO
    ema: WeightEMA | None
    reward: Any
    prompt_order: PromptSampler
    trackers: Any
    fidelity: Any = None


def build_flow(cfg: FlowConfig, evaluate: Path | None = None) -> FlowParts:
    """Assemble a Flow-GRPO run from a resolved config, cheapest failure first: the run
    directory and resume point, the prompts, the model, the update, the reward, the trackers.

    Args:
        cfg: the resolved config.
        evaluate: a checkpoint to validate (``lmrl eval``): the run directory is only read, the
            checkpoint is the resume point whatever changed in the config (another reward, more
            images), and nothing is logged.

    Raises:
        DataError: unreadable prompts, or fewer than ``data.train_batch_size`` of them;
        ModelError: no image model at ``model.path``, or one conditioned on another vector,
            or trainer.device=cuda without CUDA;
        CheckpointError: an unwritable run directory or a refused resume; RewardError: a bad
            reward.
    """
    t, s, a = cfg.trainer, cfg.sampler, cfg.actor
    # load_flow_config requires data.train_files and fills data.seed and the run directory
    assert cfg.data.train_files is not None and cfg.data.seed is not None
    assert t.default_local_dir is not None
    start = (
        open_run(cfg, FLOW_COMMAND)
        if evaluate is None
        else RunStart(Path(t.default_local_dir), FLOW_COMMAND, cfg, Path(evaluate))
    )
    torch.manual_seed(t.seed)
    train_prompts = read_prompts(cfg.data.train_files)
    val_prompts = read_prompts(cfg.data.val_files, "test") if cfg.data.val_files else []
    if cfg.data.train_batch_size > len(train_prompts):
        raise DataError(
            f"data.train_batch_size={cfg.data.train_batch_size} is more than the "
            f"{len(train_prompts)} prompts of {cfg.data.train_files}"
        )
    device = resolve_device(t.device)
    # the weights stay float32 (the masters); compute in model.mixed_precision.param_dtype
    precision = Precision.resolve("float32", cfg.model.mixed_precision, device)
    m = cfg.model
    assert m.path is not None  # load_flow_config requires it
    pipeline = load_pipeline(
        m.path, device, frozen_dtype=precision.compute, resolution=m.resolution,
        negative_prompt=m.negative_prompt, max_sequence_length=m.max_sequence_length,
    )  # fmt: skip
    cond_dim: object = 0  # an ImageFlow's config value
    if isinstance(pipeline, AttributePipeline):
        assert isinstance(pipeline.model, ImageFlow)  # load_pipeline loads one into it
        cond_dim = pipeline.model.config["cond_dim"]
    if cond_dim and cond_dim != NUM_ATTRIBUTES:
        raise ModelError(
            f"model.path={m.path} is conditioned on {cond_dim} values, the prompts' attribute "
            f"vector has {NUM_ATTRIBUTES}"
        )
    for files, prompts in (
        (cfg.data.train_files, train_prompts),
        (cfg.data.val_files, val_prompts),
    ):
        pipeline.check_prompts(prompts, files)
    # ints of the model's config (an ImageFlow's, or an SD3 transformer's and the resolution)
    image_shape = cast(tuple[int, int, int], pipeline.image_shape)
    model = pipeline.model
    shift = s.shift if s.shift is not None else getattr(pipeline, "scheduler_shift", 1.0)
    reference: Any = None
    if m.lora_rank > 0:
        targets = m.target_modules if m.target_modules is not None else pipeline.default_targets
        alpha = m.lora_alpha or 2 * m.lora_rank
        model = pipeline.add_lora(
            {"r": m.lora_rank, "lora_alpha": alpha, "target_modules": list(targets)}
        )
        if m.lora_path is not None:
            load_lora_weights(model, m.lora_path)
        reference = "adapter" if a.beta > 0 else None
    elif a.beta > 0:
        reference = copy.deepcopy(model).requires_grad_(False).eval()
    sampler = FlowSampler(
        num_steps=s.num_steps, noise_level=s.noise_level, shift=shift,
        sde_start=s.sde_start, sde_steps=s.sde_steps, timestep_fraction=s.timestep_fraction,
        window_range=_window(s.sde_window_range),
        guidance_scale=s.guidance_scale, reduce=s.logprob_reduce,
    )  # fmt: skip
    val_sampler = FlowSampler(
        num_steps=s.val_num_steps, noise_level=0.0, shift=shift,
        guidance_scale=s.guidance_scale,
    )  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    beta1, beta2 = a.optim.betas
    optimizer = torch.optim.AdamW(
        params, lr=a.optim.lr, weight_decay=a.optim.weight_decay, betas=(beta1, beta2)
    )
    settings = FlowGRPOConfig(
        clip_range=a.clip_range, clip_range_low=a.clip_range_low,
        clip_range_high=a.clip_range_high, adv_clip_max=a.adv_clip_max,
        norm_adv_by_std=a.norm_adv_by_std, beta=a.beta, std_scale=a.std_scale,
        mini_batch_size=a.ppo_mini_batch_size, micro_batch_size=a.micro_batch_size,
        ppo_epochs=a.ppo_epochs, max_grad_norm=a.max_grad_norm,
    )  # fmt: skip
    ema = WeightEMA(params, a.ema_decay, a.ema_every) if a.ema else None
    update = FlowGRPO(
        model, sampler, optimizer, settings, reference=reference, ema=ema, precision=precision
    )
    reward = load_image_reward(cfg.reward.name, cfg.reward.path, cfg.reward.max_error_fraction)
    fidelity = _fidelity(cfg, train_prompts + val_prompts)
    prompt_order = PromptSampler(len(train_prompts), cfg.data.train_batch_size, seed=cfg.data.seed)
    trackers = make_trackers(
        t.logger if evaluate is None else [], start.run_dir, t.project_name, t.experiment_name, config_dict=asdict(cfg),
        total_steps=t.total_training_steps,
        start_step=start.start_step,
    )  # fmt: skip
    return FlowParts(
        config=cfg, start=start, train_prompts=train_prompts, val_prompts=val_prompts,
        pipeline=pipeline, model=model, image_shape=image_shape, device=device, sampler=sampler,
        val_sampler=val_sampler, optimizer=optimizer, update=update, ema=ema, reward=reward,
        prompt_order=prompt_order, trackers=trackers, fidelity=fidelity,
    )  # fmt: skip


def _window(window: list[int] | None) -> tuple[int, int] | None:
    """``sampler.sde_window_range`` as ``(lo, hi)`` (two steps: validate_flow_config)."""
    if window is None:
        return None
    lo, hi = window
    return lo, hi


def _fidelity(cfg: FlowConfig, rows: list[dict[str, Any]]) -> Any:
    """The geneval checks to log beside the run's reward (see `FlowParts.fidelity`); says once
    what the detector cannot judge of the prompts.

    Raises:
        RewardError: ``reward.name=geneval`` on prompts it can judge nothing of.
    """
    coverage = geneval_coverage([r["metadata"] for r in rows])
    is_geneval = cfg.reward.path is None and cfg.reward.name.startswith("geneval")
    if is_geneval and coverage.judged == 0:
        raise RewardError(
            f"reward.name={cfg.reward.name} can judge nothing of these prompts: it checks the "
            "colour, count, shape and position of red, green or blue circles, squares and "
            "triangles from the prompts' metadata (the shapes task's attributes or GenEval's "
            "include list); give a reward of your own (reward.path=FILE reward.name=FN)"
        )
    if coverage.judged and (message := coverage.message()) is not None:
        log.warning("%s", message)
    return None if is_geneval or coverage.judged == 0 else geneval_scores


class FlowTrainer(RunsOnLoop):
    """Flow-GRPO as a program of the run loop (``lmrl.run.loop``): the loop brings the
    cadence, checkpoints with exact resume, signals, health, trackers and ``final/``.

    Args:
        parts: from `build_flow`; a checkpoint in ``parts.start.resume_from`` is loaded here.
    """

    def __init__(self, parts: FlowParts) -> None:
        self.parts = parts
        self.cfg = parts.config
        self.settings = parts.config.trainer
        self.start = parts.start
        self.run_dir = parts.start.run_dir
        self.device = parts.device
        self.train_prompts, self.val_prompts = parts.train_prompts, parts.val_prompts
        self.image_shape, self.pipeline = parts.image_shape, parts.pipeline
        self.model, self.optimizer, self.ema = parts.model, parts.optimizer, parts.ema
        self.sampler, self.val_sampler = parts.sampler, parts.val_sampler
        self.grpo, self.reward, self.prompts = parts.update, parts.reward, parts.prompt_order
        self.trackers = parts.trackers
        self.total_steps = self.cfg.trainer.total_training_steps
        self.health = FlowHealth()  # the RL run's checks, and the reward hacked
        self.global_step, self.lr_scale = 0, 1.0  # lr_scale: the rollbacks' (lower_lr)
        resume(self)

    @property
    def has_validation(self) -> bool:
        return bool(self.val_prompts)

    # ------------------------------------------------------------------ pieces
    def _cond(self, rows: list[dict]) -> torch.Tensor:
        return self.pipeline.cond(rows)

    def _uncond(self, cond: torch.Tensor) -> torch.Tensor | None:
        return self.pipeline.uncond(cond) if self.cfg.sampler.guidance_scale != 1.0 else None

    def _score(self, pixels: torch.Tensor, rows: list[dict]) -> tuple[torch.Tensor, dict]:
        """Rewards of images (B, 3, H, W) in [0, 1] (the pipeline's ``decode``), the means of
        what the reward returns beside them (``flow/check/<name>``: the geneval checks) and its
        counters (``reward/errors``)."""
        prompts, metadata = [r["prompt"] for r in rows], [r["metadata"] for r in rows]
        scores, extras, counts = self.reward.score(pixels, prompts, metadata)
        means = _means("flow/check", extras)
        if self.parts.fidelity is not None:
            means |= _means("flow/fidelity", self.parts.fidelity(pixels, prompts, metadata))
        return scores, means | counts

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
        batch = self.sampler.sample(self.grpo.velocity, cond, noise, uncond=uncond, generator=gen)
        sampled = time.perf_counter()
        scores, extra = self._score(self.pipeline.decode(batch["images"]), rows_n)
        scored = time.perf_counter()
        groups = [i // n for i in range(len(rows_n))]
        a = self.cfg.actor
        adv = flow_advantages(scores, groups, a.adv_clip_max, a.norm_adv_by_std, a.global_std)
        old = (
            self.grpo.old_log_probs(batch, uncond)
            if self.cfg.actor.recompute_old_log_probs
            else None
        )
        metrics = self.grpo.update(batch, adv.to(self.device), old, uncond=uncond, generator=gen)
        done = time.perf_counter()
        zero_spread = zero_spread_fraction(scores, groups)
        assert zero_spread is not None  # sampler.n >= 2 (validate_flow_config): groups of two

        metrics.update(extra)
        metrics.update(
            {
                "critic/score/mean": float(scores.mean()),
                "critic/score/std": float(scores.std()),
                "flow/zero_spread_groups": zero_spread,
                "flow/sde_start": float(batch["step_mask"][0].long().argmax()),
                ZERO_SPREAD_KEY: zero_spread,  # the health check's
                "timing_s/sample": sampled - start,
                "timing_s/reward": scored - sampled,
                "timing_s/update": done - scored,
                "timing_s/step": done - start,
                "perf/images_per_s": len(rows_n) / (done - start),
                "training/step": float(step),
            }
        )
        self.global_step = step
        return metrics

    @torch.no_grad()
    def validate(
        self, images_per_prompt: int | None = None, grid: Path | None = None
    ) -> dict[str, float]:
        """Reward (and the reward's checks) of ODE samples of the validation prompts from fixed
        noise (``trainer.val_images_per_prompt`` each); writes the images as ``grid`` (one row
        per prompt; default ``samples/step_<N>.png``)."""
        if not self.val_prompts:
            return {}
        images_per_prompt = images_per_prompt or self.cfg.trainer.val_images_per_prompt
        rows = [r for r in self.val_prompts for _ in range(images_per_prompt)]
        cond = self._cond(rows)
        gen = torch.Generator().manual_seed(_seed(self.cfg.trainer.seed, "validation"))
        noise = torch.randn(len(rows), *self.image_shape, generator=gen).to(self.device)
        self.model.eval()
        with self.ema.applied() if self.ema is not None else nullcontext():
            images = self.val_sampler.sample(
                self.grpo.velocity, cond, noise, uncond=self._uncond(cond)
            )
        images = self.pipeline.decode(images["images"])  # pixels on the host: scored, drawn
        scores, checks = self._score(images, rows)
        out = grid or self.run_dir / "samples" / f"step_{self.global_step}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        from PIL import Image

        Image.fromarray(image_grid(images, images_per_prompt)).save(out)
        source = self.val_prompts[0]["data_source"]
        return {
            f"val/{source}/reward/mean": float(scores.mean()),
            **{f"val/{source}/{key.removeprefix('flow/')}": v for key, v in checks.items()},
        }

    def summary(self) -> list[str]:
        """The run's first and last validation (the reward, each check) and train reward, and
        the grids of both (`lmrl.logging.summary.flow_summary`)."""
        from lmrl.logging.summary import flow_summary

        return flow_summary(self.run_dir)

    def generations(self) -> list[dict]:
        return []  # the images of each validation are written to samples/step_<N>.png

    def lower_lr(self, factor: float) -> float:
        """Multiply the learning rate by ``factor`` from now on (the run doctor's rollback,
        ``trainer.max_rollbacks``); the scale is in the checkpoint's state. Returns it."""
        self.lr_scale *= factor
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.actor.optim.lr * self.lr_scale
        return self.lr_scale

    # ------------------------------------------------------------------ checkpoints
    def _lora_only(self) -> bool:
        """A checkpoint of the adapters alone (an SD3 LoRA run: the base weights are the
        pipeline's, never changed)."""
        return self.cfg.model.lora_rank > 0 and self.pipeline.lora_only_checkpoints

    def checkpoint_weights(self) -> dict[str, dict[str, torch.Tensor]]:
        state = self.model.state_dict()
        if self._lora_only():
            trained = {name for name, p in self.model.named_parameters() if p.requires_grad}
            state = {k: v for k, v in state.items() if k in trained}
        weights = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
        return {"model": weights}

    def state_dict(self) -> dict:
        """The optimizer, the prompt order, the EMA and the step (the noise of step N is
        seeded by ``(seed, N)``)."""
        state = {
            "global_step": self.global_step,
            "optimizer": self.optimizer.state_dict(),
            "prompts": self.prompts.state_dict(),
            "rng": rng_state(),
            "lr_scale": self.lr_scale,
        }
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        if self.grpo.scaler is not None:  # fp16 compute's loss scale
            state["loss_scaler"] = self.grpo.scaler.state_dict()
        return state

    def load_checkpoint(self, path: Path) -> None:
        weights = read_weights(path / "model.safetensors")
        if self._lora_only():
            trained = {name for name, p in self.model.named_parameters() if p.requires_grad}
            if set(weights) != trained:
                raise ValueError("its LoRA adapters are not this run's (model.target_modules)")
            self.model.load_state_dict(weights, strict=False)
        else:
            self.model.load_state_dict(weights)
        state = load_state(path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.prompts.load_state_dict(state["prompts"])
        self.lr_scale = 1.0
        self.lower_lr(float(state.get("lr_scale", 1.0)))  # the configured lr x the rollbacks'
        if self.ema is not None:
            if "ema" not in state:
                raise ValueError("it holds no EMA (the run started without actor.ema)")
            self.ema.load_state_dict(state["ema"])
        if "rng" in state:
            set_rng_state(state["rng"])
        if self.grpo.scaler is not None and "loss_scaler" in state:
            self.grpo.scaler.load_state_dict(state["loss_scaler"])
        self.global_step = int(state["global_step"])

    def export(self) -> Path:
        """Write ``run_dir/final`` (the weights' average when ``actor.ema``): an ImageFlow's
        model (LoRA merged), loadable as ``model.path`` of another run; an SD3 run's LoRA
        adapter (PEFT's format) or, without LoRA, its transformer."""
        lora = self.cfg.model.lora_rank > 0
        with self.ema.applied() if self.ema is not None else nullcontext():
            return write_dir_atomically(
                self.run_dir / "final", lambda out: self.pipeline.export(self.model, out, lora)
            )

    def close(self) -> None:
        self.trackers.close()
