"""``lmrl sweep --backend ray``: the trials of `lmrl.sweep` on Ray Tune, in parallel,
stopped early by ``ASHAScheduler``.

Ray is started (or joined) the way a ``trainer.backend=ray`` run does it
(`lmrl.workers.ray_cluster.RayCluster`: a private loopback instance with its own temp
directory and a reaper, or ``resources.ray_address`` of the base config to join a cluster),
and stopped afterwards. Each trial is a Tune function trainable that runs
`lmrl.sweep.run_trial` with ``trainer.backend=local`` inside its Ray worker, on
``cpus_per_trial`` CPUs (torch threads) and ``gpus_per_trial`` GPUs. It reports at every
validation before its last step (``step``, ``score`` = `rank_score`), and once more after its
run has ended, so that a stop at ``max_t`` never cuts an export short. ASHA: ``time_attr=step``,
``grace_period=test_freq``, ``reduction_factor=eta``, ``max_t=steps``. Tune's own files go to
``DIR/tune``; each trial's record (``DIR/trials/NN/sweep_trial.json``) is what the table reads:
a trial ASHA stopped keeps the status ``running`` there and becomes ``stopped``.

Before Ray starts, a trial's resources are checked against what the cluster can give (this
machine's CPUs and GPUs for a private instance), and again against ``ray.cluster_resources()``
once it runs: Tune would wait forever for a trial no node can hold. A SIGINT/SIGTERM to the
sweep is taken from Ray (which would exit at once): the first writes ``DIR/.stop``, which every
trial reads at each step and stops there, saved, as at a signal; trials not started then
return at once. A resumed sweep runs the trials its folder does not hold finished, with ASHA's
rungs holding the scores the finished ones recorded there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from types import SimpleNamespace

from lmrl.errors import LmrlError
from lmrl.run.signals import StopOnSignal
from lmrl.sweep import (
    DONE,
    STOP_FILE,
    MetricError,
    Stop,
    StopFile,
    SuccessiveHalving,
    Sweep,
    TrialRecord,
    records_on_disk,
    replay,
    run_trial,
)

log = logging.getLogger("lmrl.trainer")


def _trainable(config: dict, sweep: Sweep, cpus: int) -> None:
    """One Tune trial: ``config["index"]`` of ``sweep``."""
    import torch
    from ray import tune

    stop = StopFile(sweep.out / STOP_FILE)
    if stop.requested:  # the sweep was stopped before this trial started
        return
    os.chdir(sweep.cwd)  # Tune runs a trial in its own folder; the config's paths are ours
    torch.set_num_threads(max(1, cpus))
    index = config["index"]

    def report(step: int, score: float, record: TrialRecord) -> bool:
        tune.report({"step": step, "score": score})
        return True  # ASHA decides, and stops the trial itself

    record = run_trial(sweep, index, report, stop)
    if record.status == "interrupted":
        return
    score, _ = record.score(sweep.flat)
    if score is not None:
        tune.report({"step": max(record.steps, 1), "score": score})


def _fit(tune, sweep: Sweep, cpus_per_trial: int, gpus_per_trial: float, todo: list[int]):
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback
    from ray.tune.schedulers import ASHAScheduler

    trainable = tune.with_resources(
        tune.with_parameters(_trainable, sweep=sweep, cpus=cpus_per_trial),
        {"cpu": cpus_per_trial, "gpu": gpus_per_trial},
    )
    scheduler = ASHAScheduler(
        time_attr="step", max_t=sweep.steps, grace_period=sweep.test_freq,
        reduction_factor=sweep.eta,
    )  # fmt: skip
    _replay_rungs(scheduler, sweep)
    tuner = tune.Tuner(
        trainable,
        param_space={"index": tune.grid_search(todo)},
        tune_config=tune.TuneConfig(metric="score", mode="max", scheduler=scheduler),
        run_config=tune.RunConfig(
            name="tune", storage_path=str(sweep.out), verbose=0,
            callbacks=[JsonLoggerCallback(), CSVLoggerCallback()],
        ),
    )  # fmt: skip
    return tuner.fit()


def _replay_rungs(scheduler, sweep: Sweep) -> None:
    """ASHA's rungs hold what the trials of a resumed sweep's folder scored there."""
    halving = SuccessiveHalving(sweep.test_freq, sweep.steps, sweep.eta)
    for record in records_on_disk(sweep).values():
        replay(halving, sweep, record)
    try:
        rungs = scheduler._brackets[0]._rungs  # [(milestone, {trial id: score})]
    except (AttributeError, IndexError):
        log.warning("sweep: this Ray's ASHAScheduler has no rungs to replay; the resumed "
                    "trials are judged among themselves")  # fmt: skip
        return
    for milestone, recorded in rungs:
        for index, score in halving.rungs.get(milestone, {}).items():
            recorded[f"sweep-trial-{index:02d}"] = score


def check_resources(
    cpus_per_trial: int, gpus_per_trial: float, cpus: float, gpus: float, where: str
) -> None:
    """Refuse a trial the cluster cannot hold (Tune would wait for it forever).

    Raises:
        LmrlError: one line naming the resource, what a trial asks and what there is.
    """
    for name, asked, have, key in (("CPU", cpus_per_trial, cpus, "cpus"),
                                   ("GPU", gpus_per_trial, gpus, "gpus")):  # fmt: skip
        if asked > have:
            raise LmrlError(f"--{key}-per-trial {asked:g}: {where} has {have:g} {name}(s), so no "
                            f"trial could start; give --{key}-per-trial {have:g} or less"
                            + (" (--gpus-per-trial 0 trains on CPUs)" if name == "GPU" else ""))  # fmt: skip


def run_ray(
    sweep: Sweep,
    stop: Stop | None = None,
    cpus_per_trial: int = 1,
    gpus_per_trial: float = 0,
    num_cpus: int | None = None,
) -> list[TrialRecord]:
    """Run the sweep's trials on Ray Tune with ASHA; returns their records by trial number.

    Args:
        stop: takes the signal that stopped the sweep (after Ray's start, the sweep's signals
            are handled here: the first stops the trials through ``DIR/.stop``).
        cpus_per_trial, gpus_per_trial: a trial's Ray resources.
        num_cpus: CPUs of the private Ray instance (None = the base config's
            ``resources.num_cpus``, else all of this machine's).

    Raises:
        LmrlError: a trial config asks for ``trainer.backend=ray`` (a trial is one process
            here), a trial asks for more CPUs or GPUs than the cluster has, or Ray cannot
            start (`lmrl.workers.ray_cluster.RayError`).
    """
    try:
        from ray import tune
    except ImportError:
        raise LmrlError("--backend ray needs Ray Tune: pip install 'ray[tune]' (or --backend "
                        "local)") from None  # fmt: skip
    from lmrl.workers.ray_cluster import RayCluster

    cfg = sweep.load(0)
    if cfg.trainer.backend == "ray":
        raise LmrlError("--backend ray runs each trial in one Ray worker: drop "
                        "trainer.backend=ray from the trials (or use --backend local)")  # fmt: skip
    resources = SimpleNamespace(
        ray_address=cfg.resources.ray_address,
        num_cpus=num_cpus if num_cpus is not None else cfg.resources.num_cpus,
        nnodes=1, n_gpus_per_node=max(1, cpus_per_trial), critic_workers=0,
    )  # fmt: skip
    device = "cpu" if not gpus_per_trial else "auto"
    if not resources.ray_address:  # a private instance: this machine's CPUs and GPUs
        import torch

        cpus = resources.num_cpus or os.cpu_count() or 1
        gpus = torch.cuda.device_count() if device != "cpu" else 0
        check_resources(cpus_per_trial, gpus_per_trial, cpus, gpus, "this machine")
    sweep = dataclasses.replace(sweep, out=sweep.out.resolve(), cwd=sweep.cwd.resolve())
    kept = records_on_disk(sweep)
    todo = [i for i in range(len(sweep.trials)) if i not in kept or kept[i].status not in DONE]
    signals = _StopTrials(StopFile(sweep.out / STOP_FILE))
    # Tune's JSON and CSV results, not its TensorBoard logger (a warning without tensorboardX);
    # the sweep's SIGINT handler, not Tune's (which would end the trials unsaved)
    quiet = {"RAY_AIR_NEW_OUTPUT": "0", "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1",
             "TUNE_DISABLE_SIGINT_HANDLER": "1"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in quiet}
    os.environ.update(quiet)
    results = []
    try:
        if todo:  # else every trial is kept from the folder: no Ray to start
            with RayCluster(resources, device):
                import ray

                total = ray.cluster_resources()
                check_resources(cpus_per_trial, gpus_per_trial, total.get("CPU", 0),
                                total.get("GPU", 0), "the Ray cluster")  # fmt: skip
                with signals:  # after ray.init, which takes SIGTERM for itself
                    results = _fit(tune, sweep, cpus_per_trial, gpus_per_trial, todo)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if stop is not None and signals.requested and not stop.requested:
            stop.requested = signals.requested
    errors = {r.config["index"]: r.error for r in results if r.error is not None}
    for error in errors.values():  # every trial refuses it at its first validation
        name, _, message = str(error).strip().splitlines()[-1].partition(": ")
        if name.endswith("MetricError"):
            raise MetricError(message)
    stopped = signals.requested is not None
    records = []
    for index in range(len(sweep.trials)):
        path = sweep.trial_dir(index) / "sweep_trial.json"
        if path.is_file():
            record = TrialRecord.load(path)
        else:
            record = TrialRecord(index, dict(sweep.trials[index]), str(sweep.trial_dir(index)))
            record.status = "pending" if stopped else "failed"
        if record.status == "running":  # ASHA stopped it between two reports
            record.status = "stopped"
            record.save()  # a resumed sweep keeps it
        if index in errors and record.status != "completed":
            record.status = "failed"
            record.error = str(errors[index]).strip().splitlines()[-1][:300]
            record.save()
        records.append(record)
    return records


class _StopTrials(StopOnSignal):
    """The sweep's signals while Tune runs: the first is passed to the trials (``stop``)."""

    def __init__(self, stop: StopFile) -> None:
        super().__init__()
        self.stop = stop

    def _handle(self, signum, frame) -> None:
        first = self.requested is None
        super()._handle(signum, frame)  # the second raises StopNow
        if first and self.requested:
            self.stop.requested = self.requested


__all__ = ["check_resources", "run_ray"]
