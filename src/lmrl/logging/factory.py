"""``make_trackers``: the trackers named in ``trainer.logger``, built before training starts.

It lives in its own module because it builds both the backends of
:mod:`lmrl.logging.trackers` and the console of :mod:`lmrl.logging.console`, which itself
builds on ``trackers.Tracker``: with the factory here, imports inside this package run one
way (factory -> console -> trackers).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lmrl.logging.console import ConsoleTracker
from lmrl.logging.trackers import (
    JsonlTracker,
    MlflowTracker,
    MultiTracker,
    TensorBoardTracker,
    Tracker,
    WandbTracker,
)

log = logging.getLogger(__name__)

TRACKERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


def make_trackers(
    names: Iterable[str],
    run_dir: str | Path,
    project_name: str = "lmrl",
    experiment_name: str = "default",
    config_dict: Mapping[str, Any] | None = None,
    total_steps: int | None = None,
    start_step: int = 0,
) -> MultiTracker:
    """Build the trackers named in ``trainer.logger``; ``jsonl`` is always the first.

    Every tracker is built here, so a missing package fails before training starts; if one
    fails, the ones already built are closed.

    Args:
        names: any of ``console``, ``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``.
        run_dir: the run directory (``trainer.default_local_dir``).
        project_name: ``trainer.project_name`` (W&B project, MLflow experiment).
        experiment_name: ``trainer.experiment_name`` (W&B and MLflow run name).
        config_dict: the resolved config as a nested dict (W&B config, MLflow params,
            TensorBoard text).
        total_steps: steps of the whole run, for the console's progress bar and ETA.
        start_step: the step the run resumes from (0 for a fresh run): the console's bar
            starts there and the JSONL files drop lines of later steps.

    Returns:
        A :class:`MultiTracker` over the built trackers.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
        TrackerUnavailableError: an optional tracker's package is missing.
    """
    if isinstance(names, str):
        names = [names]
    wanted = list(dict.fromkeys(["jsonl", *names]))
    unknown = [n for n in wanted if n not in TRACKERS]
    if unknown:
        raise ValueError(
            f"trainer.logger: unknown tracker(s) {', '.join(map(repr, unknown))}; "
            f"valid: {', '.join(TRACKERS)}"
        )
    run_dir = Path(run_dir)
    config = dict(config_dict or {})
    built: list[Tracker] = []
    try:
        for name in wanted:
            if name == "jsonl":
                built.append(JsonlTracker(run_dir, start_step=start_step))
            elif name == "console":
                built.append(ConsoleTracker(total_steps=total_steps, start_step=start_step))
            elif name == "tensorboard":
                built.append(TensorBoardTracker(run_dir, config))
            elif name == "wandb":
                built.append(WandbTracker(run_dir, project_name, experiment_name, config))
            else:  # mlflow
                built.append(MlflowTracker(run_dir, project_name, experiment_name, config))
    except BaseException:
        MultiTracker(built).close()
        raise
    log.debug("trackers: %s", ", ".join(wanted))
    return MultiTracker(built)


__all__ = ["TRACKERS", "make_trackers"]
