"""A 2-D flow-matching model of points, small enough to pre-train and RL-train in seconds.

The data of class ``c`` is two blobs at ``(-1, y_c)`` and ``(+1, y_c)`` (equal weight, std
0.15); a pre-trained model puts half its samples in each. A reward that prefers ``x > 0``
can then only be earned by moving mass, which is what Flow-GRPO must do (the learning test).
The model (`PointFlow`) is an MLP of the point, Fourier features of ``t`` and a class
embedding (one extra id, ``num_classes``, is the unconditional one for guidance).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["PointFlow", "right_side_reward", "two_blobs"]


class PointFlow(nn.Module):
    """Velocity MLP ``(x (B, dim), t (B,), cond (B,) long) -> (B, dim)``."""

    def __init__(self, num_classes: int = 4, dim: int = 2, hidden: int = 128, depth: int = 3):
        super().__init__()
        self.num_classes, self.dim = num_classes, dim
        self.freqs = nn.Parameter(torch.arange(1, 9).float() * math.pi, requires_grad=False)
        self.embed = nn.Embedding(num_classes + 1, hidden)
        self.inp = nn.Linear(dim + 2 * len(self.freqs), hidden)
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))
        self.out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        angles = t.reshape(-1, 1).float() * self.freqs
        h = self.inp(torch.cat([x.float(), angles.sin(), angles.cos()], -1)) + self.embed(cond)
        for block in self.blocks:
            h = h + block(nn.functional.silu(h))
        return self.out(nn.functional.silu(h))


def two_blobs(
    batch_size: int, generator: torch.Generator, num_classes: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(points (B, 2), classes (B,))``: class ``c`` at ``(+-1, c - (num_classes-1)/2)``."""
    cond = torch.randint(num_classes, (batch_size,), generator=generator)
    side = torch.randint(2, (batch_size,), generator=generator).float() * 2 - 1
    centre = torch.stack([side, cond.float() - (num_classes - 1) / 2], -1)
    return centre + 0.15 * torch.randn(batch_size, 2, generator=generator), cond


def right_side_reward(points: torch.Tensor) -> torch.Tensor:
    """1 for a point with ``x > 0``, else 0: (B, 2) -> (B,)."""
    return (points[:, 0] > 0).float()
