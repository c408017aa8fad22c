"""The schema: verl's defaults, documented fields, resolution of "same as X" defaults, help."""

from __future__ import annotations

import dataclasses

import pytest

from lmrl.config import Config, format_help, load_config, resolve_config, validate_config
from lmrl.config.fields import get_path, leaf_paths, schema
from lmrl.config.flow import FlowConfig
from lmrl.config.sft import SFTConfig


def test_defaults_are_verls():
    cfg = Config()
    # data
    assert cfg.data.train_batch_size == 1024
    assert cfg.data.max_prompt_length == 512 and cfg.data.max_response_length == 512
    assert cfg.data.prompt_key == "prompt" and cfg.data.reward_fn_key == "data_source"
    assert cfg.data.truncation == "error" and cfg.data.shuffle is True
    # rollout
    assert cfg.rollout.n == 1 and cfg.rollout.temperature == 1.0 and cfg.rollout.top_k == -1
    assert cfg.rollout.log_prob_mode is None  # resolved: decoupled, rollout_correction if async
    assert resolve_config(cfg).rollout.log_prob_mode == "decoupled"
    assert (cfg.rollout.val_kwargs.temperature, cfg.rollout.val_kwargs.do_sample) == (0.0, False)
    # algorithm
    assert cfg.algorithm.adv_estimator == "gae"
    assert (cfg.algorithm.gamma, cfg.algorithm.lam) == (1.0, 1.0)
    assert cfg.algorithm.kl_penalty == "kl"
    kl = cfg.algorithm.kl_ctrl
    assert kl == {"type": "fixed", "kl_coef": 0.001, "target_kl": 0.1, "horizon": 10000}
    # actor
    a = cfg.actor
    assert (a.ppo_mini_batch_size, a.ppo_epochs, a.clip_ratio, a.clip_ratio_c) == (256, 1, 0.2, 3.0)
    assert a.loss_agg_mode == "token-mean" and a.policy_loss["loss_mode"] == "vanilla"
    assert (a.use_kl_loss, a.kl_loss_coef, a.kl_loss_type) == (False, 0.001, "low_var_kl")
    assert a.entropy_coeff == 0.0 and a.grad_clip == 1.0
    assert (a.optim.lr, a.optim.weight_decay, a.optim.lr_warmup_steps) == (1e-6, 0.01, -1)
    # critic
    assert cfg.critic.optim.lr == 1e-5 and cfg.critic.cliprange_value == 0.5
    assert cfg.model.lora_rank == 0 and cfg.model.lora_alpha == 16
    assert cfg.model.target_modules == "all-linear"
    assert cfg.trainer.resume_mode == "auto" and cfg.trainer.save_freq == -1


def test_instances_do_not_share_mutable_defaults():
    a, b = Config(), Config()
    a.trainer.logger.append("jsonl")
    a.actor.optim.betas[0] = 0.5
    a.reward.custom_reward_function.reward_kwargs["x"] = 1
    assert b.trainer.logger == ["console"]
    assert b.actor.optim.betas == [0.9, 0.999]
    assert b.reward.custom_reward_function.reward_kwargs == {}
    assert a.actor.optim is not a.critic.optim


def test_every_key_and_section_is_documented():
    spec = schema()
    tops = [p for p, s in spec.items() if s.section and "." not in p]
    want = ["data", "model", "rollout", "reward", "reward_model", "algorithm", "actor", "critic"]
    want += ["ref", "retriever"]
    assert tops == [*want, "trainer", "resources", "async_training"]
    for path, s in spec.items():
        assert len(s.help) > 5, f"{path} has no help text"


# The key budget of each command's config: a ceiling, never a floor. A capability that needs
# keys raises its ceiling by exactly those keys, in the same commit, with the reason here.
# lmrl train: the budget (176 keys before the folds of test_folds.py), + data.prompt_template
# (one rendering rule for plain-string prompts from SFT to RL), + data.mixture (training
# sources mixed by weight, schedule or quota), + data.curriculum (difficulty-aware sampling,
# one key of options)
RL_KEYS_CEILING = 163
# lmrl sft: its count when the budget was set, + data.prompt_template (the same rule as RL's),
# + data.val_split (validation held out of the training files), + reward.custom_reward_function
# (path, name, reward_kwargs: the RL run's score function scores SFT's greedy answers)
SFT_KEYS_CEILING = 51
# lmrl train-flow: its count when the budget was set, + trainer.max_rollbacks and
# trainer.rollback_lr_factor (the run doctor's rollback of a hacked reward, as lmrl train's)
FLOW_KEYS_CEILING = 65


