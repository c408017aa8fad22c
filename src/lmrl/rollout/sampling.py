"""The sampling step of the ``hf`` engine, shared by its loops (`lmrl.rollout.hf`'s and the
static-cache one of `lmrl.rollout.static`): temperature, top-k and top-p truncation, a
counter-based categorical draw, and the stop-string check.

The randomness is counter-based, never the global RNG: the uniform that picks a row's token at
decode step ``t`` is a hash of (seed, the row's key, ``t``) (`Draws`), so a seed reproduces a
rollout exactly however the rows are batched, and the step can be replayed from a CUDA graph
with ``t`` a device tensor.

Logits that are not finite (a policy whose weights diverged) never make an out-of-range token:
the draw is clamped into the vocabulary, and the token's recorded log-prob is then NaN or
infinite. `check_finite` looks at a call's log-probs once, after its loop, and raises
`lmrl.errors.DivergedError`: no host sync per decode step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmrl.errors import DivergedError
from lmrl.rollout.base import SamplingParams

__all__ = ["Draws", "check_finite", "pick", "stop_hits"]

_M32 = 0xFFFFFFFF
_KEY, _STEP = 0x1B873593, 0x68E31DA4  # odd constants mixed into the key and the step
_SALT = 0x9E3779B9  # mixed into a step's second hash


def _truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf.

    Args:
        scaled: (B, V) temperature-scaled logits.
        top_k: keep this many largest (off when <= 0).
        top_p: keep the smallest prefix of the sorted distribution whose mass reaches it
            (off at 1.0); the most likely token is always kept.
    Returns:
        (B, V) logits with the removed tokens at -inf.
    """
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        remove_sorted = mass_before > top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        scaled = scaled.masked_fill(remove, float("-inf"))
    return scaled


