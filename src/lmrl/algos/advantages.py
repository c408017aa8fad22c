"""Advantage estimators: GAE, the critic-free GRPO family, REINFORCE++, ReMax, OPO.

Every estimator is registered in ``advantage_estimators`` under the recipes' name and shares
one signature, so the trainer never branches on which one runs::

    advantages, returns = estimator(
        token_level_rewards, response_mask,
        index=..., values=..., reward_baselines=...,          # what the estimator needs
        gamma=..., lam=..., epsilon=..., norm_adv_by_std_in_grpo=...,
    )

Inputs an estimator does not use are ignored; the ones it cannot do without are declared at
registration (``advantage_estimators.needs("gae") == {"values"}``), so the trainer knows to
run the critic or the greedy baseline rollout without knowing the estimator. Both outputs are ``(B, T)`` and 0 outside the
mask; nothing at a masked position (rewards, values, NaN) reaches any output.

Everything is vectorized. Group statistics use scatter-adds over the group ids; the
backward recursions of GAE and REINFORCE++ (``x_t = b_t + rate * x_{t+1}`` over the valid
tokens, masked spans skipped) are solved without a loop over tokens: when every row's valid
tokens are one run (single-turn responses), by block matrix products (16 tokens a block,
the blocks' starts solved the same way one level up); with masked spans inside a row, in
closed form per chunk of tokens (a reverse cumulative sum of decay-weighted terms), with only
a short loop across chunks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from lmrl.algos.checks import as_bool_mask, check_2d, check_same_shape
from lmrl.algos.masked import keep_float, masked_sum, masked_whiten, whiten_kept, zero_outside
from lmrl.algos.registry import Registry

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
advantage_estimators: Registry[AdvantageEstimator] = Registry("advantage estimator")

GroupIndex = torch.Tensor | np.ndarray | Sequence

# Largest total log-decay allowed inside one chunk of the scan: exp(+-500) stays well inside
# float64's range, so the closed form below neither overflows nor underflows.
_MAX_LOG_SPAN = 500.0
_MAX_LOG_SPAN_FP32 = 60.0  # float32: exp(60) * |values| below float32's max for |values| < 1e12
_MIN_RATE = 1e-30  # a rate of 0 is treated as 1e-30: contributions below 1e-30 relative.


# --------------------------------------------------------------------------- helpers


def group_ids(index: GroupIndex, device: torch.device | str = "cpu") -> torch.Tensor:
    """Dense group ids ``0..G-1`` (LongTensor (B,)) for any per-sample group labels.

    ``index`` is what verl passes (a numpy array of uid strings), a list of hashables, or an
    integer tensor.
    """
    if isinstance(index, torch.Tensor):
        if index.dim() != 1:
            raise ValueError(f"index must be one-dimensional (B,), got shape {tuple(index.shape)}")
        return torch.unique(index, return_inverse=True)[1].to(device)
    labels = np.asarray(index)
    if labels.ndim != 1:
        raise ValueError(f"index must be one-dimensional (B,), got shape {labels.shape}")
    if labels.dtype == object:
        labels = labels.astype(str)
    inverse = np.unique(labels, return_inverse=True)[1].reshape(-1)
    return torch.as_tensor(inverse, dtype=torch.long, device=device)


def group_stats(
    scores: torch.Tensor, groups: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group count, mean and unbiased std (each (B,)) of ``scores`` (B,).

    A group of one has std 0 here; callers decide what a singleton means. Group ids are below
    B, so B slots suffice and no device sync is needed to count the groups.
    """
    count = torch.zeros(scores.shape[0], dtype=scores.dtype, device=scores.device)
    count.index_add_(0, groups, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, groups, scores)
    mean = total / count
    sq = torch.zeros_like(count).index_add_(0, groups, (scores - mean[groups]).square())
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return count[groups], mean[groups], std[groups]


