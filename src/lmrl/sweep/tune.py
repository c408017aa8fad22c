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
"""

from __future__ import annotations

import dataclasses
import logging
import os
from types import SimpleNamespace

from lmrl.errors import LmrlError
from lmrl.sweep import Sweep, TrialRecord, run_trial

log = logging.getLogger("lmrl.trainer")


def _trainable(config: dict, sweep: Sweep, cpus: int) -> None:
    """One Tune trial: ``config["index"]`` of ``sweep``."""
    import torch
    from ray import tune

    os.chdir(sweep.cwd)  # Tune runs a trial in its own folder; the config's paths are ours
    torch.set_num_threads(max(1, cpus))
    index = config["index"]

    def report(step: int, score: float, record: TrialRecord) -> bool:
        tune.report({"step": step, "score": score})
        return True  # ASHA decides, and stops the trial itself

    record = run_trial(sweep, index, report)
    score, _ = record.score(sweep.flat)
    if score is not None:
        tune.report({"step": max(record.steps, 1), "score": score})


def _fit(tune, sweep: Sweep, cpus_per_trial: int, gpus_per_trial: float):
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
    tuner = tune.Tuner(
        trainable,
        param_space={"index": tune.grid_search(list(range(len(sweep.trials))))},
        tune_config=tune.TuneConfig(metric="score", mode="max", scheduler=scheduler),
        run_config=tune.RunConfig(
            name="tune", storage_path=str(sweep.out), verbose=0,
            callbacks=[JsonLoggerCallback(), CSVLoggerCallback()],
        ),
    )  # fmt: skip
    return tuner.fit()


def run_ray(
    sweep: Sweep, cpus_per_trial: int = 1, gpus_per_trial: float = 0, num_cpus: int | None = None
) -> list[TrialRecord]:
    """Run the sweep's trials on Ray Tune with ASHA; returns their records by trial number.

    Args:
        cpus_per_trial, gpus_per_trial: a trial's Ray resources.
        num_cpus: CPUs of the private Ray instance (None = the base config's
            ``resources.num_cpus``, else all of this machine's).

    Raises:
        LmrlError: a trial config asks for ``trainer.backend=ray`` (a trial is one process
            here), or Ray cannot start (`lmrl.workers.ray_cluster.RayError`).
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
    sweep = dataclasses.replace(sweep, out=sweep.out.resolve(), cwd=sweep.cwd.resolve())
    # Tune's JSON and CSV results, not its TensorBoard logger (a warning without tensorboardX)
    quiet = {"RAY_AIR_NEW_OUTPUT": "0", "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1"}
    saved = {k: os.environ.get(k) for k in quiet}
    os.environ.update(quiet)
    try:
        with RayCluster(resources, device):
            results = _fit(tune, sweep, cpus_per_trial, gpus_per_trial)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    errors = {r.config["index"]: r.error for r in results if r.error is not None}
    records = []
    for index in range(len(sweep.trials)):
        path = sweep.trial_dir(index) / "sweep_trial.json"
        if path.is_file():
            record = TrialRecord.load(path)
        else:
            record = TrialRecord(index, dict(sweep.trials[index]), str(sweep.trial_dir(index)))
            record.status = "failed"
        if record.status == "running":  # ASHA stopped it between two reports
            record.status = "stopped"
        if index in errors and record.status != "completed":
            record.status = "failed"
            record.error = str(errors[index]).strip().splitlines()[-1][:300]
        records.append(record)
    return records


__all__ = ["run_ray"]
