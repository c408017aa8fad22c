"""The optimizer and learning-rate schedule shared by the actor, the critic and SFT.

AdamW over the trainable parameters, linear warmup, then a constant or cosine schedule, as
verl's ``optim`` section describes. The schedule advances once per training step (one
``update_*`` call), not per mini-batch, so ``lr_warmup_steps`` counts steps as verl does.
``TrainableWorker`` holds a model with both; ``ActorWorker``, ``CriticWorker`` and
``SFTWorker`` add their losses; every one steps through `lmrl.models.grad.clip_and_step`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from lmrl.models.grad import clip_and_step
from lmrl.models.loading import bump_weights_version
from lmrl.workers.dist import DataParallel
from lmrl.workers.precision import Precision


def build_optimizer(params: Iterable[torch.nn.Parameter], optim) -> torch.optim.AdamW:
    """AdamW from an ``OptimConfig`` (lr, betas, weight_decay).

    The fused kernel (one pass over each parameter, its gradient and both moments) whenever
    every parameter is a plain floating-point tensor on CPU or CUDA: the same update as the
    per-tensor loop up to float rounding, and 3-8x faster (the loop re-reads every tensor
    about ten times; on a 40M-parameter model on 2 CPU threads it cost ~2 s a step).
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    fused = all(
        type(p.data) is torch.Tensor  # not a DTensor (FSDP2) or other subclass
        and p.is_floating_point()
        and p.device.type in ("cpu", "cuda")
        for p in params
    )
    return torch.optim.AdamW(
        params,
        lr=optim.lr,
        betas=tuple(optim.betas),
        weight_decay=optim.weight_decay,
        fused=fused or None,
    )


def warmup_steps(optim, total_steps: int) -> int:
    """``lr_warmup_steps`` when >= 0, else ``lr_warmup_steps_ratio * total_steps``."""
    if optim.lr_warmup_steps is not None and optim.lr_warmup_steps >= 0:
        return int(optim.lr_warmup_steps)
    return int(optim.lr_warmup_steps_ratio * total_steps)


