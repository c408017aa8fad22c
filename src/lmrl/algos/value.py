"""The critic's loss: PPO's clipped value loss.

The new value prediction may move at most ``cliprange_value`` away from the value recorded at
rollout time before the clipped branch takes over; the loss is the worse (larger) of the
clipped and unclipped squared errors, so clipping never makes the critic's loss smaller
(PPO2's value clipping, as in verl and TRL). As in the policy losses, positions outside the
mask are replaced by 0 before any arithmetic, so their values never reach the loss, the
metric or the gradient.
"""

from __future__ import annotations

import torch

from lmrl.algos.agg import AggNorm, agg_loss
from lmrl.algos.checks import as_bool_mask, check_2d, check_same_shape
from lmrl.algos.masked import masked_mean


def value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    norm: AggNorm | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * agg(max((v - R)^2, (clip(v, V - c, V + c) - R)^2))``.

    Args:
        vpreds: (B, T) the critic's current predictions; carries the gradient.
        values: (B, T) the predictions recorded at rollout time (V).
        returns: (B, T) the regression targets (R), e.g. GAE's A + V.
        response_mask: bool (B, T), True = the token counts.
        cliprange_value: c, how far ``vpreds`` may move from ``values``; >= 0.
        loss_agg_mode: see ``lmrl.algos.agg.agg_loss``.
        norm: global normalizers of the mini-batch when this is a micro-batch.
    Returns:
        ``(loss, {"vf_clipfrac": ...})``: a 0-dim loss and the detached fraction of valid
        tokens where the clipped error was the larger one.
    """
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    check_2d("vpreds", vpreds)
    check_same_shape(vpreds=vpreds, values=values, returns=returns, response_mask=response_mask)
    mask = as_bool_mask("response_mask", response_mask)
    vpreds = torch.where(mask, vpreds, 0.0)
    values = torch.where(mask, values.detach(), 0.0)
    returns = torch.where(mask, returns.detach(), 0.0)

    vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpreds_clipped - returns).square()
    vf_losses = torch.maximum(vf_losses1, vf_losses2)
    loss = 0.5 * agg_loss(vf_losses, mask, loss_agg_mode, norm)
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), mask)
    return loss, {"vf_clipfrac": vf_clipfrac.detach()}
