"""The critic worker: per-token values and the clipped value-loss update (PPO with GAE).

Same batching as the actor: epochs x mini-batches x micro-batches with the mini-batch's
global normalizers, so the update does not depend on the micro-batch size.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from lmrl.algos import AggNorm, value_loss
from lmrl.algos.masked import masked_count
from lmrl.batch import Batch
from lmrl.batch.schema import keys as schema_keys
from lmrl.models.critic import compute_values, forward_values
from lmrl.models.forward import compute_device
from lmrl.models.layout import with_row_layout
from lmrl.workers.optim import TrainableWorker
from lmrl.workers.plan import UpdateShape, update_shape

UPDATE_KEYS = schema_keys(read_by="critic_update")  # what the update moves to the device


class CriticWorker(TrainableWorker):
    """The value model with its optimizer (an ``lmrl.workers.roles.CriticRole``).

    Args:
        model: a critic from ``lmrl.models.critic.load_critic``.
        cfg: the ``critic`` config section, resolved (its null fields filled from the actor's).
        rollout_n: samples per prompt (``ppo_mini_batch_size`` counts prompts).
        max_response_length: the constant divisor of ``seq-mean-token-sum-norm``.
        total_steps: training steps, for the learning-rate schedule.
        seed: seeds the mini-batch shuffling.
        dp: this rank's data parallelism (``lmrl.workers.dist``); None = one process.
        precision: master and compute dtypes (``lmrl.workers.precision``); None = the
            model's own. The values come back in fp32 whatever the compute dtype.
    """

    def __init__(
        self, model: nn.Module, cfg, *, rollout_n: int, max_response_length: int,
        total_steps: int, seed: int = 0, dp=None, precision=None,
        update: UpdateShape | None = None,
    ) -> None:  # fmt: skip
        super().__init__(model, cfg.optim, total_steps, seed + 1, dp, precision)
        self.cfg = cfg
        self.rollout_n = rollout_n
        # the run's plan hands it in; a worker made on its own works it out by the same rule
        self.update = update if update is not None else update_shape(cfg, rollout_n)
        self.max_response_length = max_response_length

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Values of the response positions, (B, T), no grad."""
        micro = self.cfg.ppo_micro_batch_size or len(batch)
        with self.dp.full_params(self.model), self.autocast():
            values = compute_values(self.model, batch, micro)
        return values.float() if values.dtype != self.precision.master else values

    def update_critic(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Clipped value loss against ``returns``, anchored at the rollout's ``values``, over
        the response tokens of the rows a reward scored (``scored_mask``, when present).

        Returns:
            ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/grad_norm``, ``critic/lr``.
        """
        cfg, shape = self.cfg, self.update
        mini_size = shape.mini_batch_rows
        batch = with_row_layout(batch.select(*(k for k in UPDATE_KEYS if k in batch)))
        batch = batch.to(compute_device(self.model))  # from the driver's CPU
        totals: dict[str, list[torch.Tensor]] = defaultdict(list)
        for mini in self.mini_batches(batch, shape.epochs, shape.shuffle, mini_size):
            norm = AggNorm.from_mask(_fitted(mini), loss_scale_factor=self.max_response_length)
            # this rank's shares of the mini-batch's (each rank holds a row, so a micro-batch)
            stats: dict[str, torch.Tensor] = {}
            micros = self.dp.micro_batches(self.dp.shard(mini), shape.micro())
            for i, micro in enumerate(micros):
                mask = _fitted(micro)
                with self.dp.sync_grads(self.model, last=i == len(micros) - 1):
                    with self.autocast():
                        values = forward_values(self.model, micro)
                    if values.dtype != self.precision.master:
                        values = values.float()  # the value loss in fp32
                    loss, m = value_loss(
                        values, micro["values"], micro["returns"],
                        mask, cfg.cliprange_value, cfg.loss_agg_mode, norm,
                    )  # fmt: skip
                    self.backward(loss)
                share = masked_count(mask) / norm.token_count
                stats["loss"] = stats.get("loss", 0) + loss.detach()
                stats["clipfrac"] = stats.get("clipfrac", 0) + share * m["vf_clipfrac"]
            self.dp.reduce_grads(self.params)
            stats = self.dp.reduce_stats(stats)
            grad_norm, _ = self.step(cfg.grad_clip)
            totals["critic/vf_loss"].append(stats["loss"])
            totals["critic/vf_clipfrac"].append(stats["clipfrac"])
            totals["critic/grad_norm"].append(grad_norm)
        return self.finish_update(totals, "critic")


def _fitted(batch: Batch) -> torch.Tensor:
    """(B, T) bool: the tokens whose values are fitted: ``response_mask`` on the rows a reward
    function scored (a row none scored has no return to fit)."""
    mask = batch["response_mask"]
    if "scored_mask" in batch:
        mask = mask & batch["scored_mask"].to(mask.device)[:, None]
    return mask