def lr_factor(
    step: int, warmup: int, total_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """Multiplier of the peak lr at training step ``step`` (0-based).

    Warmup is linear from 0 (verl's rule: ``step / warmup``); then 1 (``constant``) or a
    half cosine from 1 down to ``min_lr_ratio`` at ``total_steps`` (``cosine``).
    """
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_scheduler {schedule!r}; valid: constant, cosine")


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The warmup + constant/cosine schedule of an ``OptimConfig`` over ``total_steps``."""
    warmup = warmup_steps(optim, total_steps)
    schedule, min_lr_ratio = optim.lr_scheduler, optim.min_lr_ratio
    lr_factor(warmup, warmup, total_steps, schedule, min_lr_ratio)  # validate the name now
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup, total_steps, schedule, min_lr_ratio)
    )


class TrainableWorker:
    """What the actor, the critic and SFT share: a model, its optimizer and schedule, the RNG
    that shuffles mini-batches, and their checkpoint state.

    Args:
        model: the module trained.
        optim: its ``OptimConfig``.
        total_steps: training steps, for the schedule.
        seed: seeds the mini-batch shuffling (the same on every rank: the mini-batches are
            cut identically everywhere, see ``lmrl.workers.dist``).
        dp: this rank's data parallelism (``lmrl.workers.dist``); None = one process.
        precision: the dtypes (``lmrl.workers.precision``); None = the model's own, no
            autocast. The parameters are the masters: AdamW's moments take their dtype.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optim,
        total_steps: int,
        seed: int,
        dp=None,
        precision: Precision | None = None,
    ) -> None:
        self.dp = dp if dp is not None else DataParallel()
        self.precision = precision if precision is not None else Precision.of(model)
        model = self.dp.prepare(model, self.precision)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, optim)
        self.scheduler = build_scheduler(self.optimizer, optim, total_steps)
        self.built_lrs = list(self.scheduler.base_lrs)  # the configured peak lrs
        self.lr_scale = 1.0  # times the configured lr: the run doctor's rollback lowers it
        self.generator = torch.Generator().manual_seed(seed)
        self.scaler = self.precision.loss_scaler()  # fp16 compute only

    def autocast(self):
        """Around a forward pass: the compute dtype of ``precision``."""
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss scaled first when computing in fp16."""
        (self.scaler.scale_loss(loss) if self.scaler is not None else loss).backward()

    def step(self, grad_clip: float | None) -> tuple[torch.Tensor, bool]:
        """One optimizer step on the reduced gradients (`clip_and_step`), unscaled first
        under fp16 loss scaling, whose scale the step's outcome then updates."""
        if self.scaler is not None:
            self.scaler.unscale(self.params)
        grad_norm, stepped = clip_and_step(self.params, self.optimizer, grad_clip)
        if self.scaler is not None:
            self.scaler.update(stepped)
        return grad_norm, stepped

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return float(self.scheduler.get_last_lr()[0])

    def mini_batches(self, batch, epochs: int, shuffle: bool, size: int):
        """``epochs`` passes over ``batch`` in pieces of ``size`` rows, in train mode.

        Shuffles the rows each pass when ``shuffle`` (with this worker's generator).
        """
        was_training = self.model.training
        self.model.train()
        try:
            for _ in range(epochs):
                n = len(batch)
                order = torch.randperm(n, generator=self.generator) if shuffle else torch.arange(n)
                yield from batch.index(order).split(size)
        finally:
            self.model.train(was_training)

    def finish_update(self, totals: dict[str, list[torch.Tensor]], prefix: str) -> dict:
        """Advance the schedule; metrics averaged over optimizer steps, plus ``<prefix>/lr``.

        Also counts the update on the model (``weights_version``): an engine with its own copy
        of the weights (vLLM) compares it to know when to copy them again.
        """
        self.scheduler.step()
        bump_weights_version(self.model)
        metrics = {k: torch.stack([v.float() for v in vs]).mean() for k, vs in totals.items()}
        metrics[f"{prefix}/lr"] = torch.tensor(self.lr)
        return metrics

    def model_state(self) -> dict[str, torch.Tensor]:
        """The full weights as CPU tensors (what a checkpoint's ``<name>.safetensors`` holds)."""
        return self.dp.model_state(self.model)

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load full weights written by `model_state` (under any number of ranks)."""
        self.dp.load_model_state(self.model, state)
        bump_weights_version(self.model)

    def state_dict(self) -> dict:
        """Optimizer, scheduler and shuffling RNG (the weights are saved separately)."""
        state = {
            "optimizer": self.dp.optimizer_state(self.model, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "lr_scale": self.lr_scale,
        }
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def scale_lr(self, factor: float) -> float:
        """Multiply the peak lr by ``factor`` from now on (kept in `state_dict` as
        ``lr_scale``); returns the scale now. The run doctor's rollback calls it."""
        self.lr_scale *= factor
        self._set_lrs()
        return self.lr_scale

    def _set_lrs(self) -> None:
        """The schedule's peak lrs and the param groups' current lrs from the configured ones
        times ``lr_scale``: the same arithmetic after `scale_lr` and after a resume."""
        scheduler = self.scheduler
        scheduler.base_lrs = [lr * self.lr_scale for lr in self.built_lrs]
        for group, base, factor in zip(
            self.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
        ):
            group["initial_lr"] = base
            group["lr"] = base * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def load_state_dict(self, state: dict) -> None:
        """Restore the moments, step counts, schedule position, shuffling RNG and lr scale.

        The hyperparameters (lr, betas, weight decay) stay the ones this worker was built
        with, so a resume with changed settings (``trainer.allow_config_change``) really
        trains at the new lr, in the param groups and the schedule. Without a change they are
        the same values, bit for bit. The peak lr is the configured one times the state's
        ``lr_scale`` (1 unless the run doctor lowered it, `lmrl.run.doctor`).
        """
        optimizer, scheduler = self.optimizer, self.scheduler
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.dp.load_optimizer_state(self.model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        for group, hyper in zip(optimizer.param_groups, fresh, strict=True):
            group.update(hyper)
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self._set_lrs()
        self.generator.set_state(state["generator"])
        if self.scaler is not None and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])
