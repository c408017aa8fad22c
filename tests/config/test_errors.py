"""Bad input fails before any model loads, with one message per problem naming key and fix."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from lmrl.algos.registry import Registry
from lmrl.config import Config, ConfigError, load_config, validate_config

BASE = ["model.path=/models/tiny", "data.train_files=/tmp/x.parquet"]
SMALL = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=4"]


def errors_of(overrides, config_file=None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(config_file, [*BASE, *overrides])
    assert isinstance(err.value, ValueError)
    return str(err.value)


# overrides, substrings the message must contain (the key first)
CASES = [
    # wrong types
    (["actor.clip_ratio=abc"], ["actor.clip_ratio", "expected a number, got 'abc'"]),
    (
        ["actor_rollout_ref.actor.clip_ratio=abc"],
        ["actor_rollout_ref.actor.clip_ratio", "(lmrl key 'actor.clip_ratio')", "a number"],
    ),
    (["actor.ppo_epochs=1.5"], ["actor.ppo_epochs", "expected an integer, got 1.5"]),
    (["trainer.total_epochs=true"], ["trainer.total_epochs", "expected an integer, got True"]),
    (["actor.use_kl_loss=3"], ["actor.use_kl_loss", "expected true or false"]),
    (["rollout.name=vlm"], ["rollout.name", "one of hf, vllm", "did you mean 'vllm'?"]),
    (["trainer.logger=[console,swanlab]"], ["trainer.logger", "item 'swanlab' is not one of"]),
    (["data.truncation=middle"], ["data.truncation", "one of error, left, right"]),
    (["model.path=null"], ["model.path is not set", "actor_rollout_ref.model.path"]),
    (["actor=3"], ["actor is a section, not a value", "actor.ppo_mini_batch_size=..."]),
    # unknown keys, with did-you-mean
    (
        ["actor.clip_ration=0.2"],
        ["unknown key 'actor.clip_ration'", "did you mean 'actor.clip_ratio'?"],
    ),
    (
        ["actor_rollout_ref.actor.clip_ration=0.2"],
        ["unknown key 'actor_rollout_ref.actor.clip_ration'", "did you mean 'actor.clip_ratio'?"],
    ),
    (
        ["actor_rollout_ref.actr.clip_ratio=0.2"],
        ["did you mean 'actor_rollout_ref.actor.clip_ratio'?"],
    ),
    (["trainr.total_epochs=2"], ["unknown key 'trainr.total_epochs'", "'trainer.total_epochs'"]),
    (["ref.zzz=1"], ["unknown key 'ref.zzz'", "the keys of ref are: log_prob_micro_batch_size"]),
    (["qqq=1"], ["unknown key 'qqq'", "lmrl train --help"]),
    # malformed overrides
    (["clip_ratio"], ["override 'clip_ratio' is not key=value"]),
    (["~actor.clip_ratio"], ["deleting keys (~key) is not supported"]),
    (["actor..clip_ratio=1"], ["is not a dotted key"]),
    # registry names
    (
        ["algorithm.adv_estimator=grop"],
        ["algorithm.adv_estimator='grop'", "did you mean 'grpo'?", "valid names: gae"],
    ),
    (["actor.policy_loss.loss_mode=gsp"], ["actor.policy_loss.loss_mode='gsp'", "'gspo'"]),
    (["algorithm.kl_penalty=k4"], ["algorithm.kl_penalty='k4'", "KL estimator", "low_var_kl"]),
    (["actor.kl_loss_type=low_var"], ["actor.kl_loss_type='low_var'", "'low_var_kl'"]),
    (["actor.loss_agg_mode=token_mean"], ["actor.loss_agg_mode='token_mean'", "'token-mean'"]),
    (
        ["critic.loss_agg_mode=seq-mean"],
        ["critic.loss_agg_mode='seq-mean'", "valid modes: token-mean"],
    ),
    # batch sizes
    (
        ["data.train_batch_size=100", "actor.ppo_mini_batch_size=30"],
        [
            "data.train_batch_size * rollout.n = 100*1",
            "actor.ppo_mini_batch_size",
            "divisor of 100 (e.g. 25)",
        ],
    ),
    (
        [
            "data.train_batch_size=6",
            "actor.ppo_mini_batch_size=4",
            "rollout.n=4",
            "algorithm.adv_estimator=grpo",
        ],
        ["6*4 = 24 sequences", "4*4 = 16", "actor.ppo_mini_batch_size to a divisor of 6 (e.g. 3)"],
    ),
    (
        ["data.train_batch_size=16", "actor.ppo_mini_batch_size=32"],
        ["actor.ppo_mini_batch_size=32 is larger than data.train_batch_size=16"],
    ),
    (
        [*SMALL, "rollout.n=3", "actor.ppo_micro_batch_size=5", "algorithm.adv_estimator=rloo"],
        ["actor.ppo_micro_batch_size=5 does not divide the mini-batch of 12 sequences", "e.g. 4"],
    ),
    (
        [*SMALL, "critic.ppo_mini_batch_size=5"],
        ["critic.ppo_mini_batch_size", "divisor of 16 (e.g. 4)"],
    ),
    (
        [*SMALL, "trainer.backend=ray", "resources.n_gpus_per_node=3"],
        ["actor.ppo_mini_batch_size * rollout.n = 4 sequences", "3 workers"],
    ),
    (
        [
            *SMALL,
            "trainer.backend=ray",
            "resources.n_gpus_per_node=2",
            "actor.ppo_micro_batch_size=4",
        ],
        [
            "actor.ppo_micro_batch_size=4 does not divide the mini-batch of 2 sequences",
            "/ 2 workers",
        ],
    ),
    # single-key ranges
    (["actor.clip_ratio_c=1.0"], ["actor.clip_ratio_c=1.0 must be > 1.0", "e.g. 3.0"]),
    (["rollout.n=0"], ["rollout.n=0 must be >= 1"]),
    (["actor.ppo_micro_batch_size=0"], ["actor.ppo_micro_batch_size=0 must be >= 1"]),
    (["algorithm.gamma=1.5"], ["algorithm.gamma=1.5 must be in [0, 1]"]),
    (["rollout.top_p=0"], ["rollout.top_p=0.0 must be in (0, 1]"]),
    (
        ["rollout.temperature=0"],
        ["rollout.temperature=0.0 with rollout.do_sample=true", "do_sample=false"],
    ),
    (["actor.optim.betas=[0.9]"], ["actor.optim.betas=[0.9] must be two numbers"]),
    (["actor.optim.lr=nan"], ["actor.optim.lr=nan must be >= 0"]),
    # combinations
    (
        ["algorithm.adv_estimator=grpo"],
        ["algorithm.adv_estimator=grpo", "rollout.n=1 gives groups of one", "rollout.n >= 2"],
    ),
    (["algorithm.adv_estimator=grpo_vectorized"], ["rollout.n=1 gives groups of one"]),
    (
        ["algorithm.filter_groups.enable=true", "algorithm.adv_estimator=remax"],
        ["algorithm.filter_groups.enable=true with rollout.n=1"],
    ),
    (
        ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=null"],
        ["algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl > 0, got None"],
    ),
    (
        ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"],
        ["algorithm.kl_ctrl.horizon > 0, got 0"],
    ),
    (
        ["critic.enable=false"],
        ["algorithm.adv_estimator=gae needs a critic", "critic.enable=false", "such as grpo"],
    ),
    (
        ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=16"],
        ["reward.overlong_buffer.enable=true needs reward.manager=dapo"],
    ),
    (
        ["reward.manager=dapo", "reward.overlong_buffer.enable=true"],
        ["reward.overlong_buffer.len=0 must be in [1, data.max_response_length=512]"],
    ),
    (
        ["rollout.correction.threshold=2", "rollout.correction.threshold_lower=3"],
        ["rollout.correction.threshold_lower=3.0 must be in [0, rollout.correction.threshold=2.0]"],
    ),
    (
        ["rollout.name=vllm", "rollout.vllm.gpu_memory_utilization=1.5"],
        ["rollout.vllm.gpu_memory_utilization=1.5 must be in (0, 1]"],
    ),
    (
        ["rollout.name=vllm", "rollout.vllm.max_model_len=16"],
        ["rollout.vllm.max_model_len=16 is shorter than"],
    ),
]


@pytest.mark.parametrize(("overrides", "expected"), CASES)
def test_bad_input_message(overrides, expected):
    text = errors_of(overrides)
    for part in expected:
        assert part in text, f"{part!r} not in {text!r}"


def test_all_problems_are_reported_together():
    text = errors_of(["actor.clip_ratio=abc", "rollout.n=x", "actor.clip_ration=1"])
    assert text.startswith("3 config errors:")
    assert "actor.clip_ratio:" in text and "rollout.n:" in text and "actor.clip_ration" in text


def test_derived_critic_sizes_are_not_reported_twice():
    text = errors_of(["data.train_batch_size=100", "actor.ppo_mini_batch_size=30"])
    assert "critic.ppo_mini_batch_size" not in text and "config errors" not in text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("actor: [1, 2]\n", "actor is a section, not a value"),
        ("- a\n- b\n", "must hold a mapping of sections"),
        ("actor: {clip_ratio: [\n", "is not valid YAML"),
        ("critic: {ppo_mini_batch_size: '${actor.nope}'}\n", "cannot resolve an interpolation"),
        ("actor_rollout_ref:\n  rollout:\n    name: ???\n", "rollout.name') is ??? (a value verl"),
        # issue 31 §4: PyYAML keeps the last of two sections without a word
        (
            "actor:\n  clip_ratio: 0.3\ndata: {}\nactor:\n  ppo_epochs: 2\n",
            "'actor' is written twice (lines 1 and 4)",
        ),
        (
            "actor:\n  optim:\n    lr: 0.1\n    lr: 0.2\n",
            "'actor.optim.lr' is written twice (lines 3 and 4)",
        ),
    ],
)
def test_bad_files(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    message = errors_of([], config_file=path)
    assert expected in message
    assert str(path) in message


def test_missing_file(tmp_path):
    assert "does not exist" in errors_of([], config_file=tmp_path / "nope.yaml")


def test_errors_in_a_file_name_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    clip_ratio: abc\n")
    text = errors_of([], config_file=path)
    assert "actor_rollout_ref.actor.clip_ratio" in text and f"in {path}" in text


def test_validate_config_checks_configs_built_in_code():
    cfg = Config()
    cfg.model.path = "/m"
    cfg.actor.clip_ratio = "abc"
    with pytest.raises(ConfigError, match=r"actor.clip_ratio: expected a number, got 'abc'"):
        validate_config(cfg)
    cfg.actor.clip_ratio = 0.2
    cfg.rollout.n = 0
    with pytest.raises(ConfigError, match=r"rollout.n=0 must be >= 1"):
        validate_config(cfg)


def test_registry_checks_use_the_registries(monkeypatch):
    """The valid names come from lmrl.algos, not from a list in the config package."""
    fake = types.ModuleType("lmrl.algos.advantages")
    fake.advantage_estimators = Registry("advantage estimator")
    fake.advantage_estimators.register("plain")(lambda *a, **k: None)
    fake.advantage_estimators.register("valued", needs=("values",))(lambda *a, **k: None)
    fake.advantage_estimators.register("grouped", needs=("index",))(lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "lmrl.algos.advantages", fake)
    # what an estimator needs is read from its registry entry, not from its name
    assert load_config(None, [*BASE, "algorithm.adv_estimator=plain"]).critic.enable is False
    assert load_config(None, [*BASE, "algorithm.adv_estimator=valued"]).critic.enable is True
    assert "needs a critic" in errors_of(["algorithm.adv_estimator=valued", "critic.enable=false"])
    assert "groups of one" in errors_of(["algorithm.adv_estimator=grouped"])
    assert "valid names: grouped, plain, valued" in errors_of(["algorithm.adv_estimator=grpo"])


# ------------------------------------------------------------------ errors name what the user wrote
@pytest.mark.parametrize(
    ("overrides", "named", "not_named"),
    [
        (["data.train_batch_size=0"], "data.train_batch_size=0", "data.gen_batch_size"),
        (["actor.ppo_mini_batch_size=0"], "actor.ppo_mini_batch_size=0", "critic."),
        (["actor.ppo_epochs=0"], "actor.ppo_epochs=0", "critic."),
        (["actor.loss_agg_mode=bad"], "actor.loss_agg_mode='bad'", "critic."),
        (
            ["rollout.log_prob_micro_batch_size=0"],
            "rollout.log_prob_micro_batch_size=0",
            "ref.log_prob_micro_batch_size",
        ),
        (
            ["actor.ppo_mini_batch_size=0", "algorithm.adv_estimator=gae"],
            "actor.ppo_mini_batch_size=0",
            "critic.ppo_mini_batch_size",
        ),
    ],
)
def test_errors_name_only_the_keys_the_user_set(overrides, named, not_named):
    text = errors_of(overrides)
    assert named in text and not_named not in text
    assert "config errors" not in text  # one error: the derived copy is not listed again


def test_a_derived_key_the_user_set_is_named():
    text = errors_of(["actor.ppo_epochs=0", "critic.ppo_epochs=0"])
    assert "actor.ppo_epochs=0" in text and "critic.ppo_epochs=0" in text
    text = errors_of(["data.gen_batch_size=0"])
    assert "data.gen_batch_size=0 must be >= 1" in text


def test_a_resolved_config_still_names_every_key():
    from lmrl.config import resolve_config

    cfg = Config()
    cfg.model.path = "/m"
    cfg.data.train_batch_size = 0
    with pytest.raises(ConfigError) as err:
        validate_config(resolve_config(cfg))
    assert "data.gen_batch_size=0" in str(err.value)  # nothing left to say it was derived
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert "data.gen_batch_size" not in str(err.value)


# ------------------------------------------------------------------ refused at config time
def test_vllm_without_the_extra_is_a_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    text = errors_of(["rollout.name=vllm"])
    assert "rollout.name=vllm" in text and "needs vLLM, which is not installed" in text
    assert "rollout.name=hf" in text


def test_vllm_installed_passes_this_check(monkeypatch):
    real = importlib.util.find_spec
    found = object()
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: found if name == "vllm" else real(name, *a)
    )
    assert load_config(None, [*BASE, "rollout.name=vllm"]).rollout.name == "vllm"


def test_ray_backend_without_ray_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    text = errors_of(["trainer.backend=ray"])
    assert "trainer.backend=ray needs Ray" in text and "lmrl[ray]" in text


def test_ray_backend_is_accepted_with_ray_installed():
    pytest.importorskip("ray")
    cfg = load_config(None, [*BASE, "trainer.backend=ray", "resources.n_gpus_per_node=2"])
    assert cfg.trainer.backend == "ray" and cfg.resources.n_gpus_per_node == 2


# ------------------------------------------------------------------ keys that change nothing
@pytest.mark.parametrize(
    "key",
    ["actor.kl_loss_coef=0.01", "actor_rollout_ref.actor.kl_loss_coef=0.001"],
)
def test_kl_loss_coef_without_the_kl_loss_gets_a_notice(key, caplog):
    notices: list[str] = []
    load_config(None, [*BASE, key], notices=notices)
    assert len(notices) == 1
    assert notices[0].startswith(key)
    assert "changes nothing: actor.use_kl_loss=false" in notices[0]
    assert "set actor.use_kl_loss=true" in notices[0] and "(on the command line)" in notices[0]
    assert [r.getMessage() for r in caplog.records if r.name == "lmrl.config"] == notices


def test_kl_loss_coef_with_the_kl_loss_or_left_alone_gets_no_notice():
    notices: list[str] = []
    load_config(None, [*BASE, "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01"], notices=notices)
    load_config(None, BASE, notices=notices)  # the default coefficient, never written
    assert notices == []


def test_kl_in_reward_keys_without_kl_in_reward_get_a_notice(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  kl_ctrl:\n    kl_coef: 0.05\n")
    notices: list[str] = []
    load_config(path, BASE, notices=notices)
    assert len(notices) == 1 and notices[0].startswith("algorithm.kl_ctrl.kl_coef=0.05")
    assert "algorithm.use_kl_in_reward=false" in notices[0] and f"in {path}" in notices[0]


def test_a_notice_is_given_even_when_the_config_has_errors(caplog):
    with pytest.raises(ConfigError):
        load_config(None, [*BASE, "actor.kl_loss_coef=0.01", "rollout.n=0"])
    assert any("kl_loss_coef" in r.getMessage() for r in caplog.records)
