"""KL regularization: per-token estimators, coefficient controllers, and KL in the reward.

``kl_estimators`` holds Schulman's sample-based estimators of KL(pi || pi_ref) from the
log-probs of tokens sampled from pi (http://joschu.net/blog/kl-approx.html): ``k1``
(unbiased, high variance, can be negative), ``abs``, ``k2`` (half squared log-ratio), ``k3``
(unbiased and always >= 0, verl's ``low_var_kl``). The recipes' names ``kl``, ``mse`` and
``low_var_kl`` resolve through the registry's alias table. ``full`` is the exact KL over the
vocabulary: it takes (B, T, V) logits (or log-probs) instead of sampled log-probs, and is
computed in chunks by ``lmrl.algos.logprob.full_kl_from_logits``. :func:`full_kl_from_hidden`
is the same KL from the two models' final hidden states and output heads, with the head fused
into the chunks, so that a policy's KL loss never holds more than one chunk of logits.

The KL coefficient of the reward penalty is state, not config: ``FixedKLController`` and
``AdaptiveKLController`` (Ziegler et al., arXiv:1909.08593) carry it across steps and
checkpoint it through ``state_dict()``. ``apply_kl_penalty`` subtracts ``beta * KL(pi_old ||
pi_ref)`` from the token scores and then lets the controller react to the observed KL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from lmrl.algos.checks import as_bool_mask, check_2d, check_same_shape
from lmrl.algos.logprob import (
    _check_temperature,
    _chunk_logits,
    _head_backward,
    _rows_per_chunk,
    full_kl_from_logits,
    head_dtype,
)
from lmrl.algos.masked import masked_mean
from lmrl.algos.registry import Registry

# ------------------------------------------------------------------------------------------
# Estimators
# ------------------------------------------------------------------------------------------

kl_estimators: Registry[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = Registry(
    "KL estimator"
)

_K3_LOG_RATIO_CLAMP = 20.0
_K3_OUTPUT_CLAMP = 10.0


@kl_estimators.register("k1")
def k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``log pi - log pi_ref``: unbiased, high variance, negative on some tokens.

    Args:
        log_prob: (B, T) log-probs of the sampled tokens under pi.
        ref_log_prob: (B, T) log-probs of the same tokens under pi_ref.
    Returns:
        (B, T) per-token estimate.
    """
    return log_prob - ref_log_prob


@kl_estimators.register("abs")
def abs_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``|log pi - log pi_ref|``: k1's magnitude (biased, never negative). Shapes as ``k1``."""
    return (log_prob - ref_log_prob).abs()


