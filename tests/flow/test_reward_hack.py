"""An image run's reward hacked: the user's reward climbing while the prompt fidelity of the
same images falls is named with both figures as soon as it shows, in place of the zero-spread
warning's hint, and sets the flag the run doctor's rollback acts on; a healthy run is quiet."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lmrl.run.health import ZERO_SPREAD_KEY
from lmrl.run.loop import RunLoop
from lmrl.trainer.flow_health import FIDELITY_KEY, FlowHealth

VAL_R, VAL_F = "val/shapes/reward/mean", "val/shapes/fidelity/score"


def _steps(reward: np.ndarray, fidelity: np.ndarray, alike: float = 0.3) -> list[dict]:
    return [{"critic/score/mean": float(r), FIDELITY_KEY: float(f), ZERO_SPREAD_KEY: alike,
             "actor/entropy": 1.0, "training/step": float(i + 1)}
            for i, (r, f) in enumerate(zip(reward, fidelity, strict=True))]  # fmt: skip


def _feed(health: FlowHealth, rows: list[dict]) -> list[str]:
    return [w for row in rows for w in health.check(row)]


def test_the_upper_half_bluer_run_is_named_reward_hacking_at_its_first_validation():
    """The user's run: reward 0.51 -> 1.00, validation fidelity 0.65 -> 0.36, 94% of the
    groups alike; validated every 5 steps."""
    health = FlowHealth()
    assert health.baseline({VAL_R: 0.51, VAL_F: 0.65}) == []
    rows = _steps(np.linspace(0.55, 1.0, 10), np.linspace(0.6, 0.35, 10), alike=0.94)
    for row in rows[:5]:
        row[ZERO_SPREAD_KEY] = 0.5  # the groups go alike as the reward saturates
    rows[4] |= {VAL_R: 0.80, VAL_F: 0.60}  # step 5: the fidelity has not fallen yet
    rows[9] |= {VAL_R: 1.00, VAL_F: 0.36}
    said = _feed(health, rows[:5])
    assert not any("hacked" in w for w in said) and health.collapse is None
    said = _feed(health, rows[5:])
    hacked = [w for w in said if w.startswith("the reward is being hacked")]
    assert len(hacked) == 1
    assert "the validation reward climbed from 0.51 to 1.00" in hacked[0]
    assert "fell from 0.65 to 0.36 (steps 0 -> 10)" in hacked[0]
    assert "the best fidelity was at step 0 (0.65)" in hacked[0]
    assert "lmrl.flow.geneval.geneval" in hacked[0] and "actor.beta=1" in hacked[0]
    assert health.collapse == (0, 0.65, 0.36)
    alike = [w for w in said if "scored all alike" in w]
    assert len(alike) == 1 and "check the images against their prompts" not in alike[0]
    assert "The reward is being hacked" in alike[0] and "0.65 to 0.36" in alike[0]


def test_groups_alike_before_the_hack_shows_quote_the_fidelity_so_far():
    health = FlowHealth()
    said = _feed(health, _steps(np.linspace(0.9, 1.0, 5), np.linspace(0.62, 0.55, 5), 0.94))
    assert len(said) == 1 and "scored all alike" in said[0]
    assert "check the images against their prompts" not in said[0]
    assert "The reward went from 0.90 to 1.00 while the prompt fidelity" in said[0]
    assert "flow/fidelity/score" in said[0] and "went from 0.62 to 0.55" in said[0]


def test_between_validations_the_train_reward_and_fidelity_show_it():
    health = FlowHealth()
    said = _feed(health, _steps(np.linspace(0.5, 1.0, 12), np.linspace(0.65, 0.3, 12)))
    hacked = [w for w in said if "being hacked" in w]
    assert len(hacked) == 1 and "(the first 5 steps against the last 5, at step 10)" in hacked[0]
    assert FIDELITY_KEY in hacked[0] and health.collapse is not None


def test_a_healthy_image_run_is_quiet():
    # geneval's reward is the fidelity itself: both climb
    up = np.linspace(0.6, 0.8, 30)
    health = FlowHealth()
    health.baseline({VAL_R: 0.6, VAL_F: 0.6})
    rows = _steps(up, up)
    for s in (10, 20, 30):
        rows[s - 1] |= {VAL_R: float(up[s - 1]), VAL_F: float(up[s - 1])}
    assert _feed(health, rows) == [] and health.collapse is None
    # a user's reward that climbs while the fidelity holds (within noise)
    rng = np.random.default_rng(0)
    steady = 0.62 + 0.03 * rng.standard_normal(30)
    health = FlowHealth()
    health.baseline({VAL_R: 0.3, VAL_F: 0.62})
    rows = _steps(np.linspace(0.3, 0.9, 30), steady)
    rows[-1] |= {VAL_R: 0.9, VAL_F: 0.58}
    assert _feed(health, rows) == [] and health.collapse is None
    # a run without fidelity (the reward is geneval): the zero-spread hint is the old one
    health = FlowHealth()
    said = _feed(health, [{"critic/score/mean": 1.0, ZERO_SPREAD_KEY: 0.95}] * 6)
    assert len(said) == 1 and "check the images against their prompts" in said[0]


def test_the_run_doctor_rolls_a_hacked_reward_back(tmp_path):
    """A program whose reward climbs while its fidelity falls at the first lr: the loop's
    rollback acts on the flag the hack sets, and returns to the best fidelity (the health's
    ``validation_score``)."""
    from tests.run.rollback_run import LrProgram, Settings

    class Hacked(LrProgram):
        def __init__(self, run_dir: Path) -> None:
            super().__init__(run_dir)
            self.health = FlowHealth()

        def step(self):
            out = super().step()
            s = self.global_step
            hacking = self.lr == 1.0 and s > 2
            return out | {"critic/score/mean": 0.5 + (0.1 * (s - 2) if hacking else 0.0),
                          FIDELITY_KEY: 0.6, "training/step": float(s)}  # fmt: skip

        def validate(self):
            s = self.global_step
            hacking = self.lr == 1.0 and s > 2
            return {VAL_R: 0.5 + (0.1 * (s - 2) if hacking else 0.0),
                    VAL_F: 0.6 - (0.1 * (s - 2) if hacking else 0.0)}  # fmt: skip

    class Once(Settings):
        test_freq = 1  # step 3's validation: the best reward (0.6), a lower fidelity (0.5)

        def rollbacks(self) -> tuple[int, float]:
            return 1, 0.5

    program = Hacked(tmp_path)
    program.total_steps = 10
    RunLoop(program, Once()).run()  # type: ignore[arg-type]
    logged = [(s, m) for s, m in program.trackers.logged if "doctor/rollback" in m]
    assert len(logged) == 1 and logged[0][1]["doctor/rolled_back_from"] == 4
    # back to the best fidelity (step 0), not to the best (hacked) reward of step 3
    assert logged[0][0] == 0 and program.lr == 0.5
    assert program.lr == 0.5 and program.global_step == 10
