"""Experiment trackers: where a run's metrics and sample generations go.

One small interface, :class:`Tracker` (``log``, ``log_generations``, ``close``), and one
class per backend; ``trainer.logger`` names the ones a run uses, and
:func:`lmrl.logging.factory.make_trackers` builds them:

- ``jsonl`` (always on): ``<run_dir>/metrics.jsonl``, one JSON object per ``log`` call with
  its ``"step"``, and ``<run_dir>/generations.jsonl``, one object per sample. Non-finite
  values are written as ``null`` so every line is strict JSON (``jq``, pandas).
- ``console``: a rich progress bar with ETA and one compact line per step
  (:mod:`lmrl.logging.console`).
- ``tensorboard``, ``wandb``, ``mlflow``: optional extras (``pip install 'lmrl[tracking]'``).
  A missing package is an :class:`TrackerUnavailableError` raised when the tracker is built,
  i.e. before training starts, never at the first log call. W&B runs offline unless
  ``WANDB_MODE`` says otherwise; MLflow writes a local file store under ``<run_dir>/mlruns``
  unless ``MLFLOW_TRACKING_URI`` points elsewhere.

The choice made here: a resumed run owns the history after its checkpoint. Built with
``start_step=s``, the JSONL tracker drops the lines of steps after ``s`` (written by the run
that was killed after its last checkpoint), so ``metrics.jsonl`` holds each step once; a fresh
run (``s = 0``) starts both files empty.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from lmrl.errors import LmrlError

INSTALL_HINT = "pip install 'lmrl[tracking]'"


class TrackerUnavailableError(ImportError, LmrlError):
    """An optional tracker's package is not installed (the message holds the install hint)."""


class Tracker:
    """Where metrics go. Subclasses override ``log``; the other two default to doing nothing."""

    name: str = ""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record one step's metrics.

        Args:
            metrics: metric name (``actor/pg_clipfrac``) -> value.
            step: the global step the values belong to.
        """
        raise NotImplementedError

    def log_generations(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        """Record sample generations: one dict per sample (prompt, response, score, ...)."""

    def close(self) -> None:
        """Flush and release the backend."""


def _require(module: str, package: str, tracker: str) -> ModuleType:
    """Import ``module`` or raise :class:`TrackerUnavailableError` with the install hint."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise TrackerUnavailableError(
            f"trainer.logger={tracker!r} needs the {package!r} package, which is not installed: "
            f"{INSTALL_HINT} (or pip install {package})"
        ) from err


def _floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Metric values as floats; a value that is not a number is an error naming its key."""
    out = {}
    for key, value in metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"metric {key!r} is not a number: {value!r}") from err
    return out


def _finite(metrics: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


def _json_value(value: Any) -> Any:
    """JSON-safe copy: non-finite floats -> None, containers recursed, the rest as is."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value


def _dumps(obj: Any) -> str:
    # default=str: numpy scalars, paths and other odd values in generation rows still write.
    return json.dumps(_json_value(obj), allow_nan=False, default=str, ensure_ascii=False)


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> ``{"actor.optim.lr": 1e-3, ...}`` (lists and scalars are leaves)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= flatten_config(value, prefix=f"{name}.")
        else:
            out[name] = value
    return out


