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

import json
import logging
from collections.abc import Callable

from lmrl.errors import CheckpointError
from lmrl.run.signals import StopNow, StopOnSignal
from lmrl.sweep.grid import draw_trials, parse_grid
from lmrl.sweep.plan import (
    DONE,
    STOP_FILE,
    SWEEP_FILE,
    TRIAL_FILE,
    Judge,
    MetricError,
    Sweep,
    TrialRecord,
    check_metric_name,
    check_out,
    check_resume,
    plan_sweep,
    records_on_disk,
)
from lmrl.sweep.rank import (
    FLAT,
    SCORE_KEY,
    SLOPE_SCALE,
    SuccessiveHalving,
    rank_score,
    slope,
    validation_score,
)
from lmrl.sweep.results import format_table, rank, table_rows, write_results
from lmrl.sweep.trial import Stop, StopFile, _pending, replay, run_local, run_trial

__all__ = [
    "DONE", "FLAT", "SCORE_KEY", "SLOPE_SCALE", "STOP_FILE", "SWEEP_FILE", "TRIAL_FILE", "Judge",
    "MetricError", "Stop", "StopFile", "SuccessiveHalving", "Sweep", "TrialRecord",
    "check_metric_name", "check_out", "check_resume", "draw_trials", "format_table",
    "parse_grid", "plan_sweep", "rank", "rank_score", "records_on_disk", "replay", "run_local",
    "run_sweep", "run_trial", "slope", "table_rows", "validation_score", "write_results",
]  # fmt: skip

log = logging.getLogger("lmrl.trainer")


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
