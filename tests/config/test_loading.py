"""Loading: YAML + dotted overrides, value parsing, precedence, notices, save/load round trip."""

from __future__ import annotations

import json
import logging
import re
import textwrap

import pytest
import yaml

from lmrl.config import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    load_config,
    parse_override,
    save_config,
)

BASE = ["model.path=/models/tiny", "data.train_files=/tmp/x.parquet"]


def write(tmp_path, text: str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_override_values_are_parsed_like_yaml():
    cfg = load_config(
        None,
        [
            *BASE,
            "actor.optim.lr=1e-6",  # a string to PyYAML, a float here
            "actor.clip_ratio_high=0.28",
            "actor.shuffle=true",
            "rollout.stop=[</answer>, '###']",
            "data.val_files=[a.parquet,b.parquet]",
            "trainer.max_ckpt_to_keep=null",
            "trainer.experiment_name=0.10",  # a string key keeps the text typed
            "trainer.project_name=2024-01-01",  # not a date
            "data.max_response_length=2048.0",  # integral float -> int
            "trainer.logger=console",  # a bare value where a list is expected
        ],
    )
    assert cfg.actor.optim.lr == 1e-6 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.actor.clip_ratio_high == 0.28
    assert cfg.actor.shuffle is True
    assert cfg.rollout.stop == ["</answer>", "###"]
    assert cfg.data.val_files == ["a.parquet", "b.parquet"]
    assert cfg.trainer.max_ckpt_to_keep is None
    assert cfg.trainer.experiment_name == "0.10"
    assert cfg.trainer.project_name == "2024-01-01"
    assert cfg.data.max_response_length == 2048 and isinstance(cfg.data.max_response_length, int)
    assert cfg.trainer.logger == ["console"]


def test_override_with_a_mapping_value_and_hydra_plus():
    cfg = load_config(None, [*BASE, "actor.optim={lr: 0.001, weight_decay: 0}", "+trainer.seed=7"])
    assert (cfg.actor.optim.lr, cfg.actor.optim.weight_decay) == (0.001, 0.0)
    assert cfg.trainer.seed == 7 and cfg.data.seed == 7


def test_parse_override_keeps_the_raw_text():
    (entry,) = parse_override("trainer.experiment_name=1e3")
    assert entry.key == "trainer.experiment_name" and entry.raw == "1e3"


def test_precedence_defaults_then_file_then_overrides(tmp_path):
    path = write(
        tmp_path,
        """
        model: {path: /models/from-file}
        data:
          train_files: /data/train.parquet
          train_batch_size: 64
        actor:
          ppo_mini_batch_size: 16
          clip_ratio: 0.1
          optim: {lr: 3.0e-6}
        """,
    )
    cfg = load_config(path, ["actor.clip_ratio=0.3", "actor.clip_ratio=0.25"])
    assert cfg.actor.clip_ratio == 0.25  # the later override wins
    assert cfg.actor.optim.lr == 3e-6  # from the file
    assert cfg.data.train_batch_size == 64 and cfg.actor.ppo_mini_batch_size == 16
    assert cfg.actor.clip_ratio_c == 3.0  # untouched default
    assert cfg.model.path == "/models/from-file"
    cfg = load_config(path, ["model.path=/models/cli"])
    assert cfg.model.path == "/models/cli"


def test_empty_file_and_empty_sections(tmp_path):
    assert load_config(write(tmp_path, ""), BASE) == load_config(None, BASE)
    path = write(tmp_path, "critic:\nactor: {}\n", "sections.yaml")
    assert load_config(path, BASE) == load_config(None, BASE)


def test_interpolations_in_a_file_are_resolved(tmp_path):
    path = write(
        tmp_path,
        """
        data: {train_batch_size: 32, train_files: /x.parquet}
        model: {path: /m}
        actor: {ppo_mini_batch_size: 8}
        critic: {ppo_mini_batch_size: "${actor.ppo_mini_batch_size}"}
        trainer: {experiment_name: "bs${data.train_batch_size}"}
        """,
    )
    cfg = load_config(path, [])
    assert cfg.critic.ppo_mini_batch_size == 8
    assert cfg.trainer.experiment_name == "bs32"


def test_required_keys_and_opting_out():
    with pytest.raises(ConfigError) as err:
        load_config(None, [])
    text = str(err.value)
    assert "model.path is not set" in text and "actor_rollout_ref.model.path" in text
    assert "data.train_files is not set" in text
    assert load_config(None, [], required=()).model.path is None


def test_save_and_load_round_trip(tmp_path):
    cfg = load_config(
        None,
        [
            *BASE,
            "algorithm.adv_estimator=grpo",
            "rollout.n=4",
            "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size=2",
            "actor.clip_ratio_high=0.28",
            "rollout.stop=['</s>']",
            "reward.custom_reward_function.reward_kwargs={scale: 2}",
            "trainer.logger=[console,jsonl]",
            "trainer.default_local_dir=" + str(tmp_path / "run"),
        ],
    )
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert path.read_text().startswith("# lmrl resolved config")
    assert yaml.safe_load(path.read_text())["actor"]["clip_ratio_high"] == 0.28
    again = load_config(path, [])
    assert again == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg
    json.dumps(config_to_dict(cfg))  # plain types only
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]  # no temp file left


