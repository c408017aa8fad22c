"""verl compatibility: the translation table, verl command lines and verl-layout YAML files."""

from __future__ import annotations

import dataclasses
import importlib.util
import textwrap

import pytest

from lmrl.config import Config, ConfigError, load_config
from lmrl.config.fields import schema
from lmrl.config.flow import FlowConfig
from lmrl.config.sft import SFT_CONFIG, SFTConfig, load_sft_config
from lmrl.config.verl import FLOW, SFT, TARGETS, TRAIN, VERL_RULES, rules_for, translate

BASE = ["model.path=/models/tiny", "data.train_files=/tmp/x.parquet"]


@pytest.mark.parametrize(
    ("target", "root"), [(TRAIN, Config), (SFT, SFTConfig), (FLOW, FlowConfig)]
)
def test_every_rule_of_the_table_lands_on_a_schema_key(target, root):
    spec = schema(root)
    rules = rules_for(target)
    assert rules and all(target in r.targets for r in rules)
    assert len({r.verl for r in rules}) == len(rules)  # one rule per key and target

    def tr(key, value):
        return translate(key, value, target)

    for rule in rules:
        key = rule.verl.replace("*.", "some.").replace(".*", ".leaf")
        if rule.ours is None:
            if rule.when_true is not None:  # a verl switch: true sets our key, false is a notice
                assert tr(key, True).path in spec, rule
                value = False
            else:
                value = rule.only[0] if rule.only else True
            out = tr(key, value)
            assert out.path is None and out.error is None and out.notice, rule
            continue
        if rule.ours.endswith(".*"):
            section = rule.ours[:-2]
            if spec[section].items is not None:  # the options of one mapping key
                name = dataclasses.fields(spec[section].items)[0].name
                assert tr(rule.verl[:-1] + name, 1).path == f"{section}.{name}", rule
                continue
            assert spec[section].section, rule
            leaf = next(p for p in spec if p.startswith(section + ".") and not spec[p].section)
            verl_key = rule.verl[:-1] + leaf[len(section) + 1 :]
            assert tr(verl_key, 1).path == leaf, rule
        else:
            accepted = [v for v in ("x", "http://x") if not rule.accepts or not rule.accepts(v)]
            value = True if rule.flag or rule.count else accepted[0]
            if rule.values:  # spelled otherwise here: one of theirs
                value = rule.values[0][0]
            path = tr(rule.verl, value).path
            holder, name = path.rsplit(".", 1)
            if path not in spec:  # one option of a mapping key (rollout.vllm.enforce_eager)
                assert spec[holder].items is not None, rule
                assert name in {f.name for f in dataclasses.fields(spec[holder].items)}, rule
            else:
                assert not spec[path].section, rule


def test_the_table_is_one_for_every_schema():
    """RL, SFT and Flow-GRPO keys are rows of one table, matched by one matcher per target; a
    row can serve several, and the same verl key can mean different things to each schema."""
    assert {t for r in VERL_RULES for t in r.targets} == set(TARGETS)
    assert set(rules_for(TRAIN)) | set(rules_for(SFT)) | set(rules_for(FLOW)) == set(VERL_RULES)
    assert translate("train.clip_range", 1e-4, FLOW).path == "actor.clip_range"
    assert translate("train.clip_range", 1e-4).path == "train.clip_range"  # unknown to Config
    shared = [r.verl for r in rules_for(TRAIN) if r in rules_for(SFT)]
    assert "hydra.*" in shared and "model.use_liger" in shared
    # an SFT key of verl's sft_trainer.yaml: translated for SFT only
    assert translate("optim.clip_grad", 0.5, SFT).path == "optim.grad_clip"
    assert translate("optim.clip_grad", 0.5).path == "optim.clip_grad"  # unknown to Config
    assert translate("model.partial_pretrain", "/m", SFT).path == "model.path"
    assert translate("trainer.n_gpus_per_node", 8).path == "resources.n_gpus_per_node"
    assert translate("trainer.n_gpus_per_node", 8, SFT).notice
    # the SFT loader uses the same function
    assert SFT_CONFIG.translate("optim.clip_grad", 0.5) == translate("optim.clip_grad", 0.5, SFT)
    assert load_sft_config(None, ["optim.clip_grad=0.5", *BASE]).optim.grad_clip == 0.5
    with pytest.raises(ValueError, match="unknown translation target 'ppo'"):
        translate("x", 1, "ppo")


