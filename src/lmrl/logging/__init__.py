"""Where a run's numbers go: trackers (console, JSONL, TensorBoard, W&B, MLflow) and plots.

``make_trackers(cfg.trainer.logger, run_dir, ...)`` (:mod:`lmrl.logging.factory`) builds
them all before training; ``lmrl.logging.plot.plot_run`` draws a run's ``metrics.jsonl``
(imported on its own, so the trainer never loads matplotlib). ``configure_logging(level)``
(:mod:`lmrl.logging.configure`) shows lmrl's own log records without raising other
libraries' levels. Of lmrl, this package imports only the error types of ``lmrl.errors``.

Inside lmrl, ``import logging`` is still the standard library: imports are absolute.
"""

from lmrl.logging.configure import configure_logging
from lmrl.logging.console import ConsoleTracker, summarize
from lmrl.logging.factory import TRACKERS, make_trackers
from lmrl.logging.trackers import (
    INSTALL_HINT,
    JsonlTracker,
    MlflowTracker,
    MultiTracker,
    TensorBoardTracker,
    Tracker,
    TrackerUnavailableError,
    WandbTracker,
)

__all__ = [
    "INSTALL_HINT",
    "TRACKERS",
    "ConsoleTracker",
    "JsonlTracker",
    "MlflowTracker",
    "MultiTracker",
    "TensorBoardTracker",
    "Tracker",
    "TrackerUnavailableError",
    "WandbTracker",
    "configure_logging",
    "make_trackers",
    "summarize",
]
