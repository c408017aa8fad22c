"""Masked reductions: every reduction over tokens in lmrl goes through these.

Masks are bool with True = the position counts (0/1 masks are accepted). Values outside the
mask never reach a result, NaN and inf included: they are selected away (``zero_outside``),
not multiplied by zero. An empty mask gives a mean of 0, not NaN.

On the CPU, torch's bool-mask kernels (``torch.where``, ``masked_fill``, ``bool.to(float)``,
``bool.sum()``) are much slower than float arithmetic on the same tensor, so the selection is
done on the bits of the floats and the mask is read through a ``uint8`` view
(``zero_outside``, ``keep_float``), with the same results.
"""

from __future__ import annotations

import torch

from lmrl.algos.checks import as_bool_mask, check_same_shape

# an integer type of the same width for each float type: the bits that ``zero_outside`` ANDs
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def zero_outside(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where ``mask`` is True, else 0 (a new tensor); NaN and inf outside the mask
    are gone, those inside kept.

    On the CPU, for tensors without autograd, a bitwise AND of each float's bits with all
    ones (kept) or all zeros (+0.0), faster there than ``torch.where``; elsewhere
    ``torch.where``.

    Args:
        values: any shape.
        mask: bool, the shape of ``values``.
    """
    bits = _BITS.get(values.dtype)
    if (
        bits is None
        or values.device.type != "cpu"
        or values.requires_grad
        or mask.shape != values.shape
        or mask.dtype != torch.bool
    ):
        return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    ones = mask.view(torch.int8).neg().to(bits)  # True -> -1 (all bits set), False -> 0
    return torch.bitwise_and(values.view(bits), ones).view(values.dtype)


def keep_float(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A bool mask as 0/1 floats of ``dtype`` (read through a ``uint8`` view: on the CPU
    faster than ``mask.to(dtype)``). Multiplying by it is only safe for finite values."""
    mask = as_bool_mask("mask", mask)
    return mask.view(torch.uint8).to(dtype)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is True, over ``dim`` (all dims when None).

    Args:
        values: any shape, e.g. (B, T).
        mask: bool, the shape of ``values``.
    """
    check_same_shape(values=values, mask=mask)
    mask = as_bool_mask("mask", mask)
    kept = zero_outside(values, mask)
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


def _count(keep: torch.Tensor) -> torch.Tensor:
    """Number of ones in ``keep`` (a mask as 0/1 floats), float64 (0-dim)."""
    if keep.dtype in (torch.float16, torch.bfloat16):
        keep = keep.float()
    if keep.dim() == 0 or keep.numel() < 2**24:  # float32 sums of ones are exact below 2^24
        return keep.sum().to(torch.float64)
    return keep.sum(-1).sum(dtype=torch.float64)  # rows, then the rows' counts


def _masked_moments(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    check_same_shape(values=values, mask=mask)
    mask = as_bool_mask("mask", mask)
    return _moments(zero_outside(values, mask), keep_float(mask, values.dtype))


def _moments(kept: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Centered values (``kept - mean`` inside the mask, 0 outside: a new tensor), count,
    mean, unbiased variance, of values already 0 outside the mask; ``keep`` is the mask as
    0/1 floats.

    Two passes (mean, then squared deviations) for stability, with torch's cascade
    summation. With fewer than two positions the variance is 0.
    """
    n = _count(keep)
    mean = kept.sum().to(torch.float64) / n.clamp(min=1)
    centered = torch.addcmul(kept, keep, -mean.to(kept.dtype))
    squares = (centered * centered).sum().to(torch.float64)
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
    check_same_shape(values=values, mask=mask)
    return whiten_kept(zero_outside(values, mask), keep_float(mask, values.dtype), shift_mean, eps)


def whiten_kept(
    kept: torch.Tensor, keep: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``masked_whiten`` of values already 0 outside the mask (``kept``), the mask given as
    0/1 floats (``keep_float``): the advantage estimators' path, which has both at hand.

    Returns:
        (B, T), 0 outside the mask (NaN there too when a value inside is NaN or inf).
    """
    centered, _, mean, var = _moments(kept, keep)
    whitened = centered.mul_(torch.rsqrt(var + eps).to(kept.dtype))
    if not shift_mean:
        whitened.addcmul_(keep, mean.to(kept.dtype))
    return whitened
