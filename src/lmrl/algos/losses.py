"""Policy losses: the ``policy_losses`` registry, one entry per recipe, one shared signature.

Every loss takes ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, *,
rollout_is_weights, norm)`` plus the keyword hyperparameters it uses, and no others, and returns
``(loss, metrics)``: a 0-dim loss whose gradient flows through ``log_prob`` only, and detached
0-dim ``pg_clipfrac``, ``pg_clipfrac_lower`` and ``ppo_kl`` (0 where a loss has no such notion).
A misspelt or foreign hyperparameter is a ``TypeError`` naming it; a caller holding every
hyperparameter passes each loss its own, read once from :func:`loss_hyperparameters`, so it
calls whichever loss the config names without branching on it.

The choice this module makes: inputs are sanitized at the boundary. Positions outside
``response_mask`` are replaced by 0 with ``torch.where`` before any arithmetic, so NaN or
huge values there never reach a loss, a metric or a gradient (the gradient of ``log_prob``
is exactly 0 there). ``rollout_is_weights`` (rollout correction, detached) multiply the
per-token loss before aggregation; ``norm`` carries the mini-batch's global counts when the
loss is computed per micro-batch (see ``lmrl.algos.agg``).
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

from lmrl.algos.agg import AggNorm, agg_loss
from lmrl.algos.checks import as_bool_mask, check_2d, check_same_shape
from lmrl.algos.masked import masked_mean
from lmrl.algos.registry import Registry

policy_losses = Registry("policy loss")

# log-ratios are clamped before exp() so that one wild token cannot overflow the loss
_LOG_RATIO_CLAMP = 20.0
# GSPO clamps its (sequence) log-ratio from above only, as in the paper's reference code
_GSPO_LOG_RATIO_MAX = 10.0

Metrics = dict[str, torch.Tensor]

# keyword arguments every policy loss takes that are inputs, not hyperparameters
_SHARED_KEYWORDS = ("rollout_is_weights", "norm")


def loss_hyperparameters(name: str) -> tuple[str, ...]:
    """The hyperparameters the policy loss ``name`` declares, in signature order.

    Its keyword-only parameters other than ``rollout_is_weights`` and ``norm``: e.g.
    ``("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")`` for ``vanilla``,
    ``()`` for ``reinforce``. Raises the registry's ValueError for an unknown name.
    """
    params = inspect.signature(policy_losses.get(name)).parameters.values()
    return tuple(
        p.name
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in _SHARED_KEYWORDS
    )


class _Inputs(NamedTuple):
    old_log_prob: torch.Tensor  # (B, T), 0 outside the mask
    log_prob: torch.Tensor  # (B, T), 0 outside the mask, carries the gradient
    advantages: torch.Tensor  # (B, T), 0 outside the mask
    mask: torch.Tensor  # bool (B, T)
    weights: torch.Tensor | None  # detached (B, T), 0 outside the mask, or None


def _prepare(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
) -> _Inputs:
    """Check shapes and zero every input outside the mask (NaN-safe, gradient-safe)."""
    check_2d("log_prob", log_prob)
    check_same_shape(
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
        rollout_is_weights=rollout_is_weights,
    )
    mask = as_bool_mask("response_mask", response_mask)
    weights = None
    if rollout_is_weights is not None:
        weights = torch.where(mask, rollout_is_weights.detach(), 0.0)
    return _Inputs(
        old_log_prob=torch.where(mask, old_log_prob.detach(), 0.0),
        log_prob=torch.where(mask, log_prob, 0.0),
        advantages=torch.where(mask, advantages.detach(), 0.0),
        mask=mask,
        weights=weights,
    )


def _clip_bounds(
    clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None
) -> tuple[float, float]:
    """``(low, high)``: each defaults to ``clip_ratio``; negative values are an error."""
    bounds = []
    for name, value in (("clip_ratio_low", clip_ratio_low), ("clip_ratio_high", clip_ratio_high)):
        if value is None:
            name, value = "clip_ratio", clip_ratio
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        bounds.append(float(value))
    return bounds[0], bounds[1]


def _log_ratio(x: _Inputs) -> torch.Tensor:
    """(B, T) ``log_prob - old_log_prob``, clamped to +-20 so that its exp stays finite."""
    return torch.clamp(x.log_prob - x.old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _clip_terms(
    advantages: torch.Tensor, ratio: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's two per-token terms ``(-A r, -A clip(r, 1 - low, 1 + high))``; their max is the
    clipped surrogate, and where the second is larger the clip chose it."""
    return -advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)


