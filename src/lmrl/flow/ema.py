"""An exponential moving average of the trained weights (Flow-GRPO's ``train.ema``).

`WeightEMA` keeps the average with diffusers' ``EMAModel`` (the field's implementation, with
its warm-up: the k-th update of the average uses the decay ``min(decay, (1 + k') / (10 + k'))``
with ``k' = k - 1``, so the first update copies the weights and early ones follow them
closely), folding the weights in after every ``every``-th optimizer step, as Flow-GRPO does
(decay 0.9, every 8 steps: the average spans about the last 160 optimizer steps).
`WeightEMA.applied` puts the average into the model for a block (validation samples with it)
and the trained weights back after; the optimizer never sees the average.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["WeightEMA"]


class WeightEMA:
    """The average of ``parameters`` (the trained ones), updated by `step`.

    Args:
        parameters: the weights the optimizer trains.
        decay: the average's decay once warmed up, in [0, 1).
        every: optimizer steps between two updates of the average, >= 1.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], decay: float = 0.9,
                 every: int = 8) -> None:  # fmt: skip
        from diffusers.training_utils import EMAModel

        if not 0.0 <= decay < 1.0 or every < 1:
            raise ValueError(f"decay must be in [0, 1) and every >= 1, got {decay}, {every}")
        self.parameters = list(parameters)
        self.every, self.calls = every, 0
        self._ema = EMAModel(self.parameters, decay=decay)

    def step(self) -> None:
        """Called after each optimizer step; every ``every``-th call updates the average."""
        self.calls += 1
        if self.calls % self.every == 0:
            self._ema.step(self.parameters)

    @property
    def updates(self) -> int:
        """How many times the average has been updated."""
        return self._ema.optimization_step

    def averaged(self) -> list[torch.Tensor]:
        """The averaged weights, one tensor per parameter (copies)."""
        return [p.detach().clone() for p in self._ema.shadow_params]

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside the block the parameters hold the average; after it, their own values."""
        self._ema.store(self.parameters)
        self._ema.copy_to(self.parameters)
        try:
            yield
        finally:
            self._ema.restore(self.parameters)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (CPU copies), for `load_state_dict`."""
        state = dict(self._ema.state_dict())
        state["shadow_params"] = [p.detach().to("cpu", copy=True) for p in state["shadow_params"]]
        return {**state, "calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.calls = int(state.pop("calls"))
        self._ema.load_state_dict(state)
        self._ema.to(device=self.parameters[0].device)
