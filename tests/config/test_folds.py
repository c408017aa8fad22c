"""Keys folded together (issue 30): verl's spellings land on the fold with their meaning, and
a bad value of the folded key is one error that names it."""

from __future__ import annotations

import textwrap

import pytest

from lmrl.config import ConfigError, config_from_dict, format_help, load_config
from lmrl.config.fields import get_path

BASE = ["model.path=/models/tiny", "data.train_files=/tmp/x.parquet"]
TOOLS = ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[search]"]


def errors(overrides, config_file=None) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(config_file, [*BASE, *overrides])
    return err.value.errors


# ---- actor.offload / critic.offload <- verl's fsdp_config.param_offload, optimizer_offload


@pytest.mark.parametrize(
    ("params", "optimizer", "expected"),
    [(False, False, "none"), (True, False, "params"), (False, True, "optimizer"),
     (True, True, "both")],
)  # fmt: skip
def test_verl_offload_flags_fold_into_one_key(params, optimizer, expected):
    actor = "actor_rollout_ref.actor.fsdp_config"
    critic = "critic.model.fsdp_config"
    cfg = load_config(None, [*BASE,
        f"{actor}.param_offload={params}", f"{actor}.optimizer_offload={optimizer}",
        f"{critic}.optimizer_offload={optimizer}", f"{critic}.param_offload={params}",
    ])  # fmt: skip
    assert (cfg.actor.offload, cfg.critic.offload) == (expected, expected)


def test_each_verl_offload_flag_keeps_its_own_last_value(tmp_path):
    """A file turns both on and the command line turns one off: as in verl, the other stays."""
    path = tmp_path / "run.yaml"
    path.write_text(
        textwrap.dedent("""\
        actor_rollout_ref:
          actor:
            fsdp_config: {param_offload: true, optimizer_offload: true}
    """)
    )
    assert load_config(path, BASE).actor.offload == "both"
    off = "actor_rollout_ref.actor.fsdp_config.param_offload=false"
    assert load_config(path, [*BASE, off]).actor.offload == "optimizer"
    both_off = [off, "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false"]
    assert load_config(path, [*BASE, *both_off]).actor.offload == "none"


def test_a_bad_offload_is_one_error_naming_it():
    (msg,) = errors(["actor.offload=param"])
    assert msg.startswith("actor.offload: expected one of none, params, optimizer, both")
    assert "did you mean 'params'" in msg
    (msg,) = errors(["actor_rollout_ref.actor.fsdp_config.param_offload=maybe"])
    assert msg.startswith("actor_rollout_ref.actor.fsdp_config.param_offload: expected true")


# ---- rollout.vllm <- verl's rollout.gpu_memory_utilization, tensor_model_parallel_size, ...


def test_vllm_options_merge_into_their_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  vllm:\n    enforce_eager: false\n")
    cfg = load_config(path, [*BASE, "actor_rollout_ref.rollout.gpu_memory_utilization=0.7"])
    assert cfg.rollout.vllm["enforce_eager"] is False
    assert cfg.rollout.vllm["gpu_memory_utilization"] == 0.7
    assert cfg.rollout.vllm["free_cache_engine"] is True  # untouched default
    # a config built in code with some options left out gets their defaults when resolved
    cfg = config_from_dict({"rollout": {"vllm": {"max_model_len": 2048}}})
    assert cfg.rollout.vllm["max_model_len"] == 2048 and cfg.rollout.vllm["dtype"] is None


def test_a_bad_vllm_option_is_one_error_naming_it():
    (msg,) = errors(["rollout.vllm.gpu_memory_utilisation=0.6"])
    assert msg.startswith("unknown key 'rollout.vllm.gpu_memory_utilisation'")
    assert "did you mean rollout.vllm.gpu_memory_utilization?" in msg
    (msg,) = errors(["rollout.vllm.enforce_eager=maybe"])
    assert msg.startswith("rollout.vllm.enforce_eager: expected true or false, got 'maybe'")
    (msg,) = errors(["actor_rollout_ref.rollout.tensor_model_parallel_size=two"])
    assert "(lmrl key 'rollout.vllm.tensor_model_parallel_size'): expected an integer" in msg


