"""The run doctor's rollback is all or nothing: a run killed at any point of it and resumed
(``trainer.resume_mode=auto``) goes on as the uninterrupted run does: the same step, lr,
rollback count, checkpoints kept and moved, and final weights.

The kills are exceptions raised in process at each point of the rollback (on a program with
no model, `rollback_run`), one SIGKILL of a subprocess, and one kill of the RL trainer's
rollback on the tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests.run.rollback_run import LrProgram, Settings, fit

from lmrl.run import checkpoint as checkpoint_module
from lmrl.run.checkpoint import list_checkpoints, load_state, read_weights
from lmrl.run.doctor import INTENT, ROLLED_BACK
from lmrl.run.loop import RunLoop

RUNNER = Path(__file__).with_name("rollback_run.py")


class Killed(BaseException):
    """A kill, in process: nothing after it runs (not even ``except Exception``)."""


def _on_disk(run_dir: Path) -> dict:
    """What a run directory holds: each checkpoint's step, lr and weights, the moved ones,
    and whatever a rollback left behind (its intent, half-replaced checkpoints)."""

    def saved(path: Path) -> tuple:
        state, weights = load_state(path), read_weights(path / "model.safetensors")
        return state["global_step"], state["lr"], weights["w"].tolist()

    folders = sorted((run_dir / ROLLED_BACK).glob("*"))
    return {
        "checkpoints": {p.name: saved(p) for p in list_checkpoints(run_dir)},
        "rolled_back": {
            f"{f.name}/{p.name}": saved(p) for f in folders for p in sorted(f.iterdir())
        },
        "left": sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")),
        "intent": (run_dir / INTENT).exists(),
    }


def _rollbacks_logged(*programs: LrProgram) -> list[tuple[int, dict]]:
    return [(step, m) for p in programs for step, m in p.trackers.logged if "doctor/rollback" in m]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole")
    program, loop = fit(run_dir)
    return program, loop, _on_disk(run_dir)


def test_the_uninterrupted_rollback(uninterrupted):
    """Collapse at step 5: back to the best (step 2) at lr x0.5, steps 3 and 4 moved."""
    program, loop, disk = uninterrupted
    assert (program.global_step, program.lr, loop.doctor.rollbacks) == (8, 0.5, 1)
    assert program.weight.tolist() == [5.0, 5.0]  # 2 steps at lr 1, 6 at 0.5
    assert disk["checkpoints"]["global_step_2"] == (2, 0.5, [2.0, 2.0])  # saved again, lower lr
    assert disk["rolled_back"] == {"1/global_step_3": (3, 1.0, [3.0, 3.0]),
                                   "1/global_step_4": (4, 1.0, [4.0, 4.0])}  # fmt: skip
    assert not disk["intent"] and not disk["left"]
    ((step, logged),) = _rollbacks_logged(program)
    assert step == 2 and logged["doctor/rolled_back_from"] == 5 and logged["doctor/lr_scale"] == 0.5


class _Os:
    """``os`` of the checkpoint module, whose ``replace`` kills the run between the two renames
    of a checkpoint saved again (the old one aside, the new one not yet in place)."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def replace(src, dst):
        dst = Path(dst)
        if dst.name.startswith("global_step_") and (dst.parent / f".{dst.name}.old").exists():
            raise Killed
        os.replace(src, dst)


# each point of the rollback: after its intent is written; after the first of the two moves;
# after the moves; inside the best's save again (before its manifest); between the save's two
# renames; after the save, before the intent is removed
POINTS = ["rollback", "move", "rollback_load", "save", "swap", "rollback_done"]


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_at_any_point_of_a_rollback_resumes_to_the_uninterrupted_run(
    point, uninterrupted, tmp_path, monkeypatch
):
    began = {"rollback": False}

    def on_stage(name: str) -> None:
        began["rollback"] |= name == "rollback"
        if began["rollback"] and name == point:
            raise Killed

    if point == "move":
        moves = []

        def move(src, dst):
            if moves:
                raise Killed
            moves.append(src)
            os.replace(src, dst)

        monkeypatch.setattr("lmrl.run.doctor.shutil", SimpleNamespace(move=move))
    if point == "swap":
        monkeypatch.setattr(checkpoint_module, "os", _Os())
    cut = LrProgram(tmp_path)
    with pytest.raises(Killed):
        RunLoop(cut, Settings(), on_stage=on_stage).run()  # type: ignore[arg-type]
    assert (tmp_path / INTENT).is_file()  # killed inside the rollback from step 5
    monkeypatch.undo()

    resumed, loop = fit(tmp_path)
    whole, _, whole_disk = uninterrupted
    assert (resumed.global_step, resumed.lr, loop.doctor.rollbacks) == (8, 0.5, 1)
    assert torch.equal(resumed.weight, whole.weight)
    assert _on_disk(tmp_path) == whole_disk
    assert len(_rollbacks_logged(cut, resumed)) == 1  # said once, by whichever run finished it


