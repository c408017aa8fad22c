"""``lmrl train-flow`` names a user's reward hacked from its logged prompt fidelity: a reward
that climbs while the fidelity of the same images falls is said at the validation where it
shows, with both figures."""

from __future__ import annotations

import dataclasses
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