# verl key, value as typed, our key, the value it must have
TRANSLATIONS = [
    ("actor_rollout_ref.model.path", "/m/qwen", "model.path", "/m/qwen"),
    (
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "false",
        "model.enable_gradient_checkpointing",
        False,
    ),
    ("actor_rollout_ref.model.trust_remote_code", "true", "model.trust_remote_code", True),
    ("actor_rollout_ref.model.lora_rank", "8", "model.lora_rank", 8),
    ("actor_rollout_ref.model.lora_alpha", "32", "model.lora_alpha", 32),
    (
        "actor_rollout_ref.model.target_modules",
        "[q_proj,v_proj]",
        "model.target_modules",
        ["q_proj", "v_proj"],
    ),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", "64", "actor.ppo_mini_batch_size", 64),
    ("actor_rollout_ref.actor.ppo_micro_batch_size", "4", "actor.ppo_micro_batch_size", 4),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "4", "actor.ppo_micro_batch_size", 4),
    ("actor_rollout_ref.actor.ppo_epochs", "2", "actor.ppo_epochs", 2),
    ("actor_rollout_ref.actor.shuffle", "true", "actor.shuffle", True),
    ("actor_rollout_ref.actor.clip_ratio", "0.2", "actor.clip_ratio", 0.2),
    ("actor_rollout_ref.actor.clip_ratio_low", "0.2", "actor.clip_ratio_low", 0.2),
    ("actor_rollout_ref.actor.clip_ratio_high", "0.28", "actor.clip_ratio_high", 0.28),
    ("actor_rollout_ref.actor.clip_ratio_c", "10.0", "actor.clip_ratio_c", 10.0),
    (
        "actor_rollout_ref.actor.loss_agg_mode",
        "seq-mean-token-sum-norm",
        "actor.loss_agg_mode",
        "seq-mean-token-sum-norm",
    ),
    (
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        "gspo",
        "actor.policy_loss.loss_mode",
        "gspo",
    ),
    ("actor_rollout_ref.actor.policy_loss.tau_neg", "1.1", "actor.policy_loss.tau_neg", 1.1),
    ("actor_rollout_ref.actor.entropy_coeff", "0.001", "actor.entropy_coeff", 0.001),
    ("actor_rollout_ref.actor.use_kl_loss", "True", "actor.use_kl_loss", True),
    ("actor_rollout_ref.actor.kl_loss_coef", "0.01", "actor.kl_loss_coef", 0.01),
    ("actor_rollout_ref.actor.kl_loss_type", "k3", "actor.kl_loss_type", "k3"),
    ("actor_rollout_ref.actor.optim.lr", "1e-6", "actor.optim.lr", 1e-6),
    (
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
        "0.285",
        "actor.optim.lr_warmup_steps_ratio",
        0.285,
    ),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps", "10", "actor.optim.lr_warmup_steps", 10),
    ("actor_rollout_ref.actor.optim.warmup_style", "cosine", "actor.optim.lr_scheduler", "cosine"),
    (
        "actor_rollout_ref.actor.optim.lr_scheduler_type",
        "cosine",
        "actor.optim.lr_scheduler",
        "cosine",
    ),
    ("actor_rollout_ref.actor.optim.min_lr_ratio", "0.1", "actor.optim.min_lr_ratio", 0.1),
    ("actor_rollout_ref.actor.optim.weight_decay", "0.1", "actor.optim.weight_decay", 0.1),
    ("actor_rollout_ref.actor.optim.betas", "[0.9,0.95]", "actor.optim.betas", [0.9, 0.95]),
    ("actor_rollout_ref.actor.optim.clip_grad", "0.5", "actor.grad_clip", 0.5),
    ("actor_rollout_ref.actor.grad_clip", "0.5", "actor.grad_clip", 0.5),
    ("actor_rollout_ref.rollout.name", "vllm", "rollout.name", "vllm"),
    ("actor_rollout_ref.rollout.n", "5", "rollout.n", 5),
    ("actor_rollout_ref.rollout.temperature", "0.7", "rollout.temperature", 0.7),
    ("actor_rollout_ref.rollout.top_p", "0.9", "rollout.top_p", 0.9),
    ("actor_rollout_ref.rollout.top_k", "50", "rollout.top_k", 50),
    ("actor_rollout_ref.rollout.do_sample", "true", "rollout.do_sample", True),
    (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size",
        "16",
        "rollout.log_prob_micro_batch_size",
        16,
    ),
    (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "16",
        "rollout.log_prob_micro_batch_size",
        16,
    ),
    ("actor_rollout_ref.rollout.val_kwargs.n", "4", "rollout.val_kwargs.n", 4),
    (
        "actor_rollout_ref.rollout.val_kwargs.temperature",
        "0.6",
        "rollout.val_kwargs.temperature",
        0.6,
    ),
    ("actor_rollout_ref.rollout.val_kwargs.top_p", "0.7", "rollout.val_kwargs.top_p", 0.7),
    (
        "actor_rollout_ref.rollout.val_kwargs.do_sample",
        "true",
        "rollout.val_kwargs.do_sample",
        True,
    ),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size", "16", "ref.log_prob_micro_batch_size", 16),
    (
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "16",
        "ref.log_prob_micro_batch_size",
        16,
    ),
    ("critic.model.path", "/m/critic", "critic.model.path", "/m/critic"),
    ("critic.ppo_micro_batch_size_per_gpu", "4", "critic.ppo_micro_batch_size", 4),
    ("critic.optim.lr", "5e-6", "critic.optim.lr", 5e-6),
    ("critic.optim.warmup_style", "cosine", "critic.optim.lr_scheduler", "cosine"),
    ("critic.cliprange_value", "0.2", "critic.cliprange_value", 0.2),
    ("critic.enable", "true", "critic.enable", True),
    ("data.max_prompt_length", "1024", "data.max_prompt_length", 1024),
    ("data.filter_overlong_prompts", "True", "data.filter_overlong_prompts", True),
    ("data.truncation", "left", "data.truncation", "left"),
    ("algorithm.gamma", "0.99", "algorithm.gamma", 0.99),
    ("algorithm.lam", "0.95", "algorithm.lam", 0.95),
    ("algorithm.norm_adv_by_std_in_grpo", "False", "algorithm.norm_adv_by_std_in_grpo", False),
    ("algorithm.use_kl_in_reward", "true", "algorithm.use_kl_in_reward", True),
    ("algorithm.kl_penalty", "low_var_kl", "algorithm.kl_penalty", "low_var_kl"),
    ("algorithm.kl_ctrl.type", "adaptive", "algorithm.kl_ctrl.type", "adaptive"),
    ("algorithm.kl_ctrl.kl_coef", "0.002", "algorithm.kl_ctrl.kl_coef", 0.002),
    ("algorithm.kl_ctrl.target_kl", "0.01", "algorithm.kl_ctrl.target_kl", 0.01),
    ("algorithm.kl_ctrl.horizon", "5000", "algorithm.kl_ctrl.horizon", 5000),
    ("algorithm.filter_groups.metric", "acc", "algorithm.filter_groups.metric", "acc"),
    (
        "algorithm.filter_groups.max_num_gen_batches",
        "4",
        "algorithm.filter_groups.max_num_gen_batches",
        4,
    ),
    ("algorithm.rollout_is", "true", "rollout.log_prob_mode", "rollout_correction"),
    ("algorithm.rollout_is_level", "geometric", "rollout.correction.level", "geometric"),
    ("algorithm.rollout_is_mode", "mask", "rollout.correction.mode", "mask"),
    ("algorithm.rollout_is_threshold", "5.0", "rollout.correction.threshold", 5.0),
    ("algorithm.rollout_is_threshold_lower", "0.5", "rollout.correction.threshold_lower", 0.5),
    ("algorithm.rollout_correction.bypass_mode", "true", "rollout.log_prob_mode", "bypass"),
    ("reward_model.reward_manager", "batch", "reward.manager", "batch"),
    (
        "custom_reward_function.path",
        "/r/score.py",
        "reward.custom_reward_function.path",
        "/r/score.py",
    ),
    ("custom_reward_function.name", "my_score", "reward.custom_reward_function.name", "my_score"),
    (
        "reward_model.overlong_buffer.penalty_factor",
        "0.5",
        "reward.overlong_buffer.penalty_factor",
        0.5,
    ),
    ("trainer.n_gpus_per_node", "8", "resources.n_gpus_per_node", 8),
    ("trainer.nnodes", "2", "resources.nnodes", 2),
    ("ray_init.num_cpus", "4", "resources.num_cpus", 4),
    ("trainer.total_epochs", "3", "trainer.total_epochs", 3),
    ("trainer.total_training_steps", "100", "trainer.total_training_steps", 100),
    ("trainer.project_name", "gsm8k", "trainer.project_name", "gsm8k"),
    ("trainer.experiment_name", "ppo", "trainer.experiment_name", "ppo"),
    ("trainer.logger", "['console','wandb']", "trainer.logger", ["console", "wandb"]),
    ("trainer.save_freq", "10", "trainer.save_freq", 10),
    ("trainer.test_freq", "5", "trainer.test_freq", 5),
    ("trainer.val_before_train", "False", "trainer.val_before_train", False),
    ("trainer.critic_warmup", "2", "trainer.critic_warmup", 2),
    ("trainer.default_local_dir", "/runs/a", "trainer.default_local_dir", "/runs/a"),
    ("trainer.resume_mode", "disable", "trainer.resume_mode", "disable"),
    ("trainer.resume_from_path", "/runs/a/step_10", "trainer.resume_mode", "/runs/a/step_10"),
    ("trainer.max_actor_ckpt_to_keep", "2", "trainer.max_ckpt_to_keep", 2),
    ("trainer.device", "cuda", "trainer.device", "cuda"),
    ("actor_rollout_ref.rollout.ignore_eos", "True", "rollout.ignore_eos", True),
]


