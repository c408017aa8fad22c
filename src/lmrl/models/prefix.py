"""A shared prompt's keys and values as a cache that a checkpointed layer may replay.

`lmrl.models.forward.shared_prompt_hidden` runs each distinct prompt once (the prompt pass)
and every row's response tokens against that prompt's keys and values, gathered to the row
(the response pass). transformers' ``DynamicCache`` appends what a layer hands it, so under
gradient checkpointing, where the backward recomputes each layer's forward, the replay would
append a second time and attend to a cache twice as long; transformers therefore drops the
cache in a checkpointed layer, unless the layer class says it only reads it
(``_can_checkpoint_with_cache``, from transformers 5). The two caches here make replaying a
pass a no-op:

- `prompt_cache`: each layer keeps the states it is given instead of appending them (the pass
  starts from nothing), so a replay stores the same states again;
- `prefix_cache`: each layer holds the prompt's states gathered to the rows, returns them with
  the new tokens' states appended, and keeps nothing of the call.

`replayable_cache` lets the checkpointed layers keep such a cache for the two passes, where
the installed transformers has the flag (`replayable`); a release without it drops the cache
of a checkpointed layer whatever the cache, so prompts are not shared under checkpointing there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["prefix_cache", "prompt_cache", "replayable", "replayable_cache"]


def _hold(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``layer`` hold ``keys`` and ``values`` (what ``lazy_initialization`` and ``update``
    set, whose signatures differ between transformers releases)."""
    layer.keys, layer.values = keys, values
    layer.is_initialized = True
    layer.dtype, layer.device = keys.dtype, keys.device


class _PromptLayer(DynamicLayer):
    """One layer of the prompt pass: the states of the latest call, not appended to."""

    def update(self, key_states, value_states, *args, **kwargs):
        _hold(self, key_states, value_states)
        return key_states, value_states


class _PrefixLayer(DynamicLayer):
    """One layer of the response pass: the prefix's states with the call's appended; the
    prefix itself is never changed."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        _hold(self, keys, values)

    def update(self, key_states, value_states, *args, **kwargs):
        return (
            torch.cat([self.keys, key_states], dim=-2),
            torch.cat([self.values, value_states], dim=-2),
        )


def prompt_cache(num_layers: int) -> Cache:
    """An empty cache for the prompt pass of a model of ``num_layers`` decoder layers."""
    return Cache(layers=[_PromptLayer() for _ in range(num_layers)])


def prefix_cache(prompt: Cache, rows: torch.Tensor) -> Cache:
    """The response pass's cache: the prompt pass's keys and values (U, kv_heads, P, d) of
    every layer gathered to the rows, (B, kv_heads, P, d) by ``rows`` (B,) (differentiable:
    the gradients of every row flow back into its prompt's pass)."""
    return Cache(
        layers=[
            _PrefixLayer(layer.keys.index_select(0, rows), layer.values.index_select(0, rows))
            for layer in prompt.layers
        ]
    )


def _checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers that transformers checkpoints (a ``GradientCheckpointingLayer`` with
    checkpointing on)."""
    return [
        m
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False) is True
        and hasattr(m, "_can_checkpoint_with_cache")
    ]


def replayable(model: nn.Module) -> bool:
    """Whether the checkpointed decoder layers of ``model`` (checkpointed) can be told to keep
    a cache: the installed transformers has ``_can_checkpoint_with_cache``."""
    return bool(_checkpointed_layers(model))


@contextlib.contextmanager
def replayable_cache(model: nn.Module) -> Iterator[None]:
    """Within: ``model``'s checkpointed decoder layers keep the cache they are passed (only
    `prompt_cache` and `prefix_cache` may be passed, which a replay leaves as it was)."""
    layers = [m for m in _checkpointed_layers(model) if "_can_checkpoint_with_cache" not in vars(m)]
    for m in layers:
        m._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for m in layers:
            del m._can_checkpoint_with_cache  # the class's own value again
