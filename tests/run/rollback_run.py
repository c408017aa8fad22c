"""A program with a learning rate that the run doctor rolls back, for the rollback's kill
tests (no model: its weights are one tensor each step adds the lr to).

Run as a script, ``python rollback_run.py RUN_DIR STAGE``: the run SIGKILLs itself at the
loop's ``on_stage`` seam STAGE of its rollback (``rollback``, ``rollback_load``,
``rollback_done``).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from lmrl.run.checkpoint import load_state, read_weights
from lmrl.run.loop import RunLoop, resume
from lmrl.run.resume import RunStart, resume_point

COMMAND = "lmrl test"
STEPS = 8
COLLAPSE_AT = 5  # seen while the lr is the first one: the rollback goes back to step 2


@dataclass
class FakeConfig:
    a: int = 1


class Settings:
    """The ``trainer`` keys the loop reads: saves every step, validation every 2, rollbacks."""

    save_freq, test_freq, val_before_train = 1, 2, True
    log_generations_freq, max_ckpt_to_keep, resume_mode = -1, None, "auto"

    def rollbacks(self) -> tuple[int, float]:
        return 2, 0.5


class Trackers:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def log_generations(self, rows, step):
        pass

    def close(self):
        pass


class Health:
    """Sees a collapse at step `COLLAPSE_AT` while the lr is 1 (read from the program's
    checkpointed state, so a resumed run sees what the uninterrupted one saw)."""

    def __init__(self, program: LrProgram) -> None:
        self.program = program
        self.collapse: tuple[int, float, float] | None = None

    def baseline(self, val):
        pass

    def check(self, metrics):
        if self.program.global_step == COLLAPSE_AT and self.program.lr == 1.0:
            self.collapse = (2, 0.0, -3.0)
        return []

    def rewind(self, step):
        self.collapse = None


class LrProgram:
    """Each step adds the lr to the weights; validation is best at step 2."""

    def __init__(self, run_dir: Path, resume_mode: str = "auto") -> None:
        run_dir = Path(run_dir)
        start = resume_point(resume_mode, run_dir, COMMAND)
        self.start = RunStart(run_dir, COMMAND, FakeConfig(), start)
        self.trackers = Trackers()
        self.health = Health(self)
        self.total_steps, self.global_step = STEPS, 0
        self.weight = torch.zeros(2)
        self.lr = 1.0
        self.on_stage = None
        resume(self)

    has_validation = True

    def step(self):
        self.weight += self.lr
        self.global_step += 1
        return {"loss": float(self.weight[0])}

    def validate(self):
        return {"val/x/acc": -abs(self.global_step - 2.0)}

    def checkpoint_weights(self):
        return {"model": {"w": self.weight.clone()}}

    def state_dict(self):
        return {"global_step": self.global_step, "lr": self.lr}

    def load_checkpoint(self, path):
        self.weight = read_weights(path / "model.safetensors")["w"]
        state = load_state(path)
        self.global_step, self.lr = state["global_step"], state["lr"]

    def lower_lr(self, factor: float) -> float:
        self.lr *= factor
        return self.lr

    def export(self):
        out = self.start.run_dir / "final"
        out.mkdir(exist_ok=True)
        return out

    def generations(self):
        return []

    def close(self):
        pass


def fit(run_dir: Path, on_stage=None) -> tuple[LrProgram, RunLoop]:
    """Run (or resume) the program in ``run_dir`` to its last step."""
    program = LrProgram(run_dir)
    loop = RunLoop(program, Settings(), on_stage=on_stage)  # type: ignore[arg-type]
    loop.run()
    return program, loop


def kill_at(stage: str):
    """An ``on_stage`` that SIGKILLs this process at ``stage`` once a rollback began."""
    began = {"rollback": False}

    def on_stage(name: str) -> None:
        began["rollback"] |= name == "rollback"
        if began["rollback"] and name == stage:
            os.kill(os.getpid(), signal.SIGKILL)

    return on_stage


if __name__ == "__main__":
    fit(Path(sys.argv[1]), on_stage=kill_at(sys.argv[2]))