# keys that need a companion setting to form a valid config
COMPANIONS = {
    "actor_rollout_ref.rollout.val_kwargs.do_sample": ["rollout.val_kwargs.temperature=1"]
}


@pytest.mark.parametrize(("verl_key", "text", "ours", "expected"), TRANSLATIONS)
def test_verl_key_maps(verl_key, text, ours, expected, monkeypatch):
    if expected == "vllm":  # the translation is under test, not whether vllm is installed
        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a: object() if name == "vllm" else real(name, *a),
        )
    overrides = [*BASE, *COMPANIONS.get(verl_key, []), f"{verl_key}={text}"]
    cfg = load_config(None, overrides, required=())
    value = cfg
    for seg in ours.split("."):  # through the options of a mapping key (rollout.correction)
        value = value[seg] if isinstance(value, dict) else getattr(value, seg)
    assert value == expected
    assert type(value) is type(expected)


def test_both_layouts_work_for_the_same_key():
    verl = load_config(None, [*BASE, "actor_rollout_ref.actor.clip_ratio=0.15"])
    ours = load_config(None, [*BASE, "actor.clip_ratio=0.15"])
    assert verl == ours and ours.actor.clip_ratio == 0.15


def test_resume_path_mode():
    notices: list[str] = []
    cfg = load_config(
        None,
        [*BASE, "trainer.resume_mode=resume_path", "trainer.resume_from_path=/runs/ckpt"],
        notices=notices,
    )
    assert cfg.trainer.resume_mode == "/runs/ckpt"
    assert any(n.startswith("trainer.resume_mode='resume_path'") for n in notices)


