"""``lmrl.algos``: the maths of RL post-training as pure tensor functions.

Tensors in, tensors out: no models, no I/O, no config objects, no ``.item()`` in the maths.
Each algorithm family is a ``Registry`` keyed by the recipes' names, with one signature per
family so that the trainer never branches on an algorithm's name:

- ``advantage_estimators``: ``(token_level_rewards, response_mask, *, index, values,
  reward_baselines, gamma, lam, epsilon, norm_adv_by_std_in_grpo) -> (advantages, returns)``
- ``policy_losses``: ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, *,
  rollout_is_weights, norm, clip_ratio...) -> (loss, metrics)``
- ``kl_estimators``: ``(log_prob, ref_log_prob) -> (B, T)``; ``full`` takes logits.

Shapes: ``B`` sequences, ``T`` response tokens, ``V`` vocabulary. Masks are bool, True =
the position counts, and every reduction over tokens goes through ``masked`` / ``agg_loss``.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module; imported on first use (PEP 562), so that importing ``lmrl.algos.registry``
# alone (reward worker processes do) does not pay for torch.
_EXPORTS = {
    "advantage_estimators": "advantages",
    "group_ids": "advantages",
    "reverse_discounted_scan": "advantages",
    "LOSS_AGG_MODES": "agg",
    "AggNorm": "agg",
    "agg_loss": "agg",
    "AdaptiveKLController": "kl",
    "FixedKLController": "kl",
    "apply_kl_penalty": "kl",
    "kl_controllers": "kl",
    "kl_estimators": "kl",
    "kl_penalty": "kl",
    "make_kl_controller": "kl",
    "full_kl_from_logits": "logprob",
    "log_probs_from_hidden": "logprob",
    "log_probs_from_logits": "logprob",
    "masked_count": "masked",
    "masked_mean": "masked",
    "masked_sum": "masked",
    "masked_var": "masked",
    "masked_whiten": "masked",
    "policy_losses": "losses",
    "ALIASES": "registry",
    "Registry": "registry",
    "rollout_importance_weights": "rollout_correction",
    "value_loss": "value",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lmrl.algos' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lmrl.algos.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
