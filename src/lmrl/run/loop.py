"""One run loop for every program: ``lmrl train``, ``lmrl sft``, ``lmrl train-flow`` and the
demos all run through `RunLoop`.

A *program* (`Program`: the RL `Trainer`, `SFTTrainer`, `FlowTrainer`) brings what differs:
its step, its validation, what a checkpoint holds, and its export. The loop brings what must
hold the same for all of them:

- **cadence**: validation before the first step (``trainer.val_before_train``), every
  ``test_freq`` steps and after the last; a checkpoint every ``save_freq`` steps and at the
  end; generations logged every ``log_generations_freq`` steps;
- **one owner**: the run directory's lock (`lmrl.run.lock`) is held from before
  ``config.yaml`` is written until the program is closed; a directory another process holds
  is refused in one line naming its pid and command;
- **signals**: the first SIGINT/SIGTERM finishes the step, saves and returns (exit code 130 or
  143, `exit_code`); the second stops at once (``StopNow``);
- **no lost work**: a periodic save that fails is logged and retried at the next one; a failed
  final save raises ``CheckpointError`` naming the last good one; a tracker that cannot write
  never stops the run; a Ray worker that dies raises ``WorkerError`` naming the checkpoint to
  resume from;
- **exact resume**: `resume` loads ``trainer.resume_mode``'s checkpoint into the program (the
  program's constructor calls it), and a resumed run ends with the weights an uninterrupted
  one ends with;
- **health, trackers, progress**: each step's metrics go to the trackers (the console's
  progress bar among them) and to the program's health checks;
- **early stop**: ``on_step_end(step, metrics) -> stop`` after each step (it may add metrics,
  which are then logged); a run it stops is validated, checkpointed and exported like a run
  that reached its last step;
- **rollback** (``trainer.max_rollbacks`` > 0, RL and image runs): each new best validation
  is saved, and a collapse, a divergence or a hacked reward the health checks see
  (``Health.collapse``) sends the run back to it at a lower lr (`lmrl.run.doctor`);
  a rollback a kill interrupted is finished before the resumed run's next step.

A run that ends (its last step, or an early stop) writes ``run_dir/final`` (`Program.export`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from lmrl.config.run import RunSettings
from lmrl.errors import CheckpointError, WorkerError
from lmrl.run.checkpoint import latest_checkpoint, save_checkpoint
from lmrl.run.doctor import Doctor, Rollback
from lmrl.run.health import validation_score
from lmrl.run.lock import RunDirLock
from lmrl.run.resume import RunStart, check_untouched
from lmrl.run.signals import EXIT_CODES, StopOnSignal

log = logging.getLogger("lmrl.trainer")

__all__ = ["Health", "Program", "RunLoop", "RunsOnLoop", "StepEnd", "resume"]

StepEnd = Callable[[int, dict[str, float]], bool]
"""``on_step_end(step, metrics) -> stop``: asked after each step, before it is logged."""


class Health(Protocol):
    """Warnings for a run that is failing while it runs (``lmrl.run.health``)."""

    def baseline(self, val_metrics: Mapping[str, float]) -> list[str] | None:
        """The validation before the first step; returns its warnings (each said once)."""

    def check(self, metrics: Mapping[str, float]) -> list[str]:
        """The warnings that became true at this step (each said once)."""

    @property
    def collapse(self) -> tuple[int, float, float] | None:
        """A collapse (or a divergence, or an image reward hacked) the checks saw, ``(best
        step, best validation, now)``: what the run doctor's rollback answers; None while
        there is none."""

    def rewind(self, step: int) -> None:
        """Forget what came after global step ``step`` (the run was rolled back there)."""

    # A health may also have ``validation_score(val_metrics) -> float | None``: what the run
    # doctor ranks validations by to keep the best (an image run's prompt fidelity); without
    # it, `lmrl.run.health.validation_score` (the accuracy, else the reward).


class Program(Protocol):
    """What `RunLoop` runs. ``global_step`` counts the steps done (it is saved and restored
    with the state); ``step()`` advances it by one.

    Attributes:
        start: the run directory, its config and resume point (``lmrl.run.resume``).
        trackers: where metrics go (``lmrl.logging.make_trackers``).
        health: the run's health checks.
        total_steps: steps of the whole run.
        global_step: steps done.
    """

    total_steps: int
    global_step: int

    # read by the loop, never set by it: a program may hold them as attributes or properties
    @property
    def start(self) -> RunStart: ...

    @property
    def trackers(self) -> Any: ...

    @property
    def health(self) -> Health: ...

    @property
    def has_validation(self) -> bool:
        """The run has validation data."""

    def step(self) -> dict[str, float]:
        """One training step (``global_step`` + 1); its metrics as floats."""

    def validate(self) -> dict[str, float]:
        """Validation metrics of the current model (``val/...``)."""

    def checkpoint_weights(self) -> dict[str, dict[str, torch.Tensor]]:
        """Full weights by name, as CPU tensors (each saved as ``<name>.safetensors``)."""

    def state_dict(self) -> dict:
        """Everything else a resumed run needs to continue exactly (``global_step`` included):
        tensors and plain data only."""

    def load_checkpoint(self, path: Path) -> None:
        """Restore weights and state from the checkpoint directory ``path``."""

    def export(self) -> Path:
        """Write the finished model to ``run_dir/final`` (a model path for the next command)."""

    def lower_lr(self, factor: float) -> float:
        """Multiply the learning rate by ``factor`` from now on (the run doctor's rollback,
        ``trainer.max_rollbacks``); returns the scale now."""

    def generations(self) -> list[dict]:
        """Rows of the last step's samples for the trackers' generations log ([] if none)."""

    def close(self) -> None:
        """Free what the run holds (workers, engines, trackers); safe to call twice."""


def resume(program: Program) -> None:
    """Load ``program.start.resume_from`` (if any) into the program.

    Raises:
        CheckpointError: the checkpoint does not fit the program (another model or config).
    """
    path = program.start.resume_from
    if path is None:
        return
    try:
        program.load_checkpoint(path)
    except (RuntimeError, KeyError, ValueError) as err:
        raise CheckpointError(
            f"cannot resume from {path}: {_one_line(err)} (a checkpoint of another model or "
            "config? use another trainer.default_local_dir or trainer.resume_mode=disable)"
        ) from None
    log.info("resumed from %s at step %d", path, program.global_step)


def _one_line(err: BaseException) -> str:
    """torch's ``load_state_dict`` error (a header, then a line per tensor) as one line: the
    header, the first tensor's line and how many more there are."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if len(lines) <= 2:
        return " ".join(lines) or type(err).__name__
    return f"{lines[0]} {lines[1]} (and {len(lines) - 2} more)"


