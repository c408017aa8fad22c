"""The reference worker: ``ref_log_probs`` of a batch under the frozen reference policy.

It wraps a :class:`lmrl.models.Reference` (a frozen copy of the initial actor, a model from
``ref.path``, or the LoRA actor with its adapter disabled) and sizes its own forward passes
(``ref.log_prob_micro_batch_size`` rows, all of them when unset). Like the actor and the
critic it is a plain class: the local backend calls it in-process.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from lmrl.batch import Batch
from lmrl.models.reference import Reference
from lmrl.workers.dist import DataParallel
from lmrl.workers.precision import Precision


class ReferenceWorker:
    """Log-probs of the responses under the reference policy (a ``ReferenceRole``).

    Args:
        reference: the reference model (see ``lmrl.models.build_reference``).
        micro_batch_size: rows per forward pass; None = the whole batch at once.
        temperature: the sampling temperature; log-probs are of ``logits / temperature``,
            as the actor's are, so the KL compares like with like.
        dp: this rank's data parallelism (``lmrl.workers.dist``): under FSDP2 the reference's
            weights are gathered once for the whole pass, as the actor's are; None = one
            process.
        precision: the actor's (``lmrl.workers.precision``): the reference computes in the
            same dtype over the same stored weights, so the KL at step 0 is exactly 0;
            None = no autocast.
    """

    def __init__(
        self,
        reference: Reference,
        micro_batch_size: int | None,
        temperature: float,
        dp=None,
        precision: Precision | None = None,
    ) -> None:
        self.reference = reference
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.dp = dp if dp is not None else DataParallel()
        self.precision = precision

    def compute_log_probs(self, batch: Batch) -> torch.Tensor:
        """``ref_log_probs``: (B, T) log-probs of ``batch["responses"]``, no grad (a batch of
        no rows gives (0, T): a rank with nothing to score still joins the gathering)."""
        autocast = self.precision.autocast() if self.precision is not None else nullcontext()
        with self.dp.full_params(self.reference.model), autocast:
            if len(batch) == 0:
                return torch.zeros(0, batch["responses"].shape[1])
            micro = self.micro_batch_size or len(batch)
            log_probs, _ = self.reference.compute_log_probs(batch, micro, self.temperature)
        return log_probs


__all__ = ["ReferenceWorker"]