def test_notices_are_returned_and_logged(caplog):
    notices: list[str] = []
    with caplog.at_level(logging.WARNING, logger="lmrl.config"):
        load_config(
            None,
            [*BASE, "actor_rollout_ref.rollout.max_num_seqs=64"],
            notices=notices,
        )
    assert len(notices) == 1
    assert notices[0].startswith("actor_rollout_ref.rollout.max_num_seqs=64")
    assert "changes nothing in lmrl" in notices[0] and "on the command line" in notices[0]
    assert [r.getMessage() for r in caplog.records if r.name == "lmrl.config"] == notices


def test_a_critic_for_a_critic_free_estimator_is_a_notice():
    notices: list[str] = []
    cfg = load_config(
        None,
        [*BASE, "algorithm.adv_estimator=remax", "critic.enable=true"],
        notices=notices,
    )
    assert cfg.critic.enable is True
    assert any("critic.enable=true" in n and "not used" in n for n in notices)


def test_both_kl_penalties_is_a_notice():
    notices: list[str] = []
    load_config(
        None, [*BASE, "algorithm.use_kl_in_reward=true", "actor.use_kl_loss=true"], notices=notices
    )
    assert any("penalized twice" in n for n in notices)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["actor.strategy=fsdp2"], "actor.strategy='fsdp2' changes nothing: trainer.backend=local"),
        (["critic.offload=both"], "critic.offload='both' changes nothing: trainer.backend=local"),
        (
            ["actor_rollout_ref.actor.fsdp_config.param_offload=true"],
            "param_offload=True changes nothing: trainer.backend=local",
        ),
        (
            ["trainer.backend=ray", "actor.offload=params"],
            "actor.offload='params' changes nothing: only fsdp2 offloads shards",
        ),
        (
            ["rollout.gpu_memory_utilization=0.7"],
            "rollout.gpu_memory_utilization=0.7 changes nothing: rollout.name=hf",
        ),
        (["rollout.vllm.enforce_eager=false"], "enforce_eager=False changes nothing: rollout.name"),
        (["retriever.topk=5"], "retriever.topk=5 changes nothing: rollout.multi_turn.enable=false"),
        (
            ["retriever.url=http://127.0.0.1:8000/retrieve"],
            "retriever.url='http://127.0.0.1:8000/retrieve' changes nothing",
        ),
    ],
)
def test_keys_the_backend_or_engine_ignore_are_a_notice(overrides, expected):
    """issue 31 §4: keys that change nothing given the backend, engine or tools are noticed
    (the run goes on)."""
    notices: list[str] = []
    load_config(None, [*BASE, *overrides], notices=notices)
    assert [n for n in notices if expected in n], notices


def test_keys_the_backend_reads_are_not_noticed():
    notices: list[str] = []
    load_config(
        None,
        [*BASE, "trainer.backend=ray", "actor.strategy=fsdp2", "actor.offload=params"],
        notices=notices,
    )
    assert not [n for n in notices if "actor." in n], notices