def test_a_sigkill_between_the_moves_and_the_save_resumes_at_the_lower_lr(uninterrupted, tmp_path):
    """The moves done, the best not yet saved again: resumed, the run is at the lower lr with
    the rollback counted once, as the uninterrupted run."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    killed = subprocess.run([sys.executable, str(RUNNER), str(tmp_path), "rollback_load"],
                            env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (tmp_path / INTENT).is_file()
    assert load_state(tmp_path / "global_step_2")["lr"] == 1.0  # not saved again yet
    resumed, loop = fit(tmp_path)
    whole, _, whole_disk = uninterrupted
    assert (resumed.global_step, resumed.lr, loop.doctor.rollbacks) == (8, 0.5, 1)
    assert torch.equal(resumed.weight, whole.weight)
    assert _on_disk(tmp_path) == whole_disk


def test_an_interrupted_rollback_is_dropped_by_a_run_that_starts_over(
    tmp_path, monkeypatch, caplog
):
    def on_stage(name: str) -> None:
        if name == "rollback_load":
            raise Killed

    with pytest.raises(Killed):
        RunLoop(LrProgram(tmp_path), Settings(), on_stage=on_stage).run()  # type: ignore[arg-type]
    monkeypatch.setattr(Settings, "resume_mode", "disable")
    with caplog.at_level("WARNING", logger="lmrl.trainer"):
        program = LrProgram(tmp_path, resume_mode="disable")
        RunLoop(program, Settings()).run()  # type: ignore[arg-type]
    assert "rollback 1 (from step 5 back to step 2) was interrupted and is dropped: " \
           "trainer.resume_mode=disable" in caplog.text  # fmt: skip
    assert not (tmp_path / INTENT).exists() and program.global_step == 8
    assert len(_rollbacks_logged(program)) == 1  # its own collapse at step 5, rolled back


# ------------------------------------------------------------------ the RL trainer's rollback
def test_the_trainer_killed_in_its_rollback_resumes_to_the_uninterrupted_weights(
    tiny_workspace, tiny_overrides, tmp_path
):
    """The RL trainer (tiny model), whose lr scale is in the actor's state, collapses at its
    one step. Killed before the best (the validation before the first step, global_step_0) is
    saved again, it resumes with the uninterrupted run's lr scale and ends with its weights,
    bit for bit."""
    from lmrl.config import load_config
    from lmrl.run.health import RunHealth
    from lmrl.trainer import Trainer, build_run

    class Collapses(RunHealth):
        """A collapse at step 1 while the actor's lr is unscaled."""

        def __init__(self, trainer) -> None:
            super().__init__(None)
            self.trainer = trainer

        def check(self, metrics):
            out = super().check(metrics)
            if self.trainer.global_step == 1 and self.trainer.actor.lr_scale == 1.0:
                self.collapse = (0, 0.0, 0.0)
            return out

    def run(run_dir: Path, on_stage=None) -> Trainer:
        cfg = load_config(None, tiny_overrides(
            tiny_workspace, run_dir, f"data.val_files={tiny_workspace / 'data' / 'test.parquet'}",
            "trainer.total_training_steps=1", "trainer.test_freq=100", "trainer.max_rollbacks=1",
            "trainer.rollback_lr_factor=0.5",
        ))  # fmt: skip
        trainer = Trainer(build_run(cfg), cfg.trainer, on_stage=on_stage)
        trainer.health = Collapses(trainer)
        trainer.fit()
        return trainer

    def kill(name: str) -> None:
        if name == "rollback_load":
            raise Killed

    whole = run(tmp_path / "whole")
    with pytest.raises(Killed):
        run(tmp_path / "cut", on_stage=kill)
    cut = tmp_path / "cut"
    assert load_state(cut / "global_step_0")["actor"]["lr_scale"] == 1.0  # not saved again yet
    resumed = run(cut)
    assert resumed.global_step == whole.global_step == 1
    assert resumed.actor.lr_scale == whole.actor.lr_scale == 0.5
    for run_dir in (tmp_path / "whole", cut):
        assert load_state(run_dir / "global_step_0")["actor"]["lr_scale"] == 0.5
        assert (run_dir / ROLLED_BACK / "1").is_dir() and not (run_dir / INTENT).exists()
    expected = read_weights(tmp_path / "whole" / "global_step_1" / "actor.safetensors")
    actual = read_weights(cut / "global_step_1" / "actor.safetensors")
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
