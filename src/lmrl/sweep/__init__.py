"""``lmrl sweep``: short RL trials over a grid (or random draws) of config keys, ranked by how
fast each one learns, the hopeless ones stopped early.

A trial is a normal ``lmrl train`` run (the base config and keys, the trial's keys on top) in
its own run directory ``DIR/trials/NN``, cut to ``steps`` steps and validated before the first
step and every ``test_freq`` steps. Its run loop's ``on_step_end`` records the scores and asks
the early-stopping rule whether to go on.

Choices:

- **Score.** The validation score is the mean over data sources of ``val/<source>/acc``
  (else ``val/<source>/reward/mean``), or the key ``metric`` names. The train score is
  ``critic/score/mean`` of each step.
- **Ranking** (`rank_score`): the validation gain per step, ``(last - first) / (steps
  between them)``, first = the validation before training. Where validation is *flat*
  (``|last - first| <= flat``, 0.01 by default: about one prompt in a hundred answered
  differently, the noise floor of a greedy validation), the trend of the train score (its
  least-squares slope) orders the trial within the flat band: below every trial whose
  validation rose, above every one whose validation fell. Completed trials rank above trials
  stopped early (those were worse at a rung), then failed ones.
- **Early stopping** is ASHA's rule: rungs at ``test_freq * eta**k`` steps (below ``steps``);
  a trial reaching a rung continues only if its score there is at least the
  ``(1 - 1/eta)`` quantile of the scores recorded at that rung before it (the median for
  ``eta = 2``); the first trial at a rung always continues. On Ray Tune this is
  ``ray.tune.schedulers.ASHAScheduler`` itself (``lmrl.sweep.tune``); in the local
  backend, trials run one after another and `SuccessiveHalving` applies the same rule.
- **Results**: ``DIR/trials.csv`` and ``DIR/trials.md`` (every trial's keys, steps,
  validation before and after, gain per step, train slope, status), ``DIR/sweep.png``, and
  the best trial's ``lmrl train`` command line, printed and in ``DIR/best.txt``.
- **Failures**: a trial that raises (an input error, out of memory, a bug) is ``failed``, its
  error in the table (a bug's traceback in ``DIR/trials/NN/error.txt``); the others go on.
- **Signals and resume**: the first SIGINT/SIGTERM stops the running trials after their step,
  saved as ``lmrl train`` saves (the Ray trials through ``DIR/.stop``, which they read at each
  step); the results are written and the command exits 130/143. The same command on the same
  ``--out`` resumes: finished trials (completed, stopped, failed) are kept, interrupted ones
  resume from their last checkpoint (``trainer.resume_mode=auto``), and the early-stopping
  rule is replayed from the recorded scores. The sweep holds its folder's lock
  (`lmrl.run.lock`) for its life; another sweep's definition in the folder is refused.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import shlex
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from lmrl.config import Config, ConfigError, load_config
from lmrl.errors import CheckpointError, LmrlError
from lmrl.run import health
from lmrl.run.lock import LOCK_FILE
from lmrl.run.signals import StopNow, StopOnSignal
from lmrl.sweep.grid import draw_trials, parse_grid

log = logging.getLogger("lmrl.trainer")

FLAT = 0.01  # a validation change at most this large is flat
SCORE_KEY = "critic/score/mean"  # the train score
SLOPE_SCALE = 0.01  # a train slope of this much per step fills half the flat band
TRIAL_FILE = "sweep_trial.json"
SWEEP_FILE = "sweep.json"
STOP_FILE = ".stop"  # a stop request for the trials (the signal's name): `StopFile`
DONE = ("completed", "stopped", "failed")  # a trial in one of these is kept on resume


class MetricError(LmrlError):
    """``--metric`` names no metric the run's validation logs."""