# seed 002 §5.3, the PPO example, with local paths in place of the hub model and ~/data
SEED_002_PPO = [
    "data.train_files=/tmp/gsm8k/train.parquet",
    "data.val_files=/tmp/gsm8k/test.parquet",
    "data.train_batch_size=256",
    "actor_rollout_ref.model.path=/tmp/models/tiny-qwen2",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.clip_ratio=0.2",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "critic.model.path=/tmp/models/tiny-qwen2",
    "critic.ppo_epochs=2",
    "critic.ppo_mini_batch_size=64",
    "critic.optim.lr=5e-6",
    "algorithm.adv_estimator=gae",
    "algorithm.gamma=0.99",
    "algorithm.lam=0.95",
    "trainer.total_epochs=3",
    "trainer.n_gpus_per_node=8",
]


def test_seed_002_ppo_command_line():
    notices: list[str] = []
    cfg = load_config(None, SEED_002_PPO, notices=notices)
    assert cfg.data.train_files == "/tmp/gsm8k/train.parquet"
    assert cfg.data.val_files == "/tmp/gsm8k/test.parquet"
    assert cfg.data.train_batch_size == 256
    assert cfg.model.path == "/tmp/models/tiny-qwen2"
    assert cfg.actor.ppo_epochs == 2 and cfg.actor.ppo_mini_batch_size == 64
    assert cfg.actor.clip_ratio == 0.2 and cfg.actor.optim.lr == 1e-6
    assert cfg.critic.model.path == "/tmp/models/tiny-qwen2"
    assert cfg.critic.ppo_epochs == 2 and cfg.critic.ppo_mini_batch_size == 64
    assert cfg.critic.optim.lr == 5e-6
    assert cfg.critic.enable is True  # gae
    assert cfg.algorithm.adv_estimator == "gae"
    assert (cfg.algorithm.gamma, cfg.algorithm.lam) == (0.99, 0.95)
    assert cfg.trainer.total_epochs == 3
    assert cfg.resources.n_gpus_per_node == 8
    # 8 GPUs place Ray workers only: the local backend says so instead of ignoring it
    assert any("n_gpus_per_node = 8" in n for n in notices)


