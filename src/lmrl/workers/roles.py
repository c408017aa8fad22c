"""The roles of a run's workers, one `typing.Protocol` each: what the trainer calls on them.

A role has the same methods, with the same argument names and defaults, wherever it runs:
in this process (``ActorWorker``, ``CriticWorker``, ``ReferenceWorker``, ``RewardWorker`` or a
reward manager), on a Ray worker group (the stand-ins ``GroupActor``, ``GroupCritic``,
``GroupReference``, ``GroupReward`` of ``lmrl.workers.stand_ins``), or as a test's fake. The
method names are verl's: ``compute_log_probs``, ``update_actor``, ``compute_values``,
``update_critic``. ``tests/workers/test_roles.py`` checks every implementation against these.

Shapes: ``B`` rows (samples), ``T`` response length; a `Batch` holds the keys of DESIGN.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lmrl.batch import Batch

if TYPE_CHECKING:
    from lmrl.rewards.result import RewardResult
    from lmrl.rollout.base import EngineView, RowDone, SamplingParams

__all__ = [
    "ActorRole",
    "CriticRole",
    "EngineRole",
    "ReferenceRole",
    "RewardRole",
    "TrainedRole",
]


class TrainedRole(Protocol):
    """The checkpoint methods of a role with weights and an optimizer (actor, critic).

    Under Ray every rank takes part in each call (gathering sharded state is collective).
    """

    def model_state(self) -> dict[str, torch.Tensor]:
        """The full weights as CPU tensors (what a checkpoint's ``<role>.safetensors`` holds)."""
        ...

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load full weights written by ``model_state`` (under any number of ranks)."""
        ...

    def scale_lr(self, factor: float) -> float:
        """Multiply the peak learning rate by ``factor`` from now on (kept in `state_dict`);
        returns the scale now. The run doctor's rollback calls it: one scalar, where a round
        trip through ``state_dict`` would ship the whole optimizer state."""
        ...

    def state_dict(self) -> dict:
        """Optimizer, scheduler and shuffling RNG (the weights are saved separately)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        ...


class ActorRole(TrainedRole, Protocol):
    """The policy being trained: its log-probs and its policy-loss update."""

    def compute_log_probs(
        self, batch: Batch, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of ``batch["responses"]`` under the current policy, no grad.

        Args:
            batch: ``input_ids``, ``attention_mask`` (B, P + T), ``responses``,
                ``response_mask`` (B, T), optionally ``position_ids``.
            with_entropy: also return the entropy of each position's distribution.

        Returns:
            ``(log_probs, entropy)``, (B, T) each; entropy None unless ``with_entropy``.
        """
        ...

    def update_actor(
        self, batch: Batch, *, old_log_probs_from_update: bool = False
    ) -> dict[str, torch.Tensor]:
        """``ppo_epochs`` x mini-batches x micro-batches of the policy loss; one lr step.

        Args:
            batch: the forward keys, ``advantages`` (B, T), ``old_log_probs`` (B, T) unless
                ``old_log_probs_from_update``, ``ref_log_probs`` (B, T) for a sampled-token KL
                loss, optionally ``loss_mask`` and ``rollout_is_weights`` (B, T).
            old_log_probs_from_update: the old log-probs are this one-pass update's own.

        Returns:
            ``actor/*`` metrics as detached scalar tensors.
        """
        ...


class CriticRole(TrainedRole, Protocol):
    """The value model (PPO with GAE): per-token values and the value-loss update."""

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Values of the response positions, (B, T), no grad."""
        ...

    def update_critic(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Clipped value loss of ``values`` (B, T) against ``returns`` (B, T).

        Returns:
            ``critic/*`` metrics as detached scalar tensors.
        """
        ...


class ReferenceRole(Protocol):
    """The frozen reference policy of the KL terms."""

    def compute_log_probs(self, batch: Batch) -> torch.Tensor:
        """``ref_log_probs``: (B, T) log-probs of ``batch["responses"]``, no grad."""
        ...


class RewardRole(Protocol):
    """Reward scoring: rule scores, a reward model's, or both."""

    def __call__(self, batch: Batch) -> RewardResult:
        """``token_level_scores`` (B, T), per-sample extras and counters of a rollout."""
        ...

    def check_dataset(self, dataset: Any) -> None:
        """Fail at load time on the rows the rule scorers cannot score.

        Args:
            dataset: an ``lmrl.data.RLDataset``.
        """
        ...

    def close(self) -> None:
        """Stop the scoring's worker processes, if any."""
        ...


class EngineRole(Protocol):
    """The rollout engine the step generates with (``lmrl.rollout``: ``hf``, ``hf`` over a
    copy, ``vllm``, the multi-turn ``AgentLoop`` around either, ``PrecisionEngine`` around
    ``hf``, or a Ray group's ``GroupEngine``). ``lmrl.rollout.base.RolloutEngine`` documents
    each method.

    Attributes:
        pad_id: the padding token of its batches.
        shares_weights: it generates with the actor's own module (its log-probs are the
            actor's); False for an engine with a copy of the weights (vLLM).
        reports_rows: ``set_row_done`` takes a hook: rows are reported as they stop.
    """

    pad_id: int
    shares_weights: bool
    reports_rows: bool

    def generate(
        self,
        prompts: Batch,
        n: int = 1,
        sampling: SamplingParams | None = None,
        *,
        prompt_offset: int = 0,
    ) -> Batch:
        """``n`` samples of each of the B left-padded prompts: a Batch of B*n rows
        (``responses`` (B*n, T), ``response_mask``, ``rollout_log_probs``...)."""
        ...

    def close(self) -> None:
        """Free what the engine holds of its own (a vLLM engine, tool processes)."""
        ...

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """Load ``state_dict`` (the actor's names) into the engine's model in place; None =
        the current weights of the module it was built over (a forced sync)."""
        ...

    def set_row_done(self, hook: RowDone | None) -> None:
        """Call ``hook(rows, block)`` as rows of a ``generate`` call stop; None stops it.
        Only None where ``reports_rows`` is False (else ValueError)."""
        ...

    def view(self) -> EngineView:
        """The module it generates with (to score given tokens), its autocast and compute
        dtype, and its forced sync, as far as it has them (``lmrl.trainer.parity``)."""
        ...
