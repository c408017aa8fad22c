"""The SFT worker: the negative log-likelihood of the trained tokens, and its update.

One update is one optimizer step over a batch given as micro-batches whose gradients
accumulate. The loss is ``lmrl.algos.agg_loss`` token-mean of ``-log p(token)`` over the
loss-masked tokens, normalized by the *whole batch's* token count (``AggNorm``), so the
accumulated gradient is the whole batch's gradient whatever the micro-batch size. The
optimizer, the warmup + constant/cosine schedule and the clipped, NaN-skipping step are
``TrainableWorker``'s, the same as the actor's and the critic's.

One forward path for every row layout: a right-padded micro-batch is split at ``P``, the first
column where any row's loss starts, and ``lmrl.models.forward_log_probs`` scores columns
``P..`` with the chunked head (no (B, L, V) fp32 log-softmax is built). Every micro-batch is
split and laid out (`sft_batch`, `lmrl.models.layout`) from the collated CPU pieces before any
forward is queued, so that no micro-batch's forward reads the device back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from lmrl.algos.agg import AggNorm, agg_loss
from lmrl.batch import Batch
from lmrl.models.forward import compute_device, eval_mode, forward_log_probs
from lmrl.models.layout import with_row_layout
from lmrl.workers.optim import TrainableWorker


def sft_batch(piece: Mapping[str, torch.Tensor] | Batch, device: torch.device | str) -> Batch:
    """A collated micro-batch split at ``P`` (the first column where any row is trained), with
    the host's layout of its rows, on ``device``: ``input_ids``, ``attention_mask`` (B, L),
    ``responses`` and ``loss_mask`` (B, L-P). Read from the piece where it is (the collate's
    CPU), so the forward that follows reads nothing back from the device.

    Raises:
        ValueError: no token of the piece is trained.
    """
    loss_mask = piece["loss_mask"]
    trained = loss_mask.any(0).nonzero()
    if trained.numel() == 0:
        raise ValueError("the micro-batch has no trained token (loss_mask is all False)")
    start = max(int(trained[0]), 1)
    input_ids = piece["input_ids"]
    batch = Batch(
        {
            "input_ids": input_ids,
            "attention_mask": piece["attention_mask"],
            "responses": input_ids[:, start:],
            "loss_mask": loss_mask[:, start:],
        }
    )
    return with_row_layout(batch).to(device)


def sft_token_log_probs(
    model: nn.Module, batch: Mapping[str, torch.Tensor] | Batch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the trained tokens of a right-padded micro-batch, differentiable.

    Columns before ``P`` (the first column where any row is trained) are only context: the
    chunked head scores columns ``P..L-1`` alone.

    Args:
        model: a causal LM (Hugging Face or PEFT-wrapped), train or eval mode as set.
        batch: ``input_ids`` (B, L), ``attention_mask`` (B, L) bool, ``loss_mask`` (B, L) bool
            (from ``lmrl.data.SFTDataset.collate``), or `sft_batch`'s split of them.
    Returns:
        ``(log_probs, loss_mask)``: (B, L-P) fp32 on the model's device, and the loss mask of
        those columns (B, L-P) bool on the same device.
    """
    if "responses" not in batch:
        batch = sft_batch(batch, compute_device(model))
    log_probs, _ = forward_log_probs(model, batch)
    return log_probs, batch["loss_mask"].to(log_probs.device)


class SFTWorker(TrainableWorker):
    """A causal LM fine-tuned on supervised examples, with its optimizer.

    Args:
        model: the causal LM trained (possibly PEFT-wrapped), on its device.
        optim: the ``optim`` section of ``SFTConfig`` (an ``OptimConfig`` with ``grad_clip``).
        total_steps: optimizer steps of the run, for the learning-rate schedule.
        seed: seeds ``TrainableWorker``'s generator (SFT's data order is the sampler's).
        precision: master and compute dtypes (``lmrl.workers.precision``); None = the
            model's own, no autocast.
    """

    def __init__(
        self, model: nn.Module, optim, *, total_steps: int, seed: int = 0, precision=None
    ) -> None:
        super().__init__(model, optim, total_steps, seed, precision=precision)
        self.grad_clip = optim.grad_clip

    def update(self, micro_batches: Sequence[Mapping[str, torch.Tensor]]) -> dict:
        """One optimizer step on a batch: forward and backward each micro-batch, then step.

        Args:
            micro_batches: the batch's pieces, each from ``SFTDataset.collate``.
        Returns:
            Metrics as detached tensors: ``sft/loss`` (the batch's token-mean NLL),
            ``sft/grad_norm`` (before clipping), ``sft/lr`` (the lr this step used),
            ``sft/tokens`` (trained tokens), ``sft/skipped_steps`` (1 when a non-finite
            gradient skipped the step).
        """
        tokens = sum(int(piece["loss_mask"].sum()) for piece in micro_batches)
        norm = AggNorm(token_count=float(tokens))
        device = compute_device(self.model)
        pieces = [sft_batch(piece, device) for piece in micro_batches]  # before any forward
        lr = self.lr
        self.model.train()
        total = torch.zeros((), device=device)
        for piece in pieces:
            with self.autocast():  # log-probs come back fp32
                log_probs, mask = sft_token_log_probs(self.model, piece)
            loss = agg_loss(-log_probs, mask, "token-mean", norm)
            self.backward(loss)
            total += loss.detach()
        grad_norm, stepped = self.step(self.grad_clip)
        self.scheduler.step()
        return {
            "sft/loss": total,
            "sft/grad_norm": grad_norm,
            "sft/lr": torch.tensor(lr),
            "sft/tokens": torch.tensor(float(tokens)),
            "sft/skipped_steps": torch.tensor(float(not stepped)),
        }

    @torch.no_grad()
    def loss(self, micro_batches: Iterable[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """The token-mean NLL over every trained token of ``micro_batches``, in eval mode.

        Returns:
            A float64 scalar on the CPU (0 when there is no trained token).
        """
        device = compute_device(self.model)
        total = torch.zeros((), dtype=torch.float64, device=device)
        count = 0
        with eval_mode(self.model), self.autocast():
            for piece in micro_batches:
                count += int(piece["loss_mask"].sum())  # the collate's CPU tensor
                log_probs, mask = sft_token_log_probs(self.model, sft_batch(piece, device))
                total += agg_loss(-log_probs, mask, "token-sum").double()
        return total.cpu() / max(count, 1)


__all__ = ["SFTWorker", "sft_batch", "sft_token_log_probs"]
