"""A sweep's plan: its trials, its folder (new, or a stopped sweep's to resume) and its
metric, and the trials' records on disk (`lmrl.sweep`)."""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lmrl.config import Config, ConfigError, load_config
from lmrl.errors import LmrlError
from lmrl.run.lock import LOCK_FILE
from lmrl.sweep.grid import draw_trials, parse_grid
from lmrl.sweep.rank import FLAT, rank_score

log = logging.getLogger("lmrl.trainer")

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
