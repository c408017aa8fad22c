"""Argument checks at the public boundaries of ``lmrl.algos``: clear ``ValueError``s that name
the offending argument, instead of a broadcasting error from deep inside the maths."""

from __future__ import annotations

import torch


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise if the given (non-None) tensors do not all have the first one's shape."""
    items = [(name, t) for name, t in tensors.items() if t is not None]
    if not items:
        return
    ref_name, ref = items[0]
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
                "they must match"
            )


def check_2d(name: str, t: torch.Tensor) -> None:
    """Raise unless ``t`` is a (B, T) tensor."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a (B, T) tensor, got {shape}")


def as_bool_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """Masks are bool (True = counts); 0/1 float or int masks, as verl passes them, are accepted."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    return mask if mask.dtype == torch.bool else mask != 0
