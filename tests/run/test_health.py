"""Warnings while a run fails: each said once, only when its condition holds."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from lmrl.run.health import ZERO_SPREAD_KEY, RunHealth, SFTHealth
from lmrl.trainer.metrics import zero_spread_fraction


def _feed(health: RunHealth, rows: list[dict]) -> list[str]:
    said = []
    for row in rows:
        said += health.check(row)
    return said


def test_a_near_uniform_start_is_said_once():
    said = _feed(RunHealth(vocab_size=259), [{"actor/entropy": 5.5}] * 3)
    assert len(said) == 1 and "starts near uniform" in said[0] and "lmrl sft" in said[0]
    assert _feed(RunHealth(vocab_size=259), [{"actor/entropy": 2.0}] * 3) == []


def test_entropy_collapse_with_a_flat_score_is_said_once_but_not_when_the_score_rises():
    entropy = np.geomspace(3.6, 0.05, 20)
    flat = [{"actor/entropy": float(e), "critic/score/mean": 0.55 + 0.01 * (i % 2)}
            for i, e in enumerate(entropy)]  # fmt: skip
    said = _feed(RunHealth(vocab_size=259), flat)
    assert len(said) == 1 and "sharpening" in said[0] and "rollout.temperature=0.7" in said[0]
    assert "loss_mode=clip_cov" in said[0]
    rising = [{"actor/entropy": float(e), "critic/score/mean": 0.1 + 0.04 * i}
              for i, e in enumerate(entropy)]  # fmt: skip
    assert _feed(RunHealth(vocab_size=259), rising) == []


def test_mostly_zero_spread_groups_are_said_once_when_sustained():
    said = _feed(RunHealth(None), [{ZERO_SPREAD_KEY: 0.9}] * 8)
    assert len(said) == 1 and "filter_groups.enable=true" in said[0]
    assert _feed(RunHealth(None), [{ZERO_SPREAD_KEY: 0.9}, {ZERO_SPREAD_KEY: 0.3}] * 4) == []


def test_an_sft_loss_that_does_not_drop_is_said_once():
    health = SFTHealth(total_steps=100)
    said = [w for _ in range(60) for w in health.check({"sft/loss": 5.5, "sft/lr": 1e-4})]
    assert len(said) == 1 and "has not dropped after 25 steps at optim.lr=0.0001" in said[0]
    health = SFTHealth(total_steps=100)
    assert [w for i in range(60) for w in health.check({"sft/loss": 5.5 * 0.97**i})] == []


def test_zero_spread_fraction_counts_groups_of_two_or_more():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.3])
    uid = np.array(["a", "a", "b", "b", "c", "c", "d"], dtype=object)  # d: one sample
    assert zero_spread_fraction(scores, uid) == pytest.approx(2 / 3)
    assert zero_spread_fraction(scores[:1], uid[:1]) is None


def test_the_trainer_warns_about_a_from_scratch_policy(
    tiny_workspace, tiny_overrides, tmp_path, caplog
):
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    cfg = load_config(None, tiny_overrides(tiny_workspace, tmp_path / "run"))
    with caplog.at_level(logging.WARNING, logger="lmrl"):
        history = Trainer(build_run(cfg), cfg.trainer).fit()
    assert all(ZERO_SPREAD_KEY in m for m in history)
    said = [r.getMessage() for r in caplog.records if "starts near uniform" in r.getMessage()]
    assert len(said) == 1


def test_flat_validation_while_the_train_score_rises_is_said_once():
    # the seed-2 demo's shape: validation at ~0.70 from early on, the train score climbing
    rows = [{"critic/score/mean": 0.5 + 0.02 * i, "val/digits/acc": min(0.3 + 0.1 * i, 0.7)}
            for i in range(20)]  # fmt: skip
    said = _feed(RunHealth(None), rows)
    assert len(said) == 1 and "validation stayed at 0.700" in said[0]
    improving = [{"critic/score/mean": 0.5 + 0.02 * i, "val/digits/acc": 0.3 + 0.03 * i}
                 for i in range(20)]  # fmt: skip
    assert _feed(RunHealth(None), improving) == []


def test_samples_far_below_the_validation_before_training_are_said_once():
    # the sort task's shape (docs/learning.md): sampled partial credit 0.35, greedy 0.73
    health = RunHealth(None)
    health.baseline({"val/sort/reward/mean": 0.73, "val/sort/acc": 0.31, "val/sort/mean@1": 0.7})
    said = _feed(health, [{"critic/score/mean": 0.35}] * 8)
    assert (
        len(said) == 1
        and "(0.350) is far below the validation score before training (0.730)" in said[0]
    )
    assert "rollout.temperature=0.7" in said[0]
    close = RunHealth(None)
    close.baseline({"val/digits/reward/mean": 0.75})
    assert _feed(close, [{"critic/score/mean": 0.55}] * 8) == []  # the demo's: 0.73 of it
    assert _feed(RunHealth(None), [{"critic/score/mean": 0.05}] * 8) == []  # no baseline