# ---- rollout.multi_turn.python <- python_timeout_s, python_memory_mb


def test_python_tool_limits_fold_into_one_key():
    cfg = load_config(None, [*BASE,
        "actor_rollout_ref.rollout.multi_turn.python_timeout_s=2.5",
        "rollout.multi_turn.python.memory_mb=256",
    ])  # fmt: skip
    assert cfg.rollout.multi_turn.python == {"timeout_s": 2.5, "memory_mb": 256, "disk_mb": 64}


def test_a_bad_python_limit_is_one_error_naming_it():
    (msg,) = errors([*TOOLS, "retriever.source=http://127.0.0.1:1/retrieve",
                     "rollout.multi_turn.python.memory_mb=0"])  # fmt: skip
    assert msg == "rollout.multi_turn.python.memory_mb=0 must be > 0"
    (msg,) = errors(["rollout.multi_turn.python.cpu_s=3"])
    assert "the options of rollout.multi_turn.python are: timeout_s, memory_mb" in msg


# ---- retriever.source <- retriever.corpus (a file), retriever.url (Search-R1's server)


def test_search_r1_url_and_a_corpus_fold_into_source(tmp_path):
    url = "http://127.0.0.1:8000/retrieve"
    assert load_config(None, [*BASE, f"retriever.url={url}"]).retriever.source == url
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"contents": "a"}\n')
    cfg = load_config(None, [*BASE, *TOOLS, f"retriever.corpus={corpus}"])
    assert cfg.retriever.source == str(corpus)


def test_a_bad_retriever_source_is_one_error_naming_it():
    (msg,) = errors([*TOOLS, "retriever.source=/nowhere/corpus.parquet"])
    assert msg.startswith("retriever.source=/nowhere/corpus.parquet: no such file")
    (msg,) = errors([*TOOLS])
    assert msg.startswith("the search tool needs retriever.source")
    (msg,) = errors(["retriever.url=/data/corpus.parquet"])
    assert msg.startswith("retriever.url='/data/corpus.parquet': not an http(s) URL")
    assert "retriever.source=/data/corpus.parquet" in msg
    (msg,) = errors(["retriever.corpus=https://example.org/retrieve"])
    assert "a URL is a retrieval server: retriever.source=https://example.org/retrieve" in msg


def test_help_lists_the_options_of_a_folded_key():
    text = format_help(["rollout"])
    assert "  rollout.vllm  (mapping of the options below)" in text
    assert "- gpu_memory_utilization = 0.5  (float)" in text
    assert "- memory_mb = 512  (int)" in text


# ---- reward.overlap <- reward.in_flight_rows, in_flight_chunks, launch_async (verl's
# ---- reward_model.launch_reward_fn_async)


@pytest.mark.parametrize(
    ("old", "option", "value"),
    [
        ("reward.in_flight_rows=true", "rows", True),
        ("reward.in_flight_chunks=4", "chunks", 4),
        ("reward.launch_async=true", "log_probs", True),
        ("reward_model.launch_reward_fn_async=true", "log_probs", True),
    ],
)
def test_each_scoring_overlap_key_lands_on_its_option(old, option, value):
    cfg = load_config(None, [*BASE, old])
    assert cfg.reward.overlap == {"rows": False, "chunks": 1, "log_probs": False, option: value}


def test_the_three_scoring_overlaps_still_combine(tmp_path):
    """Rows, chunks and the log-probs overlap together, as the old keys allowed, from a file
    of the old spellings and from the new key's options alike."""
    path = tmp_path / "run.yaml"
    path.write_text("reward: {in_flight_rows: true, in_flight_chunks: 2, launch_async: true}\n")
    old = load_config(path, BASE)
    new = load_config(None, [*BASE, "reward.overlap={rows: true, chunks: 2, log_probs: true}"])
    assert old == new and new.reward.overlap == {"rows": True, "chunks": 2, "log_probs": True}


