"""Values a run would silently ignore or mis-read are refused before any model loads, one line
each naming the key, the value and the fix: a NaN or unbounded staleness, two verl keys that
land on one lmrl key with different values, and keys that are out of range or change nothing
given the others."""

from __future__ import annotations

import textwrap

import pytest

from lmrl.cli import main
from lmrl.config import ConfigError, load_config

BASE = ["model.path=/models/tiny", "data.train_files=/tmp/x.parquet"]
ASYNC = ["async_training.enable=true"]
ACTOR_DTYPE = "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"
CRITIC_DTYPE = "critic.model.fsdp_config.mixed_precision.param_dtype"


def only_error(overrides, config_file=None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(config_file, [*BASE, *overrides])
    (message,) = err.value.errors
    assert "\n" not in message
    return message


# ---- async_training.staleness_threshold


@pytest.mark.parametrize("extra", [ASYNC, []])
def test_a_nan_staleness_is_one_line(extra):
    message = only_error([*extra, "async_training.staleness_threshold=nan"])
    assert message.startswith("async_training.staleness_threshold=nan must be >= 0, a number")


def test_a_staleness_past_the_run_or_the_cap_is_refused():
    message = only_error(
        [*ASYNC, "trainer.total_training_steps=10", "async_training.staleness_threshold=12"]
    )
    assert message.startswith("async_training.staleness_threshold=12.0 lets a batch's weights")
    assert "the run's 10 steps (trainer.total_training_steps)" in message
    assert "initial policy" in message and "staleness_threshold <= 9" in message
    message = only_error([*ASYNC, "async_training.staleness_threshold=1e9"])
    assert "more than lmrl's cap of 64" in message and "staleness_threshold <= 64" in message
    message = only_error([*ASYNC, "async_training.trigger_parameter_sync_step=100"])
    assert "trigger_parameter_sync_step=100" in message and "cap of 64" in message
    # within both: accepted (a lag of 2 in a run of 3 steps; the cap itself)
    load_config(None, [*BASE, *ASYNC, "trainer.total_training_steps=3",
                       "async_training.staleness_threshold=2"])  # fmt: skip
    load_config(None, [*BASE, *ASYNC, "async_training.staleness_threshold=64"])


# ---- two verl keys onto one lmrl key


def test_two_verl_keys_for_one_lmrl_key_with_different_values_are_one_error():
    message = only_error([f"{ACTOR_DTYPE}=bf16", f"{CRITIC_DTYPE}=fp32"])
    assert message.startswith("model.mixed_precision.param_dtype is set twice")
    assert f"{ACTOR_DTYPE}='bf16'" in message and f"{CRITIC_DTYPE}='fp32'" in message
    assert "set model.mixed_precision.param_dtype alone" in message
    # any key lmrl folds: verl's two micro-batch spellings
    message = only_error(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                          "actor_rollout_ref.actor.ppo_micro_batch_size=4"])  # fmt: skip
    assert message.startswith("actor.ppo_micro_batch_size is set twice")
    # the same value, or one key's two spellings (the later wins): no conflict
    cfg = load_config(None, [*BASE, f"{ACTOR_DTYPE}=bf16", f"{CRITIC_DTYPE}=bf16"])
    assert cfg.model.mixed_precision.param_dtype == "bf16"
    cfg = load_config(
        None, [*BASE, "actor.clip_ratio=0.1", "actor_rollout_ref.actor.clip_ratio=0.3"]
    )
    assert cfg.actor.clip_ratio == 0.3  # the later override wins, as for one key


def test_a_verl_key_on_the_command_line_against_a_file_s_other_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent("""
        actor_rollout_ref:
          actor: {fsdp_config: {mixed_precision: {param_dtype: bf16}}}
    """))  # fmt: skip
    message = only_error([f"{CRITIC_DTYPE}=fp32"], path)
    assert f"{ACTOR_DTYPE}='bf16' (in {path})" in message
    assert f"{CRITIC_DTYPE}='fp32' (on the command line)" in message
    cfg = load_config(path, [*BASE, "model.mixed_precision.param_dtype=fp32"])  # ours: for all
    assert cfg.model.mixed_precision.param_dtype == "fp32"


