"""The run doctor (``trainer.max_rollbacks``): the new health checks, and a collapsed run
rolled back to its best validated checkpoint at a lower learning rate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmrl.config import ConfigError, load_config
from lmrl.run.checkpoint import list_checkpoints, load_state
from lmrl.run.health import RunHealth
from lmrl.trainer import Trainer, build_run

VAL = "val/digits/acc"


def _feed(health: RunHealth, rows: list[dict]) -> list[str]:
    return [w for row in rows for w in health.check(row)]


# ---------------------------------------------------------------------------- health checks
def test_validation_flat_over_k_validations_is_said_whatever_the_train_score_does():
    rows = [{"critic/score/mean": 0.5 - 0.01 * i, VAL: 0.30 + 0.01 * (i % 2),
             "training/step": i} for i in range(1, 7)]  # fmt: skip
    health = RunHealth(None)
    health.baseline({VAL: 0.30})
    said = _feed(health, rows)
    assert len(said) == 1 and "validation has stayed at 0.300" in said[0]
    assert "lmrl sweep" in said[0] and "steps 0-6" in said[0]
    moving = RunHealth(None)
    moving.baseline({VAL: 0.30})
    assert _feed(moving, [{**r, VAL: 0.30 + 0.03 * i} for i, r in enumerate(rows)]) == []


def test_a_collapse_is_entropy_under_a_floor_while_validation_falls():
    health = RunHealth(None)
    health.baseline({VAL: 0.45})
    rows = [{"actor/entropy": e, "critic/score/mean": 0.1, VAL: v, "training/step": s}
            for s, (e, v) in enumerate([(2.2, 0.5), (1.7, 0.3), (0.9, 0.1), (0.1, 0.0)], 1)]  # fmt: skip
    said = _feed(health, rows[:3])
    assert health.collapse is None and not any("collapsed" in w for w in said)  # entropy 0.9
    said = _feed(health, rows[3:])
    assert health.collapse == (1, 0.5, 0.0)
    assert any("collapsed" in w and "from 0.500 (step 1) to 0.000 (step 4)" in w for w in said)
    assert any("trainer.max_rollbacks=2" in w for w in said)
    health.rewind(1)  # the run went back to step 1: the collapse may be said again
    assert health.collapse is None and health.val_history == [(0, 0.45), (1, 0.5)]
    assert any("collapsed" in w for w in _feed(health, rows[3:]))
    # validation that falls while the entropy stays high is not a collapse
    high = RunHealth(None)
    high.baseline({VAL: 0.45})
    _feed(high, [{**r, "actor/entropy": 2.0} for r in rows])
    assert high.collapse is None


def test_a_score_that_climbs_while_responses_hit_the_limit_is_said_once():
    rows = [{"critic/score/mean": 0.1 + 0.05 * i, "response_length/clip_ratio": min(1, 0.1 * i)}
            for i in range(16)]  # fmt: skip
    said = _feed(RunHealth(None), rows)
    assert len(said) == 1 and "paying for length" in said[0]
    assert "reward.overlong_buffer.enable=true" in said[0]
    short = [{**r, "response_length/clip_ratio": 0.05} for r in rows]
    assert _feed(RunHealth(None), short) == []


# ---------------------------------------------------------------------------- config
def test_rollback_without_validation_is_one_line(tiny_workspace):
    base = [f"model.path={tiny_workspace / 'model'}",
            f"data.train_files={tiny_workspace / 'data' / 'train.parquet'}"]  # fmt: skip
    needs = r"trainer\.max_rollbacks=2 \(the rollback\) needs validation"
    with pytest.raises(ConfigError, match=needs):  # the old switch folds into max_rollbacks
        load_config(None, [*base, "trainer.rollback=true"])
    with pytest.raises(ConfigError, match=r"trainer.rollback_lr_factor.*must be in \(0, 1\)"):
        load_config(None, [*base, "trainer.rollback_lr_factor=1.5"])


# ---------------------------------------------------------------------------- the rollback
@pytest.fixture(scope="module")
def warm_digits(tmp_path_factory):
    """A tiny model warm-started on digits to greedy accuracy ~0.3-0.5 (about 20 s)."""
    from lmrl.demos.digits import run_sft, warm_start_options, write_task_data
    from lmrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("doctor")
    model = build_tiny_model(root / "model", arch="qwen2", size="tiny", seed=0)
    data = write_task_data("digits", root / "data", seed=0, num_train=2000, num_val=64,
                           sft_options=warm_start_options("digits"))  # fmt: skip
    sft = run_sft(model, data, root / "sft", seed=0, target_acc=0.3, max_steps=300, lr=1e-3,
                  batch_size=64, max_new_tokens=8, console=False)  # fmt: skip
    assert sft["acc"] >= 0.2, sft
    return sft["model"], data


def _rl(model: Path, data: dict, run_dir: Path, *extra: str):
    return load_config(None, [
        f"model.path={model}", f"data.train_files={data['train']}",
        f"data.val_files={data['test']}", "data.max_prompt_length=64",
        "data.max_response_length=8", "data.train_batch_size=16", "rollout.n=4",
        "algorithm.adv_estimator=grpo", "actor.ppo_mini_batch_size=16",
        "actor.optim.lr=1e-2", "actor.optim.lr_warmup_steps=0",
        "model.enable_gradient_checkpointing=false", "reward.num_workers=0",
        "trainer.total_training_steps=24", "trainer.test_freq=3", "trainer.save_freq=-1",
        "trainer.logger=[jsonl]", f"trainer.default_local_dir={run_dir}", "trainer.device=cpu",
        *extra,
    ])  # fmt: skip


def test_a_collapsed_run_rolls_back_to_its_best_checkpoint_and_ends_above_the_collapse(
    warm_digits, tmp_path
):
    """lr 1e-2 collapses the warm start (validation to ~0); with trainer.max_rollbacks the run
    goes back to its best validated checkpoint at a lower lr and ends well above the collapse."""
    model, data = warm_digits
    cfg = _rl(model, data, tmp_path / "plain")
    plain = Trainer(build_run(cfg), cfg.trainer)
    plain.fit()
    collapsed = plain.validations[24][VAL]
    best_plain = max(v[VAL] for v in plain.validations.values())
    assert collapsed < best_plain - 0.15, plain.validations  # the forced collapse happened

    # x0.01: at lr 1e-3 this tiny warm start's greedy accuracy still sinks to ~0.1 (its
    # samples at temperature 1 are far worse than its greedy answers); at 1e-4 it holds
    cfg = _rl(model, data, tmp_path / "doctor", "trainer.max_rollbacks=2",
              "trainer.rollback_lr_factor=0.01")  # fmt: skip
    trainer = Trainer(build_run(cfg), cfg.trainer)
    trainer.fit()
    run_dir = tmp_path / "doctor"
    rolled = sorted(p.name for p in (run_dir / "rolled_back").iterdir())
    assert rolled and len(rolled) <= 2
    final = trainer.validations[24][VAL]
    assert final > collapsed + 0.15, (final, collapsed, trainer.validations)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    backs = [r for r in records if "doctor/rollback" in r]
    assert [r["doctor/rollback"] for r in backs] == [float(i + 1) for i in range(len(rolled))]
    assert np.isclose(backs[-1]["doctor/lr_scale"], 0.01 ** len(backs))
    assert all(r["step"] < r["doctor/rolled_back_from"] for r in backs)
    # the best checkpoint was re-saved with the lower lr: a resume keeps it
    best = json.loads((run_dir / "best_validation.json").read_text())
    state = load_state(run_dir / f"global_step_{best['step']}")
    assert state["actor"]["lr_scale"] <= 0.01 + 1e-12
    assert all(int(p.name.split("_")[-1]) > best["step"]
               for folder in (run_dir / "rolled_back").iterdir() for p in folder.iterdir())  # fmt: skip
    assert list_checkpoints(run_dir)[-1].name == "global_step_24"
    # lmrl plot marks each rollback in the reward and validation panels
    from lmrl.logging.plot import draw_run, load_metrics

    figure = draw_run(load_metrics(run_dir / "metrics.jsonl"))
    came_from = int(backs[0]["doctor/rolled_back_from"])
    for ax in figure.axes[:2]:
        labels = ax.get_legend_handles_labels()[1]
        assert f"rollback 1 (from step {came_from})" in labels, labels


def test_the_lr_scale_travels_in_the_worker_state(tiny_workspace, tmp_path):
    """A worker's ``lr_scale`` multiplies the configured lr in the param groups and the
    schedule, and 1.0 leaves the state exactly as before."""
    cfg = load_config(None, [
        f"model.path={tiny_workspace / 'model'}",
        f"data.train_files={tiny_workspace / 'data' / 'train.parquet'}",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.optim.lr=1e-3",
        "trainer.device=cpu", f"trainer.default_local_dir={tmp_path}", "trainer.logger=[]",
    ])  # fmt: skip
    trainer = Trainer(build_run(cfg), cfg.trainer)
    actor = trainer.parts.actor
    assert actor.state_dict()["lr_scale"] == 1.0
    assert trainer.lower_lr(0.1) == pytest.approx(0.1)
    assert actor.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
    actor.scheduler.step()
    assert actor.scheduler.get_last_lr()[0] == pytest.approx(1e-4)
    state = actor.state_dict()
    state["lr_scale"] = 1.0
    actor.load_state_dict(state)
    assert actor.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert torch.equal(torch.tensor(actor.scheduler.base_lrs), torch.tensor([1e-3]))
