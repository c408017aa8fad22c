"""``lmrl.algos``: the maths of RL post-training as pure tensor functions.

Tensors in, tensors out: no models, no I/O, no config objects, no ``.item()`` in the maths.
Each algorithm family is a ``Registry`` keyed by the recipes' names, with one signature per
family so that the trainer never branches on an algorithm's name:

- ``advantage_estimators``: ``(token_level_rewards, response_mask, *, index, values,
  reward_baselines, gamma, lam, epsilon, norm_adv_by_std_in_grpo) -> (advantages, returns)``
- ``policy_losses``: ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, *,
  rollout_is_weights, norm, <its own hyperparameters>) -> (loss, metrics)``; which
  hyperparameters a loss takes: ``loss_hyperparameters(name)``
- ``kl_estimators``: ``(log_prob, ref_log_prob) -> (B, T)``; ``full`` takes logits
  (``full_kl_from_hidden`` computes it from hidden states and output heads).

Shapes: ``B`` sequences, ``T`` response tokens, ``V`` vocabulary. Masks are bool, True =
the position counts, and every reduction over tokens goes through ``masked`` / ``agg_loss``.
"""

from __future__ import annotations

from lmrl._lazy import lazy_exports

# name -> module; imported on first use (PEP 562), so that importing ``lmrl.algos.registry``
# alone (reward worker processes do) does not pay for torch.
_EXPORTS = {
    "advantage_estimators": "lmrl.algos.advantages",
    "group_ids": "lmrl.algos.advantages",
    "reverse_discounted_scan": "lmrl.algos.advantages",
    "LOSS_AGG_MODES": "lmrl.algos.agg",
    "AggNorm": "lmrl.algos.agg",
    "agg_loss": "lmrl.algos.agg",
    "AdaptiveKLController": "lmrl.algos.kl",
    "FixedKLController": "lmrl.algos.kl",
    "apply_kl_penalty": "lmrl.algos.kl",
    "full_kl_from_hidden": "lmrl.algos.kl",
    "kl_controllers": "lmrl.algos.kl",
    "kl_estimators": "lmrl.algos.kl",
    "kl_penalty": "lmrl.algos.kl",
    "make_kl_controller": "lmrl.algos.kl",
    "full_kl_from_logits": "lmrl.algos.logprob",
    "log_probs_from_hidden": "lmrl.algos.logprob",
    "log_probs_from_logits": "lmrl.algos.logprob",
    "masked_count": "lmrl.algos.masked",
    "masked_mean": "lmrl.algos.masked",
    "masked_sum": "lmrl.algos.masked",
    "masked_var": "lmrl.algos.masked",
    "masked_whiten": "lmrl.algos.masked",
    "loss_hyperparameters": "lmrl.algos.losses",
    "policy_losses": "lmrl.algos.losses",
    "ALIASES": "lmrl.algos.registry",
    "Registry": "lmrl.algos.registry",
    "rollout_importance_weights": "lmrl.algos.rollout_correction",
    "value_loss": "lmrl.algos.value",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