@kl_estimators.register("k2")
def k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``0.5 * (log pi - log pi_ref)^2``: low variance, biased; its gradient is the log-ratio.

    Shapes as ``k1``.
    """
    return 0.5 * (log_prob - ref_log_prob).square()


@kl_estimators.register("k3")
def k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``ratio - log(ratio) - 1`` with ``ratio = pi_ref / pi``: unbiased and >= 0.

    For stability the log-ratio is clamped to [-20, 20] before ``exp`` and the estimate to
    [-10, 10] (seed 000, errata). Shapes as ``k1``. Computed as ``expm1(x) - x``, not
    ``exp(x) - 1 - x`` (which cancels to -1e-16 for |x| ~ 1e-10), and kept >= 0 as it is.
    """
    log_ratio = torch.clamp(ref_log_prob - log_prob, -_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
    kld = torch.expm1(log_ratio) - log_ratio
    return torch.clamp(kld, 0.0, _K3_OUTPUT_CLAMP)


@kl_estimators.register("full", needs=("logits",))
def full(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Exact ``KL(pi || pi_ref) = sum_v pi_v (log pi_v - log pi_ref_v)`` over the vocabulary.

    Args:
        log_prob: (B, T, V) logits (or log-probs: they are renormalized) of pi; may carry the
            gradient.
        ref_log_prob: (B, T, V) logits of pi_ref, treated as constants.
    Returns:
        (B, T), computed in chunks of rows: no full fp32 (B, T, V) copy is made.
    """
    if log_prob.dim() != 3:
        raise ValueError(
            f"the 'full' KL needs (B, T, V) logits, got log_prob of shape {tuple(log_prob.shape)}"
        )
    return full_kl_from_logits(log_prob, ref_log_prob)


class _FullKLFromHidden(torch.autograd.Function):
    """KL(pi || ref) per row of hidden states; the reference side is a constant.

    Forward keeps the per-row log-sum-exps and KL; backward recomputes both chunks of logits
    and writes ``d KL / d z = p * (log p - log q - KL) / T`` through the policy's head.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, ref_hidden, ref_weight, ref_bias, temperature, rows):
        n, dtype = hidden.shape[0], head_dtype(hidden, weight)
        acc = torch.promote_types(dtype, torch.float32)
        lse, ref_lse, kl = (hidden.new_empty(n, dtype=acc) for _ in range(3))
        w, ref_w = weight.to(dtype), ref_weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, n, rows):
                j = min(i + rows, n)
                log_p = _chunk_logits(hidden[i:j], w, bias, temperature, dtype)  # (c, V) fp32
                log_q = _chunk_logits(ref_hidden[i:j], ref_w, ref_bias, temperature, dtype)
                lse[i:j] = torch.logsumexp(log_p, dim=-1)
                ref_lse[i:j] = torch.logsumexp(log_q, dim=-1)
                log_p.sub_(lse[i:j, None])
                log_q.sub_(ref_lse[i:j, None]).neg_().add_(log_p)  # log p - log q
                # sum_v p (log p - log q) as a batched dot: no third (c, V) tensor
                kl[i:j] = torch.bmm(log_p.exp_().unsqueeze(1), log_q.unsqueeze(2)).view(-1)
        ctx.save_for_backward(hidden, weight, bias, ref_hidden, ref_weight, ref_bias,
                              lse, ref_lse, kl)  # fmt: skip
        ctx.temperature, ctx.rows, ctx.dtype = temperature, rows, dtype
        ctx.has_bias, ctx.has_ref_bias = bias is not None, ref_bias is not None
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_kl):
        hidden, weight, bias, ref_hidden, ref_weight, ref_bias, lse, ref_lse, kl = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        ref_bias = ref_bias if ctx.has_ref_bias else None
        temperature, dtype = ctx.temperature, ctx.dtype
        w, ref_w = weight.to(dtype), ref_weight.to(dtype)

        def grad_z(i: int, j: int) -> torch.Tensor:
            log_p = _chunk_logits(hidden[i:j], w, bias, temperature, dtype).sub_(lse[i:j, None])
            log_q = _chunk_logits(ref_hidden[i:j], ref_w, ref_bias, temperature, dtype)
            log_q.sub_(ref_lse[i:j, None])
            # p * (log p - log q - KL) * g / T, built in log_q's storage
            g = log_q.neg_().add_(log_p).sub_(kl[i:j, None]).mul_(log_p.exp_())
            return g.mul_(grad_kl[i:j, None] / temperature)

        grads = _head_backward(hidden, weight, bias, ctx.needs_input_grad[:3], ctx.rows, grad_z,
                               cast=w)  # fmt: skip
        return (*grads, None, None, None, None, None)


