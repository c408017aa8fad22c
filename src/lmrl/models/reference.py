"""The reference policy: the KL anchor, never trained.

Two forms, one interface (:class:`Reference`):

- a frozen model (``requires_grad`` off, eval mode): a deep copy of the actor at start, or a
  model loaded from ``ref.path`` when it differs from the actor's;
- with LoRA, the actor itself with its adapter disabled (PEFT's ``disable_adapter()`` context):
  the base weights are frozen and shared, so no second copy is held in memory. Its log-probs are
  those of the base model at every step, whatever the adapter has learned.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from lmrl.models.forward import compute_log_probs
from lmrl.models.loading import freeze, load_causal_lm
from lmrl.models.lora import is_lora


class Reference:
    """A reference policy: ``compute_log_probs`` under the frozen or adapter-disabled model.

    Args:
        model: the frozen reference model, or the LoRA actor when ``disable_adapter``.
        disable_adapter: run ``model`` with its LoRA adapter disabled (shares the actor).
    """

    def __init__(self, model: nn.Module, disable_adapter: bool = False):
        if disable_adapter and not is_lora(model):
            raise ValueError("disable_adapter=True needs a LoRA (PEFT) model")
        self.model = model
        self.disable_adapter = disable_adapter

    @contextlib.contextmanager
    def context(self) -> Iterator[nn.Module]:
        """The model as the reference: inside, a LoRA actor computes the base model."""
        if self.disable_adapter:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.model

    def compute_log_probs(
        self,
        batch,
        micro_batch_size: int,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``ref_log_probs`` of ``batch["responses"]``: (B, T), see ``compute_log_probs``."""
        with self.context() as model:
            return compute_log_probs(model, batch, micro_batch_size, temperature, with_entropy)


def build_reference(
    actor: nn.Module,
    path: str | Path | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> Reference:
    """The reference for ``actor``, built once before training starts.

    Rule: a LoRA actor -> the actor with its adapter disabled (``path`` is ignored: the base
    weights are the reference); else ``path`` given -> that model, loaded frozen; else a frozen
    deep copy of ``actor`` (call this before the first update).

    Args:
        actor: the policy (a Hugging Face causal LM, or PEFT-wrapped).
        path: a different reference model directory; None = the actor's own weights.
        dtype, device, trust_remote_code: as for ``load_causal_lm`` when ``path`` is given.
    """
    if is_lora(actor):
        return Reference(actor, disable_adapter=True)
    if path is not None:
        model = load_causal_lm(
            path, dtype=dtype, device=device, trust_remote_code=trust_remote_code
        )
        return Reference(freeze(model))
    return Reference(freeze(copy.deepcopy(actor)))