def _weighted(pg_losses: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return pg_losses if weights is None else pg_losses * weights


def _fraction(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of valid tokens where ``condition`` holds, as a float 0-dim tensor."""
    return masked_mean(condition.float(), mask)


def _metrics(
    pg_clipfrac: torch.Tensor | None, pg_clipfrac_lower: torch.Tensor | None, ppo_kl: torch.Tensor
) -> Metrics:
    """Detached 0-dim metrics, at least float32 (a bf16 ``ppo_kl`` is promoted)."""
    zero = torch.zeros((), dtype=torch.float32, device=ppo_kl.device)
    values = {
        "pg_clipfrac": zero if pg_clipfrac is None else pg_clipfrac,
        "pg_clipfrac_lower": zero if pg_clipfrac_lower is None else pg_clipfrac_lower,
        "ppo_kl": ppo_kl,
    }
    return {
        k: v.detach().to(torch.promote_types(v.dtype, torch.float32)) for k, v in values.items()
    }


@policy_losses.register("vanilla")
def vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    rollout_is_weights: torch.Tensor | None = None,
    norm: AggNorm | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate with asymmetric bounds and the dual clip for A < 0.

    PPO (arXiv:1707.06347), clip-higher from DAPO (arXiv:2503.14476), dual clip
    (arXiv:1912.09729). Per token, with ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``:
    ``l = max(-A r, -A clip(r, 1 - low, 1 + high))``, and for ``A < 0`` additionally
    ``l = min(l, -A clip_ratio_c)``: the loss of a bad action is bounded by ``-A c``.

    Args:
        old_log_prob: (B, T) log-probs of the sampled tokens under the policy that the
            ratio is anchored to (pi_old).
        log_prob: (B, T) log-probs under the policy being optimized; carries the gradient.
        advantages: (B, T).
        response_mask: bool (B, T), True = the token counts.
        loss_agg_mode: see ``lmrl.algos.agg.agg_loss``.
        rollout_is_weights: detached (B, T) weights multiplying the per-token loss.
        norm: global normalizers of the mini-batch when this is a micro-batch.
        clip_ratio: epsilon; the default of ``clip_ratio_low`` and ``clip_ratio_high``.
        clip_ratio_low: the ratio is clipped from below at ``1 - clip_ratio_low``.
        clip_ratio_high: the ratio is clipped from above at ``1 + clip_ratio_high``.
        clip_ratio_c: dual-clip constant, must be > 1.
    Returns:
        ``(loss, metrics)``: ``pg_clipfrac`` = fraction of tokens where the clipped term was
        chosen; ``pg_clipfrac_lower`` = fraction with A < 0 bounded by the dual clip;
        ``ppo_kl`` = masked mean of ``old_log_prob - log_prob``.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    adv = x.advantages

    log_ratio = _log_ratio(x)
    pg_losses1, pg_losses2 = _clip_terms(adv, torch.exp(log_ratio), low, high)
    clipped = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -adv * clip_ratio_c
    dual_clipped = torch.minimum(clipped, pg_losses3)
    pg_losses = torch.where(adv < 0, dual_clipped, clipped)

    loss = agg_loss(_weighted(pg_losses, x.weights), x.mask, loss_agg_mode, norm)
    return loss, _metrics(
        pg_clipfrac=_fraction(pg_losses2 > pg_losses1, x.mask),
        pg_clipfrac_lower=_fraction((clipped > pg_losses3) & (adv < 0), x.mask),
        ppo_kl=masked_mean(-log_ratio, x.mask),
    )


@policy_losses.register("gspo")
def gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    *,
    rollout_is_weights: torch.Tensor | None = None,
    norm: AggNorm | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO: PPO clipping on a sequence-level ratio, with token-level gradients.

    Group Sequence Policy Optimization (arXiv:2507.18071). ``s_i`` is the geometric mean of
    the token ratios of sequence i, ``exp(mean_t(log_prob - old_log_prob))``; each token uses
    ``s_it = sg[s_i] * pi / sg[pi]`` (same value as ``s_i``, gradient of its own log-prob),
    log-clamped at 10, in ``max(-A s_it, -A clip(s_it, 1 - low, 1 + high))``.
    The aggregation is always ``seq-mean-token-mean`` (``loss_agg_mode`` is ignored, as in
    verl); ``norm`` is honoured.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T), as in ``vanilla``.
        loss_agg_mode: ignored (see above).
        rollout_is_weights: detached (B, T) weights multiplying the per-token loss.
        norm: global normalizers of the mini-batch when this is a micro-batch.
        clip_ratio, clip_ratio_low, clip_ratio_high: the clip range, as in ``vanilla``
            (the GSPO paper uses small values such as 3e-4 / 4e-4).
    Returns:
        ``(loss, metrics)``; ``pg_clipfrac_lower`` is 0.
    """
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)

    log_ratio = x.log_prob - x.old_log_prob  # (B, T)
    seq_log_ratio = masked_mean(log_ratio, x.mask, dim=-1)  # (B,)
    log_seq_ratio = x.log_prob - x.log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=_GSPO_LOG_RATIO_MAX))
    pg_losses1, pg_losses2 = _clip_terms(x.advantages, seq_ratio, low, high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)

    loss = agg_loss(_weighted(pg_losses, x.weights), x.mask, "seq-mean-token-mean", norm)
    return loss, _metrics(
        pg_clipfrac=_fraction(pg_losses2 > pg_losses1, x.mask),
        pg_clipfrac_lower=None,
        ppo_kl=masked_mean(-log_ratio, x.mask),
    )