def full_kl_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ref_hidden: torch.Tensor,
    ref_weight: torch.Tensor,
    ref_bias: torch.Tensor | None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Exact ``KL(pi || pi_ref) = sum_v p_v (log p_v - log q_v)`` per token, from hidden states.

    ``p = softmax((hidden @ weight.T + bias) / T)`` and ``q`` likewise from the reference's
    ``ref_hidden``, ``ref_weight``, ``ref_bias``. The logits of both exist one chunk of
    ``chunk_size`` rows at a time, in fp32, in forward and backward (which recomputes them):
    memory beyond the inputs is one (rows, V) chunk per side and three floats per row.
    The gradient flows to ``hidden``, ``weight`` and ``bias`` only; the reference side is a
    constant (detached here).

    Args:
        hidden: (B, T, H) (any leading dims) the policy's final hidden states.
        weight: (V, H) the policy's output head; bias: (V,) or None.
        ref_hidden: (B, T, H') the reference's final hidden states at the same positions.
        ref_weight: (V, H') the reference's output head; ref_bias: (V,) or None.
        temperature: the sampling temperature, > 0, applied to both.
        chunk_size: rows per chunk; default keeps one fp32 chunk of logits near 64 MB.
    Returns:
        (B, T) fp32 KL (fp64 for fp64 inputs), >= 0 up to rounding.
    """
    for name, h, w, b in (
        ("hidden", hidden, weight, bias),
        ("ref_hidden", ref_hidden, ref_weight, ref_bias),
    ):
        if not isinstance(h, torch.Tensor) or h.dim() < 2 or not h.is_floating_point():
            raise ValueError(f"{name} must be a floating point (..., H) tensor")
        if w.dim() != 2 or w.shape[1] != h.shape[-1]:
            raise ValueError(
                f"the head of {name} must be (V, H) with H = {h.shape[-1]}, got {tuple(w.shape)}"
            )
        if b is not None and b.shape != w.shape[:1]:
            raise ValueError(f"the bias of {name} must be ({w.shape[0]},), got {tuple(b.shape)}")
    if ref_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"ref_hidden {tuple(ref_hidden.shape)} and hidden {tuple(hidden.shape)} must cover "
            "the same positions"
        )
    if ref_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"the reference's vocabulary ({ref_weight.shape[0]}) differs from the policy's "
            f"({weight.shape[0]}): the full KL needs the same tokens on both sides"
        )
    temperature = _check_temperature(temperature)
    lead = hidden.shape[:-1]
    rows = _rows_per_chunk(weight.shape[0], chunk_size, weight.device)
    kl = _FullKLFromHidden.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias,
        ref_hidden.detach().reshape(-1, ref_hidden.shape[-1]), ref_weight.detach(),
        ref_bias.detach() if ref_bias is not None else None, temperature, rows,
    )  # fmt: skip
    return kl.view(lead)


def _kl_estimate(
    log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str, straight_through: bool
) -> torch.Tensor:
    check_same_shape(log_prob=log_prob, ref_log_prob=ref_log_prob)
    if straight_through and "logits" in kl_estimators.needs(kind):
        raise ValueError("straight_through applies to sampled-token estimators, not to 'full'")
    estimate = kl_estimators.get(kind)(log_prob, ref_log_prob)
    if not straight_through:
        return estimate
    quadratic = k2(log_prob, ref_log_prob)
    return quadratic + (estimate - quadratic).detach()


def kl_penalty(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    kind: str = "k1",
    straight_through: bool = False,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled tokens, by estimator name.

    ``straight_through=True`` returns the estimator's value with k2's gradient (the
    log-ratio), i.e. ``k2 + sg(estimate - k2)``: the value stays an unbiased KL estimate (k1,
    k3) while the gradient is that of the true KL's second-order expansion, which k1's and
    k3's own gradients are not when used as a loss.

    Args:
        log_prob: (B, T) log-probs of the sampled tokens under pi (may carry the gradient).
        ref_log_prob: (B, T) log-probs of the same tokens under pi_ref.
        kind: ``k1``, ``abs``, ``k2``, ``k3``, an alias (``kl``, ``mse``, ``low_var_kl``), or
            ``full`` with (B, T, V) logits in place of the log-probs.
        straight_through: value of ``kind``, gradient of ``k2``.
    Returns:
        (B, T) per-token estimates (masking is the caller's, e.g. through ``agg_loss``).
    Raises:
        ValueError: unknown ``kind`` (the message lists the valid names) or shape mismatch.
    """
    return _kl_estimate(log_prob, ref_log_prob, kind, straight_through)


# ------------------------------------------------------------------------------------------
# Controllers
# ------------------------------------------------------------------------------------------


class KLController(Protocol):
    """What the trainer needs from a KL coefficient controller."""

    value: float

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """A constant KL coefficient: ``update`` does nothing.

    Args:
        kl_coef: the coefficient beta, >= 0.
    """

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = _read_value(state)

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value})"