def test_a_bad_scoring_overlap_is_one_error_naming_it():
    (msg,) = errors(["reward.overlap=rows"])
    assert msg.startswith("reward.overlap: expected a mapping, got 'rows'")
    assert "its options are rows, chunks, log_probs (set one as reward.overlap.NAME=...)" in msg
    (msg,) = errors(["reward.overlap.async=true"])
    assert "the options of reward.overlap are: rows, chunks, log_probs" in msg
    (msg,) = errors(["reward.overlap.chunks=0"])
    assert msg == "reward.overlap.chunks=0 must be >= 1"
    (msg,) = errors(["reward.in_flight_chunks=0"])  # the old spelling: the same check
    assert msg == "reward.overlap.chunks=0 must be >= 1"
    (msg,) = errors(["reward.manager=batch", "reward.overlap.rows=true"])
    assert msg == "reward.overlap.rows=True needs reward.manager=naive or dapo"


# ---- trainer.max_rollbacks (0 = off) <- the trainer.rollback switch


VALIDATED = ["data.val_files=/tmp/v.parquet", "trainer.test_freq=2"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.rollback=true"], 2),  # the switch alone: the old default of 2 rollbacks
        (["trainer.rollback=false"], 0),
        (["trainer.rollback=true", "trainer.max_rollbacks=3"], 3),
        (["trainer.max_rollbacks=3", "trainer.rollback=true"], 3),  # on already: kept
        (["trainer.max_rollbacks=3", "trainer.rollback=false"], 0),
        ([], 0),  # off by default, as the switch was
    ],
)
def test_the_rollback_switch_folds_into_max_rollbacks(overrides, expected):
    assert load_config(None, [*BASE, *VALIDATED, *overrides]).trainer.max_rollbacks == expected


def test_a_bad_rollback_is_one_error_naming_it():
    (msg,) = errors(["trainer.rollback=maybe"])
    assert msg.startswith("trainer.rollback: expected true or false, got 'maybe'")
    (msg,) = errors(["trainer.max_rollbacks=-1"])
    assert msg == "trainer.max_rollbacks=-1 must be >= 0 (0 = no rollback)"
    (msg,) = errors(["trainer.rollback=true"])  # no validation to find the best checkpoint
    assert msg.startswith("trainer.max_rollbacks=2 (the rollback) needs validation")


# ---- options keys: rollout.correction, reward.overlong_buffer, algorithm.kl_ctrl,
# ---- algorithm.filter_groups, actor.policy_loss: every spelling of their old keys stays


@pytest.mark.parametrize(
    ("given", "key", "option", "value"),
    [
        ("algorithm.rollout_is_level=geometric", "rollout.correction", "level", "geometric"),
        ("rollout.correction.threshold=3", "rollout.correction", "threshold", 3.0),
        ("reward_model.overlong_buffer.len=16", "reward.overlong_buffer", "len", 16),
        ("reward.overlong_buffer.penalty_factor=0.5", "reward.overlong_buffer", "penalty_factor",
         0.5),
        ("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl", "type", "adaptive"),
        ("algorithm.filter_groups.max_num_gen_batches=4", "algorithm.filter_groups",
         "max_num_gen_batches", 4),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor.policy_loss", "loss_mode",
         "gspo"),
        ("actor.policy_loss.clip_cov_ratio=0.1", "actor.policy_loss", "clip_cov_ratio", 0.1),
    ],
)  # fmt: skip
def test_old_keys_land_on_the_options_of_their_fold(given, key, option, value):
    cfg = load_config(None, [*BASE, given])
    assert get_path(cfg, f"{key}.{option}") == value
    assert type(get_path(cfg, f"{key}.{option}")) is type(value)


def test_a_bad_option_of_a_fold_is_one_error_naming_it():
    (msg,) = errors(["algorithm.kl_ctrl.type=adaptve"])
    assert msg.startswith("algorithm.kl_ctrl.type: expected one of fixed, adaptive")
    (msg,) = errors(["actor.policy_loss.tau=1.0"])
    assert "the options of actor.policy_loss are: loss_mode, tau_pos, tau_neg" in msg
    (msg,) = errors(["rollout.correction.level=tokens"])
    assert msg.startswith("rollout.correction.level: expected one of token, sequence, geometric")
