"""Tests of `lmrl.batch.schema`: every key declared once, strict writes, the key sets derived
from it, and a real RL step and flow rollout writing only declared keys, each by its stage."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import lmrl.batch as batch_module
from lmrl.batch import Batch
from lmrl.batch.schema import ENV, KEYS, ROLES, STAGES, UndeclaredKeyError, keys


def test_the_tests_run_strict():
    assert batch_module.strict()


def test_writing_an_undeclared_key_fails_naming_it_and_the_schema():
    b = Batch({"responses": torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(UndeclaredKeyError, match=r"'advantage'.*'advantages'.*lmrl\.batch\.schema"):
        b["advantage"] = torch.zeros(2, 3)
    with pytest.raises(UndeclaredKeyError, match=r"'my_column'"):
        Batch(non_tensors={"my_column": ["a", "b"]})
    with pytest.raises(UndeclaredKeyError, match=r"'score'"):
        Batch({"score": torch.zeros(2)})
    assert b.keys() == ["responses"]


def test_a_tensor_under_a_columns_key_fails_and_the_reverse():
    b = Batch({"responses": torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(UndeclaredKeyError, match=r"'uid' is declared a non-tensor column"):
        b["uid"] = torch.zeros(2)
    with pytest.raises(UndeclaredKeyError, match=r"'values' is declared a tensor"):
        b["values"] = [0.0, 1.0]


def test_strict_mode_is_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(ENV)
    b = Batch({"score": torch.zeros(2)})
    b["anything"] = ["a", "b"]
    assert b.keys() == ["score", "anything"]


def test_every_key_is_declared_once_with_a_role_a_stage_and_a_shape():
    for name, k in KEYS.items():
        assert k.name == name
        assert k.role in ROLES, name
        assert k.writer in STAGES, name
        assert k.shape.startswith("(B"), name
        assert k.meaning, name
        assert (k.role == "column") == (not k.is_tensor), name
        assert all(isinstance(d, torch.dtype) for d in k.dtypes), name
    assert len(KEYS) == sum(1 for _ in KEYS)  # a dict: one entry per name
    # DESIGN.md's data flow lists these
    design = [
        "prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
        "rollout_log_probs", "old_log_probs", "ref_log_probs", "loss_mask", "values",
        "token_level_scores", "token_level_rewards", "advantages", "returns", "uid",
        "data_source", "ground_truth", "extra_info", "pixel_values", "image_grid_thw",
    ]  # fmt: skip
    assert set(design) <= set(KEYS)
    assert "M-RoPE" in KEYS["position_ids"].shape


def test_the_key_sets_of_the_forward_and_the_updates_are_the_schemas():
    from lmrl.models.layout import LAYOUT_KEYS, MICRO_KEYS, REQUIRED_KEYS
    from lmrl.rollout.agent import AGENT_KEYS
    from lmrl.workers.actor import UPDATE_KEYS as ACTOR_KEYS
    from lmrl.workers.critic import UPDATE_KEYS as CRITIC_KEYS
    from lmrl.workers.group import FORWARD_KEYS

    tokens = {"input_ids", "attention_mask", "position_ids", "responses", "response_mask"}
    assert set(FORWARD_KEYS) == tokens
    assert set(ACTOR_KEYS) == tokens | {
        "loss_mask", "advantages", "old_log_probs", "ref_log_probs", "rollout_is_weights"
    }  # fmt: skip
    assert set(CRITIC_KEYS) == tokens | {"values", "returns", "scored_mask"}
    assert REQUIRED_KEYS == ("input_ids", "attention_mask", "responses")
    assert LAYOUT_KEYS == ("row_layout", "prompt_group")
    assert set(MICRO_KEYS) == {*REQUIRED_KEYS, "position_ids", *LAYOUT_KEYS}
    counters = ("turns", "tool_calls", "valid_calls", "tool_errors", "tool_timeouts",
                "obs_tokens", "answered")  # fmt: skip
    assert tuple(AGENT_KEYS) == tuple(f"agent_{n}" for n in counters)  # Row's field order
    assert keys(group="flow") == (
        "latents", "next_latents", "log_probs", "timesteps", "next_timesteps", "step_mask",
        "images", "cond",
    )  # fmt: skip


# the step's timer stages (`timing_s/<name>`) -> the writer the schema names; "step" is entered
# before the prompts are drawn; rollout correction writes in stage 3's slot, untimed
TIMER_TO_WRITER = {"step": "data", "gen": "rollout", "gen_baseline": "baseline"}
WRITER_SEEN_AS = {"correction": "old_log_prob"}


def test_a_tiny_rl_step_writes_only_declared_keys_each_by_its_stage(
    tiny_workspace, tmp_path, monkeypatch
):
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    root = tiny_workspace
    cfg = load_config(None, [
        f"model.path={root / 'model'}", f"data.train_files={root / 'data' / 'train.parquet'}",
        "data.max_prompt_length=64", "data.max_response_length=6", "data.train_batch_size=2",
        "rollout.n=2", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
        "algorithm.adv_estimator=gae", "actor.use_kl_loss=true",
        "rollout.log_prob_mode=rollout_correction", "model.enable_gradient_checkpointing=false",
        "trainer.device=cpu", "trainer.total_training_steps=1", "trainer.logger=[]",
        f"trainer.default_local_dir={tmp_path}", "reward.num_workers=0",
    ])  # fmt: skip
    stage = ["build"]
    writers: dict[str, set[str]] = defaultdict(set)
    check = batch_module.check_write

    def recorded(key: str, is_tensor: bool) -> None:
        check(key, is_tensor)
        writers[key].add(stage[0])

    def on_stage(name: str) -> None:
        stage[0] = TIMER_TO_WRITER.get(name, name)

    monkeypatch.setattr(batch_module, "check_write", recorded)
    trainer = Trainer(build_run(cfg), cfg.trainer, on_stage=on_stage)
    trainer.step()
    batch = trainer.last_batch
    for stage_keys in ("old_log_probs", "ref_log_probs", "values", "loss_mask", "returns"):
        assert stage_keys in batch  # the stages this run was chosen to exercise
    written = batch.keys()
    for key in written:
        spec = KEYS[key]
        assert WRITER_SEEN_AS.get(spec.writer, spec.writer) in writers[key], (key, writers[key])
        if spec.is_tensor:
            assert batch[key].dtype in spec.dtypes, (key, batch[key].dtype)


def test_a_flow_rollout_writes_its_declared_keys():
    from lmrl.flow import FlowSampler, PointFlow

    torch.manual_seed(0)
    cond = torch.arange(4) % 4
    batch = FlowSampler(num_steps=3).sample(PointFlow(hidden=8), cond, torch.randn(4, 2))
    written = batch.keys()
    assert set(written) == set(keys(writer="flow_rollout"))
    for key in written:
        assert batch[key].dtype in KEYS[key].dtypes, key


def test_the_key_types_are_the_schemas_keys():
    """``TensorKey`` and ``ColumnKey`` (what a type checker reads ``batch[key]`` by) list
    exactly the schema's tensor and column keys."""
    from typing import get_args

    from lmrl.batch.schema import KEYS, ColumnKey, TensorKey

    assert set(get_args(TensorKey)) == {k for k, spec in KEYS.items() if spec.dtype != "object"}
    assert set(get_args(ColumnKey)) == {k for k, spec in KEYS.items() if spec.dtype == "object"}