class AdaptiveKLController:
    """A KL coefficient that steers the observed KL towards a target.

    Ziegler et al., "Fine-Tuning Language Models from Human Preferences"
    (arXiv:1909.08593), as in verl: ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``,
    ``value *= 1 + e * n_steps / horizon``. Too much KL raises the coefficient, too little
    lowers it, by at most 20% per ``horizon`` samples.

    Args:
        init_kl_coef: the starting coefficient, >= 0.
        target_kl: the KL to aim for, > 0.
        horizon: samples over which a full 20% correction happens, > 0.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if init_kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl is None or target_kl <= 0:
            raise ValueError(
                f"target_kl must be > 0 for the adaptive KL controller, got {target_kl}"
            )
        if horizon is None or horizon <= 0:
            raise ValueError(f"horizon must be > 0 for the adaptive KL controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Move the coefficient after a batch of ``n_steps`` samples with mean KL ``current_kl``.

        Args:
            current_kl: the observed KL, a float or a 0-dim tensor.
            n_steps: samples in the batch (verl passes the batch size).
        """
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = _read_value(state)

    def __repr__(self) -> str:
        return (
            f"AdaptiveKLController(value={self.value}, target={self.target}, "
            f"horizon={self.horizon})"
        )


def _read_value(state: dict[str, float]) -> float:
    if "value" not in state:
        raise ValueError(f"KL controller state has no 'value' key; got keys {sorted(state)}")
    return float(state["value"])


kl_controllers: Registry[Callable[..., KLController]] = Registry("KL controller")


@kl_controllers.register("fixed")
def _make_fixed(
    kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController:
    return FixedKLController(kl_coef)


@kl_controllers.register("adaptive")
def _make_adaptive(
    kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> AdaptiveKLController:
    return AdaptiveKLController(kl_coef, target_kl, horizon)


def make_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> KLController:
    """Build a KL controller from the ``algorithm.kl_ctrl`` settings.

    Args:
        kind: ``fixed`` or ``adaptive``.
        kl_coef: the (initial) coefficient.
        target_kl: target KL, required (> 0) for ``adaptive``.
        horizon: adaptation horizon in samples, required (> 0) for ``adaptive``.
    Raises:
        ValueError: unknown ``kind`` (lists the valid ones), or ``target_kl`` / ``horizon``
            missing or <= 0 for ``adaptive``.
    """
    return kl_controllers.get(kind)(kl_coef, target_kl=target_kl, horizon=horizon)


# ------------------------------------------------------------------------------------------
# KL in the reward
# ------------------------------------------------------------------------------------------


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "k1",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token rewards ``scores - beta * KL(pi_old || pi_ref)`` under the mask; updates ``kl_ctrl``.

    PPO's KL-in-reward (seed 001/002 ``apply_kl_penalty``): ``beta`` is the controller's value
    before this batch; the batch's KL, the mean over sequences of each sequence's masked mean
    KL, then updates the controller with ``n_steps = B``.

    Args:
        token_level_scores: (B, T) rewards from the reward stage.
        old_log_prob: (B, T) log-probs of the response under pi_old.
        ref_log_prob: (B, T) log-probs under pi_ref.
        response_mask: bool (B, T); positions outside keep their score unchanged.
        kl_ctrl: a KL controller (``fixed`` or ``adaptive``); updated in place.
        kl_penalty: the KL estimator's name (``k1``, ``abs``, ``k2``, ``k3`` or an alias).
    Returns:
        ``(token_level_rewards, metrics)``: (B, T) rewards, and ``reward_kl_penalty`` (the
        batch KL) and ``reward_kl_penalty_coeff`` (beta) as detached 0-dim tensors.
    """
    check_2d("token_level_scores", token_level_scores)
    check_same_shape(
        token_level_scores=token_level_scores,
        old_log_prob=old_log_prob,
        ref_log_prob=ref_log_prob,
        response_mask=response_mask,
    )
    mask = as_bool_mask("response_mask", response_mask)
    with torch.no_grad():
        kld = _kl_estimate(old_log_prob, ref_log_prob, kl_penalty, straight_through=False)
        kld = torch.where(mask, kld, 0.0)
        beta = kl_ctrl.value
        token_level_rewards = token_level_scores - beta * kld
        current_kl = masked_mean(kld, mask, dim=-1).mean()
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    metrics = {
        "reward_kl_penalty": current_kl.detach(),
        "reward_kl_penalty_coeff": torch.tensor(beta, dtype=torch.float32, device=kld.device),
    }
    return token_level_rewards, metrics
