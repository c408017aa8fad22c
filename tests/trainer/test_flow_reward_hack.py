"""``lmrl train-flow`` names a user's reward hacked from its logged prompt fidelity: a reward
that climbs while the fidelity of the same images falls is said at the validation where it
shows, with both figures."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from lmrl.config.flow import load_flow_config
from lmrl.trainer.flow import FlowTrainer, build_flow
from lmrl.trainer.flow_health import FlowHealth


def _args(root, run, *extra):
    return [
        f"model.path={root / 'model'}",
        f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}",
        f"trainer.default_local_dir={run}", "trainer.logger=[]",
        "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.test_freq=2",
        "data.train_batch_size=2", "sampler.n=2", "sampler.num_steps=4",
        "sampler.val_num_steps=4", "actor.micro_batch_size=2", "actor.ppo_mini_batch_size=2",
        "trainer.device=cpu", *extra,
    ]  # fmt: skip


class Climbing:
    """A user's reward that pays more at each call (each image of a call alike but one)."""

    def __init__(self) -> None:
        self.calls = 0

    def score(self, images, prompts, metadata):
        self.calls += 1
        scores = torch.full((images.shape[0],), 0.3 + 0.15 * self.calls)
        scores[0] -= 0.01
        return scores, {}, {"reward/errors": 0.0}


class Falling:
    """The prompt fidelity of the same images, lower at each call."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        return {"score": torch.full((images.shape[0],), 0.7 - 0.1 * self.calls)}


def test_a_reward_climbing_while_the_fidelity_falls_is_named_at_the_validation(
    flow_workspace, tmp_path, caplog
):
    parts = build_flow(load_flow_config(None, _args(flow_workspace, tmp_path / "run")))
    trainer = FlowTrainer(dataclasses.replace(parts, reward=Climbing(), fidelity=Falling()))
    assert isinstance(trainer.health, FlowHealth)
    with caplog.at_level(logging.WARNING, logger="lmrl"):
        history = trainer.fit()
    assert history[0]["training/step"] == 1.0
    hacked = [r.getMessage() for r in caplog.records if "being hacked" in r.getMessage()]
    # validations at 0 (calls 1) and 2 (calls 4): reward 0.45 -> 0.90, fidelity 0.60 -> 0.30
    assert len(hacked) == 1
    assert "the validation reward climbed from 0.45 to 0.90" in hacked[0]
    assert "fell from 0.60 to 0.30 (steps 0 -> 2)" in hacked[0]
    assert trainer.health.collapse == (0, pytest.approx(0.6), pytest.approx(0.3))  # rollback's


class Fidelity:
    """The prompt fidelity of the same images at each call: ``values``, then falling."""

    def __init__(self, *values: float) -> None:
        self.values, self.calls = values, 0

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        extra = self.calls - len(self.values)
        value = self.values[-1] - 0.1 * extra if extra > 0 else self.values[self.calls - 1]
        return {"score": torch.full((images.shape[0],), value)}


class Recorded:
    """The run's trackers, with what they logged kept."""

    def __init__(self, trackers) -> None:
        self.trackers, self.logged = trackers, []

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))
        self.trackers.log(metrics, step)

    def __getattr__(self, name):
        return getattr(self.trackers, name)


def _hacked_run(root, run, rollbacks: int):
    """Validated every step: at step 1 the reward climbed (0.45 -> 0.75) and the fidelity held
    (0.60 -> 0.55): the best reward, not the best fidelity; at step 2 the reward is hacked
    (1.05, fidelity 0.30)."""
    args = _args(root, run, "trainer.total_training_steps=3", "trainer.test_freq=1",
                 f"trainer.max_rollbacks={rollbacks}")  # fmt: skip
    parts = build_flow(load_flow_config(None, args))
    # calls: validation 0, step 1, validation 1, step 2, validation 2, ...
    fidelity = Fidelity(0.6, 0.6, 0.55, 0.5, 0.3)
    trainer = FlowTrainer(dataclasses.replace(parts, reward=Climbing(), fidelity=fidelity))
    trainer.trackers = Recorded(trainer.trackers)
    return trainer


def test_a_hacked_image_run_rolls_back_to_its_best_fidelity_at_a_lower_lr(
    flow_workspace, tmp_path, caplog
):
    trainer = _hacked_run(flow_workspace, tmp_path / "run", rollbacks=1)
    lr = trainer.cfg.actor.optim.lr
    with caplog.at_level(logging.WARNING, logger="lmrl"):
        history = trainer.fit()
    doctor = [m for _, m in trainer.trackers.logged if "doctor/rollback" in m]
    assert len(doctor) == 1
    assert doctor[0]["doctor/rolled_back_from"] == 2 and doctor[0]["doctor/lr_scale"] == 0.1
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "rollback 1: from step 2 back to step 0 (validation 0.600)" in said  # not step 1
    assert (tmp_path / "run" / "rolled_back" / "1").is_dir()
    best = json.loads((tmp_path / "run" / "best_validation.json").read_text())
    assert best == {"score": pytest.approx(0.6), "step": 0}
    assert [h["training/step"] for h in history] == [1.0, 2.0, 1.0, 2.0, 3.0]
    assert trainer.lr_scale == 0.1 and trainer.global_step == 3
    assert all(g["lr"] == pytest.approx(lr * 0.1) for g in trainer.optimizer.param_groups)
    # the lower lr is in the checkpoints: a resumed run keeps it
    resumed = FlowTrainer(build_flow(trainer.cfg))
    assert resumed.global_step == 3 and resumed.lr_scale == pytest.approx(0.1)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(lr * 0.1)
    resumed.close()


def test_without_max_rollbacks_a_hacked_image_run_is_only_said(flow_workspace, tmp_path):
    trainer = _hacked_run(flow_workspace, tmp_path / "run", rollbacks=0)
    history = trainer.fit()
    assert trainer.health.collapse is not None  # the hack was seen
    assert not [m for _, m in trainer.trackers.logged if "doctor/rollback" in m]
    assert [h["training/step"] for h in history] == [1.0, 2.0, 3.0]
    assert not (tmp_path / "run" / "rolled_back").exists() and trainer.lr_scale == 1.0
    assert trainer.optimizer.param_groups[0]["lr"] == trainer.cfg.actor.optim.lr
