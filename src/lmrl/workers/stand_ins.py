"""The driver's stand-ins for the local workers on a Ray worker group (``lmrl.workers.group``):
each has the methods of its role (``lmrl.workers.roles``) and dispatches them to the group's
ranks, so ``Trainer.step`` runs unchanged (the dispatch table is in ``lmrl.workers.group``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmrl.batch import Batch
from lmrl.rollout.base import EngineView, RowDone, SamplingParams
from lmrl.rollout.merge import concat_rollouts
from lmrl.workers.actor import UPDATE_KEYS as ACTOR_KEYS
from lmrl.workers.critic import UPDATE_KEYS as CRITIC_KEYS
from lmrl.workers.group import RayWorkerGroup

if TYPE_CHECKING:
    from lmrl.rewards.result import RewardResult

__all__ = ["GroupActor", "GroupCritic", "GroupEngine", "GroupReference", "GroupReward"]


class GroupEngine:
    """The rollout engine of a group: each rank samples a contiguous chunk of the prompts.
    Rows are not reported as they stop (``reports_rows`` False): they come back with the
    ranks' results."""

    pad_id: int
    shares_weights: bool
    reports_rows = False

    def __init__(self, group: RayWorkerGroup) -> None:
        self.group = group
        self.pad_id = group.infos[0]["pad_id"]
        self.shares_weights = group.infos[0]["shares_weights"]

    def generate(
        self,
        prompts: Batch,
        n: int = 1,
        sampling: SamplingParams | None = None,
        *,
        prompt_offset: int = 0,
    ) -> Batch:
        chunks = prompts.chunk(self.group.world_size)
        offsets = np.cumsum([0] + [len(c) for c in chunks[:-1]]) + prompt_offset
        outs = self.group.call_each(
            "generate", [(c, n, sampling, int(o)) for c, o in zip(chunks, offsets, strict=True)]
        )
        outs = [o for o in outs if o is not None]
        return outs[0] if len(outs) == 1 else concat_rollouts(outs, self.pad_id)

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """Hand the actor's weights to every rank (an async run's rollout group).

        Raises:
            ValueError: no ``state_dict``: the ranks' engines follow their own policy, the
                driver has no module of theirs to copy from.
        """
        if state_dict is None:
            raise ValueError("a group's engine syncs only the weights it is handed")
        self.group.call("load_policy", dict(state_dict))

    def set_row_done(self, hook: RowDone | None) -> None:
        """Only None: the ranks' rows come back with their results (``reports_rows``)."""
        if hook is not None:
            raise ValueError("GroupEngine does not report rows as they stop")

    def view(self) -> EngineView:
        """Nothing to score with on the driver: the models are the ranks'."""
        return EngineView(None, shares_weights=self.shares_weights)

    def close(self) -> None:
        """Nothing here: each rank's engine is freed with its process (``RayBackend.close``)."""


def _one(rows: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`RayWorkerGroup.map_rows`'s result for a rank method that returns one tensor."""
    assert isinstance(rows, torch.Tensor)  # the method returns one (b, T) tensor, no tuple
    return rows


class _Trained:
    """Checkpoint methods of a trained role (state of rank 0, weights gathered by all)."""

    role = ""

    def __init__(self, group: RayWorkerGroup) -> None:
        self.group = group

    def state_dict(self) -> dict:
        states = self.group.call("state", self.role)
        state = states[0]
        state["rank_rngs"] = [s.pop("rank_rng") for s in states]
        return state

    def load_state_dict(self, state: dict) -> None:
        rngs = state.get("rank_rngs")
        per_rank = []
        for rank in range(self.group.world_size):
            s = {k: v for k, v in state.items() if k != "rank_rngs"}
            if rngs is not None and len(rngs) == self.group.world_size:
                s["rank_rng"] = rngs[rank]
            per_rank.append((self.role, s))
        self.group.call_each("load_state", per_rank)

    def scale_lr(self, factor: float) -> float:
        return self.group.call("scale_lr", self.role, factor)[0]

    def model_state(self) -> dict[str, torch.Tensor]:
        return self.group.call("weights", self.role)[0]

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.group.call("load_weights", self.role, state)


class GroupActor(_Trained):
    """The actor of a group: log-probs split across ranks; the update on every rank."""

    role = "actor"

    def compute_log_probs(
        self, batch: Batch, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not with_entropy:
            return _one(self.group.map_rows("actor_log_probs", batch)), None
        rows = self.group.map_rows("actor_log_probs", batch, True)
        assert isinstance(rows, tuple)  # the ranks' (log_probs, entropy)
        log_probs, entropy = rows
        return log_probs, entropy

    def update_actor(
        self, batch: Batch, *, old_log_probs_from_update: bool = False
    ) -> dict[str, torch.Tensor]:
        batch = batch.select(*(k for k in ACTOR_KEYS if k in batch))
        metrics = self.group.call("update_actor", batch, old_log_probs_from_update)[0]
        return {k: torch.tensor(v) for k, v in metrics.items()}


class GroupCritic(_Trained):
    """The critic of a group (colocated with the actor or in a pool of its own)."""

    role = "critic"

    def compute_values(self, batch: Batch) -> torch.Tensor:
        return _one(self.group.map_rows("values", batch))

    def update_critic(self, batch: Batch) -> dict[str, torch.Tensor]:
        batch = batch.select(*(k for k in CRITIC_KEYS if k in batch))
        metrics = self.group.call("update_critic", batch)[0]
        return {k: torch.tensor(v) for k, v in metrics.items()}


class GroupReference:
    """The reference of a group: ``ref_log_probs`` split across ranks."""

    def __init__(self, group: RayWorkerGroup) -> None:
        self.group = group

    def compute_log_probs(self, batch: Batch) -> torch.Tensor:
        return _one(self.group.map_rows("ref_log_probs", batch))


class GroupReward:
    """Reward scoring on the ranks: contiguous chunks of rows, results joined in order."""

    def __init__(self, group: RayWorkerGroup) -> None:
        self.group = group

    def __call__(self, batch: Batch) -> RewardResult:
        from lmrl.rewards.result import merge_results

        chunks = batch.chunk(self.group.world_size)
        results = [
            r for r in self.group.call_each("score", [(c,) for c in chunks]) if r is not None
        ]
        return merge_results(results)

    def check_dataset(self, dataset) -> None:
        self.group.call_one(0, "check_dataset", dataset)

    def close(self) -> None:
        """The ranks stop their reward workers when the group closes."""
