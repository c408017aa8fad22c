"""RL for flow-matching generators (Flow-GRPO): the SDE sampler with per-step log-probs, the
rollout that keeps a trajectory's steps in a `lmrl.batch.Batch`, the GRPO update from
`lmrl.algos`, flow-matching pre-training, and a 2-D toy model."""

from lmrl._lazy import lazy_exports

_EXPORTS = {
    "SdeStep": "lmrl.flow.sde",
    "gaussian_kl": "lmrl.flow.sde",
    "noise_std": "lmrl.flow.sde",
    "ode_step": "lmrl.flow.sde",
    "schedule": "lmrl.flow.sde",
    "sde_step": "lmrl.flow.sde",
    "FlowSampler": "lmrl.flow.rollout",
    "velocity": "lmrl.flow.rollout",
    "FlowGRPO": "lmrl.flow.grpo",
    "FlowGRPOConfig": "lmrl.flow.grpo",
    "flow_advantages": "lmrl.flow.grpo",
    "WeightEMA": "lmrl.flow.ema",
    "flow_matching_loss": "lmrl.flow.matching",
    "pretrain": "lmrl.flow.matching",
    "PointFlow": "lmrl.flow.toy",
    "right_side_reward": "lmrl.flow.toy",
    "two_blobs": "lmrl.flow.toy",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
