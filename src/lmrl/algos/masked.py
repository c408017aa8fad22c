"""Masked reductions: every reduction over tokens in lmrl goes through these.

Masks are bool with True = the position counts (0/1 masks are accepted). Values outside the
mask never reach a result, NaN and inf included: they are selected away with ``torch.where``,
not multiplied by zero. An empty mask gives a mean of 0, not NaN.
"""

from __future__ import annotations

import torch

from lmrl.algos.checks import as_bool_mask, check_same_shape


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is True, over ``dim`` (all dims when None).

    Args:
        values: any shape, e.g. (B, T).
        mask: bool, the shape of ``values``.
    """
    check_same_shape(values=values, mask=mask)
    mask = as_bool_mask("mask", mask)
    kept = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of True positions of ``mask`` over ``dim``, as a float tensor."""
    mask = as_bool_mask("mask", mask)
    return mask.sum(dtype=torch.float32) if dim is None else mask.sum(dim=dim, dtype=torch.float32)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the True positions of ``mask`` (0 where nothing counts).

    Args:
        values: any shape, e.g. (B, T).
        mask: bool, the shape of ``values``.
        dim: reduce over this dim only (e.g. ``-1`` for one mean per sequence), or all.
    """
    total = masked_sum(values, mask, dim)
    count = masked_count(mask, dim).to(total.dtype)
    return total / count.clamp(min=1)


def _masked_moments(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Centered kept values (0 - mean outside the mask), count, mean, unbiased variance.

    Two passes (mean, then squared deviations) for stability, with torch's cascade
    summation; outside the mask the centered values are ``-mean``, whose squares are
    subtracted exactly. With fewer than two positions the variance is 0.
    """
    check_same_shape(values=values, mask=mask)
    mask = as_bool_mask("mask", mask)
    centered = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    n = mask.sum().to(torch.float64)
    mean = centered.sum().to(torch.float64) / n.clamp(min=1)
    centered.sub_(mean.to(values.dtype))
    squares = (centered * centered).sum().to(torch.float64)
    squares = squares - (mask.numel() - n) * mean.square()
    var = (squares / (n - 1).clamp(min=1)).clamp(min=0)
    return centered, n, mean, var


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all True positions of ``mask``.

    Unbiased (Bessel's n/(n-1)) by default, as verl's ``masked_var``; with fewer than two
    positions the variance is 0 rather than a division by zero.
    """
    _, n, _, var = _masked_moments(values, mask)
    if not unbiased:
        var = var * (n - 1).clamp(min=0) / n.clamp(min=1)
    return var.to(values.dtype)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalize ``values`` to unit variance (and zero mean) over the True positions of ``mask``.

    ``(x - mean) / sqrt(var + eps)``, with the unbiased masked variance; with
    ``shift_mean=False`` the mean is added back (only the scale changes). Positions outside
    the mask are set to 0.

    Args:
        values: (B, T).
        mask: bool (B, T).
    Returns:
        (B, T), zero outside the mask.
    """
    mask = as_bool_mask("mask", mask)
    centered, _, mean, var = _masked_moments(values, mask)
    whitened = centered.mul_(torch.rsqrt(var + eps).to(values.dtype))
    if not shift_mean:
        whitened.add_(mean.to(values.dtype))
    return whitened.masked_fill_(~mask, 0.0)
