"""The precision policy of the trained models: fp32 masters, bf16 (or fp16) compute.

The weights a worker holds are the masters: ``model.dtype`` (float32 by default, ``auto``
too), and AdamW's moments follow them. The forward passes run in the compute dtype
(``model.mixed_precision.param_dtype``) under ``torch.autocast``: matmuls in bf16, while
the maths that decide the update stays in fp32 (``lmrl.algos.logprob`` upcasts each chunk
of logits; losses, KL and advantages see fp32 log-probs; values are upcast by the critic).
Gradients land on the fp32 masters, so the data-parallel all-reduce is fp32 too
(``reduce_dtype``). Under FSDP2, ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` casts
the all-gathered shards instead, and autocast around it changes nothing more.

The choice this module makes: autocast over fp32 parameters, as verl's FSDP workers and
``torch.amp`` do, rather than bf16 copies of the weights beside the masters: the masters
are the parameters themselves, so checkpoints, resume, weight sync and export need no
second copy. ``param_dtype`` equal to ``model.dtype`` (the CPU default, or pure bf16 with
both bfloat16) is plain training with no autocast. fp16 compute scales the loss
(`LossScaler`, GradScaler's dynamic rule, decided by the global gradient norm so that
every rank agrees).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from lmrl.batch import Batch
from lmrl.errors import ModelError
from lmrl.models.loading import DTYPES
from lmrl.rollout.base import EngineView, RolloutEngine, RowDone, SamplingParams

__all__ = ["LossScaler", "Precision", "PrecisionEngine", "planned_dtypes"]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Precision:
    """Dtypes of one trained model.

    Attributes:
        master: the parameters' dtype (the fp32 masters), and the optimizer states'.
        compute: the forward's dtype; ``mixed`` when it differs from ``master``.
        reduce: the dtype gradients are all-reduced (DDP) or reduce-scattered (FSDP2) in.
        buffer: the dtype of the model's floating-point buffers.
        device_type: ``cpu`` or ``cuda`` (the autocast device).
    """

    master: torch.dtype = torch.float32
    compute: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32
    buffer: torch.dtype = torch.float32
    device_type: str = "cpu"

    @property
    def mixed(self) -> bool:
        """The forward runs in another dtype than the weights are stored in."""
        return self.compute != self.master

    @classmethod
    def from_config(cls, model_cfg, device: str | torch.device = "cpu") -> Precision:
        """The policy of ``model.dtype`` and ``model.mixed_precision`` on ``device``.

        ``model.dtype=auto`` is float32; ``param_dtype=auto`` is bfloat16 on a GPU that
        supports it, else float32 (bf16 on most CPUs is slower than fp32). An ``auto``
        compute dtype wider than the masters (float32 over bfloat16 or float64 masters)
        means the masters' dtype. float64 masters (exactness checks) reduce and keep
        buffers in float64.

        Raises:
            ModelError: a dtype the device cannot compute in (fp16 on a CPU, bf16 on a GPU
                without it), or a compute dtype wider than the masters, in one line.
        """
        return cls.resolve(model_cfg.dtype, model_cfg.mixed_precision, device)

    @classmethod
    def resolve(cls, dtype: str, mp, device: str | torch.device = "cpu") -> Precision:
        """`from_config` of a ``model.dtype`` value and a ``MixedPrecisionConfig``."""
        device_type = torch.device(device).type
        bf16 = device_type == "cuda" and torch.cuda.is_bf16_supported()
        master, compute = _dtypes(dtype, mp.param_dtype, bf16)
        if compute != master and compute.itemsize >= master.itemsize:
            raise ModelError(
                f"model.mixed_precision.param_dtype={mp.param_dtype} cannot compute over "
                f"model.dtype={dtype} masters: use a narrower compute dtype or "
                f"param_dtype={_name(master)}"
            )
        _check_device(compute, device_type)
        exact = master == torch.float64  # exactness checks keep float64 everywhere
        return cls(
            master=master,
            compute=compute,
            reduce=master if exact else DTYPES[mp.reduce_dtype],
            buffer=master if exact else DTYPES[mp.buffer_dtype],
            device_type=device_type,
        )

    @classmethod
    def of(cls, model: nn.Module) -> Precision:
        """The model as it is: its parameters' dtype for everything, no autocast."""
        p = next(model.parameters())
        return cls(p.dtype, p.dtype, p.dtype, p.dtype, p.device.type)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Around a forward pass: autocast to the compute dtype when mixed, else nothing."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute)

    def loss_scaler(self) -> LossScaler | None:
        """A fresh `LossScaler` for one trained model when computing in fp16 over wider masters,
        else None (pure fp16 weights train unscaled, as before mixed precision existed)."""
        return LossScaler() if self.compute == torch.float16 and self.mixed else None

    def prepare(self, model: nn.Module) -> nn.Module:
        """The loaded model's floating-point buffers cast to ``buffer`` (its parameters stay
        the masters)."""
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.is_floating_point() and buf.dtype != self.buffer:
                    setattr(module, name, buf.to(self.buffer))
        return model


