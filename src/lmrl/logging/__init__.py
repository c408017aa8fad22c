"""Where a run's numbers go: trackers (console, JSONL, TensorBoard, W&B, MLflow) and plots.

``make_trackers(cfg.trainer.logger, run_dir, ...)`` builds them all before training;
``lmrl.logging.plot.plot_run`` draws a run's ``metrics.jsonl`` (imported on its own, so the
trainer never loads matplotlib). This package imports nothing else of lmrl.

Inside lmrl, ``import logging`` is still the standard library: imports are absolute.
"""

from lmrl.logging.console import ConsoleTracker, summarize
from lmrl.logging.trackers import (
    INSTALL_HINT,
    TRACKERS,
    JsonlTracker,
    MlflowTracker,
    MultiTracker,
    TensorBoardTracker,
    Tracker,
    TrackerUnavailableError,
    WandbTracker,
    make_trackers,
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
    "make_trackers",
    "summarize",
]