def reverse_discounted_scan(
    inputs: torch.Tensor, response_mask: torch.Tensor, rate: float
) -> torch.Tensor:
    """Solve ``x_t = b_t + rate * x_{t'}`` backwards over the valid tokens, ``x`` after the
    last valid token being 0, where ``t'`` is the next valid position after ``t``.

    At masked positions nothing happens: the running value is carried through unchanged
    (multi-turn observation tokens are skipped, not reset), and the output there is 0.

    Args:
        inputs: (B, T) the ``b_t``; values at masked positions are ignored (NaN included).
        response_mask: bool (B, T).
        rate: the decay per valid token, in [0, 1].
    Returns:
        (B, T) in the dtype of ``inputs``, 0 outside the mask.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"the discount rate must be in [0, 1], got {rate}")
    mask = as_bool_mask("response_mask", response_mask)
    check_same_shape(inputs=inputs, response_mask=mask)
    return _discounted(inputs, mask, rate)[0].to(inputs.dtype)


def _discounted(
    inputs: torch.Tensor, mask: torch.Tensor, rate: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reverse_discounted_scan` in the working dtype, and the mask as 0/1 of that dtype
    (``keep``, for a caller that goes on to whiten). Both (B, T); ``mask`` bool."""
    work = _work_dtype(inputs)
    keep = keep_float(mask, work)
    return _scan(zero_outside(inputs, mask).to(work), keep, rate).mul_(keep), keep


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    """The scans' working precision. On the CPU float32 loses nothing: the block scan sums at
    most 16 terms per level, and the chunked one's kernels (``cumsum``, ``cumprod``)
    accumulate in float64 whatever the tensor's type. Other devices accumulate in the
    tensor's own type, so they work in float64."""
    if t.device.type != "cpu" or t.dtype == torch.float64:
        return torch.float64
    return torch.float32


def _scan(b: torch.Tensor, keep: torch.Tensor, rate: float) -> torch.Tensor:
    """The running value ``y_t = keep_t * b_t + a_t * y_{t+1}`` (``y_T = 0``), with decay
    ``a_t = rate`` at valid and 1 at masked positions: at the valid positions, the solution.

    Args:
        b: (B, T) finite, 0 outside the mask; keep: the mask as 0/1 of ``b``'s dtype.
    Returns:
        (B, T), a new tensor; its values at masked positions are unspecified (callers zero
        them).
    """
    if b.device.type == "cpu" and _single_runs(keep):
        # no masked position lies between two valid ones: inside each row's run every step
        # decays, and outside it b is 0 (what leaks onto the masked positions is dropped)
        return _block_scan(b, rate)
    return _chunked_scan(b, keep, rate)


def _single_runs(keep: torch.Tensor) -> bool:
    """Whether each row's valid positions form one contiguous run (or none).

    A row with ``n`` valid positions in ``r`` runs has ``n - r`` pairs of adjacent valid
    positions, so it is one run (or empty) iff ``n - pairs <= 1``. Two float reductions over
    the 0/1 mask, exact (a row holds fewer than 2^24 ones). Reads one flag, which on the CPU
    costs no device sync.

    Args:
        keep: (B, T) 0/1 floats.
    """
    if keep.numel() == 0:
        return True
    pairs = (keep[:, 1:] * keep[:, :-1]).sum(-1)
    return bool((keep.sum(-1) - pairs).max() <= 1)


_BLOCK = 16  # (B*T/16, 16) @ (16, 16): the fastest block size on the CPU (benchmarks/README.md)


