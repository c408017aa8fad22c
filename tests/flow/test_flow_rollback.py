"""The run doctor's rollback on an image run (``lmrl train-flow trainer.max_rollbacks``): its
keys' checks are one-line errors, and the best checkpoint is the one of the best prompt
fidelity (a hacked reward is highest where the images are worst), else of the best reward."""

from __future__ import annotations

import numpy as np
import pytest

from lmrl.config.errors import ConfigError
from lmrl.config.flow import load_flow_config
from lmrl.run.doctor import Doctor
from lmrl.trainer.flow_health import FlowHealth

VALIDATED = ["data.val_files=/tmp/v.parquet", "trainer.test_freq=2"]


def _load(*overrides: str):
    return load_flow_config(None, list(overrides), required=())


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        _load(*overrides)
    (message,) = err.value.errors
    assert "\n" not in str(err.value)
    return message


def test_the_rollback_keys_default_off_and_load():
    t = _load().trainer
    assert (t.max_rollbacks, t.rollback_lr_factor) == (0, 0.1) and t.rollbacks() == (0, 0.1)
    t = _load(*VALIDATED, "trainer.max_rollbacks=2", "trainer.rollback_lr_factor=0.5").trainer
    assert t.rollbacks() == (2, 0.5)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.max_rollbacks=-1"], "trainer.max_rollbacks=-1 must be >= 0 (0 = no rollback)"),
        ([*VALIDATED, "trainer.max_rollbacks=1", "trainer.rollback_lr_factor=1.0"],
         "trainer.rollback_lr_factor=1.0 must be in (0, 1), e.g. 0.1"),
        ([*VALIDATED, "trainer.max_rollbacks=1", "trainer.rollback_lr_factor=0"],
         "trainer.rollback_lr_factor=0.0 must be in (0, 1), e.g. 0.1"),
        (["trainer.max_rollbacks=2", "trainer.test_freq=2"],
         "trainer.max_rollbacks=2 (the rollback) needs validation to find the best checkpoint: "
         "set data.val_files and trainer.test_freq > 0"),
        (["data.val_files=/tmp/v.parquet", "trainer.max_rollbacks=2", "trainer.test_freq=-1"],
         "trainer.max_rollbacks=2 (the rollback) needs validation to find the best checkpoint: "
         "set data.val_files and trainer.test_freq > 0"),
        (["trainer.rollback_lr_factor=0.5"],
         "trainer.rollback_lr_factor=0.5 changes nothing: trainer.max_rollbacks=0 turns the "
         "rollback off; set trainer.max_rollbacks > 0 (e.g. 2) or leave "
         "trainer.rollback_lr_factor out"),
    ],
)  # fmt: skip
def test_a_bad_rollback_key_is_one_error_naming_it(overrides, expected):
    assert _error(*overrides) == expected


def test_the_doctor_of_an_image_run_keeps_the_best_fidelity(tmp_path):
    rank = FlowHealth.validation_score
    doctor = Doctor(tmp_path, 1, 0.1, score=rank)
    hacked = {"val/shapes/reward/mean": 0.9, "val/shapes/fidelity/score": 0.3}
    assert doctor.is_new_best(0, {"val/shapes/reward/mean": 0.4, "val/shapes/fidelity/score": 0.6})
    assert not doctor.is_new_best(2, hacked)  # more reward, less fidelity: not the best
    assert doctor.best == (0.6, 0)
    # the RL ranking would keep the hacked one
    assert Doctor(tmp_path / "rl", 1, 0.1).is_new_best(2, hacked)
    # without the fidelity (the reward is geneval itself) the reward ranks
    assert rank({"val/shapes/reward/mean": 0.7}) == 0.7 and rank({"loss": 1.0}) is None


def test_a_rolled_back_health_sees_the_hack_again_only_from_fresh_steps():
    from tests.flow.test_reward_hack import _feed, _steps

    rows = _steps(np.linspace(0.5, 1.0, 12), np.linspace(0.65, 0.3, 12))
    health = FlowHealth()
    assert any("being hacked" in w for w in _feed(health, rows)) and health.collapse is not None
    health.rewind(0)  # back to the start: the steps seen are abandoned
    assert health.collapse is None
    assert _feed(health, rows[-1:]) == [] and health.collapse is None  # one step: no window
    health.rewind(0)
    assert any("being hacked" in w for w in _feed(health, rows))  # the same run: said again