@policy_losses.register("geo_mean")
def geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    rollout_is_weights: torch.Tensor | None = None,
    norm: AggNorm | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GMPO: the geometric mean of token ratios per sequence, clipped token-wise in log space.

    Geometric-Mean Policy Optimization (arXiv:2507.20673). With ``d = log_prob -
    old_log_prob`` and ``s = sign(A)``, each token contributes ``s * min(s d, s clip(d, -low,
    high))`` (A > 0 caps d at ``high``, A < 0 floors it at ``-low``); the sequence ratio is
    ``exp`` of the mean of those over the sequence, the sequence advantage the mean of A, and
    ``loss = mean_i(-A_i * ratio_i)`` over sequences with at least one valid token
    (``loss_agg_mode`` is ignored; ``norm.seq_count`` is honoured). Rollout weights enter per
    sequence as their geometric mean.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T), as in ``vanilla``.
        loss_agg_mode: ignored (see above).
        rollout_is_weights: detached (B, T) weights; their per-sequence geometric mean
            multiplies the sequence loss.
        norm: global normalizers of the mini-batch when this is a micro-batch.
        clip_ratio, clip_ratio_low, clip_ratio_high: the clip range in log space.
    Returns:
        ``(loss, metrics)``: ``pg_clipfrac`` / ``pg_clipfrac_lower`` = fraction of tokens with
        A > 0 / A < 0 whose log-ratio lies outside ``[-low, high]``.
    """
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    adv = x.advantages

    log_ratio = x.log_prob - x.old_log_prob  # (B, T)
    sign = torch.sign(adv)
    log_ratio_clamped = torch.clamp(log_ratio, -low, high)
    log_ratio_min = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clamped)
    seq_ratio = torch.exp(masked_mean(log_ratio_min, x.mask, dim=-1))  # (B,)
    seq_adv = masked_mean(adv, x.mask, dim=-1)  # (B,)
    seq_losses = -seq_adv * seq_ratio  # (B,)
    if x.weights is not None:
        log_w = torch.log(x.weights.clamp(min=1e-10))
        seq_losses = seq_losses * torch.exp(masked_mean(log_w, x.mask, dim=-1))

    has_tokens = x.mask.any(dim=-1)
    loss = agg_loss(seq_losses[:, None], has_tokens[:, None], "seq-mean-token-sum", norm)
    clipped = log_ratio != log_ratio_clamped
    return loss, _metrics(
        pg_clipfrac=_fraction(clipped & (adv > 0), x.mask),
        pg_clipfrac_lower=_fraction(clipped & (adv < 0), x.mask),
        ppo_kl=masked_mean(-log_ratio, x.mask),
    )


@policy_losses.register("cispo")
def cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    rollout_is_weights: torch.Tensor | None = None,
    norm: AggNorm | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio.

    MiniMax-M1 (arXiv:2506.13585). Per token ``l = -sg(clip(r, 1 - low, 1 + high)) * A *
    log_prob`` with ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``: clipping the weight
    instead of the update keeps every token's gradient (the paper leaves the lower bound
    open: set ``clip_ratio_low`` >= 1).

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T), as in ``vanilla``.
        loss_agg_mode: see ``lmrl.algos.agg.agg_loss``.
        rollout_is_weights: detached (B, T) weights multiplying the per-token loss.
        norm: global normalizers of the mini-batch when this is a micro-batch.
        clip_ratio, clip_ratio_low, clip_ratio_high: the importance-weight clip range.
    Returns:
        ``(loss, metrics)``: ``pg_clipfrac`` = fraction of tokens whose ratio was clipped;
        ``pg_clipfrac_lower`` is 0.
    """
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)

    log_ratio = _log_ratio(x)
    ratio = torch.exp(log_ratio).detach()
    clipped_ratio = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    pg_losses = -clipped_ratio * x.advantages * x.log_prob

    loss = agg_loss(_weighted(pg_losses, x.weights), x.mask, loss_agg_mode, norm)
    return loss, _metrics(
        pg_clipfrac=_fraction(ratio != clipped_ratio, x.mask),
        pg_clipfrac_lower=None,
        ppo_kl=masked_mean(-log_ratio, x.mask),
    )