@functools.lru_cache(maxsize=64)
def _decay_matrix(rate: float, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``D[s, u] = rate^(s - u)`` for ``s >= u`` (else 0), ``(size, size)``, and
    ``g[u] = rate^(size - u)``, ``(size,)``: within a block, how ``b_s`` reaches ``y_u``, and
    how the value at the next block's start does. Powers in float64, rounded once; those
    below the dtype's smallest normal number are 0 (subnormals make CPU matmuls crawl).
    CPU tensors (the only device `_block_scan` runs on), cached per rate and size."""
    i = torch.arange(size, dtype=torch.float64)
    steps = i[:, None] - i[None, :]
    rate_t = torch.tensor(rate, dtype=torch.float64)
    tiny = torch.finfo(dtype).tiny
    matrix = torch.where(steps >= 0, rate_t ** steps.clamp(min=0), 0.0)
    carry = rate_t ** (size - i)
    return tuple(torch.where(t < tiny, 0.0, t).to(dtype) for t in (matrix, carry))


def _block_scan(b: torch.Tensor, rate: float) -> torch.Tensor:
    """``y_t = b_t + rate * y_{t+1}`` along the last dim (``y_T = 0``), every position
    decaying.

    In blocks of ``k = _BLOCK`` tokens: one matmul with the decay matrix of `_decay_matrix`
    sums each position's discounted rest of its block; the values at the blocks' starts obey
    the same recursion over blocks, with rate ``rate^k``, and are solved the same way
    (``log_16(T)`` levels, each 1/16 the size of the last); a block start's value reaches
    position ``u`` of the block before as ``rate^(k - u)`` times it. Every level sums at most
    16 terms, so float32 keeps ~1e-7 of the largest value (no overflow, no long-range
    rounding growth), and the whole scan costs about one matmul pass and one update pass,
    less than the chunked scan's running product and sum (benchmarks/README.md).

    Args:
        b: (B, T), float32 or float64 (on the CPU).
    Returns:
        (B, T) ``y``, a new tensor.
    """
    batch, length = b.shape
    if length <= _BLOCK:
        return b @ _decay_matrix(rate, length, b.dtype)[0]
    pad = -length % _BLOCK
    blocks = (length + pad) // _BLOCK
    padded = torch.nn.functional.pad(b, (0, pad)) if pad else b
    matrix, carry = _decay_matrix(rate, _BLOCK, b.dtype)
    y = torch.matmul(padded.reshape(batch, blocks, _BLOCK), matrix)
    starts = _block_scan(y[:, :, 0].contiguous(), rate**_BLOCK)  # value at each block start
    y[:, :-1].addcmul_(starts[:, 1:, None], carry)
    y = y.view(batch, blocks * _BLOCK)
    return y[:, :length].contiguous() if pad else y


def _chunked_scan(b: torch.Tensor, keep: torch.Tensor, rate: float) -> torch.Tensor:
    """`_scan` for any mask (masked spans carry the value through, undecayed), on any device.

    Closed form, in reversed time ``u`` (the flips are cheap copies): with ``w_u`` the product
    of ``1/a`` up to ``u``, ``y_u = (1/w_u) * sum_{s <= u} w_s b_s``: one running product
    and one cumulative sum of increasing terms (no cancellation), in place. The product runs
    in float64 (a float32 ``1/rate`` is off by up to 6e-8, an error that would compound
    along it), rounded once to ``b``'s dtype; it restarts every chunk of columns so ``w``
    stays below ``exp(span)``, and a short loop over the chunks carries ``y`` across (chunks
    of ~1200 tokens for ``rate = 0.95`` in float32, ~6000 for 0.99).
    """
    if rate == 1.0:  # no discount: a plain reverse cumulative sum
        return b.flip(-1).cumsum_(-1).flip(-1)
    rate = max(rate, _MIN_RATE)
    span = _MAX_LOG_SPAN if b.dtype == torch.float64 else _MAX_LOG_SPAN_FP32
    length = b.shape[-1]
    chunk = max(1, min(length, int(span / -math.log(rate))))
    # 1/a per position: 1/rate where valid, 1 where masked
    factors = keep.flip(-1).to(torch.float64).mul_(1.0 / rate - 1.0).add_(1.0)
    b = b.flip(-1)
    y = torch.empty_like(b)
    carry = None
    for start in range(0, length, chunk):
        cols = slice(start, min(start + chunk, length))
        w, ys = factors[:, cols].cumprod_(-1).to(b.dtype), y[:, cols]
        torch.mul(b[:, cols], w, out=ys).cumsum_(-1).div_(w)
        if carry is not None:
            ys.addcdiv_(carry, w)  # the value carried in decays by the chunk's product of a
        carry = ys[:, -1:]  # read before the next chunk's columns are written
    return y.flip(-1)


def _next_valid_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """For each position, ``values`` at the next valid position after it (0 if none). (B, T)"""
    batch, length = values.shape
    positions = torch.arange(length, device=values.device).expand(batch, length)
    valid_pos = torch.where(mask, positions, length)
    # first valid position at or after t, then shifted: strictly after t.
    first_at_or_after = valid_pos.flip(-1).cummin(-1).values.flip(-1)
    sentinel = torch.full((batch, 1), length, device=values.device, dtype=positions.dtype)
    first_after = torch.cat([first_at_or_after[:, 1:], sentinel], dim=-1)
    padded = torch.cat([torch.where(mask, values, 0.0), values.new_zeros(batch, 1)], dim=-1)
    return padded.gather(-1, first_after)


def _check_inputs(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **others: torch.Tensor | None
) -> torch.Tensor:
    check_2d("token_level_rewards", token_level_rewards)
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask, **others)
    return as_bool_mask("response_mask", response_mask)


def _need(name: str, value, estimator: str):
    if value is None:
        raise ValueError(f"the {estimator!r} advantage estimator needs {name}")
    return value


def _groups_for(index: GroupIndex | None, scores: torch.Tensor, estimator: str) -> torch.Tensor:
    groups = group_ids(_need("index", index, estimator), device=scores.device)
    if groups.shape[0] != scores.shape[0]:
        raise ValueError(
            f"index has {groups.shape[0]} entries but token_level_rewards has {scores.shape[0]} rows"
        )
    return groups


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B,) -> (B, T), 0 outside the mask."""
    return torch.where(mask, per_seq.to(dtype).unsqueeze(-1), 0.0)


def _scores(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Outcome score per sequence (B,), in float64 for the group statistics."""
    return masked_sum(token_level_rewards, mask, dim=-1).double()


# ------------------------------------------------------------------------ estimators


@advantage_estimators.register("gae", needs=("values",))
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    ``delta_t = r_t + gamma * V_{t'} - V_t``, ``A_t = delta_t + gamma * lam * A_{t'}``, with
    ``t'`` the next valid token (masked spans skipped, values and advantages carried through
    them, as verl does for multi-turn observation tokens); returns ``A + V``; the advantages
    are then whitened over the mask.

    Args:
        token_level_rewards: (B, T).
        response_mask: bool (B, T).
        values: (B, T) critic values.
        gamma: discount; lam: GAE lambda.
    Returns:
        advantages (B, T) whitened, returns (B, T) = unwhitened advantages + values.
    """
    _need("values", values, "gae")
    mask = _check_inputs(token_level_rewards, response_mask, values=values)
    dtype = token_level_rewards.dtype
    values = zero_outside(values.to(dtype), mask)
    if lam > 0:
        # With w = (gamma lam)^(valid steps), A_t = sum_s w (r_s + gamma V_s' - V_s) regroups as
        # sum_s w (r_s + (1/lam - 1) V_s) - V_t / lam: one scan, no next-value lookup.
        # small lam magnifies V by 1/lam and then cancels it: do that part in float64
        work = torch.float64 if lam < 0.5 else _work_dtype(token_level_rewards)
        values_w = values.to(work)
        inputs = torch.add(token_level_rewards.to(work), values_w, alpha=1.0 / lam - 1.0)
        scanned, keep = _discounted(inputs, mask, gamma * lam)  # masked junk dropped there
        advantages = scanned.sub_(values_w, alpha=1.0 / lam).to(dtype)
        keep = keep.to(dtype)
    else:  # TD(0): A_t = delta_t
        deltas = token_level_rewards + gamma * _next_valid_values(values, mask) - values
        advantages, keep = zero_outside(deltas, mask), keep_float(mask, dtype)
    returns = advantages + values  # both 0 outside the mask
    return whiten_kept(advantages, keep), returns


@advantage_estimators.register("grpo", needs=("index",))
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: outcome score normalized within its prompt group (Shao et al. 2024, DeepSeekMath).

    ``A_i = (r_i - mean_g) / (std_g + epsilon)`` with the unbiased std; a group of one gets
    mean 0 and std 1. ``norm_adv_by_std_in_grpo=False`` is Dr.GRPO (Liu et al. 2025,
    arXiv:2503.20783): ``A_i = r_i - mean_g``.

    Args:
        token_level_rewards: (B, T); the score of a sequence is its masked sum.
        response_mask: bool (B, T).
        index: (B,) group label of each sample (same prompt = same label).
    Returns:
        (advantages, advantages), both (B, T).
    """
    mask = _check_inputs(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards, mask)
    count, mean, std = group_stats(scores, _groups_for(index, scores, "grpo"))
    singleton = count == 1
    mean = torch.where(singleton, 0.0, mean)
    std = torch.where(singleton, 1.0, std)
    adv = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
    adv = _broadcast(adv, mask, token_level_rewards.dtype)
    return adv, adv


@advantage_estimators.register("grpo_passk", needs=("index",))
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO Pass@k (arXiv:2503.19595): only the best sample of a group learns.

    The best sample (first one on ties) gets ``r_max - r_second``, divided by
    ``std_g + epsilon`` when ``norm_adv_by_std_in_grpo``; every other sample gets 0. Every
    group needs at least two samples.

    Returns:
        (advantages, advantages), both (B, T).
    """
    mask = _check_inputs(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards, mask)
    groups = _groups_for(index, scores, "grpo_passk")
    count, _, std = group_stats(scores, groups)
    if bool((count < 2).any()):
        raise ValueError("index: grpo_passk needs at least 2 samples in every group")
    num_groups = scores.shape[0]  # ids are < B; unused slots stay untouched
    neg_inf = torch.full((num_groups,), -math.inf, dtype=scores.dtype, device=scores.device)
    best = neg_inf.scatter_reduce(0, groups, scores, "amax")
    positions = torch.arange(scores.shape[0], device=scores.device)
    is_max = scores == best[groups]
    first = torch.full((num_groups,), scores.shape[0], device=scores.device, dtype=positions.dtype)
    first = first.scatter_reduce(0, groups, torch.where(is_max, positions, scores.shape[0]), "amin")
    is_best = positions == first[groups]
    second = neg_inf.scatter_reduce(0, groups, torch.where(is_best, -math.inf, scores), "amax")
    gap = best[groups] - second[groups]
    if norm_adv_by_std_in_grpo:
        gap = gap / (std + epsilon)
    adv = _broadcast(torch.where(is_best, gap, 0.0), mask, token_level_rewards.dtype)
    return adv, adv


@advantage_estimators.register("rloo", needs=("index",))
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): baseline = mean of the *other* samples.

    ``A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g)``; a group of one keeps ``r_i``.

    Returns:
        (advantages, advantages), both (B, T).
    """
    mask = _check_inputs(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards, mask)
    count, mean, _ = group_stats(scores, _groups_for(index, scores, "rloo"))
    loo = (scores - mean) * count / (count - 1).clamp(min=1)
    adv = _broadcast(torch.where(count > 1, loo, scores), mask, token_level_rewards.dtype)
    return adv, adv


@advantage_estimators.register("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted reward-to-go, whitened over the batch.

    ``G_t = r_t + gamma * G_{t'}`` over the valid tokens (masked spans skipped, not reset).

    Returns:
        advantages (B, T) = whitened returns, returns (B, T).
    """
    mask = _check_inputs(token_level_rewards, response_mask)
    dtype = token_level_rewards.dtype
    returns, keep = _discounted(token_level_rewards, mask, gamma)
    return whiten_kept(returns, keep).to(dtype), returns.to(dtype)


