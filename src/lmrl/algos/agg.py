"""Loss aggregation: how a (B, T) matrix of per-token losses becomes one scalar.

The mode decides how tokens and sequences are weighted, as in verl's ``agg_loss``:

- ``token-mean``: every valid token of the mini-batch weighs the same (DAPO).
- ``token-sum``: plain sum over valid tokens.
- ``seq-mean-token-sum``: sum within a sequence, mean over sequences (long ones weigh more).
- ``seq-mean-token-mean``: mean within a sequence, mean over sequences (GRPO paper, GSPO).
- ``seq-mean-token-sum-norm``: the sum of sequence sums divided by a constant,
  ``loss_scale_factor`` (default: the response length T), as Dr.GRPO asks. As in verl,
  this divisor does not include the number of sequences.

Micro-batches and data-parallel ranks: a mini-batch split into pieces must give the same
loss and gradient as the whole. Pass an ``AggNorm`` with the mini-batch's *global* token and
sequence counts: each piece then returns its share, and the shares add up to the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmrl.algos.checks import as_bool_mask, check_2d, check_same_shape
from lmrl.algos.masked import masked_count, masked_sum

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@dataclass(frozen=True)
class AggNorm:
    """Global normalizers for ``agg_loss`` when a mini-batch is processed in pieces.

    Attributes:
        token_count: valid tokens in the whole mini-batch (``token-mean``).
        seq_count: sequences with at least one valid token in the whole mini-batch
            (``seq-mean-*`` modes).
        loss_scale_factor: the constant divisor of ``seq-mean-token-sum-norm``; set it to the
            maximum response length when pieces are trimmed to different lengths.
        dp_size: data-parallel ranks whose gradients are *averaged*; the loss is multiplied
            by it so that the average equals the global mini-batch loss.
    """

    token_count: torch.Tensor | float | None = None
    seq_count: torch.Tensor | float | None = None
    loss_scale_factor: float | None = None
    dp_size: int = 1

    @classmethod
    def from_mask(
        cls, response_mask: torch.Tensor, loss_scale_factor: float | None = None, dp_size: int = 1
    ) -> AggNorm:
        """Normalizers of a whole mini-batch, to pass to each of its micro-batches."""
        mask = as_bool_mask("response_mask", response_mask)
        return cls(
            token_count=masked_count(mask),
            seq_count=(mask.sum(-1) > 0).sum(dtype=torch.float32),
            loss_scale_factor=loss_scale_factor,
            dp_size=dp_size,
        )


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    norm: AggNorm | None = None,
) -> torch.Tensor:
    """Aggregate per-token losses into a scalar.

    Args:
        loss_mat: (B, T) per-token losses.
        loss_mask: bool (B, T), True = the token counts.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        norm: global normalizers when this is a piece of a larger mini-batch; by default the
            counts of this batch itself.
    Returns:
        A 0-dim tensor.
    """
    check_2d("loss_mat", loss_mat)
    check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    mask = as_bool_mask("loss_mask", loss_mask)
    norm = norm or AggNorm()
    if loss_agg_mode == "token-mean":
        count = masked_count(mask) if norm.token_count is None else norm.token_count
        loss = masked_sum(loss_mat, mask) / _clamp_count(count)
    elif loss_agg_mode == "token-sum":
        loss = masked_sum(loss_mat, mask)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        scale = loss_mat.shape[-1] if norm.loss_scale_factor is None else norm.loss_scale_factor
        loss = masked_sum(loss_mat, mask) / scale
    elif loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        seq_tokens = masked_count(mask, dim=-1)
        seq_losses = masked_sum(loss_mat, mask, dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / seq_tokens.clamp(min=1).to(seq_losses.dtype)
        count = (
            (seq_tokens > 0).sum(dtype=torch.float32) if norm.seq_count is None else norm.seq_count
        )
        loss = seq_losses.sum() / _clamp_count(count)
    else:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )
    return loss * norm.dp_size


def _clamp_count(count: torch.Tensor | float) -> torch.Tensor | float:
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(float(count), 1.0)
