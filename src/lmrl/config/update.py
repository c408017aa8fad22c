"""The learning half of ``lmrl train``'s schema: ``algorithm``, ``actor``, ``critic``, ``ref``.

What happens to a scored batch: the advantage estimator and the KL penalty in the reward
(``algorithm``), the policy update with its loss, KL and entropy terms and optimizer
(``actor``), the value function (``critic``) and the reference policy (``ref``). The
generating half (``data``, ``model``, ``rollout``, ``reward``...) and the whole ``Config``
are in ``lmrl.config.schema``, which re-exports these classes; the conventions (``opt``,
verl's defaults, ``null = X``) are stated there.
"""

# ruff: noqa: RUF009  (``opt`` returns a ``dataclasses.field``; ruff cannot see that)

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lmrl.config.run import opt, options

# ------------------------------------------------------------------------------------------
# algorithm
# ------------------------------------------------------------------------------------------


@dataclass
class KLControlConfig:
    """The options of ``algorithm.kl_ctrl``: the coefficient of the KL penalty in the reward
    (algorithm.use_kl_in_reward)."""

    type: Literal["fixed", "adaptive"] = opt(
        "fixed", "fixed keeps kl_coef; adaptive steers the observed KL towards target_kl."
    )
    kl_coef: float = opt(0.001, "The (initial) KL coefficient beta.")
    target_kl: float | None = opt(0.1, "Target KL of the adaptive controller.")
    horizon: int | None = opt(
        10000, "Samples over which the adaptive controller makes a full correction."
    )


@dataclass
class FilterGroupsConfig:
    """The options of ``algorithm.filter_groups``: DAPO dynamic sampling, which drops groups
    whose responses all score the same."""

    enable: bool = opt(False, "Drop zero-spread groups and generate more until the batch is full.")
    metric: str = opt(
        "seq_reward",
        "Per-sample value whose spread is tested: seq_reward (sum of token rewards), "
        "seq_final_reward, or a value the scoring returns: score, acc, format (built-in "
        "scorers), rm_score (reward model), overlong_penalty (overlong buffer), or a custom "
        "function's own key.",
    )
    max_num_gen_batches: int = opt(
        10, "Most generation calls per step before giving up; <= 0 = unlimited."
    )


@dataclass
class AlgorithmConfig:
    """Advantages and the KL penalty in the reward."""

    adv_estimator: str = opt(
        "gae",
        "Advantage estimator (lmrl.algos registry): gae (needs the critic), grpo, rloo, "
        "grpo_passk, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, opo.",
    )
    gamma: float = opt(1.0, "Discount factor, in [0, 1].")
    lam: float = opt(1.0, "GAE lambda, in [0, 1]: 1 = Monte Carlo, 0 = one-step TD.")
    norm_adv_by_std_in_grpo: bool = opt(True, "GRPO divides by the group std; false gives Dr.GRPO.")
    use_kl_in_reward: bool = opt(
        False, "Subtract kl_coef * KL(pi_old || pi_ref) from the token rewards."
    )
    kl_penalty: str = opt(
        "kl", "KL estimator for the reward penalty: kl (k1), abs, mse (k2), low_var_kl (k3)."
    )
    kl_ctrl: dict[str, Any] = options(
        KLControlConfig, "KL coefficient controller; set one as algorithm.kl_ctrl.NAME."
    )
    filter_groups: dict[str, Any] = options(
        FilterGroupsConfig, "DAPO dynamic sampling; set one as algorithm.filter_groups.NAME."
    )


# ------------------------------------------------------------------------------------------
# actor and critic
# ------------------------------------------------------------------------------------------


@dataclass
class OptimConfig:
    """AdamW with linear warmup and a constant or cosine schedule."""

    lr: float = opt(1e-6, "Peak learning rate.")
    weight_decay: float = opt(0.01, "AdamW weight decay.")
    betas: list[float] = opt([0.9, 0.999], "AdamW betas [beta1, beta2].")
    lr_warmup_steps: int = opt(-1, "Linear warmup steps; negative = use lr_warmup_steps_ratio.")
    lr_warmup_steps_ratio: float = opt(
        0.0, "Warmup as a fraction of the total training steps, in [0, 1]."
    )
    lr_scheduler: Literal["constant", "cosine"] = opt(
        "constant", "Schedule after warmup (verl: warmup_style / lr_scheduler_type)."
    )
    min_lr_ratio: float = opt(
        0.0, "cosine: the final learning rate as a fraction of lr, in [0, 1]."
    )


@dataclass
class PolicyLossConfig:
    """The options of ``actor.policy_loss``: which policy loss, and its own hyperparameters
    (each loss reads the ones its signature names)."""

    loss_mode: str = opt(
        "vanilla",
        "Policy loss (lmrl.algos registry): vanilla (PPO clip + dual clip), gspo, geo_mean "
        "(GMPO), cispo, sapo, clip_cov, kl_cov, reinforce.",
    )
    tau_pos: float = opt(1.0, "sapo: gate temperature for positive advantages.")
    tau_neg: float = opt(1.05, "sapo: gate temperature for negative advantages.")
    clip_cov_ratio: float = opt(
        0.0002,
        "clip_cov: fraction of the tokens whose gradient is dropped, drawn among those of "
        "high log-prob/advantage covariance (verl's default suits 10^5+ tokens a batch).",
    )
    clip_cov_lb: float = opt(1.0, "clip_cov: only tokens with covariance above this.")
    clip_cov_ub: float = opt(5.0, "clip_cov: only tokens with covariance below this.")
    kl_cov_ratio: float = opt(
        0.0002, "kl_cov: fraction of the tokens, of highest covariance, given the KL penalty."
    )
    ppo_kl_coef: float = opt(1.0, "kl_cov: weight of the |log-ratio| penalty.")


