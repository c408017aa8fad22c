"""Flow-matching pre-training: the analogue of SFT before Flow-GRPO.

The rectified-flow objective: for data ``x_0``, noise ``eps ~ N(0, I)`` and ``t ~ U(0, 1)``,
``x_t = (1 - t) x_0 + t eps`` and the model's velocity at ``(x_t, t)`` regresses ``eps - x_0``
(mean squared error). With ``uncond_id`` set, a fraction ``cond_dropout`` of the rows see the
unconditional id instead of their condition, so that the model also learns the unconditional
velocity that classifier-free guidance needs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["flow_matching_loss", "pretrain"]


def flow_matching_loss(
    model: torch.nn.Module,
    x0: torch.Tensor,
    cond: torch.Tensor,
    generator: torch.Generator | None = None,
    uncond_id: int | None = None,
    cond_dropout: float = 0.1,
) -> torch.Tensor:
    """The rectified-flow loss of a batch of data ``x0`` (B, ...) with conditions ``cond`` (B,)."""
    b = x0.shape[0]
    t = torch.rand(b, generator=generator, device=x0.device)
    eps = torch.randn(x0.shape, generator=generator, device=x0.device)
    tb = t.reshape(-1, *([1] * (x0.dim() - 1)))
    xt = (1 - tb) * x0 + tb * eps
    if uncond_id is not None and cond_dropout > 0:
        drop = torch.rand(b, generator=generator, device=x0.device) < cond_dropout
        cond = torch.where(drop, torch.full_like(cond, uncond_id), cond)
    return torch.mean((model(xt, t, cond) - (eps - x0)) ** 2)


def pretrain(
    model: torch.nn.Module,
    data: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    batch_size: int = 256,
    lr: float = 1e-3,
    seed: int = 0,
    uncond_id: int | None = None,
) -> list[float]:
    """Train ``model`` by flow matching on ``data(batch_size, generator) -> (x0, cond)``.

    Returns:
        the loss of every step.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    losses = []
    model.train()
    for _ in range(steps):
        x0, cond = data(batch_size, gen)
        loss = flow_matching_loss(model, x0, cond, gen, uncond_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses
