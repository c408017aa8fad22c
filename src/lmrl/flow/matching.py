"""Flow-matching pre-training (`pretrain`, `pretrain_image_flow`): SFT's analogue for images.

The rectified-flow objective: for data ``x_0``, noise ``eps ~ N(0, I)`` and ``t ~ U(0, 1)``,
``x_t = (1 - t) x_0 + t eps`` and the model's velocity at ``(x_t, t)`` regresses ``eps - x_0``
(mean squared error). With ``uncond_id`` set, a fraction ``cond_dropout`` of the rows see the
unconditional id instead of their condition, so that the model also learns the unconditional
velocity that classifier-free guidance needs (`pretrain_image_flow` uses the zero vector).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from lmrl.flow.image_model import ImageFlow

log = logging.getLogger("lmrl.flow")

__all__ = ["flow_matching_loss", "pretrain", "pretrain_image_flow"]


def flow_matching_loss(
    model: torch.nn.Module,
    x0: torch.Tensor,
    cond: torch.Tensor,
    generator: torch.Generator | None = None,
    uncond_id: float | None = None,
    cond_dropout: float = 0.1,
) -> torch.Tensor:
    """The rectified-flow loss of a batch of data ``x0`` (B, ...) with conditions ``cond``
    (B, ...); ``uncond_id`` is what a dropped row's condition becomes (a class id, or 0 for
    every entry of a condition vector)."""
    b = x0.shape[0]
    t = torch.rand(b, generator=generator, device=x0.device)
    eps = torch.randn(x0.shape, generator=generator, device=x0.device)
    tb = t.reshape(-1, *([1] * (x0.dim() - 1)))
    xt = (1 - tb) * x0 + tb * eps
    if uncond_id is not None and cond_dropout > 0:
        drop = torch.rand(b, generator=generator, device=x0.device) < cond_dropout
        drop = drop.reshape(-1, *([1] * (cond.dim() - 1)))
        cond = torch.where(drop, torch.full_like(cond, uncond_id), cond)
    return torch.mean((model(xt, t, cond) - (eps - x0)) ** 2)


def pretrain(
    model: torch.nn.Module,
    data: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    batch_size: int = 256,
    lr: float = 1e-3,
    seed: int = 0,
    uncond_id: float | None = None,
    cond_dropout: float = 0.1,
    log_every: int = 0,
) -> list[float]:
    """Train ``model`` by flow matching on ``data(batch_size, generator) -> (x0, cond)``:
    AdamW with a one-cycle schedule (5% warm-up, then cosine to ~0).

    Returns:
        the loss of every step.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.05)
    losses: list[float] = []
    model.train()
    for step in range(steps):
        x0, cond = data(batch_size, gen)
        loss = flow_matching_loss(model, x0, cond, gen, uncond_id, cond_dropout)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            recent = np.mean(losses[-log_every:])
            log.info("pretrain step %d/%d: loss %.4f", step + 1, steps, recent)
    return losses


def pretrain_image_flow(
    images_path: str | Path,
    out_dir: str | Path,
    steps: int = 400,
    batch_size: int = 64,
    lr: float = 2e-3,
    seed: int = 0,
    block_out_channels: tuple[int, ...] = (32, 64),
    cond_dropout: float = 0.1,
    caption_noise: float = 0.0,
    log_every: int = 0,
) -> tuple[ImageFlow, list[float]]:
    """Pre-train an `ImageFlow` on the ``shapes`` task's ``images.parquet`` and save it.

    The condition of an image is its prompt's attribute vector; ``cond_dropout`` of the rows
    see the zero vector (the unconditional input of guidance); the loop is `pretrain`'s. With
    ``caption_noise`` each attribute of an image's caption is redrawn at random with that
    probability, once per image (`lmrl.data.shapes.noisy_captions`, seeded by ``seed``): the
    model learns to draw every image well and to follow its prompt only in part.

    Returns:
        the model (saved in ``out_dir``) and the loss of every step.
    """
    from lmrl.data.shapes import NUM_ATTRIBUTES, attribute_vector, noisy_captions, read_images

    torch.manual_seed(seed)
    pixels, specs = read_images(images_path)
    if caption_noise:
        specs = noisy_captions(specs, caption_noise, seed)
    data = torch.tensor(pixels).permute(0, 3, 1, 2) * 2 - 1
    conds = torch.tensor(np.stack([attribute_vector(s) for s in specs]))
    model = ImageFlow(NUM_ATTRIBUTES, image_size=data.shape[-1], channels=data.shape[1],
                      block_out_channels=block_out_channels)  # fmt: skip

    def batch(size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(len(data), (size,), generator=gen)
        return data[idx], conds[idx]

    losses = pretrain(model, batch, steps, batch_size, lr, seed, uncond_id=0.0,
                      cond_dropout=cond_dropout, log_every=log_every)  # fmt: skip
    model.save(out_dir)
    return model, losses