Offload = Literal["none", "params", "optimizer", "both"]
_OFFLOAD_HELP = (
    "strategy=fsdp2: which shards stay on the CPU between uses, named after verl's "
    "fsdp_config.param_offload / optimizer_offload (each maps onto it). FSDP2's "
    "CPUOffloadPolicy keeps parameters, gradients and optimizer state together, so params, "
    "optimizer and both all offload the three; none keeps them on the GPU."
)


Strategy = Literal["ddp", "fsdp2", "fsdp"]


@dataclass
class ActorConfig:
    """The policy update: batching, the PPO loss, entropy and KL terms, the optimizer."""

    ppo_mini_batch_size: int = opt(
        256,
        "Prompts per optimizer step (times rollout.n sequences); data.train_batch_size "
        "must be a multiple of it.",
    )
    ppo_micro_batch_size: int | None = opt(
        None,
        "Sequences per forward/backward pass (per device), gradients accumulated; "
        "null = the whole mini-batch at once.",
    )
    ppo_epochs: int = opt(1, "Passes over each batch of rollouts.")
    shuffle: bool = opt(False, "Shuffle sequences before cutting mini-batches.")
    clip_ratio: float = opt(0.2, "PPO clip range epsilon: the ratio is kept in [1-eps, 1+eps].")
    clip_ratio_low: float | None = opt(None, "Lower clip range (1 - low); null = clip_ratio.")
    clip_ratio_high: float | None = opt(
        None, "Upper clip range (1 + high); null = clip_ratio. DAPO's clip-higher uses 0.28."
    )
    clip_ratio_c: float = opt(
        3.0, "Dual clip: the loss of a negative-advantage token is at most -A * clip_ratio_c; > 1."
    )
    loss_agg_mode: str = opt(
        "token-mean",
        "How token losses become one number: token-mean, token-sum, seq-mean-token-sum, "
        "seq-mean-token-mean, seq-mean-token-sum-norm (Dr.GRPO).",
    )
    policy_loss: dict[str, Any] = options(
        PolicyLossConfig,
        "The policy loss (loss_mode) and its hyperparameters; set one as actor.policy_loss.NAME.",
    )
    entropy_coeff: float = opt(0.0, "Weight of the entropy bonus (loss -= coeff * entropy).")
    use_kl_loss: bool = opt(False, "Add kl_loss_coef * KL(pi || pi_ref) to the loss (GRPO-style).")
    kl_loss_coef: float = opt(0.001, "Weight of the KL loss.")
    kl_loss_type: str = opt(
        "low_var_kl", "KL estimator of the KL loss: kl (k1), abs, mse (k2), low_var_kl (k3)."
    )
    optim: OptimConfig = opt(OptimConfig(), "Actor optimizer.")
    grad_clip: float = opt(1.0, "Clip the global gradient norm to this value.")
    strategy: Strategy = opt(
        "ddp",
        "Data parallelism under trainer.backend=ray: ddp = replicated weights, gradients "
        "all-reduced; fsdp2 = parameters, gradients and optimizer state sharded (PyTorch "
        "fully_shard); fsdp = verl's name for it, the same as fsdp2. One process "
        "(backend=local) ignores it.",
    )
    offload: Offload = opt("none", _OFFLOAD_HELP)
    state_masking: bool = opt(
        True,
        "Multi-turn: tool observations are not trained (False in response_mask, Search-R1's "
        "info_mask); false trains them as if generated.",
    )


@dataclass
class CriticModelConfig:
    """The value model: a language model with a scalar head."""

    path: str | None = opt(
        None,
        "Model directory; null = model.path (the actor's). model.trust_remote_code and "
        "model.enable_gradient_checkpointing apply to the critic too.",
    )


@dataclass
class CriticConfig:
    """The value function (PPO with GAE): its model, batching, clipped value loss, optimizer."""

    enable: bool | None = opt(
        None, "Train a critic; null = on exactly when the advantage estimator needs values (gae)."
    )
    model: CriticModelConfig = opt(CriticModelConfig(), "Critic model.")
    optim: OptimConfig = opt(OptimConfig(lr=1e-5), "Critic optimizer.")
    ppo_epochs: int | None = opt(None, "Passes over each batch; null = actor.ppo_epochs.")
    ppo_mini_batch_size: int | None = opt(
        None, "Prompts per critic optimizer step (times rollout.n); null = actor's."
    )
    ppo_micro_batch_size: int | None = opt(
        None,
        "Sequences per forward/backward pass (per device), and per forward pass when "
        "computing values; null = the whole mini-batch.",
    )
    shuffle: bool | None = opt(None, "Shuffle before cutting mini-batches; null = actor's.")
    cliprange_value: float = opt(
        0.5, "Value clipping: new values stay within old +- cliprange_value."
    )
    loss_agg_mode: str | None = opt(
        None, "Aggregation of the value loss; null = actor.loss_agg_mode."
    )
    grad_clip: float = opt(1.0, "Clip the critic's global gradient norm to this value.")
    strategy: Strategy = opt(
        "ddp", "Data parallelism of the critic under Ray (see actor.strategy)."
    )
    offload: Offload = opt("none", "The critic's; see actor.offload.")


@dataclass
class RefConfig:
    """The reference policy (frozen initial actor, or the actor with LoRA disabled)."""

    log_prob_micro_batch_size: int | None = opt(
        None, "Sequences per forward pass; null = rollout.log_prob_micro_batch_size."
    )
