"""Running a sweep's trials on the run loop, one after another here, with their stop
requests (`lmrl.sweep`)."""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from lmrl.errors import LmrlError
from lmrl.sweep.plan import (
    DONE,
    TRIAL_FILE,
    Judge,
    MetricError,
    Sweep,
    TrialRecord,
    records_on_disk,
)
from lmrl.sweep.rank import SCORE_KEY, SuccessiveHalving, rank_score, validation_score

log = logging.getLogger("lmrl.trainer")


class Stop(Protocol):
    """A stop request: ``requested`` is the signal's name (``"SIGTERM"``) once one came."""

    requested: str | None


class StopFile:
    """A stop request shared through a file (``DIR/.stop`` holds the signal's name): the sweep
    writes it, and the Ray trials, which run where the sweep's signals do not reach, read it
    at each step."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @property
    def requested(self) -> str | None:
        try:
            return self.path.read_text().strip() or "SIGTERM"
        except OSError:
            return None

    @requested.setter
    def requested(self, name: str | None) -> None:
        if name is None:
            self.path.unlink(missing_ok=True)
        else:
            self.path.write_text(name + "\n")


def run_trial(
    sweep: Sweep, index: int, judge: Judge | None = None, stop: Stop | None = None
) -> TrialRecord:
    """Run trial ``index`` on the run loop; its record is saved at each step and at the end.
    A trial with a record of an interrupted run resumes it (its scores kept, its run from
    the last checkpoint).

    Args:
        judge: the early-stopping rule (None: never stops early).
        stop: a stop request seen at each step (`StopFile`, for a trial on Ray Tune): the
            trial then stops as at a signal. A signal stopping the trial is written into it.

    Returns:
        The record: ``completed``, ``stopped`` (by ``judge``), ``interrupted`` (by a signal or
        ``stop``), or ``failed`` (any error; its first line in ``error``, a bug's traceback in
        ``error.txt`` of the trial's directory).

    Raises:
        MetricError: ``sweep.metric`` is not among the first validation's metrics.
    """
    from lmrl.trainer import Trainer, build_run

    record = TrialRecord(index, dict(sweep.trials[index]), str(sweep.trial_dir(index)))
    previous = sweep.trial_dir(index) / TRIAL_FILE
    if previous.is_file():  # an interrupted run of this trial: its scores so far
        before = TrialRecord.load(previous)
        record.steps, record.val, record.train = before.steps, before.val, before.train
        record.seconds = before.seconds
    start = time.perf_counter() - record.seconds
    cfg = sweep.load(index)
    record.status, record.error = "running", ""
    try:
        trainer = Trainer(build_run(cfg), cfg.trainer)
        if stop is not None and stop.requested:  # a signal came while the models loaded
            trainer.close()
            record.status = "interrupted"
            raise _Interrupted
        if sweep.metric is not None:
            trainer.validate = _checked_validate(trainer.validate, sweep.metric)

        def on_step_end(step: int, metrics: dict[str, float]) -> bool:
            record.steps = step
            if SCORE_KEY in metrics:
                record.train[step] = metrics[SCORE_KEY]
            if stop is not None and stop.requested and trainer.loop is not None:
                trainer.loop.interrupt(stop.requested)
            for at, val_metrics in trainer.validations.items():
                value = validation_score(val_metrics, sweep.metric)
                if value is not None:
                    record.val[at] = value
            record.seconds = time.perf_counter() - start
            record.save()  # each step: what a resumed trial starts from
            if step not in trainer.validations:
                return False
            score, _ = record.score(sweep.flat)
            if judge is None or step >= sweep.steps or score is None:
                return False
            if judge(step, score, record):
                return False
            record.status = "stopped"
            return True

        trainer.fit(on_step_end=on_step_end)
        if trainer.stopped_by:
            record.status = "interrupted"
            if stop is not None and not stop.requested:
                stop.requested = trainer.stopped_by
        elif record.status == "running":
            record.status = "completed"
    except _Interrupted:
        pass
    except MetricError:
        raise
    except Exception as err:  # any error ends this trial only
        record.status, record.error = "failed", _first_line(err)
        kept = ""
        if not isinstance(err, LmrlError):  # a bug: its traceback beside the trial's run
            path = sweep.trial_dir(index) / "error.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(traceback.format_exception(err)))
            kept = f" (traceback: {path})"
        log.error("sweep: trial %02d failed: %s%s", index, record.error, kept)
    record.seconds = time.perf_counter() - start
    record.save()
    return record


class _Interrupted(Exception):
    """A trial stopped before its first step."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    line = text.splitlines()[0] if text else ""
    if not isinstance(err, LmrlError):
        line = f"{type(err).__name__}: {line}" if line else type(err).__name__
    return line[:300]


def _checked_validate(validate: Callable[[], dict[str, float]], metric: str):
    """``validate`` that refuses a ``metric`` its validation does not log."""

    def checked() -> dict[str, float]:
        metrics = validate()
        if metrics and metric not in metrics:
            raise MetricError(f"--metric {metric!r} is not a metric of this run's validation; "
                              f"it logs {', '.join(sorted(metrics))}")  # fmt: skip
        return metrics

    return checked


def replay(halving: SuccessiveHalving, sweep: Sweep, record: TrialRecord) -> None:
    """Record in ``halving`` what trial ``record`` scored at each rung it passed (a resumed
    sweep's early stopping goes on where it was): the scores `run_trial` judged, at each
    validation before the last step, from the validation and train scores up to it."""
    for step in range(sweep.test_freq, min(record.steps, sweep.steps - 1) + 1, sweep.test_freq):
        val = {s: v for s, v in record.val.items() if s <= step}
        train = {s: v for s, v in record.train.items() if s <= step}
        score, _ = rank_score(val, train, sweep.flat)
        if score is not None:
            halving.keep(record.index, step, score)


def run_local(
    sweep: Sweep, stop: Stop | None = None, on_trial: Callable[[TrialRecord], None] | None = None
) -> list[TrialRecord]:
    """Every trial in this process, one after another, under `SuccessiveHalving`. Trials the
    folder holds finished are kept (their scores replayed into the rule); after a signal
    (``stop``), the trials not started are ``pending``."""
    halving = SuccessiveHalving(sweep.test_freq, sweep.steps, sweep.eta)
    kept = records_on_disk(sweep)
    for record in kept.values():
        replay(halving, sweep, record)
    records = []
    for index in range(len(sweep.trials)):
        if index in kept and kept[index].status in DONE:
            records.append(kept[index])
            continue
        if stop is not None and stop.requested:
            records.append(_pending(sweep, index, kept.get(index)))
            continue
        record = run_trial(sweep, index, lambda step, score, r: halving.keep(r.index, step, score),
                           stop)  # fmt: skip
        records.append(record)
        if on_trial is not None:
            on_trial(record)
    return records


def _pending(sweep: Sweep, index: int, record: TrialRecord | None) -> TrialRecord:
    """The record of a trial not run (again) here: an interrupted one stays so."""
    if record is None:
        return TrialRecord(index, dict(sweep.trials[index]), str(sweep.trial_dir(index)),
                           status="pending")  # fmt: skip
    if record.status == "running":
        record.status = "interrupted"
    return record