def test_a_files_default_values_are_not_noticed_but_typed_ones_are(tmp_path):
    """A saved config.yaml (``lmrl eval`` loads it) or a full verl config writes every key:
    its values equal to the defaults change nothing and get no notice; the same value typed
    on the command line does."""
    path = save_config(load_config(None, BASE), tmp_path / "config.yaml")
    notices: list[str] = []
    load_config(path, [], notices=notices)
    assert notices == []
    load_config(path, ["actor.strategy=ddp", "retriever.topk=3"], notices=notices)
    assert [n.split(" changes nothing")[0] for n in notices] == [
        "actor.strategy='ddp'",
        "retriever.topk=3",
    ]


def test_items_of_a_mapping_key_can_be_set_one_by_one():
    cfg = load_config(
        None,
        [
            *BASE,
            "custom_reward_function.reward_kwargs={scale: 2}",
            "reward.custom_reward_function.reward_kwargs.offset=0.5",
        ],
    )
    assert cfg.reward.custom_reward_function.reward_kwargs == {"scale": 2, "offset": 0.5}


def test_scorer_options_nest_and_reach_the_reward_manager():
    from tests.rewards.test_managers import make_batch

    from lmrl.models.tiny import build_tokenizer
    from lmrl.workers.reward import build_reward

    cfg = load_config(
        None,
        [
            *BASE,
            "reward.num_workers=0",
            "reward.scorer_options={gsm8k: {method: flexible}}",
            "reward.scorer_options.digits.binary=true",  # one item, nested by its dots
        ],
    )
    assert cfg.reward.scorer_options == {
        "gsm8k": {"method": "flexible"},
        "digits": {"binary": True},
    }
    tok = build_tokenizer()
    batch = make_batch(tok, ["321", "320"], ["321", "321"])
    for options, expected in ((cfg.reward.scorer_options, [1.0, 0.0]), ({}, [1.0, 2 / 3])):
        cfg.reward.scorer_options = options
        manager = build_reward(cfg, tok)
        try:
            assert manager(batch).scores.tolist() == pytest.approx(expected)
        finally:
            manager.close()


@pytest.mark.parametrize(
    "override, message",
    [
        ("reward.scorer_options.add=3", "reward.scorer_options.add must be a mapping"),
        ("reward.custom_reward_function.path=/r.py", "reward.custom_reward_function.path "
         "replaces them"),
    ],
)  # fmt: skip
def test_scorer_options_errors_name_the_key(override, message):
    extra = ["reward.scorer_options.digits.binary=true"] if "custom" in override else []
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [*BASE, override, *extra])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"digitz": {"binary": True}}, "reward.scorer_options.digitz: no built-in scorer has "
         "that data_source; valid names: 2wikimultihopqa, DigitalLearningGmbH/MATH-lighteval"),
        ({"add": {"exact": True}}, "reward.scorer_options.add.exact: the add scorer has no "
         "option 'exact'; its options: binary"),
    ],
)  # fmt: skip
def test_scorer_options_the_scorers_lack_are_config_errors_when_the_reward_is_built(
    options, message
):
    from lmrl.models.tiny import build_tokenizer
    from lmrl.workers.reward import build_reward

    cfg = load_config(None, [*BASE, "reward.num_workers=0"])
    cfg.reward.scorer_options = options
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_reward(cfg, build_tokenizer())


def test_config_from_a_dict_in_verls_layout():
    cfg = config_from_dict(
        {"actor_rollout_ref": {"actor": {"clip_ratio": 0.3}, "model": {"path": "/m"}}},
        ["actor_rollout_ref.actor.ppo_epochs=2"],
    )
    assert (cfg.actor.clip_ratio, cfg.actor.ppo_epochs, cfg.model.path) == (0.3, 2, "/m")
    assert cfg.critic.model.path == "/m"


@pytest.mark.parametrize("engine", ["rollout.dtype=bfloat16", "rollout.name=vllm"])
def test_an_engine_with_its_own_copy_under_fsdp2_is_refused_in_one_line(engine):
    with pytest.raises(ConfigError, match=rf"{re.escape(engine)} with actor.strategy=fsdp2"):
        load_config(None, [*BASE, "trainer.backend=ray", "actor.strategy=fsdp2", engine])
    load_config(
        None, [*BASE, "trainer.backend=ray", "actor.strategy=ddp", "rollout.dtype=bfloat16"]
    )