@advantage_estimators.register("reinforce_plus_plus_baseline", needs=("index",))
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: outcome score minus its group mean, then whitened over the batch.

    A group of one has baseline 0.

    Returns:
        (advantages, advantages), both (B, T).
    """
    mask = _check_inputs(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards, mask)
    count, mean, _ = group_stats(scores, _groups_for(index, scores, "reinforce_plus_plus_baseline"))
    centered = scores - torch.where(count > 1, mean, 0.0)
    adv = masked_whiten(_broadcast(centered, mask, torch.float64), mask)
    adv = adv.to(token_level_rewards.dtype)
    return adv, adv


@advantage_estimators.register("remax", needs=("reward_baselines",))
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    reward_baselines: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): the greedy rollout's reward is the baseline.

    ``returns_t`` = undiscounted reward-to-go, ``A_t = returns_t - b`` with ``b`` the reward of
    the greedy response to the same prompt.

    Args:
        reward_baselines: (B,) reward of the greedy response for each sample's prompt.
    Returns:
        advantages (B, T), returns (B, T).
    """
    _need("reward_baselines", reward_baselines, "remax")
    mask = _check_inputs(token_level_rewards, response_mask)
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"reward_baselines must have shape ({token_level_rewards.shape[0]},), "
            f"got {tuple(reward_baselines.shape)}"
        )
    returns = reverse_discounted_scan(token_level_rewards, mask, 1.0)
    advantages = torch.where(mask, returns - reward_baselines.to(returns.dtype).unsqueeze(-1), 0.0)
    return advantages, returns


@advantage_estimators.register("opo", needs=("index",))
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: GroupIndex | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (On-Policy RL with Optimal reward baseline, arXiv:2505.23585).

    The baseline is the length-weighted mean score of the group,
    ``b_g = sum_j |o_j| r_j / sum_j |o_j|``; a group of one has baseline 0.

    Returns:
        (advantages, advantages), both (B, T).
    """
    mask = _check_inputs(token_level_rewards, response_mask)
    scores = _scores(token_level_rewards, mask)
    groups = _groups_for(index, scores, "opo")
    lengths = mask.sum(-1).to(scores.dtype)
    num_groups = scores.shape[0]  # ids are < B
    zeros = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    weighted = zeros.index_add(0, groups, lengths * scores)[groups]
    total_len = zeros.index_add(0, groups, lengths)[groups]
    count = zeros.index_add(0, groups, torch.ones_like(scores))[groups]
    baseline = torch.where(count > 1, weighted / total_len.clamp(min=1), 0.0)
    adv = _broadcast(scores - baseline, mask, token_level_rewards.dtype)
    return adv, adv