def pick(
    logits: torch.Tensor, sampling: SamplingParams, draws: Draws, t: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's choice for every row of ``logits`` (R, V): the token (a counter-based
    draw from the truncated, temperature-scaled distribution at step ``t``, or the argmax when
    greedy) and its log-prob under the untruncated scaled distribution (``rollout_log_probs``).
    Returns ``(token (R,), log_prob (R,))``; a row whose logits hold a NaN or an infinity gets
    a token in range and a log-prob that is not finite (`check_finite`)."""
    scaled = logits / sampling.logprob_temperature
    logp = torch.log_softmax(scaled, dim=-1)
    if sampling.do_sample:
        probs = _truncate(scaled, sampling.top_k, sampling.top_p).softmax(dim=-1)
        token = _draw(probs, draws.uniform(t))
    else:
        token = logits.argmax(dim=-1)
    return token, logp.gather(1, token[:, None]).squeeze(1)


def check_finite(log_probs: torch.Tensor) -> None:
    """Raise `DivergedError` when a sampled token's log-prob is not finite: the policy's logits
    held a NaN or an infinity. One reduction and one host sync, for a whole call's tokens.

    A log-softmax over logits with a NaN is NaN in every entry, with a +inf NaN or -inf, and
    with every logit -inf NaN; a sampled token from finite logits has a finite log-prob.

    Args:
        log_probs: the sampled tokens' log-probs, any shape, 0 where no token was sampled.
    """
    if not bool(torch.isfinite(log_probs).all()):
        raise DivergedError(
            "the policy's logits are not finite (NaN/inf) while sampling: its weights have "
            "diverged; lower actor.optim.lr or resume from an earlier checkpoint"
        )


def stop_hits(
    tokenizer,
    tokens: torch.Tensor,
    ends: torch.Tensor,
    rows: torch.Tensor,
    stop: Sequence[str],
    width: int,
) -> torch.Tensor:
    """bool (R,): the ``rows`` whose last ``width`` tokens before ``ends`` decode to a text
    holding a stop string.

    A stop string completed by a row's newest token ends in it, and every token decodes to at
    least one character (or is a special token), so the last ``len(stop) + 1`` tokens hold
    it; an earlier occurrence would have stopped the row earlier.

    Args:
        tokens: (R, L) each row's tokens so far; ``ends`` (R,) how many are its.
        rows: bool (R,), the rows to check.
    """
    idx = rows.nonzero().flatten().tolist()
    hit = torch.zeros_like(rows)
    if not idx:
        return hit
    ends_list = ends.tolist()
    tails = [tokens[r, max(0, ends_list[r] - width) : ends_list[r]].tolist() for r in idx]
    texts = tokenizer.batch_decode(tails, skip_special_tokens=True)
    found = [r for r, text in zip(idx, texts, strict=True) if any(s in text for s in stop)]
    if found:
        hit[torch.tensor(found, device=hit.device)] = True
    return hit


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An avalanche hash of 32-bit values held in int64 (``lowbias32``: xor-shift-multiply
    rounds; each output bit depends on every input bit). Products overflow int64 and wrap,
    which keeps their low 32 bits exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


class Draws:
    """Counter-based uniforms: one per row and decode step, a pure function of (seed, the
    row's key, the step), computed for all rows at once.

    Args:
        seed: the call's seed (any int; 64 bits are used).
        keys: (R,) int64, each row's key (its sample's position in the whole batch).
    """

    def __init__(self, seed: int, keys: torch.Tensor) -> None:
        seed &= 2**64 - 1
        lo, hi = seed & _M32, seed >> 32
        # the hash maps 0 to 0: the constants keep (seed 0, key 0, step 0) from drawing u = 0
        self.base = _mix32(_mix32((keys.long() & _M32) ^ _KEY) ^ hi) ^ lo  # (R,)
        # the two hashes of a step: counters 2t and 2t + 1, the second salted
        self._pair = torch.tensor([0, 1], device=keys.device)[:, None]
        self._salt = torch.tensor([0, _SALT], device=keys.device)[:, None]

    def uniform(self, t: int | torch.Tensor) -> torch.Tensor:
        """(R, 1) float64 uniforms in [0, 1) of decode step ``t`` (53 random bits each); ``t``
        may be a (R,) tensor, each row at its own step (the agent loop's rows advance apart)."""
        t = torch.as_tensor(t, dtype=torch.long, device=self.base.device).expand_as(self.base)
        counters = 2 * t[None, :] + self._pair  # (2, R): both hashes in one pass of ops
        h1, h2 = _mix32(self.base ^ _mix32(counters ^ _STEP) ^ self._salt)
        bits = (h1 << 21) | (h2 >> 11)  # 32 + 21 = 53 bits
        return (bits.double() * 2.0**-53)[:, None]


DRAW_BLOCK = 1024  # tokens per block of `_draw`'s two-level search


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (R, V), by inverting the row's cumulative distribution.

    ``torch.multinomial`` draws an exponential variate for every (row, token): R x V random
    numbers per decode step, a cost that grows with the vocabulary and not with the model.
    This takes one uniform per row and inverts the row's float64 cumulative sum. Past four
    blocks of `DRAW_BLOCK` tokens it does so in two levels: the sums of the blocks (one read
    of ``probs``, no (R, V) float64 copy) pick the block, and the cumulative sum inside that
    block alone picks the token (0.87 ms a step instead of 1.06 for 256 rows of Qwen2.5's
    151,936 tokens on an H200). An exact sampler of the same distribution; tokens of
    probability 0 are never drawn: the block and the token are each the first whose
    cumulative mass exceeds the uniform, clamped below the mass there is. Probabilities that
    are not finite (NaN logits) still give a token id in the vocabulary.

    Args:
        probs: (R, V) non-negative, each row with a positive sum (need not be normalized).
        u: (R, 1) float64 uniforms in [0, 1) (`Draws.uniform`).
    Returns:
        (R,) long token ids.
    """
    rows, vocab = probs.shape
    if vocab <= 4 * DRAW_BLOCK:  # a few blocks: one cumulative sum costs less
        cdf = probs.double().cumsum(dim=-1)
        u = _below(u.to(cdf.device) * cdf[:, -1:], cdf[:, -1:])
        token = torch.searchsorted(cdf, u, right=True).squeeze(1)  # first token with cdf > u
        return token.clamp(max=vocab - 1)  # a NaN mass finds no token: keep the id in range
    full = vocab // DRAW_BLOCK * DRAW_BLOCK
    sums = probs[:, :full].view(rows, -1, DRAW_BLOCK).sum(dim=-1, dtype=torch.float64)
    if full < vocab:
        tail = probs[:, full:].sum(dim=-1, keepdim=True, dtype=torch.float64)
        sums = torch.cat([sums, tail], dim=1)  # (R, blocks)
    cdf = sums.cumsum(dim=-1)
    u = _below(u.to(cdf.device) * cdf[:, -1:], cdf[:, -1:])
    block = torch.searchsorted(cdf, u, right=True)  # (R, 1): first block with cdf > u
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    index = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=probs.device)  # (R, B)
    inside = probs.gather(1, index.clamp(max=vocab - 1)).double()
    inside = inside.masked_fill(index >= vocab, 0.0).cumsum(dim=-1)
    # the mass left inside the block: at least 0, below the block's own sum
    left = _below((u - before).clamp(min=0.0), inside[:, -1:])
    offset = torch.searchsorted(inside, left, right=True)  # first token with cdf > left
    return (block * DRAW_BLOCK + offset).squeeze(1).clamp(max=vocab - 1)  # NaN: in range


def _below(x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """``x`` clamped strictly below ``bound`` (> 0): a uniform scaled by a cumulative mass
    then always lands before the mass's end, whatever the rounding."""
    return torch.minimum(x, torch.nextafter(bound, torch.zeros_like(bound)))