@policy_losses.register("sapo")
def sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    *,
    rollout_is_weights: torch.Tensor | None = None,
    norm: AggNorm | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip.

    Soft Adaptive Policy Optimization (arXiv:2511.20347). Per token ``l = -f(r) * A`` with
    ``f(r) = (4 / tau) * sigmoid(tau * (r - 1))``, ``tau = tau_pos`` where A > 0 and
    ``tau_neg`` elsewhere, ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``. At r = 1 the
    gate's slope is 1 (the plain policy gradient); far from 1 it fades smoothly. As in verl
    the aggregation is always ``seq-mean-token-mean`` (``loss_agg_mode`` is ignored; ``norm``
    is honoured); it has no clip range.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T), as in ``vanilla``.
        loss_agg_mode: ignored (see above).
        rollout_is_weights: detached (B, T) weights multiplying the per-token loss.
        norm: global normalizers of the mini-batch when this is a micro-batch.
        tau_pos: gate temperature for positive advantages, > 0.
        tau_neg: gate temperature for non-positive advantages, > 0 (larger = the gradient
            of a bad token fades faster once its ratio moves away from 1).
    Returns:
        ``(loss, metrics)``; ``pg_clipfrac`` and ``pg_clipfrac_lower`` are 0 (nothing is
        clipped).
    """
    for name, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
        if tau <= 0:
            raise ValueError(f"{name} must be > 0, got {tau}")
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)

    log_ratio = _log_ratio(x)
    ratio = torch.exp(log_ratio)
    tau = torch.where(x.advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -gate * x.advantages

    loss = agg_loss(_weighted(pg_losses, x.weights), x.mask, "seq-mean-token-mean", norm)
    return loss, _metrics(None, None, ppo_kl=masked_mean(-log_ratio, x.mask))


def _covariance(x: _Inputs) -> torch.Tensor:
    """(B, T) per-token ``(A - mean A) * (log_prob - mean log_prob)`` over the valid tokens,
    detached; ``-inf`` outside the mask (never selected). Its mean is the covariance whose
    sign drives the entropy's change under the policy gradient (arXiv:2505.22617)."""
    logp = x.log_prob.detach()
    cov = (x.advantages - masked_mean(x.advantages, x.mask)) * (logp - masked_mean(logp, x.mask))
    return torch.where(x.mask, cov, float("-inf"))


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1] (a fraction of the tokens), got {value}")


