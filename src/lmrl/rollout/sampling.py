"""The sampling step of the ``hf`` engine, shared by its loops (`lmrl.rollout.hf`'s and the
static-cache one of `lmrl.rollout.static`): temperature, top-k and top-p truncation, a
counter-based categorical draw, and the stop-string check.

The randomness is counter-based, never the global RNG: the uniform that picks a row's token at
decode step ``t`` is a hash of (seed, the row's key, ``t``) (`Draws`), so a seed reproduces a
rollout exactly however the rows are batched, and the step can be replayed from a CUDA graph
with ``t`` a device tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmrl.rollout.base import SamplingParams

__all__ = ["Draws", "pick", "stop_hits"]

_M32 = 0xFFFFFFFF
_KEY, _STEP = 0x1B873593, 0x68E31DA4  # odd constants mixed into the key and the step


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
    Returns ``(token (R,), log_prob (R,))``."""
    scaled = logits / sampling.logprob_temperature
    logp = torch.log_softmax(scaled, dim=-1)
    if sampling.do_sample:
        probs = _truncate(scaled, sampling.top_k, sampling.top_p).softmax(dim=-1)
        token = _draw(probs, draws.uniform(t))
    else:
        token = logits.argmax(dim=-1)
    return token, logp.gather(1, token[:, None]).squeeze(1)


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

    def uniform(self, t: int | torch.Tensor) -> torch.Tensor:
        """(R, 1) float64 uniforms in [0, 1) of decode step ``t`` (53 random bits each); ``t``
        may be a (R,) tensor, each row at its own step (the agent loop's rows advance apart)."""
        t = torch.as_tensor(t, dtype=torch.long, device=self.base.device).expand_as(self.base)
        h1 = _mix32(self.base ^ _mix32((2 * t) ^ _STEP))
        h2 = _mix32(self.base ^ _mix32((2 * t + 1) ^ _STEP) ^ 0x9E3779B9)
        bits = (h1 << 21) | (h2 >> 11)  # 32 + 21 = 53 bits
        return (bits.double() * 2.0**-53)[:, None]


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (R, V), by inverting the row's cumulative distribution.

    ``torch.multinomial`` draws an exponential variate for every (row, token): R x V random
    numbers per decode step, a cost that grows with the vocabulary and not with the model.
    This takes one uniform per row and binary-searches the row's float64 cumulative sum, an
    exact sampler of the same distribution; ``docs/performance.md`` has the timings of both.
    Tokens of probability 0 are never drawn.

    Args:
        probs: (R, V) non-negative, each row with a positive sum (need not be normalized).
        u: (R, 1) float64 uniforms in [0, 1) (`Draws.uniform`).
    Returns:
        (R,) long token ids.
    """
    cdf = probs.double().cumsum(dim=-1)  # (R, V)
    total = cdf[:, -1:]
    u = u.to(cdf.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total, always
    return torch.searchsorted(cdf, u, right=True).squeeze(1)  # first token with cdf > u