def _dtypes(dtype: str, param_dtype: str, bf16: bool) -> tuple[torch.dtype, torch.dtype]:
    """``(master, compute)`` of ``model.dtype`` and ``param_dtype`` where bf16 computes or
    not: the one rule `Precision.resolve` and the run's plan (`planned_dtypes`) share."""
    master = torch.float32 if dtype == "auto" else DTYPES[dtype]
    if param_dtype != "auto":
        return master, DTYPES[param_dtype]
    compute = torch.bfloat16 if bf16 else torch.float32
    if compute.itemsize >= master.itemsize or master == torch.float64:
        compute = master  # float64 masters are exactness checks: float64 throughout
    return master, compute


def planned_dtypes(dtype: str, mp, device: str) -> tuple[str, str]:
    """``(master, compute)`` dtype names a run on ``device`` (``cpu``/``cuda``) will use, as
    `Precision.resolve` decides them, with bf16 taken as supported on CUDA (a plan is made
    away from the GPU too). Nothing is checked here: the run's own resolve refuses what the
    device cannot do."""
    master, compute = _dtypes(dtype, mp.param_dtype, device == "cuda")
    return _name(master), _name(compute)


def _check_device(dtype: torch.dtype, device_type: str) -> None:
    if dtype == torch.float16 and device_type == "cpu":
        raise ModelError(
            "float16 compute on a CPU is not supported (no fp16 kernels, no loss scaling "
            "there): use model.mixed_precision.param_dtype=bfloat16 or float32"
        )
    if dtype == torch.bfloat16 and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ModelError(
            "this GPU does not support bfloat16 (torch.cuda.is_bf16_supported()): use "
            "model.mixed_precision.param_dtype=float16 (with loss scaling) or float32"
        )


class LossScaler:
    """Dynamic loss scaling for fp16 compute (``torch.amp.GradScaler``'s rule).

    The loss is multiplied by ``scale`` before backward and the gradients divided by it
    before clipping. A step whose gradient is not finite is skipped (``clip_and_step``) and
    halves the scale; ``growth_interval`` finite steps in a row double it. The decision
    uses the global gradient norm, the same on every rank, so the ranks' scales never part.
    """

    def __init__(
        self, init_scale: float = 2.0**16, growth_interval: int = 2000, factor: float = 2.0
    ) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.factor = factor
        self.good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale(self, params: list[nn.Parameter]) -> None:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(1.0 / self.scale)

    def update(self, stepped: bool) -> None:
        if not stepped:
            self.scale /= self.factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: Mapping) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


class PrecisionEngine(RolloutEngine):
    """An engine that generates with the actor's own module (``hf``), run under the actor's
    autocast, so a rollout computes as the training forward does."""

    def __init__(self, engine: RolloutEngine, precision: Precision) -> None:
        self.engine = engine
        self.precision = precision
        self.pad_id = engine.pad_id
        self.shares_weights = engine.shares_weights
        self.reports_rows = engine.reports_rows

    def generate(
        self,
        prompts: Batch,
        n: int = 1,
        sampling: SamplingParams | None = None,
        *,
        prompt_offset: int = 0,
    ) -> Batch:
        with self.precision.autocast():
            return self.engine.generate(prompts, n, sampling, prompt_offset=prompt_offset)

    def close(self) -> None:
        self.engine.close()

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        self.engine.sync_weights(state_dict)

    def set_row_done(self, hook: RowDone | None) -> None:
        self.engine.set_row_done(hook)

    def view(self) -> EngineView:
        """The wrapped engine's, its forward under this autocast when mixed."""
        view = self.engine.view()
        if not self.precision.mixed:
            return view
        return replace(view, autocast=self.precision.autocast, compute=self.precision.compute)
