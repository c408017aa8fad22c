"""Every registry-valued key is checked at load: a wrong name is an error naming the key and
suggesting the right one; the built-in names the config package lists match their registries."""

from __future__ import annotations

import typing

import pytest
import torch

from lmrl.config import ConfigError, load_config, names
from lmrl.config.fields import schema
from lmrl.config.flow import load_flow_config

BASE = ["model.path=/models/tiny", "data.train_files=/tmp/x.parquet"]
GROUPS = ["algorithm.adv_estimator=grpo", "rollout.n=2"]
DAPO = [*GROUPS, "algorithm.filter_groups.enable=true"]
TOOLS = ["rollout.multi_turn.enable=true", "retriever.source=http://127.0.0.1:1/retrieve"]

# key, overrides with the wrong name, the name suggested
RL_CASES = [
    ("algorithm.adv_estimator", ["algorithm.adv_estimator=grop"], "grpo"),
    ("actor.policy_loss.loss_mode", ["actor.policy_loss.loss_mode=gpso"], "gspo"),
    ("algorithm.kl_penalty", ["algorithm.kl_penalty=low_var_kll"], "low_var_kl"),
    ("actor.kl_loss_type", ["actor.use_kl_loss=true", "actor.kl_loss_type=lowvar_kl"],
     "low_var_kl"),
    ("actor.loss_agg_mode", ["actor.loss_agg_mode=token-meen"], "token-mean"),
    ("critic.loss_agg_mode", ["critic.loss_agg_mode=seq-mean-tokenmean"], "seq-mean-token-mean"),
    ("algorithm.kl_ctrl.type", ["algorithm.kl_ctrl.type=adaptve"], "adaptive"),
    ("rollout.name", ["rollout.name=vlm"], "vllm"),
    ("reward.manager", ["reward.manager=dapoo"], "dapo"),
    ("trainer.logger", ["trainer.logger=[tensorbord]"], "tensorboard"),
    ("algorithm.filter_groups.metric", [*DAPO, "algorithm.filter_groups.metric=accc"], "acc"),
    ("algorithm.filter_groups.metric", [*DAPO, "algorithm.filter_groups.metric=seq_rewrd"],
     "seq_reward"),
    ("rollout.multi_turn.tools", [*TOOLS, "rollout.multi_turn.tools=[serach]"], "search"),
    ("reward.scorer_options.gsm8kk", ["reward.scorer_options.gsm8kk.method=flexible"], "gsm8k"),
]  # fmt: skip


@pytest.mark.parametrize(("key", "overrides", "suggested"), RL_CASES)
def test_a_wrong_registry_name_names_the_key_and_suggests(key, overrides, suggested):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, *overrides])
    text = str(err.value)
    assert key in text and f"did you mean {suggested!r}?" in text, text


def test_a_wrong_image_reward_names_the_key_and_suggests():
    with pytest.raises(ConfigError, match=r"reward.name='genevall'.*did you mean 'geneval'\?"):
        load_flow_config(None, [*BASE, "reward.name=genevall"])
    # a function of the user's file may have any name
    cfg = load_flow_config(None, [*BASE, "reward.name=mine", "reward.path=/tmp/r.py"])
    assert cfg.reward.name == "mine"


@pytest.mark.parametrize(
    ("overrides", "metric"),
    [
        (DAPO, "acc"),
        (DAPO, "seq_final_reward"),
        ([*DAPO, "reward.custom_reward_function.path=/tmp/r.py"], "my_extra"),
        ([*DAPO, "reward_model.enable=true", "reward_model.model.path=/rm"], "rm_score"),
        (
            [*DAPO, "reward.manager=dapo", "reward.overlong_buffer.enable=true",
             "reward.overlong_buffer.len=8"],
            "overlong_penalty",
        ),
        (GROUPS, "not_checked_while_filter_groups_is_off"),
    ],
)  # fmt: skip
def test_filter_metrics_that_exist_are_accepted(overrides, metric):
    cfg = load_config(None, [*BASE, *overrides, f"algorithm.filter_groups.metric={metric}"])
    assert cfg.algorithm.filter_groups["metric"] == metric


def test_metrics_of_a_model_alone_are_not_the_scorers():
    rm = [
        "reward_model.enable=true",
        "reward_model.model.path=/rm",
        "reward_model.rule_reward=false",
    ]
    with pytest.raises(ConfigError, match=r"algorithm\.filter_groups\.metric='acc'"):
        load_config(None, [*BASE, *DAPO, *rm, "algorithm.filter_groups.metric=acc"])


def test_a_tool_file_may_define_any_tool_name(tmp_path):
    tools = tmp_path / "tools.py"
    tools.write_text("def lookup(q: str) -> str:\n    '''Look q up.'''\n    return q\n")
    overrides = [
        *TOOLS,
        f"rollout.multi_turn.tool_path={tools}",
        "rollout.multi_turn.tools=[lookup]",
    ]
    assert load_config(None, [*BASE, *overrides]).rollout.multi_turn.tools == ["lookup"]


# ------------------------------------------------------------------ the lists match the registries
def test_builtin_names_match_their_registries():
    from lmrl.flow.rewards import IMAGE_REWARDS
    from lmrl.rewards.scorers import SCORERS
    from lmrl.tools import BUILTIN_TOOLS

    assert tuple(BUILTIN_TOOLS) == names.BUILTIN_TOOLS
    assert tuple(IMAGE_REWARDS) == names.IMAGE_REWARDS
    assert tuple(SCORERS) == names.DATA_SOURCES


def test_literal_choices_match_their_registries():
    from lmrl.algos.kl import kl_controllers
    from lmrl.rewards.managers import REWARD_MANAGERS
    from lmrl.rollout.engines import ENGINES

    spec = schema()
    kl_type = typing.get_type_hints(spec["algorithm.kl_ctrl"].items)["type"]  # an option
    assert sorted(typing.get_args(kl_type)) == kl_controllers.names()
    for key, registry in (("rollout.name", ENGINES), ("reward.manager", REWARD_MANAGERS)):
        assert sorted(typing.get_args(spec[key].type)) == registry.names(), key


def test_sequence_metrics_are_the_ones_dynamic_sampling_computes():
    from lmrl.trainer.stages import filter_metric

    batch = {"token_level_scores": torch.tensor([[0.0, 1.0], [0.5, 0.0]])}
    for name in names.SEQUENCE_METRICS:
        assert filter_metric(batch, {}, name).tolist() == [1.0, 0.5]
    with pytest.raises(ValueError, match="is not a score extra"):
        filter_metric(batch, {}, "seq_rewards")
