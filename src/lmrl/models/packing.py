"""Group packing: a prompt and all its responses in one row, with a mask that keeps them apart.

`lmrl.models.forward`'s shared-prompt path runs the backbone twice per micro-batch: once over
the distinct prompts, once over every row's response tokens against the gathered prompt cache,
each response padded to the longest of the micro-batch. Group packing runs it once. Each
distinct prompt becomes one row: its prompt columns, then the real tokens of each of its
responses back to back (no padding between them)::

    [ prompt (width) | response 1 | response 2 | ... | response m | padding ]

A 4-D boolean mask (True = attend) lets a prompt position see the prompt before it, and a
response position see the whole real prompt and its own response up to itself, never another
response; position ids restart after the prompt for every response, so each response sees
exactly the keys, at exactly the positions, of the unpacked forward. The hidden states are then
gathered back to the (B, kept, H) layout of `shared_prompt_hidden`.

It pays where the per-call overhead and the padding are the cost (small models, short
responses: a CPU), and not where attention is: the mask is dense, so attention costs
``L^2`` per packed row of length ``L`` instead of ``(P + T) * T`` per response. `pack_pays`
is the rule (packed rows of at most ``MAX_PACKED`` tokens), and only sdpa takes such a mask
as transformers passes it (`packable`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "LLAMA_FAMILY",
    "MAX_PACKED",
    "PackedGroups",
    "pack_groups",
    "pack_pays",
    "packable",
    "packed_hidden",
    "packed_width",
    "packs",
]

MAX_PACKED = 512  # the longest packed row where packing is used (see the module docstring)
# The Llama-family model types lmrl's shortcuts are tested on (qwen2 and llama; mistral and
# qwen3 share their code): their forward hands a 4-D mask to attention as is (packing), their
# checkpointed decoder layers keep `lmrl.models.prefix`'s caches, and their RMSNorm is
# normalized in fp32, rounded to the input's dtype, times the weight (`lmrl.rollout.static`).
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class PackedGroups:
    """The packed rows of one micro-batch and the way back.

    ``input_ids``, ``position_ids``: (U, L). ``mask``: (U, 1, L, L) bool, True = attend.
    ``rows``, ``cols``: (B, kept) long, where row ``b``'s hidden state for response token
    ``t`` lies in the packed output (``hidden[rows, cols]``); padded tokens point at the
    prompt's last column (their values are never used).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor


def packable(model: nn.Module) -> bool:
    """Whether ``model`` (unwrapped) is of `LLAMA_FAMILY` and attends with sdpa, the
    one implementation given a custom 4-D boolean mask as is (eager adds a mask as a float
    bias, flash-attention takes none)."""
    config = getattr(model, "config", None)
    return (
        getattr(config, "model_type", None) in LLAMA_FAMILY
        and getattr(config, "_attn_implementation", None) == "sdpa"
    )


def pack_pays(width: int, lengths: torch.Tensor, inverse: torch.Tensor, groups: int) -> bool:
    """Packing is used when the longest packed row (`packed_width`) is at most `MAX_PACKED`
    tokens."""
    return packs(packed_width(width, lengths, inverse, groups))


def packs(width: int) -> bool:
    """A packed row of ``width`` tokens is short enough to pay (at most `MAX_PACKED`)."""
    return width <= MAX_PACKED


def packed_width(width: int, lengths: torch.Tensor, inverse: torch.Tensor, groups: int) -> int:
    """The longest packed row: ``width`` prompt columns plus the response tokens of its rows
    but their last (one host read of ``lengths``' device)."""
    return width + int(_segments(lengths, inverse, groups)[1].max()) if groups else width


def _segments(lengths: torch.Tensor, inverse: torch.Tensor, groups: int):
    """Each row's packed tokens (its response but the last token, which predicts nothing
    scored), (B,), and their sum per group, (U,)."""
    segments = (lengths - 1).clamp(min=0)
    totals = torch.zeros(groups, dtype=segments.dtype, device=segments.device)
    return segments, totals.index_add_(0, inverse, segments)


