"""Rewards: built-in scorers by ``data_source``, user reward functions, reward managers.

- ``lmrl.rewards.scorers``: ``SCORERS`` (data_source -> scorer), ``get_scorer``, ``default_compute_score``;
- ``lmrl.rewards.functions``: ``RewardFunction``, ``load_reward_fn`` (verl's per-sample and
  TRL's batched signatures);
- ``lmrl.rewards.pool``: ``ScoringPool``, worker processes with a per-call timeout;
- ``lmrl.rewards.managers``: ``naive``/``batch``/``dapo`` managers, ``make_reward_manager``;
- ``lmrl.rewards.result``: ``RewardResult``, ``split_extras`` (numeric extras to metrics,
  text ones to the generations log).

The names below are imported lazily (PEP 562), so that reward worker processes, which import
only the scorers and the function wrappers, never pay for importing torch.
"""

from __future__ import annotations

from lmrl._lazy import lazy_exports

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
    "RewardResult": "lmrl.rewards.result",
    "make_reward_manager": "lmrl.rewards.managers",
    "overlong_penalty": "lmrl.rewards.managers",
    "split_extras": "lmrl.rewards.result",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
