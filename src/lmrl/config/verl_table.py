"""The rows of the verl translation table (``lmrl.config.verl`` applies them): for each verl key
path, the target schemas it applies to and what it becomes here (a path, a rename, a fold, or a
one-line notice for a key of verl's GPU stack that changes nothing here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmrl.config.fields import is_url

#: the target schemas of the table: ``lmrl train``'s ``Config`` and ``lmrl sft``'s ``SFTConfig``
TRAIN = "train"
SFT = "sft"
FLOW = "flow"
TARGETS = (TRAIN, SFT, FLOW)


@dataclass(frozen=True)
class Rule:
    """One row of the table.

    Attributes:
        verl: a dotted path; ``X.*`` matches every key below ``X``; ``*.name`` matches a last
            segment ``name`` at any depth.
        ours: where it goes: a dotted path (``Y.*`` when ``verl`` is ``X.*``), or None when the
            key changes nothing in lmrl (accepted with a notice).
        note: why such a key changes nothing (shown in the notice).
        only: for ``ours=None``, the only values accepted; any other value is an error
            (the feature is not available in lmrl). Empty = every value is accepted.
        when_true: for a verl on/off switch: ``(our_path, our_value)`` set when it is true;
            false changes nothing (a notice).
        skip: values that change nothing (a notice) instead of being mapped.
        targets: the schemas the rule applies to (``TRAIN``, ``SFT``).
        flag: for one of several verl on/off switches folded into one key of ours (the two
            FSDP offload flags -> ``actor.offload``): true adds ``flag`` to the key's current
            value, false removes it (``OFFLOAD_FLAGS`` names the combinations), so each switch
            keeps its own last value as in verl.
        accepts: for a key mapped onto a key of ours that takes more: ``accepts(value)`` is
            an error message when verl's key cannot mean that value (``retriever.url`` a
            path), else None.
        values: for a key whose values are spelled otherwise here: ``(theirs, ours)`` pairs
            (Flow-GRPO's ``mixed_precision=bf16`` -> ``bfloat16``); any other value is an error.
        index: for a key that is one item of a list of ours (Flow-GRPO's ``train.adam_beta1``
            -> ``actor.optim.betas[0]``): the item it sets.
        also: more paths of ours that take the value unless the config sets them itself.
        count: for an on/off switch folded into a count of ours (``trainer.rollback`` ->
            ``trainer.max_rollbacks``, 0 = off): true sets the count to ``count`` unless it
            is already above 0, false sets it to 0.
    """

    verl: str
    ours: str | None
    note: str = ""
    only: tuple[Any, ...] = ()
    when_true: tuple[str, Any] | None = None
    skip: tuple[Any, ...] = ()
    targets: tuple[str, ...] = (TRAIN,)
    flag: str | None = None
    accepts: Callable[[Any], str | None] | None = None
    values: tuple[tuple[Any, Any], ...] = ()
    index: int | None = None
    also: tuple[str, ...] = ()
    count: int | None = None


#: ``actor.offload`` / ``critic.offload``: each value and verl's FSDP flags it stands for
OFFLOAD_FLAGS: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "params": frozenset({"params"}),
    "optimizer": frozenset({"optimizer"}),
    "both": frozenset({"params", "optimizer"}),
}


def _switch(flag: str, on: bool, current: str) -> str:
    """``current`` (an ``OFFLOAD_FLAGS`` name) with ``flag`` switched on or off."""
    flags = OFFLOAD_FLAGS[current] | {flag} if on else OFFLOAD_FLAGS[current] - {flag}
    return next(name for name, f in OFFLOAD_FLAGS.items() if f == flags)


def _count_switch(count: int, on: bool, current: int) -> int:
    """``current`` (a count, 0 = off) switched on (to ``count`` unless already on) or off."""
    return (current if current > 0 else count) if on else 0


def _server(value: Any) -> str | None:
    if value is None or is_url(value):
        return None
    return (
        f"not an http(s) URL of a retrieval server; a local passages file is "
        f"retriever.source={value}"
    )


def _corpus(value: Any) -> str | None:
    if is_url(value):
        return f"a URL is a retrieval server: retriever.source={value}"
    return None


_FSDP = "a verl FSDP tuning knob; lmrl's fsdp2 takes actor.offload / critic.offload"
_BSZ = "verl's token-budget dynamic batching; lmrl batches by the micro-batch sizes"
_SP = "verl's sequence parallelism"
_ENGINE = "verl's vLLM/SGLang engine setting"
_PROF = "verl's profiler"
_KERNEL = "a verl kernel/compile option"
_CKPT = "lmrl checkpoints always hold model, optimizer and trainer state"
_REF_STRATEGY = "the reference is a frozen copy of the actor (or the LoRA actor without adapter)"
_VALUES = "the critic computes values in slices of critic.ppo_micro_batch_size"
_LEN = "lmrl takes the lengths from data.max_prompt_length / data.max_response_length"
_UNSUPPORTED = "not available in lmrl"
_SFT_FSDP = "verl's FSDP setting; lmrl sft trains one whole model in one process"
_SFT_ONE = "lmrl sft runs in one process on one device"
_SFT_NO = "not available in lmrl sft"
_ONLY_SFT = (SFT,)
_ONLY_FLOW = (FLOW,)
_FLOW_LOCAL = "a Flow-GRPO launch setting; lmrl train-flow runs in one process"
_FLOW_REWARD = (
    "lmrl train-flow trains on one reward: reward.name=NAME (a built-in, e.g. geneval; "
    "`lmrl train-flow --help` lists them) or reward.path=FILE reward.name=FN; a weighted sum of "
    "rewards is a function of such a file"
)
_FLOW_BATCH = (
    "Flow-GRPO's per-GPU batching; lmrl samples data.train_batch_size prompts x sampler.n images "
    "a step and updates per actor.ppo_mini_batch_size"
)

VERL_RULES: tuple[Rule, ...] = (
    # ---- section prefixes: verl's nesting onto ours
    Rule("actor_rollout_ref.model.*", "model.*"),
    Rule("actor_rollout_ref.actor.*", "actor.*"),
    Rule("actor_rollout_ref.rollout.*", "rollout.*"),
    Rule("actor_rollout_ref.ref.*", "ref.*"),
    Rule("custom_reward_function.*", "reward.custom_reward_function.*"),
    Rule("reward_model.reward_manager", "reward.manager"),
    Rule("reward_model.overlong_buffer.*", "reward.overlong_buffer.*"),
    Rule("reward_model.reward_kwargs.overlong_buffer_cfg.*", "reward.overlong_buffer.*"),
    Rule("trainer.n_gpus_per_node", "resources.n_gpus_per_node"),
    Rule("trainer.nnodes", "resources.nnodes"),
    Rule("ray_init.num_cpus", "resources.num_cpus"),
    Rule("ray_kwargs.ray_init.num_cpus", "resources.num_cpus"),
    Rule("ray_init.address", "resources.ray_address"),
    Rule("ray_kwargs.ray_init.address", "resources.ray_address"),
    # ---- renames (verl names, also accepted in our layout)
    Rule("actor.ppo_micro_batch_size_per_gpu", "actor.ppo_micro_batch_size"),
    Rule("actor.optim.warmup_style", "actor.optim.lr_scheduler"),
    Rule("actor.optim.lr_scheduler_type", "actor.optim.lr_scheduler"),
    Rule("actor.optim.clip_grad", "actor.grad_clip"),
    Rule("rollout.log_prob_micro_batch_size_per_gpu", "rollout.log_prob_micro_batch_size"),
    Rule("ref.log_prob_micro_batch_size_per_gpu", "ref.log_prob_micro_batch_size"),
    Rule("critic.ppo_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size"),
    Rule("critic.optim.warmup_style", "critic.optim.lr_scheduler"),
    Rule("critic.optim.lr_scheduler_type", "critic.optim.lr_scheduler"),
    Rule("critic.optim.clip_grad", "critic.grad_clip"),
    Rule("trainer.max_actor_ckpt_to_keep", "trainer.max_ckpt_to_keep"),
    Rule("trainer.max_critic_ckpt_to_keep", "trainer.max_ckpt_to_keep"),
    Rule(
        "trainer.resume_from_path",
        "trainer.resume_mode",
        "no checkpoint path given",
        skip=(None,),
        targets=TARGETS,
    ),
    Rule(
        "trainer.resume_mode",
        "trainer.resume_mode",
        "the checkpoint path given as trainer.resume_from_path becomes trainer.resume_mode",
        skip=("resume_path",),
        targets=TARGETS,
    ),
    Rule("algorithm.rollout_is_level", "rollout.correction.level"),
    Rule("algorithm.rollout_is_mode", "rollout.correction.mode"),
    Rule(
        "algorithm.rollout_is_threshold",
        "rollout.correction.threshold",
        "null switches verl's rollout correction off; rollout.log_prob_mode decides",
        skip=(None,),
    ),
    Rule("algorithm.rollout_is_threshold_lower", "rollout.correction.threshold_lower"),
    Rule(
        "algorithm.rollout_is",
        None,
        "rollout.log_prob_mode decides",
        when_true=("rollout.log_prob_mode", "rollout_correction"),
    ),
    Rule(
        "algorithm.rollout_correction.bypass_mode",
        None,
        "rollout.log_prob_mode decides",
        when_true=("rollout.log_prob_mode", "bypass"),
    ),
    Rule("algorithm.rollout_is_veto_threshold", None, _UNSUPPORTED, only=(None,)),
    # async_training: verl's fully-async recipe (the section's own keys are ours too)
    Rule(
        "async_training.use_rollout_log_probs",
        None,
        "rollout.log_prob_mode decides",
        when_true=("rollout.log_prob_mode", "bypass"),
    ),
    Rule(
        "async_training.compute_prox_log_prob",
        None,
        "rollout.log_prob_mode decides",
        when_true=("rollout.log_prob_mode", "rollout_correction"),
    ),
    Rule(
        "async_training.require_batches",
        None,
        "an lmrl step trains on one whole batch of data.train_batch_size prompts",
        only=(1,),
    ),
    Rule(
        "async_training.checkpoint_engine.*",
        None,
        "verl's NCCL broadcast of the weights; lmrl hands them to the engine between requests",
    ),
    # ---- accepted, change nothing here: model
    Rule("model.use_remove_padding", None, _KERNEL),
    Rule("model.use_fused_kernels", None, _KERNEL),
    Rule("model.fused_kernel_options.*", None, _KERNEL),
    Rule("model.use_liger", None, _KERNEL, targets=TARGETS),
    Rule("model.use_shm", None, "verl's shared-memory model loading", targets=TARGETS),
    Rule("model.enable_activation_offload", None, _FSDP),
    Rule("model.external_lib", None, _UNSUPPORTED, only=(None,), targets=TARGETS),
    Rule("model.custom_chat_template", None, _UNSUPPORTED, only=(None,)),
    Rule("model.exclude_modules", None, _UNSUPPORTED, only=(None,)),
    # actor
    Rule("actor.strategy", "actor.strategy"),
    Rule("actor.fsdp_config.param_offload", "actor.offload", flag="params"),
    Rule("actor.fsdp_config.optimizer_offload", "actor.offload", flag="optimizer"),
    # one precision for every model: actor, ref and critic keys all set model.mixed_precision
    # (two of them with different values are an error: "set twice", naming both)
    Rule("actor.fsdp_config.mixed_precision.*", "model.mixed_precision.*"),
    Rule("actor.fsdp_config.*", None, _FSDP),
    Rule("actor.use_dynamic_bsz", None, _BSZ),
    Rule("actor.ppo_max_token_len_per_gpu", None, _BSZ),
    Rule("actor.ulysses_sequence_parallel_size", None, _SP),
    Rule("actor.use_torch_compile", None, _KERNEL),
    Rule("actor.use_fused_kernels", None, _KERNEL),
    Rule("actor.use_remove_padding", None, _KERNEL),
    Rule("actor.entropy_from_logits_with_chunking", None, _KERNEL),
    Rule("actor.entropy_checkpointing", None, _KERNEL),
    Rule("actor.checkpoint.*", None, _CKPT),
    Rule("actor.profiler.*", None, _PROF),
    Rule("actor.optim.total_training_steps", None, "the trainer computes the total steps"),
    Rule("actor.optim.num_cycles", None, "lmrl's cosine is a half cycle", only=(0.5,)),
    # ref
    Rule("ref.strategy", None, _REF_STRATEGY),
    Rule("ref.fsdp_config.mixed_precision.*", "model.mixed_precision.*"),
    Rule("ref.fsdp_config.*", None, _FSDP),
    Rule("ref.log_prob_use_dynamic_bsz", None, _BSZ),
    Rule("ref.log_prob_max_token_len_per_gpu", None, _BSZ),
    Rule("ref.ulysses_sequence_parallel_size", None, _SP),
    Rule("ref.use_torch_compile", None, _KERNEL),
    Rule("ref.entropy_from_logits_with_chunking", None, _KERNEL),
    Rule("ref.entropy_checkpointing", None, _KERNEL),
    Rule("ref.profiler.*", None, _PROF),
    Rule("ref.model", None, "the reference is the initial actor", only=(None,)),
    # rollout
    Rule("rollout.mode", None, "verl's sync/async engine mode"),
    Rule("rollout.prompt_length", None, _LEN),
    Rule("rollout.response_length", None, _LEN),
    Rule("rollout.max_model_len", "rollout.vllm.max_model_len"),
    Rule("rollout.dtype", "rollout.dtype"),
    Rule("rollout.gpu_memory_utilization", "rollout.vllm.gpu_memory_utilization"),
    Rule("rollout.tensor_model_parallel_size", "rollout.vllm.tensor_model_parallel_size"),
    Rule("rollout.data_parallel_size", None, _ENGINE),
    Rule("rollout.expert_parallel_size", None, _ENGINE),
    Rule("rollout.pipeline_model_parallel_size", None, _ENGINE),
    Rule("rollout.enforce_eager", "rollout.vllm.enforce_eager"),
    Rule("rollout.cudagraph_capture_sizes", None, _ENGINE),
    Rule("rollout.free_cache_engine", "rollout.vllm.free_cache_engine"),
    Rule("rollout.max_num_batched_tokens", "rollout.vllm.max_num_batched_tokens"),
    Rule("rollout.max_num_seqs", None, _ENGINE),
    Rule("rollout.enable_chunked_prefill", None, _ENGINE),
    Rule("rollout.enable_prefix_caching", None, _ENGINE),
    Rule("rollout.load_format", None, _ENGINE),
    Rule("rollout.layered_summon", None, _ENGINE),
    Rule("rollout.disable_log_stats", None, _ENGINE),
    Rule("rollout.multi_stage_wake_up", None, _ENGINE),
    Rule("rollout.update_weights_bucket_megabytes", None, _ENGINE),
    Rule("rollout.engine_kwargs.*", None, _ENGINE),
    Rule("rollout.log_prob_use_dynamic_bsz", None, _BSZ),
    Rule("rollout.log_prob_max_token_len_per_gpu", None, _BSZ),
    Rule("rollout.calculate_log_probs", None, "lmrl's engines always return their log-probs"),
    Rule("rollout.profiler.*", None, _PROF),
    Rule("rollout.trace.*", None, "verl's rollout tracing"),
    Rule("rollout.agent.*", None, "verl's agent loop"),
    Rule("rollout.skip_dump_dir", None, "verl's rollout dump"),
    Rule("rollout.skip_rollout", None, _UNSUPPORTED, only=(False,)),
    Rule("rollout.ignore_eos", "rollout.ignore_eos"),
    Rule("rollout.over_sample_rate", None, _UNSUPPORTED, only=(0, 0.0)),
    Rule("rollout.multi_turn.enable", "rollout.multi_turn.enable"),
    Rule("rollout.multi_turn.max_assistant_turns", "rollout.multi_turn.max_turns"),
    Rule("rollout.multi_turn.max_user_turns", None, "lmrl counts tool turns only"),
    Rule("rollout.multi_turn.max_turns", "rollout.multi_turn.max_turns"),
    Rule("rollout.multi_turn.tools", "rollout.multi_turn.tools"),
    Rule("rollout.multi_turn.tool_path", "rollout.multi_turn.tool_path"),
    Rule("rollout.multi_turn.format", "rollout.multi_turn.format", skip=("hermes",)),
    Rule("rollout.multi_turn.max_obs_length", "rollout.multi_turn.max_obs_length"),
    Rule("rollout.multi_turn.tool_timeout_s", "rollout.multi_turn.tool_timeout_s"),
    Rule("rollout.multi_turn.tool_processes", "rollout.multi_turn.tool_processes"),
    Rule("rollout.multi_turn.pipeline_groups", "rollout.multi_turn.pipeline_groups"),
    Rule("rollout.multi_turn.max_tool_error_fraction", "rollout.multi_turn.max_tool_error_fraction"),
    Rule("rollout.multi_turn.python", "rollout.multi_turn.python"),
    Rule("rollout.multi_turn.python.*", "rollout.multi_turn.python.*"),
    Rule("rollout.multi_turn.python_timeout_s", "rollout.multi_turn.python.timeout_s"),
    Rule("rollout.multi_turn.python_memory_mb", "rollout.multi_turn.python.memory_mb"),
    Rule(
        "rollout.multi_turn.tool_config_path",
        None,
        "verl's tool YAML is not read; list tools in rollout.multi_turn.tools and define your "
        "own in a Python file given as rollout.multi_turn.tool_path",
        only=(None,),
    ),
    Rule("rollout.multi_turn.*", None, "a verl multi-turn setting lmrl does not use"),
    # ---- Search-R1's keys (its fork of verl): n_agent, state masking, the retriever
    Rule("rollout.n_agent", "rollout.n"),
    Rule("actor.state_masking", "actor.state_masking"),
    Rule("max_turns", "rollout.multi_turn.max_turns"),
    Rule("do_search", "rollout.multi_turn.enable"),
    Rule("data.max_obs_length", "rollout.multi_turn.max_obs_length"),
    Rule("data.max_start_length", None, _LEN),
    Rule(
        "data.train_data_num",
        None,
        "Search-R1's row limit; every row of the file is used",
        only=(None,),
    ),
    Rule(
        "data.val_data_num",
        None,
        "Search-R1's row limit; every row of the file is used",
        only=(None,),
    ),
    Rule("data.shuffle_train_dataloader", "data.shuffle"),
    Rule("retriever.url", "retriever.source", accepts=_server),
    Rule("retriever.corpus", "retriever.source", accepts=_corpus),
    Rule(
        "algorithm.no_think_rl",
        None,
        "Search-R1's no-think ablation is " + _UNSUPPORTED,
        only=(False,),
    ),
    # critic
    Rule("critic.strategy", "critic.strategy"),
    Rule("critic.rollout_n", None, "lmrl reads rollout.n"),
    Rule("critic.use_dynamic_bsz", None, _BSZ),
    Rule("critic.ppo_max_token_len_per_gpu", None, _BSZ),
    Rule("critic.forward_max_token_len_per_gpu", None, _BSZ),
    Rule("critic.ulysses_sequence_parallel_size", None, _SP),
    Rule("critic.checkpoint.*", None, _CKPT),
    Rule("critic.profiler.*", None, _PROF),
    Rule("critic.optim.total_training_steps", None, "the trainer computes the total steps"),
    Rule("critic.optim.num_cycles", None, "lmrl's cosine is a half cycle", only=(0.5,)),
    Rule("critic.model.fsdp_config.param_offload", "critic.offload", flag="params"),
    Rule("critic.model.fsdp_config.optimizer_offload", "critic.offload", flag="optimizer"),
    Rule("critic.fsdp_config.param_offload", "critic.offload", flag="params"),
    Rule("critic.fsdp_config.optimizer_offload", "critic.offload", flag="optimizer"),
    Rule("critic.model.fsdp_config.mixed_precision.*", "model.mixed_precision.*"),
    Rule("critic.fsdp_config.mixed_precision.*", "model.mixed_precision.*"),
    Rule("critic.model.fsdp_config.*", None, _FSDP),
    Rule("critic.model.tokenizer_path", None, "the critic uses the actor's tokenizer"),
    Rule("critic.model.trust_remote_code", None, "model.trust_remote_code applies to both"),
    Rule(
        "critic.model.enable_gradient_checkpointing",
        None,
        "model.enable_gradient_checkpointing applies to both",
    ),
    Rule("critic.forward_micro_batch_size", None, _VALUES),
    Rule("critic.forward_micro_batch_size_per_gpu", None, _VALUES),
    Rule("critic.model.use_shm", None, "verl's shared-memory model loading"),
    Rule("critic.model.use_remove_padding", None, _KERNEL),
    Rule("critic.model.enable_activation_offload", None, _FSDP),
    Rule("critic.model.external_lib", None, _UNSUPPORTED, only=(None,)),
    Rule("critic.model.lora_rank", None, "critic LoRA is " + _UNSUPPORTED, only=(0,)),
    Rule("critic.model.lora_alpha", None, "critic LoRA is off"),
    Rule("critic.model.target_modules", None, "critic LoRA is off"),
    # reward model
    Rule("reward_model.enable", "reward_model.enable"),
    Rule("reward_model.model.path", "reward_model.model.path"),
    Rule("reward_model.model.input_tokenizer", "reward_model.model.input_tokenizer"),
    Rule("reward_model.model.trust_remote_code", "reward_model.model.trust_remote_code"),
    Rule("reward_model.model.*", None, "a verl reward-model loading option"),
    Rule("reward_model.strategy", None, "the reward model runs whole in each reward worker"),
    Rule("reward_model.micro_batch_size_per_gpu", "reward_model.micro_batch_size"),
    Rule("reward_model.micro_batch_size", "reward_model.micro_batch_size"),
    Rule("reward_model.max_length", "reward_model.max_length"),
    Rule("reward_model.use_dynamic_bsz", None, _BSZ),
    Rule("reward_model.forward_max_token_len_per_gpu", None, _BSZ),
    Rule("reward_model.ulysses_sequence_parallel_size", None, _SP),
    Rule("reward_model.profiler.*", None, _PROF),
    Rule("reward_model.launch_reward_fn_async", "reward.overlap.log_probs"),
    # ---- lmrl's own keys folded into one: the scoring overlaps, the rollback switch
    Rule("reward.launch_async", "reward.overlap.log_probs"),
    Rule("reward.in_flight_rows", "reward.overlap.rows"),
    Rule("reward.in_flight_chunks", "reward.overlap.chunks"),
    Rule("trainer.rollback", "trainer.max_rollbacks", count=2),
    Rule(
        "reward_model.sandbox_fusion.url",
        None,
        "sandboxed code execution is " + _UNSUPPORTED,
        only=(None,),
    ),
    Rule("reward_model.sandbox_fusion.*", None, "sandboxed code execution is off"),
    Rule("reward_model.overlong_buffer.log", None, "the overlong penalty is always logged"),
    Rule(
        "reward_model.reward_kwargs.overlong_buffer_cfg.log", None, "the penalty is always logged"
    ),
    Rule("reward_model.reward_kwargs.max_resp_len", None, _LEN),
    # algorithm
    Rule("algorithm.use_pf_ppo", None, "PF-PPO is " + _UNSUPPORTED, only=(False,)),
    Rule("algorithm.pf_ppo.*", None, "PF-PPO is off"),
    # data
    Rule("data.tokenizer", None, "the tokenizer is the model's", only=(None,)),
    Rule("data.use_shm", None, "verl's shared-memory data loading", targets=TARGETS),
    Rule("data.return_raw_input_ids", None, "a verl dataloader detail"),
    Rule("data.return_raw_chat", None, "a verl dataloader detail"),
    Rule("data.return_full_prompt", None, "a verl dataloader detail"),
    Rule("data.return_multi_modal_inputs", None, "a verl dataloader detail"),
    Rule("data.dataloader_num_workers", None, "prompts are read in-process"),
    Rule("data.filter_overlong_prompts_workers", None, "prompts are filtered in-process"),
    Rule("data.validation_shuffle", None, "validation runs in file order"),
    Rule("data.trust_remote_code", None, "model.trust_remote_code applies"),
    Rule("data.image_key", None, "multimodal data is " + _UNSUPPORTED),
    Rule("data.video_key", None, "multimodal data is " + _UNSUPPORTED),
    Rule(
        "data.custom_cls.*",
        None,
        "custom dataset classes are " + _UNSUPPORTED,
        only=(None,),
        targets=TARGETS,
    ),
    Rule("data.sampler.*", None, "custom samplers are " + _UNSUPPORTED, only=(None,)),
    Rule("data.datagen.*", None, "dataset generators are " + _UNSUPPORTED, only=(None,)),
    # trainer and the rest
    Rule("trainer.balance_batch", None, "verl's sequence-length balancing across GPUs"),
    Rule("trainer.log_val_generations", None, "see trainer.log_generations_freq"),
    Rule("trainer.esi_redundant_time", None, "verl's elastic-instance setting"),
    Rule(
        "trainer.default_hdfs_dir",
        None,
        "HDFS upload is " + _UNSUPPORTED,
        only=(None,),
        targets=TARGETS,
    ),
    Rule("trainer.del_local_ckpt_after_load", None, "checkpoints are kept"),
    Rule("trainer.ray_wait_register_center_timeout", None, "a verl Ray setting"),
    Rule("trainer.use_legacy_worker_impl", None, "verl's worker implementation switch"),
    Rule("trainer.rollout_data_dir", None, "see trainer.log_generations_freq", only=(None,)),
    Rule("trainer.validation_data_dir", None, "see trainer.log_generations_freq", only=(None,)),
    Rule("trainer.val_only", None, "use `lmrl eval` for validation alone", only=(False,)),
    Rule("actor_rollout_ref.hybrid_engine", None, "lmrl's actor and rollout always share weights"),
    Rule("actor_rollout_ref.nccl_timeout", None, "a verl distributed setting"),
    Rule("global_profiler.*", None, _PROF),
    Rule("ray_kwargs.timeline_json_file", None, "a verl Ray profiling setting"),
    Rule("ray_init.*", None, "a verl Ray setting"),
    Rule("ray_kwargs.*", None, "a verl Ray setting"),
    Rule(
        "defaults",
        None,
        "Hydra's defaults list; lmrl's defaults are its dataclasses",
        targets=TARGETS,
    ),
    Rule("hydra.*", None, "Hydra's own settings", targets=TARGETS),
    Rule("*._target_", None, "a Hydra instantiation target", targets=TARGETS),
    # ---- lmrl sft: verl's sft_trainer.yaml (the rules above marked TARGETS apply too)
    Rule("model.partial_pretrain", "model.path", targets=_ONLY_SFT),
    Rule("data.micro_batch_size_per_gpu", "data.micro_batch_size", targets=_ONLY_SFT),
    Rule("data.multiturn.messages_key", "data.messages_key", targets=_ONLY_SFT),
    Rule("optim.warmup_steps_ratio", "optim.lr_warmup_steps_ratio", targets=_ONLY_SFT),
    Rule("optim.warmup_style", "optim.lr_scheduler", targets=_ONLY_SFT),
    Rule("optim.lr_scheduler_type", "optim.lr_scheduler", targets=_ONLY_SFT),
    Rule("optim.clip_grad", "optim.grad_clip", targets=_ONLY_SFT),
    Rule("data.multiturn.enable", None, "the layout is read from the columns", targets=_ONLY_SFT),
    Rule(
        "data.multiturn.*",
        None,
        "tools and thinking switches are not available in lmrl sft",
        targets=_ONLY_SFT,
    ),
    Rule("data.prompt_dict_keys", None, _SFT_NO, only=(None,), targets=_ONLY_SFT),
    Rule("data.response_dict_keys", None, _SFT_NO, only=(None,), targets=_ONLY_SFT),
    Rule(
        "data.chat_template",
        None,
        "the tokenizer's own template is used",
        only=(None,),
        targets=_ONLY_SFT,
    ),
    Rule("data.balance_dp_token", None, _SFT_ONE, targets=_ONLY_SFT),
    Rule("model.strategy", None, _SFT_FSDP, targets=_ONLY_SFT),
    Rule("model.fsdp_config.mixed_precision.*", "model.mixed_precision.*", targets=_ONLY_SFT),
    Rule("model.fsdp_config.*", None, _SFT_FSDP, targets=_ONLY_SFT),
    Rule("ulysses_sequence_parallel_size", None, _SFT_ONE, only=(1,), targets=_ONLY_SFT),
    Rule("use_remove_padding", None, _KERNEL, targets=_ONLY_SFT),
    Rule("trainer.nnodes", None, _SFT_ONE, targets=_ONLY_SFT),
    Rule("trainer.n_gpus_per_node", None, _SFT_ONE, targets=_ONLY_SFT),
    Rule("trainer.checkpoint.*", None, _CKPT, targets=_ONLY_SFT),
    # ---- Flow-GRPO's config names (yifan123/flow_grpo config/base.py) onto lmrl train-flow
    Rule("sample.num_steps", "sampler.num_steps", targets=_ONLY_FLOW),
    Rule("sample.eval_num_steps", "sampler.val_num_steps", targets=_ONLY_FLOW),
    Rule("sample.guidance_scale", "sampler.guidance_scale", targets=_ONLY_FLOW),
    Rule("sample.noise_level", "sampler.noise_level", targets=_ONLY_FLOW),
    Rule("sample.num_image_per_prompt", "sampler.n", targets=_ONLY_FLOW),
    Rule("sample.sde_window_size", "sampler.sde_steps", skip=(0,), note="0 is an SDE on every "
         "step, lmrl's default (sampler.sde_steps=null)", targets=_ONLY_FLOW),
    Rule("sample.sde_window_range", "sampler.sde_window_range", targets=_ONLY_FLOW),
    Rule("train.learning_rate", "actor.optim.lr", targets=_ONLY_FLOW),
    Rule("train.adam_weight_decay", "actor.optim.weight_decay", targets=_ONLY_FLOW),
    Rule("train.clip_range", "actor.clip_range", targets=_ONLY_FLOW),
    Rule("train.clip_range_lt", "actor.clip_range_low", targets=_ONLY_FLOW),
    Rule("train.clip_range_gt", "actor.clip_range_high", targets=_ONLY_FLOW),
    Rule("train.adv_clip_max", "actor.adv_clip_max", targets=_ONLY_FLOW),
    Rule("train.beta", "actor.beta", targets=_ONLY_FLOW),
    Rule("train.timestep_fraction", "sampler.timestep_fraction", targets=_ONLY_FLOW),
    Rule("train.max_grad_norm", "actor.max_grad_norm", targets=_ONLY_FLOW),
    Rule("train.num_inner_epochs", "actor.ppo_epochs", targets=_ONLY_FLOW),
    Rule("train.ema", "actor.ema", targets=_ONLY_FLOW),
    Rule("num_epochs", "trainer.total_training_steps", targets=_ONLY_FLOW),
    Rule("eval_freq", "trainer.test_freq", targets=_ONLY_FLOW),
    Rule("run_name", "trainer.experiment_name", targets=_ONLY_FLOW),
    Rule("pretrained.model", "model.path", targets=_ONLY_FLOW),
    Rule("dataset", "data.train_files", also=("data.val_files",), targets=_ONLY_FLOW),
    Rule("pretrained.revision", None, _FLOW_LOCAL, only=("main", None), targets=_ONLY_FLOW),
    Rule("resolution", "model.resolution", targets=_ONLY_FLOW),
    Rule("use_lora", None, "full fine-tuning is model.lora_rank=0 (the default)",
         when_true=("model.lora_rank", 32), targets=_ONLY_FLOW),
    Rule("train.lora_path", "model.lora_path", targets=_ONLY_FLOW),
    Rule("seed", "trainer.seed", targets=_ONLY_FLOW),
    Rule("save_freq", "trainer.save_freq", targets=_ONLY_FLOW),
    Rule("num_checkpoint_limit", "trainer.max_ckpt_to_keep", targets=_ONLY_FLOW),
    Rule("resume_from", "trainer.resume_mode", skip=(None, ""), note="a fresh start",
         targets=_ONLY_FLOW),
    Rule("mixed_precision", "model.mixed_precision.param_dtype", targets=_ONLY_FLOW,
         values=(("no", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"))),
    Rule("train.adam_beta1", "actor.optim.betas", index=0, targets=_ONLY_FLOW),
    Rule("train.adam_beta2", "actor.optim.betas", index=1, targets=_ONLY_FLOW),
    Rule("train.adam_epsilon", None, "AdamW's eps is torch's 1e-8", only=(1e-8,),
         targets=_ONLY_FLOW),
    Rule("train.batch_size", "actor.micro_batch_size", targets=_ONLY_FLOW),
    Rule("train.gradient_accumulation_steps", None, _FLOW_BATCH, targets=_ONLY_FLOW),
    Rule("sample.train_batch_size", None, _FLOW_BATCH, targets=_ONLY_FLOW),
    Rule("sample.test_batch_size", None, _FLOW_BATCH, targets=_ONLY_FLOW),
    Rule("sample.num_batches_per_epoch", None, _FLOW_BATCH, targets=_ONLY_FLOW),
    Rule("sample.global_std", "actor.global_std", targets=_ONLY_FLOW),
    Rule("per_prompt_stat_tracking", None, "the advantage is always normalized within each "
         "prompt's images", only=(True,), targets=_ONLY_FLOW),
    Rule("sample.eval_guidance_scale", None, "validation guides with sampler.guidance_scale",
         targets=_ONLY_FLOW),
    Rule("train.cfg", None, "the update guides as the sampler does (sampler.guidance_scale)",
         only=(True,), targets=_ONLY_FLOW),
    Rule("sample.same_latent", None, "each image of a prompt starts from its own noise",
         only=(False,), targets=_ONLY_FLOW),
    Rule("train.use_8bit_adam", None, "AdamW is torch's", only=(False,), targets=_ONLY_FLOW),
    Rule("allow_tf32", None, _FLOW_LOCAL, targets=_ONLY_FLOW),
    Rule("debug", None, _FLOW_LOCAL, targets=_ONLY_FLOW),
    Rule("train.timestep_shift", None, "BAGEL's schedule shift; lmrl's is sampler.shift",
         targets=_ONLY_FLOW),
    Rule("prompt_fn", None, "the prompts are data.train_files' (or dataset's)", targets=_ONLY_FLOW),
    Rule("prompt_fn_kwargs.*", None, "the prompts are data.train_files' (or dataset's)",
         targets=_ONLY_FLOW),
    Rule("reward_fn.*", None, _FLOW_REWARD, only=(None,), targets=_ONLY_FLOW),
    Rule("save_dir", "trainer.default_local_dir", skip=("",), note="the run directory stays "
         "trainer.default_local_dir", targets=_ONLY_FLOW),
    Rule("logdir", None, "the run directory is trainer.default_local_dir", targets=_ONLY_FLOW),
    Rule("activation_checkpointing", None, _FLOW_LOCAL, only=(False,), targets=_ONLY_FLOW),
    Rule("fsdp_optimizer_offload", None, _FLOW_LOCAL, only=(False,), targets=_ONLY_FLOW),
)  # fmt: skip