# ------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Sweep:
    """A sweep, checked: every trial's config loads.

    Attributes:
        config: the base YAML config, or None.
        overrides: the base ``key=value`` list (what ``lmrl train`` takes).
        trials: each trial's ``{key: value text}``.
        steps: steps of a trial.
        test_freq: validate every this many steps (and before the first and after the last).
        out: the sweep's folder.
        eta: the early-stopping reduction factor (rungs at ``test_freq * eta**k``).
        flat: the validation change at most which validation is flat.
        metric: the validation key ranked on; None = the mean ``acc`` over sources (else
            ``reward/mean``).
        experiment: the base config's experiment name (each trial appends its number).
        cwd: the directory relative paths of the config are relative to.
    """

    config: Path | None
    overrides: tuple[str, ...]
    trials: tuple[dict[str, str], ...]
    steps: int
    test_freq: int
    out: Path
    eta: int = 2
    flat: float = FLAT
    metric: str | None = None
    experiment: str = "default"
    cwd: Path = field(default_factory=Path.cwd)

    def trial_dir(self, index: int) -> Path:
        return self.out / "trials" / f"{index:02d}"

    def trial_overrides(self, index: int) -> list[str]:
        """The ``lmrl train`` keys of trial ``index``: base, the sweep's, the trial's."""
        return [
            *self.overrides,
            f"trainer.total_training_steps={self.steps}",
            f"trainer.test_freq={self.test_freq}",
            "trainer.val_before_train=true",
            "trainer.resume_mode=auto",  # a fresh trial starts, an interrupted one resumes
            f"trainer.default_local_dir={json.dumps(str(self.trial_dir(index)))}",
            f"trainer.experiment_name={json.dumps(f'{self.experiment}-sweep{index:02d}')}",
            *(f"{k}={v}" for k, v in self.trials[index].items()),
        ]

    def train_command(self, keys: Mapping[str, str]) -> str:
        """The ``lmrl train`` command line of a trial's keys at full length."""
        config = ["--config", str(self.config)] if self.config is not None else []
        args = ["lmrl", "train", *config, *self.overrides, *(f"{k}={v}" for k, v in keys.items())]
        return " ".join(shlex.quote(a) for a in args)

    def load(self, index: int) -> Config:
        return load_config(self.config, self.trial_overrides(index))

    def definition(self) -> dict:
        """What decides the trials and their scores (``sweep.json``; a resume must match)."""
        return {
            "config": str(self.config) if self.config else None, "overrides": list(self.overrides),
            "trials": [dict(t) for t in self.trials], "steps": self.steps,
            "test_freq": self.test_freq, "eta": self.eta, "flat": self.flat, "metric": self.metric,
        }  # fmt: skip