class RunLoop:
    """Runs a program to its last step (see the module docstring).

    Args:
        program: the program.
        settings: its config's ``trainer`` section (every command's derives from ``RunSettings``).
        on_stage: called with ``save`` once a checkpoint's files are written, before its
            manifest (the seam of the fault-injection tests; the RL step calls it per stage).
        on_step_end: the early-stop callback.

    Attributes:
        history: each step's metrics, in order.
        validations: validation metrics by step (0 = before the first step).
        stopped_by: the signal that interrupted the run (``"SIGINT"``), or None.
        stopped_early: ``on_step_end`` ended the run.
    """

    def __init__(
        self,
        program: Program,
        settings: RunSettings,
        on_stage: Callable[[str], None] | None = None,
        on_step_end: StepEnd | None = None,
    ) -> None:
        self.program = program
        self.settings = settings
        self.on_stage = on_stage or (lambda name: None)
        self.on_step_end = on_step_end
        self.history: list[dict[str, float]] = []
        self.validations: dict[int, dict[str, float]] = {}
        self.stopped_by: str | None = None
        self.stopped_early = False
        self.last_saved = program.global_step if program.start.resume_from else -1
        self._tracker_failed = False
        self._signals: StopOnSignal | None = None
        rollbacks, lr_factor = settings.rollbacks()
        self.doctor = (
            Doctor(self.run_dir, rollbacks, lr_factor,
                   resumed=program.start.resume_from is not None,
                   resume_mode=settings.resume_mode,
                   score=getattr(program.health, "validation_score", validation_score))
            if rollbacks > 0 else None
        )  # fmt: skip

    @property
    def run_dir(self) -> Path:
        return self.program.start.run_dir

    @property
    def exit_code(self) -> int:
        """0 after a finished run; 130 (SIGINT) or 143 (SIGTERM) after an interrupted one."""
        return EXIT_CODES.get(self.stopped_by, 130) if self.stopped_by else 0

    @property
    def finished(self) -> bool:
        """The run reached its last step, or was stopped early by ``on_step_end``."""
        return self.stopped_early or self.program.global_step >= self.program.total_steps

    def run(self) -> list[dict[str, float]]:
        """Run the remaining steps; returns the metrics of the steps run here."""
        prog, t = self.program, self.settings
        start = time.perf_counter()
        lock = RunDirLock(self.run_dir)
        try:
            lock.acquire()  # re-entrant: a command or sweep holding it already goes on
            check_untouched(self.run_dir)
            prog.start.begin(prog.global_step)
            with StopOnSignal() as stop:
                self._signals = stop
                pending = self.doctor.interrupted() if self.doctor is not None else None
                if pending is not None:  # a rollback a kill interrupted: finished first
                    self._finish_rollback(pending)
                elif t.val_before_train and prog.global_step == 0 and prog.has_validation:
                    before = self._validate()
                    self.log_metrics(before)
                    for warning in prog.health.baseline(before) or []:
                        log.warning("%s", warning)
                    if self.doctor is not None and self.doctor.is_new_best(0, before):
                        self._save(final=False)  # global_step_0: the start to return to
                while not self.finished and not stop.requested:
                    self._one_step()
                self.stopped_by = stop.requested
                if self.last_saved != prog.global_step and prog.global_step > 0:
                    self._save(final=True)
                if self.history and self.finished:
                    self.export()
        except WorkerError as err:  # a Ray worker died or failed: nothing more can run
            last = latest_checkpoint(self.run_dir)
            resume_hint = (
                f"the last good checkpoint is {last}; run the same command to resume from it"
                if last is not None
                else "no checkpoint was written yet"
            )
            raise WorkerError(f"{err}; {resume_hint}") from None
        finally:
            try:
                prog.close()
            finally:
                lock.release()
        if self.stopped_by:
            log.warning("%s: stopped after step %d (saved); run the same command to resume",
                        self.stopped_by, prog.global_step)  # fmt: skip
        log.info("ran %d steps in %.1fs", len(self.history), time.perf_counter() - start)
        return self.history

    def interrupt(self, name: str = "SIGTERM") -> None:
        """Stop after this step as the first signal ``name`` does (saved, resumable, no
        export): for a run on a thread, which the process's signals do not reach (a sweep's
        trial on Ray Tune), asked from ``on_step_end``."""
        if self._signals is not None and self._signals.requested is None:
            self._signals.requested = name

    def _one_step(self) -> None:
        prog, t = self.program, self.settings
        metrics = prog.step()
        step = prog.global_step
        validated = prog.has_validation and (step >= prog.total_steps or _every(t.test_freq, step))
        if validated:
            metrics |= self._validate()
        if self.on_step_end is not None and self.on_step_end(step, metrics):
            self.stopped_early = True
            if prog.has_validation and not validated:  # validated like a last step
                metrics |= self._validate()
        self.history.append(metrics)
        self.log_metrics(metrics)
        for warning in prog.health.check(metrics):
            log.warning("%s", warning)
        if _every(t.log_generations_freq, step):
            rows = prog.generations()
            if rows:
                prog.trackers.log_generations(rows, step=step)
        doctor = self.doctor
        if doctor is not None and doctor.can_roll_back(prog.health.collapse):
            self._roll_back(step)
            return
        best = doctor is not None and validated and doctor.is_new_best(step, metrics)
        if not self.finished and (_every(t.save_freq, step) or best):
            self._save(final=False)

    def _roll_back(self, step: int) -> None:
        """Back to the best validated checkpoint at a lower lr (`lmrl.run.doctor`)."""
        assert self.doctor is not None, "a rollback needs the run doctor (max_rollbacks > 0)"
        self._finish_rollback(self.doctor.begin(step))

    def _finish_rollback(self, rollback: Rollback) -> None:
        """Carry out a rollback whose intent is written, each part once, so that a run killed
        anywhere in it and resumed goes on as the uninterrupted run (`lmrl.run.doctor`). Its
        ``on_stage`` seams: ``rollback`` (nothing moved yet), ``rollback_load`` (the abandoned
        checkpoints moved), ``save`` (the best saved again, its manifest not yet written) and
        ``rollback_done`` (saved, the intent not yet removed)."""
        prog, doctor = self.program, self.doctor
        assert doctor is not None, "a rollback needs the run doctor (trainer.max_rollbacks > 0)"
        self.on_stage("rollback")
        folder = doctor.abandon(rollback)
        self.on_stage("rollback_load")
        prog.load_checkpoint(self.run_dir / f"global_step_{rollback.to}")
        scale = doctor.saved_scale(rollback)  # saved again before a kill: its lr is lowered
        if scale is None:
            scale = prog.lower_lr(rollback.lr_factor)
            # the best again, with the lower lr (a resume keeps it), marked as this rollback's
            self.save_checkpoint(note={"rollback": {"number": rollback.number, "lr_scale": scale}})
        self.last_saved = prog.global_step
        self.on_stage("rollback_done")
        prog.health.rewind(prog.global_step)
        self.validations = {s: v for s, v in self.validations.items() if s <= prog.global_step}
        doctor.done()
        best = f"{doctor.best[0]:.3f}" if doctor.best is not None else "?"
        log.warning("run doctor: rollback %d: from step %d back to step %d (validation %s), "
                    "actor lr x%g from now on; the abandoned checkpoints are in %s",
                    rollback.number, rollback.came_from, prog.global_step, best, scale,
                    folder)  # fmt: skip
        self.log_metrics({"doctor/rollback": float(rollback.number),
                          "doctor/rolled_back_from": float(rollback.came_from),
                          "doctor/lr_scale": scale})  # fmt: skip

    def _validate(self) -> dict[str, float]:
        metrics = self.program.validate()
        self.validations[self.program.global_step] = metrics
        return metrics

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Log at the current step; a tracker that cannot write (a full disk) never stops the
        run."""
        try:
            self.program.trackers.log(metrics, step=self.program.global_step)
        except OSError as err:
            if not self._tracker_failed:
                log.error("could not write metrics (%s); training goes on", err)
            self._tracker_failed = True

    # ---------------------------------------------------------------- checkpoints
    def summary(self) -> list[str]:
        """Lines the command prints when the run has finished (an image run's before/after);
        none by default."""
        return []

    def save_checkpoint(self, note: dict | None = None) -> Path:
        """Write ``global_step_<N>`` now (atomically), ``note`` in its manifest; returns its
        path."""
        prog = self.program
        path = save_checkpoint(
            self.run_dir, prog.global_step, prog.checkpoint_weights(), prog.state_dict(),
            self.settings.max_ckpt_to_keep, before_manifest=lambda: self.on_stage("save"),
            command=prog.start.command, keep=self.doctor.keep() if self.doctor else None,
            note=note,
        )  # fmt: skip
        self.last_saved = prog.global_step
        log.info("checkpoint saved: %s", path)
        return path

    def _save(self, final: bool) -> None:
        try:
            self.save_checkpoint()
        except OSError as err:
            where = self.run_dir / f"global_step_{self.program.global_step}"
            if final:
                last = f"step {self.last_saved}" if self.last_saved >= 0 else "none"
                raise CheckpointError(
                    f"the final checkpoint could not be written to {where}: {err}; "
                    f"last good checkpoint: {last}"
                ) from None
            log.error("checkpoint %s could not be written (%s); training goes on and the next "
                      "save retries", where, err)  # fmt: skip

    def export(self) -> Path:
        """``run_dir/final`` (`Program.export`).

        Raises:
            CheckpointError: it cannot be written (the checkpoints are unaffected).
        """
        out = self.run_dir / "final"
        try:
            path = self.program.export()
        except OSError as err:
            raise CheckpointError(f"the final model could not be written to {out}: {err}; "
                                  "the last checkpoint holds the same weights") from None  # fmt: skip
        log.info("final model written: %s", path)
        return path


class RunsOnLoop:
    """``fit`` for a program, and what its last run left: the same for every program.

    A program sets ``settings`` (its config's ``trainer`` section) and may set ``on_stage``;
    it implements the rest of `Program`, which the loop runs it as.
    """

    settings: RunSettings
    on_stage: Callable[[str], None] | None = None
    loop: RunLoop | None = None  # the loop of the last fit()

    def fit(self, on_step_end: StepEnd | None = None) -> list[dict[str, float]]:
        """Run the remaining steps on the run loop (validation, checkpoints, ``final/``,
        signals, health, trackers); returns each step's metrics.

        Args:
            on_step_end: ``on_step_end(step, metrics) -> stop``, asked after each step; True
                ends the run there (validated, saved and exported like a last step).
        """
        self.loop = RunLoop(cast(Program, self), self.settings, self.on_stage, on_step_end)
        return self.loop.run()

    @property
    def stopped_by(self) -> str | None:
        """The signal that interrupted the last `fit`, if any."""
        return self.loop.stopped_by if self.loop is not None else None

    @property
    def exit_code(self) -> int:
        """0 after a finished run; 130 (SIGINT) or 143 (SIGTERM) after an interrupted one."""
        return self.loop.exit_code if self.loop is not None else 0

    @property
    def validations(self) -> dict[int, dict[str, float]]:
        """Validation metrics by step of the last `fit` (0 = before the first step)."""
        return self.loop.validations if self.loop is not None else {}

    def summary(self) -> list[str]:
        """Lines the command prints when the run has finished (an image run's before/after);
        none by default."""
        return []

    def lower_lr(self, factor: float) -> float:
        """The run doctor's rollback lowers the learning rate: a program whose settings allow
        rollbacks (``trainer.max_rollbacks`` of RL and image runs) overrides this."""
        raise NotImplementedError(f"{type(self).__name__} has no rollback")

    def save_checkpoint(self) -> Path:
        """Write ``global_step_<N>`` now (atomically); returns its path."""
        return (
            self.loop or RunLoop(cast(Program, self), self.settings, self.on_stage)
        ).save_checkpoint()


def _every(freq: int, step: int) -> bool:
    """``freq > 0`` and ``step`` is a multiple of it (the config's "<= 0 = never" rule)."""
    return freq > 0 and step % freq == 0
