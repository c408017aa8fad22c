"""Joining rollouts generated apart (dynamic sampling's rounds, a batch split across ranks).

Two rollout batches differ in their widths: each call pads its prompts to its own longest and
stops its responses at its own longest sample. ``concat_rollouts`` re-pads them to one layout.
"""

from __future__ import annotations

import torch

from lmrl.batch import Batch

__all__ = ["concat_rollouts"]


def concat_rollouts(batches: list[Batch], pad_id: int) -> Batch:
    """Concatenate rollout batches whose prompt and response widths differ.

    Prompts are left-padded and responses right-padded to the widest; ``input_ids``,
    ``attention_mask`` (each batch's own, padded) and ``position_ids`` are rebuilt from them; the other (N, T) tensors
    are right-padded with zeros (False for masks).
    """
    width_p = max(b["prompts"].shape[1] for b in batches)
    width_t = max(b["responses"].shape[1] for b in batches)
    rebuilt = ("prompts", "input_ids", "attention_mask", "position_ids")
    aligned = []
    for b in batches:
        p, t = b["prompts"].shape[1], b["responses"].shape[1]
        out = b.select(*b.keys())
        prompt_mask = _pad(b["attention_mask"][:, :p], width_p, False, left=True)
        # the tokens read: the response mask, plus a multi-turn rollout's observations
        response_attention = _pad(b["attention_mask"][:, p:], width_t, False)
        out["prompts"] = _pad(b["prompts"], width_p, pad_id, left=True)
        for key in b.tensor_keys():
            x: torch.Tensor = b.tensors[key]
            if key not in rebuilt and x.dim() == 2 and x.shape[1] == t:
                out[key] = _pad(x, width_t, pad_id if key == "responses" else 0)
        attention = torch.cat([prompt_mask, response_attention], dim=1)
        out["input_ids"] = torch.cat([out["prompts"], out["responses"]], dim=1)
        out["attention_mask"] = attention
        out["position_ids"] = (attention.long().cumsum(-1) - 1).clamp(min=0)
        aligned.append(out)
    return Batch.concat(aligned)


def _pad(x: torch.Tensor, width: int, value, left: bool = False) -> torch.Tensor:
    """Pad a (N, L) tensor to (N, width) with ``value``, on the right (or the left)."""
    fill = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
    return torch.cat([fill, x] if left else [x, fill], dim=1)
