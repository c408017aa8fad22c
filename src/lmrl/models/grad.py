"""One optimizer step of a model: clip the global gradient norm (plain or FSDP2-sharded
gradients), then step unless the gradient is not finite. The actor, the critic, SFT and
Flow-GRPO's update all step through `clip_and_step`."""

from __future__ import annotations

import math

import torch

__all__ = ["clip_and_step"]


def clip_and_step(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, grad_clip: float | None
) -> tuple[torch.Tensor, bool]:
    """Clip the global gradient norm and step, unless the gradient is not finite.

    Returns:
        ``(grad_norm, stepped)``: the norm before clipping; ``stepped`` False when a NaN or
        inf gradient (from a non-finite loss, say) made the step be skipped. Skipping costs
        one device sync per optimizer step, the price of never applying a bad update.
    """
    max_norm = grad_clip if grad_clip and grad_clip > 0 else math.inf
    if any(_is_dtensor(p.grad) for p in params):
        grad_norm = _clip_sharded(params, max_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    stepped = bool(torch.isfinite(grad_norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.detach(), stepped


def _is_dtensor(t) -> bool:
    return t is not None and type(t).__name__ == "DTensor"


def wire_device() -> torch.device:
    """Where a tensor must be for a collective of the default process group: NCCL takes CUDA
    tensors only (this rank's GPU), gloo CPU tensors."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _clip_sharded(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` for FSDP2's sharded gradients: the norm of the whole gradient
    (squared shard norms summed over the ranks), then the same clip coefficient on every
    shard, exactly as the single process clips its whole gradient."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if _is_dtensor(g) else g for g in grads]
    device = local[0].device if local else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for g in local:  # each shard's norm in its own dtype, as clip_grad_norm_ computes it
        squares = squares + torch.linalg.vector_norm(g).double() ** 2
    squares = squares.to(wire_device())  # offloaded shards are on the CPU, NCCL wants CUDA
    dist.all_reduce(squares, op=dist.ReduceOp.SUM)
    total = squares.sqrt().to(device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in local:
        g.mul_(coef.to(g.device, g.dtype))
    return total