def pack_groups(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    lengths: torch.Tensor,
    first: torch.Tensor,
    inverse: torch.Tensor,
    width: int,
    kept: int,
    total: int | None = None,
) -> PackedGroups:
    """Lay out the distinct prompts and their responses as packed rows.

    Args:
        input_ids, position_ids: (B, width + kept) a trimmed micro-batch: ``width`` prompt
            columns (left padded), then the response columns (right padded).
        prompt_mask: (B, width) bool, the real prompt columns.
        lengths: (B,) real response tokens per row (a prefix of the response columns).
        first, inverse: (U,) a row of each distinct prompt, (B,) each row's distinct prompt.
        width, kept: prompt columns, and response columns scored.
        total: the packed rows' length, `packed_width` (read from the tensors when None: the
            one host read here; with it given, the layout is built without any).
    """
    device = input_ids.device
    groups, batch = len(first), len(inverse)
    segments, group_total = _segments(lengths, inverse, groups)
    # Each row's segment offset inside its packed row: rows of a group in batch order.
    order = torch.argsort(inverse, stable=True)
    seg_sorted = segments[order]
    ends = seg_sorted.cumsum(0)
    group_start = torch.zeros(groups, dtype=torch.long, device=device)
    group_start[1:] = group_total.cumsum(0)[:-1]
    offsets = torch.empty(batch, dtype=torch.long, device=device)
    offsets[order] = ends - seg_sorted - group_start[inverse[order]] + width
    if total is None:
        total = packed_width(width, lengths, inverse, groups)

    # Token and position of every packed column; segment id 0 = prompt, b + 1 = row b, -1 = pad.
    # One column more than the rows hold: every padded response token is written there (no
    # boolean indexing, whose size the host would have to read), and it is cut after.
    ids = torch.zeros(groups, total + 1, dtype=input_ids.dtype, device=device)
    pos = torch.zeros(groups, total + 1, dtype=position_ids.dtype, device=device)
    seg = torch.full((groups, total + 1), -1, dtype=torch.long, device=device)
    ids[:, :width] = input_ids[first, :width]
    pos[:, :width] = position_ids[first, :width]
    seg[:, :width] = torch.where(prompt_mask[first], 0, -1)
    steps = torch.arange(max(kept - 1, 0), device=device)
    valid = steps[None, :] < segments[:, None]  # (B, kept - 1)
    row_of = inverse[:, None].expand_as(valid)
    col_of = torch.where(valid, offsets[:, None] + steps[None, :], total)
    ids[row_of, col_of] = input_ids[:, width : width + kept - 1]
    pos[row_of, col_of] = position_ids[:, width : width + kept - 1]
    seg[row_of, col_of] = torch.arange(1, batch + 1, device=device)[:, None].expand_as(valid)
    ids, pos, seg = ids[:, :total], pos[:, :total], seg[:, :total]

    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()
    real = seg >= 0
    same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])  # (U, query, key)
    mask = causal & same & real[:, None, :] & real[:, :, None]
    mask |= torch.eye(total, dtype=torch.bool, device=device)  # padding attends to itself

    rows = inverse[:, None].expand(batch, kept)
    cols = torch.full((batch, kept), width - 1, dtype=torch.long, device=device)
    if kept > 1:
        after = offsets[:, None] + steps[None, :]
        cols[:, 1:] = torch.where(valid, after, width - 1)
    return PackedGroups(ids, pos, mask[:, None], rows, cols)


def packed_hidden(backbone: nn.Module, packed: PackedGroups) -> torch.Tensor:
    """The backbone over the packed rows, gathered back: (B, kept, H)."""
    out = backbone(
        input_ids=packed.input_ids,
        attention_mask=packed.mask,
        position_ids=packed.position_ids,
        use_cache=False,
    )
    return out.last_hidden_state[packed.rows, packed.cols]