GPU_ONLY = [
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.rollout.max_num_seqs=64",
    "actor_rollout_ref.rollout.enable_chunked_prefill=True",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "critic.ppo_max_token_len_per_gpu=32768",
    "trainer.balance_batch=True",
]


def test_strategy_and_offload_keys_map_to_the_ray_workers():
    cfg = load_config(None, [*BASE,
        "actor_rollout_ref.actor.strategy=fsdp",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
        "critic.strategy=fsdp2",
        "critic.model.fsdp_config.param_offload=True",
    ])  # fmt: skip
    assert cfg.actor.strategy == "fsdp" and cfg.critic.strategy == "fsdp2"
    assert (cfg.actor.offload, cfg.critic.offload) == ("both", "params")


def test_vllm_engine_keys_map_to_the_rollout_section():
    cfg = load_config(None, [*BASE,
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.enforce_eager=False",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.max_num_batched_tokens=8192",
        "actor_rollout_ref.rollout.max_model_len=4096",
        "actor_rollout_ref.rollout.dtype=bfloat16",
    ])  # fmt: skip
    assert cfg.rollout.vllm == {
        "gpu_memory_utilization": 0.6, "tensor_model_parallel_size": 2,
        "max_num_batched_tokens": 8192, "max_model_len": 4096, "enforce_eager": False,
        "free_cache_engine": False, "dtype": None,
    }  # fmt: skip
    assert cfg.rollout.dtype == "bfloat16"  # the engine's dtype, hf's and vllm's alike


@pytest.mark.parametrize(
    ("override", "applies"),
    [
        ("critic.model.enable_gradient_checkpointing=False", "model.enable_gradient_checkpointing"),
        ("critic.forward_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size"),
        ("critic.forward_micro_batch_size=8", "critic.ppo_micro_batch_size"),
    ],
)
def test_verl_keys_folded_into_another_give_a_notice_naming_it(override, applies):
    notices: list[str] = []
    assert load_config(None, [*BASE, override], notices=notices) == load_config(None, BASE)
    (notice,) = notices
    assert notice.startswith(override.split("=")[0]) and applies in notice


def test_gpu_only_keys_give_one_notice_each_and_change_nothing():
    notices: list[str] = []
    cfg = load_config(None, [*BASE, *GPU_ONLY], notices=notices)
    assert cfg == load_config(None, BASE)
    assert len(notices) == len(GPU_ONLY)
    for override, notice in zip(GPU_ONLY, notices, strict=True):
        assert notice.startswith(override.split("=")[0] + "=")
        assert "changes nothing in lmrl" in notice and "\n" not in notice


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("reward_model.enable=True", "needs reward_model.model.path"),
        ("algorithm.no_think_rl=true", "no-think ablation"),
        ("algorithm.use_pf_ppo=true", "PF-PPO"),
        ("trainer.val_only=true", "lmrl eval"),
        ("algorithm.rollout_is=maybe", "expected true or false"),
    ],
)
def test_verl_switches_lmrl_cannot_honour_are_errors(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, override])
    assert message in str(err.value)
    assert override.split("=")[0] in str(err.value)