@policy_losses.register("clip_cov")
def clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    rollout_is_weights: torch.Tensor | None = None,
    norm: AggNorm | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov: PPO's clip, and no gradient from a random few tokens of high covariance.

    "The Entropy Mechanism of RL for Reasoning LMs" (arXiv:2505.22617): the policy's entropy
    falls at a rate set by the covariance of each token's log-prob and advantage; tokens
    that are both likely and rewarded (or unlikely and penalized) sharpen the policy. Per
    token ``c = (A - mean A)(log_prob - mean log_prob)`` over the valid tokens of this
    (micro-)batch; among the tokens the PPO clip did not already take with ``clip_cov_lb < c
    < clip_cov_ub``, ``max(1, int(clip_cov_ratio * #valid tokens))`` are drawn uniformly
    (torch's global generator) and contribute no gradient; the others take ``max(-A r, -A
    clip(r, 1 - low, 1 + high))``. No dual clip (as in verl). Unlike a clip on the ratio it
    acts on the first, on-policy update too.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T), as in ``vanilla``.
        loss_agg_mode: see ``lmrl.algos.agg.agg_loss``.
        rollout_is_weights: detached (B, T) weights multiplying the per-token loss.
        norm: global normalizers of the mini-batch when this is a micro-batch.
        clip_ratio, clip_ratio_low, clip_ratio_high: the ratio's clip range, as in ``vanilla``.
        clip_cov_ratio: the fraction of valid tokens whose gradient is dropped, in [0, 1]
            (verl's default 0.0002 is for batches of 10^5-10^6 tokens).
        clip_cov_lb, clip_cov_ub: only tokens with covariance strictly between them.
    Returns:
        ``(loss, metrics)``: ``pg_clipfrac`` as in ``vanilla``; ``cov_clipfrac`` = fraction of
        valid tokens dropped; ``pg_clipfrac_lower`` is 0.
    """
    _check_fraction("clip_cov_ratio", clip_cov_ratio)
    if clip_cov_lb >= clip_cov_ub:
        raise ValueError(f"clip_cov_lb ({clip_cov_lb}) must be below clip_cov_ub ({clip_cov_ub})")
    low, high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)

    log_ratio = _log_ratio(x)
    pg_losses1, pg_losses2 = _clip_terms(x.advantages, torch.exp(log_ratio), low, high)
    clipped = (pg_losses2 > pg_losses1) & x.mask
    cov = _covariance(x)
    eligible = (cov > clip_cov_lb) & (cov < clip_cov_ub) & ~clipped
    candidates = eligible.flatten().nonzero().squeeze(1)
    count = max(1, int(clip_cov_ratio * int(x.mask.sum())))
    pick = torch.randperm(len(candidates), device=candidates.device)[:count]
    dropped = torch.zeros_like(x.mask).flatten().index_fill_(0, candidates[pick], True)
    dropped = dropped.view_as(x.mask)
    pg_losses = torch.where(dropped, 0.0, torch.maximum(pg_losses1, pg_losses2))

    loss = agg_loss(_weighted(pg_losses, x.weights), x.mask, loss_agg_mode, norm)
    metrics = _metrics(
        pg_clipfrac=_fraction(clipped, x.mask),
        pg_clipfrac_lower=None,
        ppo_kl=masked_mean(-log_ratio, x.mask),
    )
    metrics["cov_clipfrac"] = _fraction(dropped, x.mask).detach()
    return loss, metrics


@policy_losses.register("kl_cov")
def kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    rollout_is_weights: torch.Tensor | None = None,
    norm: AggNorm | None = None,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 1.0,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov: the unclipped surrogate, with a KL penalty on the tokens of highest covariance.

    arXiv:2505.22617 (see ``clip_cov``). Per token ``l = -A r``; the ``int(kl_cov_ratio *
    #valid tokens)`` valid tokens of largest covariance ``c`` (none when that is 0) take ``l =
    -A r + ppo_kl_coef * |log_prob - old_log_prob|`` instead, which holds them near the policy
    that sampled them. On the first, on-policy update ``log_prob == old_log_prob`` and the
    penalty's gradient is 0: it acts from the second mini-batch or epoch of a batch on
    (``ppo_mini_batch_size`` below the batch, or ``ppo_epochs`` > 1).

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T), as in ``vanilla``.
        loss_agg_mode: see ``lmrl.algos.agg.agg_loss``.
        rollout_is_weights: detached (B, T) weights multiplying the per-token loss.
        norm: global normalizers of the mini-batch when this is a micro-batch.
        kl_cov_ratio: the fraction of valid tokens penalized, in [0, 1].
        ppo_kl_coef: the penalty's weight, >= 0.
    Returns:
        ``(loss, metrics)``: ``cov_klfrac`` = fraction of valid tokens penalized; the clip
        fractions are 0.
    """
    _check_fraction("kl_cov_ratio", kl_cov_ratio)
    if ppo_kl_coef < 0:
        raise ValueError(f"ppo_kl_coef must be >= 0, got {ppo_kl_coef}")
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)

    log_ratio = _log_ratio(x)
    pg_losses = -x.advantages * torch.exp(log_ratio)
    top = _covariance(x).flatten().topk(int(kl_cov_ratio * int(x.mask.sum()))).indices
    penalized = torch.zeros_like(x.mask).flatten().index_fill_(0, top, True).view_as(x.mask)
    pg_losses = torch.where(penalized, pg_losses + ppo_kl_coef * log_ratio.abs(), pg_losses)

    loss = agg_loss(_weighted(pg_losses, x.weights), x.mask, loss_agg_mode, norm)
    metrics = _metrics(None, None, ppo_kl=masked_mean(-log_ratio, x.mask))
    metrics["cov_klfrac"] = _fraction(penalized, x.mask).detach()
    return loss, metrics


@policy_losses.register("reinforce")
def reinforce(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    rollout_is_weights: torch.Tensor | None = None,
    norm: AggNorm | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Plain policy gradient ``-A * log_prob * w`` (w = rollout weights, or 1).

    REINFORCE (Williams, 1992), for bypass mode where the rollout engine's log-probs serve as
    the old policy and the only correction is ``rollout_is_weights``. No ratio, no clipping,
    no hyperparameters; ``old_log_prob`` only feeds the ``ppo_kl`` diagnostic.

    Args:
        old_log_prob, log_prob, advantages, response_mask: (B, T), as in ``vanilla``.
        loss_agg_mode: see ``lmrl.algos.agg.agg_loss``.
        rollout_is_weights: detached (B, T) weights multiplying the per-token loss.
        norm: global normalizers of the mini-batch when this is a micro-batch.
    Returns:
        ``(loss, metrics)``; clip fractions are 0, ``ppo_kl`` = masked mean of
        ``old_log_prob - log_prob``.
    """
    x = _prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    pg_losses = -x.advantages * x.log_prob
    loss = agg_loss(_weighted(pg_losses, x.weights), x.mask, loss_agg_mode, norm)
    ppo_kl = masked_mean(x.old_log_prob - x.log_prob.detach(), x.mask)
    return loss, _metrics(None, None, ppo_kl=ppo_kl)
