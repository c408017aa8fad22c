"""Rollout correction: importance weights between the training policy and the rollout engine.

The engine that samples (vLLM in bf16, say) and the trainer that recomputes log-probs (fp32)
disagree a little, so the samples are slightly off-policy for pi_old. The weight
``w = pi_old / pi_rollout`` of each sampled token corrects for that, as verl's rollout
correction (``algorithm.rollout_is*``) does:

- ``level``: ``token`` (one weight per token), ``sequence`` (the product over the sequence,
  broadcast to its tokens) or ``geometric`` (the geometric mean over the sequence, a
  length-independent sequence weight).
- ``mode``: ``truncate`` (truncated IS, TIS: ``w = min(w, threshold)``, nothing dropped) or
  ``mask`` (rejection: tokens, or whole sequences at the sequence levels, whose weight falls
  outside ``[threshold_lower, threshold]`` leave the mask and get weight 0).

The weights are detached (they scale the policy loss, they are not optimized) and the
log-weights are clamped to [-20, 20] before ``exp``. Diagnostics come back as detached 0-dim
tensors: the mean and max weight, the effective sample size, how much was masked or
truncated, and the mismatch KL(pi_rollout || pi_old) by k1 and k3.
"""

from __future__ import annotations

import torch

from lmrl.algos.checks import as_bool_mask, check_2d, check_same_shape
from lmrl.algos.kl import k3
from lmrl.algos.masked import masked_count, masked_mean, masked_sum

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")

_LOG_WEIGHT_CLAMP = 20.0


def rollout_importance_weights(
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = 2.0,
    threshold_lower: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights ``pi_old / pi_rollout`` for the sampled tokens, truncated or masked.

    Args:
        old_log_prob: (B, T) log-probs recomputed by the training policy (pi_old).
        rollout_log_probs: (B, T) log-probs reported by the rollout engine.
        response_mask: bool (B, T), True = the token counts.
        level: ``token``, ``sequence`` or ``geometric``.
        mode: ``truncate`` or ``mask``.
        threshold: the upper bound (> 0): the truncation cap, or the rejection bound.
        threshold_lower: the lower rejection bound in ``mask`` mode (default
            ``1 / threshold``); unused by ``truncate``.
    Returns:
        ``(weights, response_mask_out, metrics)``: detached (B, T) weights, 0 outside
        ``response_mask_out``; the bool (B, T) mask with rejected positions removed (the input
        mask in ``truncate`` mode); metrics ``is_weight_mean``, ``is_weight_max`` and
        ``is_eff_sample_size`` (``(sum w)^2 / (n sum w^2)`` in (0, 1], 1 for equal weights)
        over the returned mask, ``is_masked_fraction`` and ``is_truncated_fraction`` of the
        input mask's tokens, ``mismatch_kl`` (k1) and ``mismatch_k3`` estimating
        KL(pi_rollout || pi_old) over the input mask.
    Raises:
        ValueError: unknown ``level`` or ``mode``, ``threshold`` <= 0, ``threshold_lower`` < 0
            or above ``threshold``, or mismatched shapes.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; valid levels: {', '.join(LEVELS)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    if threshold <= 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    lower = 1.0 / threshold if threshold_lower is None else float(threshold_lower)
    if lower < 0:
        raise ValueError(f"threshold_lower must be >= 0, got {threshold_lower}")
    if lower > threshold:
        raise ValueError(f"threshold_lower ({lower}) must not exceed threshold ({threshold})")
    check_2d("old_log_prob", old_log_prob)
    check_same_shape(
        old_log_prob=old_log_prob, rollout_log_probs=rollout_log_probs, response_mask=response_mask
    )
    mask = as_bool_mask("response_mask", response_mask)

    with torch.no_grad():
        old = torch.where(mask, old_log_prob, 0.0)
        rollout = torch.where(mask, rollout_log_probs, 0.0)
        log_ratio = old - rollout  # (B, T), 0 outside the mask
        if level == "token":
            log_w = log_ratio
        elif level == "sequence":
            log_w = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
        else:  # geometric
            log_w = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
        w = torch.exp(torch.clamp(log_w, -_LOG_WEIGHT_CLAMP, _LOG_WEIGHT_CLAMP))

        truncated = torch.zeros_like(mask)
        if mode == "truncate":
            truncated = mask & (w > threshold)
            w = torch.clamp(w, max=threshold)
            mask_out = mask
        else:  # mask: at the sequence levels w is constant along a row, so whole rows go
            mask_out = mask & (w >= lower) & (w <= threshold)
        weights = torch.where(mask_out, w, 0.0)

        total = weights.sum()
        n = masked_count(mask_out).to(weights.dtype)
        ess = total.square() / (n * weights.square().sum()).clamp(min=torch.finfo(w.dtype).tiny)
        metrics = {
            "is_weight_mean": masked_mean(weights, mask_out),
            "is_weight_max": weights.max(),
            "is_eff_sample_size": ess,
            "is_masked_fraction": masked_mean((~mask_out).float(), mask),
            "is_truncated_fraction": masked_mean(truncated.float(), mask),
            "mismatch_kl": masked_mean(rollout - old, mask),
            "mismatch_k3": masked_mean(k3(rollout, old), mask),
        }
    return weights, mask_out, metrics