def plan_sweep(
    config: Path | None,
    overrides: Sequence[str],
    grid: Sequence[str],
    *,
    out: Path,
    samples: int | None = None,
    steps: int = 20,
    test_freq: int | None = None,
    eta: int = 2,
    metric: str | None = None,
    flat: float = FLAT,
    seed: int = 0,
) -> Sweep:
    """Parse the grid, draw the trials and load every trial's config (no model loads, nothing
    is written): each problem is a ``ConfigError`` naming the key, as ``lmrl train`` gives it.

    Args:
        test_freq: None = ``max(1, steps // 4)`` (4 validations after the one before).
        flat: a validation change at most this large is flat (`rank_score`).
    """
    if not 0 <= flat < 1:
        raise ConfigError(
            f"--flat must be in [0, 1) (a change of the validation score), got {flat}"
        )
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    test_freq = max(1, steps // 4) if test_freq is None else test_freq
    if not 1 <= test_freq <= steps:
        raise ConfigError(f"--test-freq must be in [1, --steps={steps}], got {test_freq}")
    if eta < 2:
        raise ConfigError(
            f"--eta must be >= 2 (the fraction of trials a rung keeps is 1/eta), got {eta}"
        )
    check_out(out)
    axes = parse_grid(grid)
    trials = draw_trials(axes, samples, seed)
    base = load_config(config, overrides)  # the base alone first: its errors once
    if metric is not None:
        check_metric_name(metric, base.rollout.val_kwargs.n)
    sweep = Sweep(
        config=config, overrides=tuple(overrides), trials=tuple(trials), steps=steps,
        test_freq=test_freq, out=out, eta=eta, metric=metric, flat=flat,
        experiment=base.trainer.experiment_name,
    )  # fmt: skip
    errors: list[str] = []
    quiet = logging.getLogger("lmrl.config")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the base's notices were logged once
    try:
        for i in range(len(trials)):
            try:
                sweep.load(i)
            except ConfigError as err:
                errors.extend(e for e in err.errors if e not in errors)
    finally:
        quiet.setLevel(level)
    if errors:
        raise ConfigError(errors)
    check_resume(sweep)
    if not base.data.val_files:
        log.warning("sweep: no data.val_files; trials are ranked by the train score's slope alone")
    return sweep


def check_out(out: Path) -> None:
    """``--out`` is a new or empty folder, or a sweep's (``sweep.json``: resumed).

    Raises:
        LmrlError: one line: a file, a path through a file, or a folder holding other files.
    """
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        where = "is a file" if probe == out else f"is inside {probe}, a file"
        raise LmrlError(f"--out {out} {where}, not a folder; nothing was written: give a new "
                        "folder (or a stopped sweep's folder to resume it)")  # fmt: skip
    # a lock file alone is what a sweep killed before it wrote anything left
    others = [path for path in out.iterdir() if path.name != LOCK_FILE] if probe == out else []
    if others and not (out / SWEEP_FILE).is_file():
        raise LmrlError(f"--out {out} holds other files and no {SWEEP_FILE}; nothing was "
                        "written: give a new or empty folder (or a stopped sweep's folder to "
                        "resume it)")  # fmt: skip


def check_resume(sweep: Sweep) -> bool:
    """Whether ``sweep.out`` holds this sweep already (to resume); False for a new folder.

    Raises:
        LmrlError: the folder holds another sweep (one line naming what differs).
    """
    path = sweep.out / SWEEP_FILE
    if not path.is_file():
        return False
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise LmrlError(f"--out {sweep.out}: {path} is unreadable ({err}); give a new --out") from None  # fmt: skip
    ours = sweep.definition()
    if not any(records_on_disk(sweep)):  # nothing scored yet: the metric may be corrected
        ours.pop("metric")
    names = {"overrides": "the base keys", "trials": "the trials", "config": "--config"}
    changed = [
        names.get(key, f"--{key.replace('_', '-')}") + (
            "" if key in ("overrides", "trials") else f" {saved.get(key)!r} -> {value!r}")
        for key, value in ours.items() if saved.get(key) != value
    ]  # fmt: skip
    if changed:
        raise LmrlError(f"--out {sweep.out} holds another sweep ({'; '.join(changed)} differ "
                        "from its sweep.json); nothing was written: give a new --out, or that "
                        "sweep's own command to resume it")  # fmt: skip
    return True


def check_metric_name(metric: str, val_n: int) -> None:
    """``--metric`` is a validation metric's name: ``val/<source>/<name>``, ``<name>`` one of
    ``acc``, ``reward/mean``, ``mean@<n>`` or ``pass@<n>`` (``n = rollout.val_kwargs.n``); the
    source is checked at the first validation (`run_trial`).

    Raises:
        MetricError: one line naming the forms.
    """
    names = ("acc", "reward/mean", f"mean@{val_n}", f"pass@{val_n}")
    body = metric.removeprefix("val/")  # <source>/<name>; a source may hold a "/"
    if metric.startswith("val/") and any(
        body.endswith(f"/{n}") and len(body) > len(n) + 1 for n in names
    ):
        return
    raise MetricError(f"--metric {metric!r} is not a validation metric of this run: the "
                      f"validation logs val/<source>/{{{','.join(names)}}} (acc when the scorer "
                      "reports one); leave --metric out to rank on the mean val/<source>/acc")  # fmt: skip


# ------------------------------------------------------------------------------ ranking
def validation_score(metrics: Mapping[str, float], metric: str | None = None) -> float | None:
    """The validation score of one validation's metrics (see the module docstring)."""
    if metric is not None:
        value = metrics.get(metric)
        return float(value) if value is not None and math.isfinite(value) else None
    return health.validation_score(metrics)  # the score the health checks and doctor read


def slope(points: Mapping[int, float]) -> float | None:
    """Least-squares slope of ``{step: value}`` per step; None with fewer than 2 steps."""
    if len(points) < 2:
        return None
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def rank_score(
    val: Mapping[int, float], train: Mapping[int, float], flat: float = FLAT
) -> tuple[float | None, str]:
    """A trial's ranking number and what decided it (``val``, ``train`` or ``none``).

    Validation decides when it moved: the number is the gain per step. Where it is flat, the
    train score's slope ``s`` orders the trial inside the flat band, as ``(flat / span) *
    s / (|s| + SLOPE_SCALE)`` (span = steps between the first and last validation): strictly
    between every trial whose validation fell and every one whose validation rose by more
    than ``flat`` over the same span. Without validation, the number is the train slope.

    Args:
        val: validation score by step (0 = before the first step).
        train: train score by step.
        flat: validation that moved at most this much from first to last is flat.

    Returns:
        ``(gain per step, "val")``; ``(train slope in the flat band, "train")``; ``(train
        slope, "train")`` without validation; ``(0.0, "val")`` flat without a train score;
        ``(None, "none")`` when nothing was measured.
    """
    train_slope = slope(train)
    if len(val) < 2:
        return (train_slope, "train") if train_slope is not None else (None, "none")
    first, last = min(val), max(val)
    gain = val[last] - val[first]
    if abs(gain) > flat:
        return gain / (last - first), "val"
    if train_slope is None:
        return 0.0, "val"
    band = flat / (last - first)
    return band * train_slope / (abs(train_slope) + SLOPE_SCALE), "train"


class SuccessiveHalving:
    """ASHA's stopping rule (``ray.tune.schedulers.ASHAScheduler``'s ``_Bracket``) for trials
    run one after another.

    Rungs at ``first * eta**k`` steps below ``last``. At the highest rung a trial has reached
    and not yet been judged at, it stops if its score is below the ``(1 - 1/eta)`` quantile of
    the scores recorded there before it (none recorded: it continues); its score is recorded.
    """

    def __init__(self, first: int, last: int, eta: int = 2) -> None:
        self.eta = eta
        self.rungs: dict[int, dict[int, float]] = {}
        milestone = first
        while milestone < last:
            self.rungs[milestone] = {}
            milestone *= eta

    def keep(self, trial: int, step: int, score: float) -> bool:
        """Record ``score`` at the rung ``step`` reached; False = stop the trial."""
        import numpy as np

        for milestone in sorted(self.rungs, reverse=True):
            recorded = self.rungs[milestone]
            if step < milestone or trial in recorded:
                continue
            cutoff = (np.nanpercentile(list(recorded.values()), (1 - 1 / self.eta) * 100)
                      if recorded else None)  # fmt: skip
            recorded[trial] = score
            return cutoff is None or score >= cutoff
        return True


# ------------------------------------------------------------------------------ one trial
@dataclass
class TrialRecord:
    """What one trial measured (``DIR/trials/NN/sweep_trial.json``).

    Attributes:
        status: ``running``, ``completed``, ``stopped`` (early, at ``steps``), ``failed``,
            ``interrupted`` (by a signal: resumed by the same command) or ``pending`` (not
            started when a signal came).
        val, train: validation and train score by step.
    """

    index: int
    keys: dict[str, str]
    run_dir: str
    steps: int = 0
    status: str = "running"
    val: dict[int, float] = field(default_factory=dict)
    train: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    error: str = ""

    def score(self, flat: float = FLAT) -> tuple[float | None, str]:
        return rank_score(self.val, self.train, flat)

    def save(self) -> None:
        path = Path(self.run_dir) / TRIAL_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> TrialRecord:
        data = json.loads(Path(path).read_text())
        for name in ("val", "train"):
            data[name] = {int(k): v for k, v in data[name].items()}
        return cls(**data)


Judge = Callable[[int, float, TrialRecord], bool]
"""``judge(step, score, record) -> go on``: asked at each validation before the last step."""


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


def records_on_disk(sweep: Sweep) -> dict[int, TrialRecord]:
    """The trials' records the sweep's folder holds, by trial number (a resumed sweep's)."""
    found = {}
    for index in range(len(sweep.trials)):
        path = sweep.trial_dir(index) / TRIAL_FILE
        if path.is_file():
            try:
                found[index] = TrialRecord.load(path)
            except (OSError, ValueError, TypeError) as err:
                log.warning("sweep: %s is unreadable (%s); trial %02d runs again", path, err, index)
    return found


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


# ------------------------------------------------------------------------------ results
_ORDER = {"completed": 0, "stopped": 1, "running": 1, "interrupted": 2, "pending": 2, "failed": 3}


def rank(records: Sequence[TrialRecord], flat: float = FLAT) -> list[TrialRecord]:
    """Best first: completed trials by score, then trials stopped early (the later they
    stopped, the higher), then interrupted and failed ones."""

    def key(r: TrialRecord):
        score, _ = r.score(flat)
        return (_ORDER.get(r.status, 3), -r.steps if r.status == "stopped" else 0,
                -score if score is not None else math.inf, r.index)  # fmt: skip

    return sorted(records, key=key)


def _status(r: TrialRecord) -> str:
    if r.status == "stopped":
        return f"stopped early at step {r.steps}"
    if r.status == "interrupted":
        return f"interrupted at step {r.steps}"
    if r.status == "failed" and r.error:
        return f"failed: {r.error}"
    return "not started" if r.status == "pending" else r.status


def table_rows(sweep: Sweep, records: Sequence[TrialRecord]) -> list[dict[str, str]]:
    """One row per trial, best first (the columns of ``trials.csv``)."""
    keys = list(sweep.trials[0]) if sweep.trials else []
    rows = []
    for place, r in enumerate(rank(records, sweep.flat), start=1):
        _, basis = r.score(sweep.flat)
        first = r.val[min(r.val)] if r.val else None
        last = r.val[max(r.val)] if r.val else None
        gain = (last - first) / (max(r.val) - min(r.val)) if len(r.val) > 1 else None
        train_slope = slope(r.train)
        rows.append({
            "rank": str(place), "trial": f"{r.index:02d}", **{k: r.keys.get(k, "") for k in keys},
            "steps": str(r.steps), "val_before": _num(first), "val_after": _num(last),
            "gain_per_step": _num(gain, "+.4f"), "train_slope": _num(train_slope, "+.4f"),
            "ranked_by": {"train": "train slope (val flat)"}.get(basis, basis),
            "status": _status(r), "seconds": f"{r.seconds:.0f}", "run_dir": r.run_dir,
        })  # fmt: skip
    return rows


def _num(value: float | None, spec: str = ".3f") -> str:
    return "" if value is None else format(value, spec)


def format_table(rows: Sequence[Mapping[str, str]]) -> str:
    """The rows as a Markdown table (``trials.md``; printed at the end)."""
    if not rows:
        return "(no trial ran)"
    cols = [c for c in rows[0] if c != "run_dir"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(row[c].replace("|", "\\|") for c in cols) + " |" for row in rows]
    return "\n".join(lines)


def write_results(
    sweep: Sweep, records: Sequence[TrialRecord], plot: bool = True
) -> dict[str, Path | str | None]:
    """``trials.csv``, ``trials.md``, ``sweep.png`` and ``best.txt`` in the sweep's folder.

    Returns:
        ``{"csv", "table", "plot", "best"}``: paths, and the best trial's ``lmrl train``
        command line (None when no trial completed); ``plot`` False: no ``sweep.png``.
    """
    from lmrl.logging.sweep_plot import Curve, draw_sweep

    sweep.out.mkdir(parents=True, exist_ok=True)
    rows = table_rows(sweep, records)
    csv_path = sweep.out / "trials.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["trial"])
        writer.writeheader()
        writer.writerows(rows)
    md = sweep.out / "trials.md"
    md.write_text(format_table(rows) + "\n")
    ranked = rank(records, sweep.flat)
    best = ranked[0] if ranked and ranked[0].status == "completed" else None
    curves = [
        Curve(" ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in r.keys.items()) or f"{r.index:02d}",
              sorted(r.val.items()), sorted(r.train.items()), stopped=r.status == "stopped",
              best=r is best)
        for r in sorted(records, key=lambda r: r.index)
    ]  # fmt: skip
    title = f"lmrl sweep: {len(records)} trials, {sweep.steps} steps each"
    drawn = draw_sweep(curves, sweep.out / "sweep.png", title=title,
                       val_label=sweep.metric or "validation score") if plot else None  # fmt: skip
    command = sweep.train_command(best.keys) if best is not None else None
    (sweep.out / "best.txt").write_text((command or "no trial completed") + "\n")
    return {"csv": csv_path, "table": md, "plot": drawn, "best": command}


def run_sweep(
    sweep: Sweep, runner: Callable[[Sweep, Stop], list[TrialRecord]] | None = None
) -> tuple[list[TrialRecord], dict]:
    """Run every trial with ``runner`` (default `run_local`; Ray Tune with ASHA:
    ``lmrl.sweep.tune.run_ray``), then write the results; returns the records and
    `write_results`'s paths, with ``"stopped_by"``: the signal that stopped the sweep, or None.

    The sweep holds its folder's lock (`lmrl.run.lock.RunDirLock`) throughout, and takes
    SIGINT/SIGTERM: the first stops the trials after their step (saved), the results are
    written; the second stops at once (``StopNow``), the table written from the trials'
    records first.

    Raises:
        CheckpointError: another process runs in the folder.
        LmrlError: the folder holds another sweep.
    """
    from lmrl.run.lock import RunDirLock

    runner = runner or run_local
    lock = RunDirLock(sweep.out)
    try:
        lock.acquire()
    except CheckpointError as err:
        raise CheckpointError(str(err).replace("trainer.default_local_dir", "--out")) from None
    try:
        check_resume(sweep)  # again, now that no other sweep can write it
        # trials/ exists before any trial starts: trials launched at once (Ray Tune) each probe
        # their run directory, and a probe removes the directories it made, so a trials/ made
        # by one trial's probe could vanish under another's mkdir
        sweep.trial_dir(0).parent.mkdir(parents=True, exist_ok=True)
        StopFile(sweep.out / STOP_FILE).requested = None
        (sweep.out / SWEEP_FILE).write_text(json.dumps({
            **sweep.definition(), "backend": "local" if runner is run_local else "ray",
        }, indent=1) + "\n")  # fmt: skip
        with StopOnSignal() as stop:
            try:
                records = runner(sweep, stop)
            except StopNow:  # the second signal: the table of what the trials recorded
                on_disk = records_on_disk(sweep)
                write_results(sweep, [_pending(sweep, i, on_disk.get(i))
                                      for i in range(len(sweep.trials))], plot=False)  # fmt: skip
                raise
        paths = write_results(sweep, records)
        StopFile(sweep.out / STOP_FILE).requested = None
    finally:
        lock.release()
    return records, {**paths, "stopped_by": stop.requested}


__all__ = [
    "MetricError",
    "StopFile",
    "SuccessiveHalving",
    "Sweep",
    "TrialRecord",
    "format_table",
    "plan_sweep",
    "rank",
    "rank_score",
    "records_on_disk",
    "replay",
    "run_local",
    "run_sweep",
    "run_trial",
    "slope",
    "validation_score",
    "write_results",
]