# ------------------------------------------------------------------------------------ jsonl
class JsonlTracker(Tracker):
    """``metrics.jsonl`` and ``generations.jsonl`` in the run directory (always on)."""

    name = "jsonl"

    def __init__(self, run_dir: str | Path, start_step: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.generations_path = self.run_dir / "generations.jsonl"
        for path in (self.metrics_path, self.generations_path):
            _keep_steps_up_to(path, start_step)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        line = _dumps({"step": int(step), **_floats(metrics)})
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")

    def log_generations(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        if not rows:
            return
        with self.generations_path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(_dumps({"step": int(step), **row}) + "\n")


def _keep_steps_up_to(path: Path, start_step: int) -> None:
    """Rewrite ``path`` without the lines of steps after ``start_step`` (all of them at 0).

    Lines that do not parse (a write cut short by SIGKILL) are dropped too. The rewrite goes
    through a temporary file and a rename, so a crash here leaves the old file whole.
    """
    if not path.exists():
        return
    if start_step <= 0:
        path.unlink()
        return
    kept = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, (int, float)) and step <= start_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------ tensorboard
class TensorBoardTracker(Tracker):
    """Scalars (and the config and generations as text) in ``<run_dir>/tensorboard``."""

    name = "tensorboard"

    def __init__(self, run_dir: str | Path, config: Mapping[str, Any] | None = None) -> None:
        _require("tensorboard", "tensorboard", self.name)
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        if config:
            text = json.dumps(_json_value(dict(config)), indent=2, default=str)
            self.writer.add_text("config", f"```\n{text}\n```", global_step=0)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in _finite(_floats(metrics)).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_generations(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        if rows:
            self.writer.add_text("generations", _markdown_table(rows), global_step=step)

    def close(self) -> None:
        self.writer.close()


def _markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows as a markdown table (TensorBoard's text plugin renders markdown)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ wandb
class WandbTracker(Tracker):
    """A Weights & Biases run in ``<run_dir>/wandb``; offline unless ``WANDB_MODE`` is set.

    Offline runs need no network or account; ``wandb sync <run_dir>/wandb/offline-run-*``
    uploads them later. Set ``WANDB_MODE=online`` to stream live.
    """

    name = "wandb"

    def __init__(
        self,
        run_dir: str | Path,
        project_name: str,
        experiment_name: str,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.wandb = _require("wandb", "wandb", self.name)
        mode = {} if os.environ.get("WANDB_MODE") else {"mode": "offline"}
        self.run = self.wandb.init(
            project=project_name,
            name=experiment_name,
            dir=str(run_dir),
            config=_json_value(dict(config or {})),
            **mode,
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(_finite(_floats(metrics)), step=step)

    def log_generations(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        if not rows:
            return
        columns = list(dict.fromkeys(k for row in rows for k in row))
        data = [[_table_cell(row.get(c)) for c in columns] for row in rows]
        self.run.log({"generations": self.wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


def _table_cell(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


# ----------------------------------------------------------------------------------- mlflow
_MLFLOW_BAD_CHARS = re.compile(r"[^A-Za-z0-9_\-. :/]")


def mlflow_metric_name(name: str) -> str:
    """MLflow allows only ``[A-Za-z0-9_-. :/]`` in names: ``val/x/pass@4`` -> ``val/x/pass_at_4``."""
    return _MLFLOW_BAD_CHARS.sub("_", name.replace("@", "_at_"))


class MlflowTracker(Tracker):
    """An MLflow run: experiment = project_name, run name = experiment_name.

    The store is ``MLFLOW_TRACKING_URI`` when set, otherwise a local file store in
    ``<run_dir>/mlruns`` (browse it with ``mlflow ui --backend-store-uri <run_dir>/mlruns``).
    MLflow 3 refuses file stores unless ``MLFLOW_ALLOW_FILE_STORE`` is true; it is set for
    this default only, and only when the user has not set it.
    """

    name = "mlflow"
    _MAX_PARAM_CHARS = 6000  # MLflow's limit on a parameter value
    _BATCH = 100  # MLflow's limit on params per log_batch call (metrics: 1000)

    def __init__(
        self,
        run_dir: str | Path,
        project_name: str,
        experiment_name: str,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        _require("mlflow", "mlflow", self.name)
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric_cls = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            store = Path(run_dir).resolve() / "mlruns"
            store.mkdir(parents=True, exist_ok=True)
            uri = store.as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project_name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(project_name)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=experiment_name).info.run_id
        params = [
            Param(mlflow_metric_name(k), str(v)[: self._MAX_PARAM_CHARS])
            for k, v in flatten_config(config or {}).items()
        ]
        for i in range(0, len(params), self._BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + self._BATCH])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        entries = [
            self._metric_cls(mlflow_metric_name(k), v, now, int(step))
            for k, v in _finite(_floats(metrics)).items()
        ]
        for i in range(0, len(entries), 1000):
            self.client.log_batch(self.run_id, metrics=entries[i : i + 1000])

    def log_generations(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        if rows:
            text = "".join(_dumps(dict(row)) + "\n" for row in rows)
            self.client.log_text(self.run_id, text, f"generations/step_{int(step):07d}.jsonl")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# ------------------------------------------------------------------------------ many at once
class MultiTracker(Tracker):
    """Several trackers behind one: each call goes to all of them, in order."""

    name = "multi"

    def __init__(self, trackers: Iterable[Tracker]) -> None:
        self.trackers = list(trackers)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def log_generations(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        for tracker in self.trackers:
            tracker.log_generations(rows, step)

    def close(self) -> None:
        """Close every tracker, even when one fails; the first failure is raised after."""
        errors = []
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as err:
                errors.append(err)
        if errors:
            raise errors[0]

    def __enter__(self) -> MultiTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "INSTALL_HINT",
    "JsonlTracker",
    "MlflowTracker",
    "MultiTracker",
    "TensorBoardTracker",
    "Tracker",
    "TrackerUnavailableError",
    "WandbTracker",
    "flatten_config",
    "mlflow_metric_name",
]