VERL_YAML = """
# a run file in verl's nesting, the way verl dumps it
data:
  tokenizer: null
  train_files: /data/gsm8k/train.parquet
  val_files: [/data/gsm8k/test.parquet, /data/math/test.parquet]
  train_batch_size: 32
  max_prompt_length: 256
  max_response_length: 128
  dataloader_num_workers: 8
actor_rollout_ref:
  hybrid_engine: true
  model:
    path: /models/tiny
    use_remove_padding: true
    enable_gradient_checkpointing: false
  actor:
    _target_: verl.workers.config.FSDPActorConfig
    strategy: fsdp
    ppo_mini_batch_size: 8
    ppo_micro_batch_size_per_gpu: 4
    clip_ratio_low: 0.2
    clip_ratio_high: 0.28
    loss_agg_mode: token-mean
    use_kl_loss: true
    kl_loss_type: low_var_kl
    policy_loss:
      loss_mode: vanilla
      clip_cov_ratio: 0.0002
    optim:
      lr: 1.0e-06
      warmup_style: constant
      total_training_steps: -1
    fsdp_config:
      param_offload: false
      wrap_policy:
        min_num_params: 0
  rollout:
    name: hf
    n: 4
    gpu_memory_utilization: 0.5
    log_prob_micro_batch_size_per_gpu: 16
    val_kwargs:
      n: 2
      do_sample: true
      temperature: 0.6
  ref:
    log_prob_micro_batch_size_per_gpu: ${actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu}
    fsdp_config:
      param_offload: true
critic:
  ppo_mini_batch_size: ${actor_rollout_ref.actor.ppo_mini_batch_size}
reward_model:
  enable: false
  reward_manager: dapo
  overlong_buffer:
    enable: true
    len: 32
    penalty_factor: 1.0
custom_reward_function:
  path: null
  name: compute_score
algorithm:
  adv_estimator: grpo
  norm_adv_by_std_in_grpo: false
  filter_groups:
    enable: true
    metric: acc
    max_num_gen_batches: 5
trainer:
  logger: [console, tensorboard]
  n_gpus_per_node: 1
  total_epochs: 2
  save_freq: 5
  max_actor_ckpt_to_keep: 3
"""


def test_verl_layout_yaml_file(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(textwrap.dedent(VERL_YAML))
    notices: list[str] = []
    cfg = load_config(path, ["actor_rollout_ref.rollout.n=8"], notices=notices)
    assert cfg.data.val_files == ["/data/gsm8k/test.parquet", "/data/math/test.parquet"]
    assert (cfg.data.train_batch_size, cfg.data.max_response_length) == (32, 128)
    assert cfg.model.path == "/models/tiny" and cfg.model.enable_gradient_checkpointing is False
    assert (cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size) == (8, 4)
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.28)
    assert cfg.actor.use_kl_loss is True and cfg.actor.optim.lr == 1e-6
    assert cfg.actor.optim.lr_scheduler == "constant"
    assert cfg.rollout.n == 8  # the override wins over the file's 4
    assert cfg.rollout.val_kwargs.n == 2 and cfg.rollout.val_kwargs.temperature == 0.6
    assert cfg.rollout.log_prob_micro_batch_size == 16
    assert cfg.ref.log_prob_micro_batch_size == 16  # through the interpolation
    assert cfg.critic.ppo_mini_batch_size == 8 and cfg.critic.enable is False
    assert cfg.reward.manager == "dapo" and cfg.reward.overlong_buffer["len"] == 32
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert cfg.algorithm.filter_groups["enable"] is True
    assert cfg.algorithm.filter_groups["metric"] == "acc"
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert cfg.trainer.max_ckpt_to_keep == 3 and cfg.resources.n_gpus_per_node == 1
    assert cfg.actor.strategy == "fsdp" and cfg.actor.offload == "none"
    assert cfg.actor.policy_loss["clip_cov_ratio"] == 0.0002  # clip_cov's, carried over
    noticed = {n.split("=")[0] for n in notices}
    assert {
        "data.tokenizer",
        "data.dataloader_num_workers",
        "actor_rollout_ref.hybrid_engine",
        "actor_rollout_ref.model.use_remove_padding",
        "actor_rollout_ref.actor._target_",
        "actor_rollout_ref.actor.optim.total_training_steps",
        "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params",
        "actor_rollout_ref.ref.fsdp_config.param_offload",
        # inert under trainer.backend=local (issue 31 §4); the file's param_offload: false
        # and gpu_memory_utilization: 0.5 are the defaults, so they are not noticed
        "actor_rollout_ref.actor.strategy",
    } == noticed
    assert all(f"in {path}" in n for n in notices)


def test_a_key_set_twice_in_one_file_is_an_error(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("actor: {clip_ratio: 0.1}\nactor_rollout_ref: {actor: {clip_ratio: 0.3}}\n")
    with pytest.raises(ConfigError, match=r"actor\.clip_ratio is set twice"):
        load_config(path, BASE)
