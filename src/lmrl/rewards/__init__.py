"""Rewards: built-in scorers by ``data_source``, user reward functions, reward managers.

- ``lmrl.rewards.scorers``: ``SCORERS`` (data_source -> scorer), ``get_scorer``, ``default_compute_score``;
- ``lmrl.rewards.functions``: ``RewardFunction``, ``load_reward_fn`` (verl's per-sample and
  TRL's batched signatures);
- ``lmrl.rewards.pool``: ``ScoringPool``, worker processes with a per-call timeout;
- ``lmrl.rewards.managers``: ``naive``/``batch``/``dapo`` managers, ``make_reward_manager``,
  ``RewardResult``.

The names below are imported lazily (PEP 562), so that reward worker processes, which import
only the scorers and the function wrappers, never pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SCORERS": "lmrl.rewards.scorers",
    "BuiltinScorer": "lmrl.rewards.scorers",
    "default_compute_score": "lmrl.rewards.scorers",
    "get_scorer": "lmrl.rewards.scorers",
    "RewardFunction": "lmrl.rewards.functions",
    "load_reward_fn": "lmrl.rewards.functions",
    "ScoringPool": "lmrl.rewards.pool",
    "REWARD_MANAGERS": "lmrl.rewards.managers",
    "RewardManager": "lmrl.rewards.managers",
    "BatchRewardManager": "lmrl.rewards.managers",
    "DAPORewardManager": "lmrl.rewards.managers",
    "OverlongBuffer": "lmrl.rewards.managers",
    "RewardResult": "lmrl.rewards.managers",
    "make_reward_manager": "lmrl.rewards.managers",
    "overlong_penalty": "lmrl.rewards.managers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lmrl.rewards' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