def test_a_null_from_verl_s_other_spelling_is_no_conflict(tmp_path):
    """verl's YAML writes null for the spelling it leaves unset: the value stands, in a file
    and against a command line."""
    path = tmp_path / "verl.yaml"
    path.write_text(textwrap.dedent("""
        actor_rollout_ref:
          actor: {ppo_micro_batch_size_per_gpu: 2, ppo_micro_batch_size: null}
          rollout: {log_prob_micro_batch_size: null, log_prob_micro_batch_size_per_gpu: null}
    """))  # fmt: skip
    cfg = load_config(
        path, [*BASE, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"]
    )
    assert (cfg.actor.ppo_micro_batch_size, cfg.rollout.log_prob_micro_batch_size) == (2, 4)
    cfg = load_config(path, [*BASE, "actor.ppo_micro_batch_size=null"])  # ours: it is meant
    assert cfg.actor.ppo_micro_batch_size is None


# ---- out of range, or changing nothing given the others

SMALL = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=4"]
PYTHON_TOOL = ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[python]"]


@pytest.mark.parametrize(
    "overrides,start,fix",
    [
        (["trainer.parity_threshold=-1"], "trainer.parity_threshold=-1.0 must be", "0 or null = off"),
        (["trainer.parity_threshold=nan"], "trainer.parity_threshold=nan must be", "0 or null = off"),
        ([*SMALL, "reward.overlap.chunks=32"], "reward.overlap.chunks=32 is more calls than the "
         "16 prompts", "reward.overlap.chunks <= 16"),
        ([*SMALL, "reward.in_flight_chunks=32"], "reward.overlap.chunks=32", "<= 16"),
        (["rollout.multi_turn.format=json"], "rollout.multi_turn.format='json' changes nothing",
         "set rollout.multi_turn.enable=true"),
        (["rollout.multi_turn.max_turns=0"], "rollout.multi_turn.max_turns=0 changes nothing",
         "leave rollout.multi_turn.max_turns out"),
        ([*PYTHON_TOOL, "rollout.multi_turn.max_turns=0"], "rollout.multi_turn.max_turns=0 must "
         "be >= 1 with rollout.multi_turn.enable=true", "no tool call would ever run"),
        (["trainer.device=cpu", "rollout.dtype=float16"], "rollout.dtype=float16: float16 compute "
         "on a CPU is not supported", "use bfloat16 or float32"),
        (["trainer.rollback_lr_factor=0.5"], "trainer.rollback_lr_factor=0.5 changes nothing",
         "set trainer.max_rollbacks > 0"),
    ],
)  # fmt: skip
def test_inert_or_out_of_range_values_are_one_line(overrides, start, fix):
    message = only_error(overrides)
    assert message.startswith(start) and fix in message


def test_the_same_values_where_they_act_are_accepted(tmp_path):
    val = tmp_path / "val.parquet"
    val.touch()
    load_config(None, [*BASE, *SMALL, "reward.overlap.chunks=16", "trainer.parity_threshold=0",
                       *PYTHON_TOOL, "rollout.multi_turn.format=json",
                       "rollout.multi_turn.max_turns=1", "trainer.max_rollbacks=1",
                       "trainer.rollback_lr_factor=0.5", f"data.val_files={val}",
                       "trainer.test_freq=1", "rollout.dtype=bfloat16"])  # fmt: skip


def test_scoring_calls_that_do_not_divide_the_prompts_get_a_notice():
    notices: list[str] = []
    load_config(None, [*BASE, *SMALL, "reward.overlap.chunks=3"], notices=notices)
    (notice,) = [n for n in notices if "reward.overlap.chunks" in n]
    assert notice.startswith("reward.overlap.chunks=3 does not divide the 16 prompts")


def test_lmrl_train_exits_2_with_the_line(capsys):
    code = main(["train", *BASE, f"{ACTOR_DTYPE}=bf16", f"{CRITIC_DTYPE}=fp32"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert line.startswith("lmrl train: error: model.mixed_precision.param_dtype is set twice")


# ---- lmrl train-flow's optimizer


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.optim.betas=[0.9]", "actor.optim.betas=[0.9] must be two numbers in [0, 1)"),
        ("actor.optim.betas=[0.9,1.5]", "must be two numbers in [0, 1)"),
        ("actor.optim.weight_decay=-0.1", "actor.optim.weight_decay=-0.1 must be >= 0"),
    ],
)
def test_flow_optimizer_values_are_checked_before_any_model_loads(override, message):
    from lmrl.config.flow import load_flow_config

    with pytest.raises(ConfigError) as err:
        load_flow_config(None, [*BASE, override])
    (line,) = err.value.errors
    assert message in line