@pytest.mark.parametrize(
    ("root", "ceiling"),
    [(Config, RL_KEYS_CEILING), (SFTConfig, SFT_KEYS_CEILING), (FlowConfig, FLOW_KEYS_CEILING)],
)
def test_each_config_stays_within_its_key_budget(root, ceiling):
    """A key holding options (``reward.overlap``) counts once: its options only matter
    together."""
    keys = leaf_paths(root)
    assert len(keys) <= ceiling, (
        f"{root.__name__} has {len(keys)} keys, over its ceiling of {ceiling}: fold keys that "
        "only matter together, or raise the ceiling by the keys a capability names"
    )


def test_resolve_fills_same_as_defaults_without_mutating():
    cfg = Config()
    cfg.model.path = "/models/tiny"
    cfg.actor.ppo_mini_batch_size = 32
    cfg.actor.ppo_epochs = 3
    cfg.rollout.log_prob_micro_batch_size = 8
    out = resolve_config(cfg)
    assert cfg.critic.enable is None and cfg.critic.model.path is None  # input untouched
    assert out.critic.enable is True  # gae needs values
    assert out.critic.model.path == "/models/tiny"
    assert (out.critic.ppo_mini_batch_size, out.critic.ppo_epochs) == (32, 3)
    assert out.critic.loss_agg_mode == "token-mean" and out.critic.shuffle is False
    assert out.ref.log_prob_micro_batch_size == 8
    assert out.data.seed == 42 and out.data.gen_batch_size == 1024
    assert out.trainer.default_local_dir == "checkpoints/lmrl/default"
    assert out.actor.clip_ratio_low is None  # the loss reads null as clip_ratio
    assert resolve_config(out) == out  # idempotent


def test_resolve_converts_types_and_expands_home(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    cfg = Config()
    cfg.actor.clip_ratio = "0.3"  # e.g. set from code with a string
    cfg.model.path = "~/models/m"
    cfg.data.train_files = ["~/a.parquet", "/b.parquet"]
    cfg.algorithm.adv_estimator = "grpo_vectorized"  # an alias of grpo
    cfg.rollout.n = 2
    out = validate_config(cfg)  # converted by the loader, the one place that converts
    assert out.actor.clip_ratio == 0.3
    assert out.model.path == "/home/someone/models/m"
    assert out.data.train_files == ["/home/someone/a.parquet", "/b.parquet"]
    assert out.critic.enable is False


def test_load_with_no_file_and_no_overrides_is_the_resolved_defaults():
    assert load_config(None, [], required=()) == resolve_config(Config())


def test_help_lists_every_key_with_default_and_doc():
    text = format_help()
    defaults = Config()
    for path, s in schema().items():
        assert path in text
        if not s.section:
            assert s.help.split()[0] in text
    assert "  actor.clip_ratio = 0.2  (float)" in text
    assert "  rollout.name = hf  (hf|vllm)" in text
    assert "  critic.optim.lr = 1e-05  (float)" in text  # the critic's own default
    assert get_path(defaults, "trainer.logger") == ["console"]
    assert "  trainer.logger = [console]" in text
    assert "actor_rollout_ref.actor.*" in text and "-> actor.*" in text
    assert text.endswith("\n")


def test_help_for_some_sections():
    text = format_help(["critic"])
    assert "critic.cliprange_value" in text and "actor.clip_ratio " not in text
    assert "actor_rollout_ref" not in text
    with pytest.raises(ValueError, match="unknown config section"):
        format_help(["critics"])


def test_config_is_a_plain_dataclass_tree():
    cfg = Config()
    assert dataclasses.is_dataclass(cfg.actor.optim)
    assert dataclasses.asdict(cfg)["actor"]["policy_loss"]["loss_mode"] == "vanilla"
