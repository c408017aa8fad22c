"""``lmrl sweep``: the grid and its refusals, the ranking and stopping rules by hand, a local
sweep that stops a trial, a failing trial, a sweep stopped by SIGTERM and resumed, the Ray
backend's stop path, a Ray Tune sweep, and the lr sweep on the demo's warm start."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from lmrl.cli import main
from lmrl.config import ConfigError
from lmrl.sweep import (
    SuccessiveHalving,
    TrialRecord,
    rank,
    rank_score,
    slope,
    validation_score,
)
from lmrl.sweep.grid import Axis, draw_trials, parse_grid

# the score of a call grows with every call, times `scale`: a trial at scale=-1 scores lower
# at every validation and every step than one at scale=1, whatever the model answers
COUNTING_REWARD = """
CALLS = [0]

def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    CALLS[0] += 1
    return scale * CALLS[0] / 1000
"""


# ---------------------------------------------------------------- the grid
def test_grid_is_every_point_and_keeps_bracketed_values_whole():
    axes = parse_grid(["actor.optim.lr=1e-5,1e-4", "trainer.logger=[console,jsonl],[]"])
    assert axes == [
        Axis("actor.optim.lr", ("1e-5", "1e-4")),
        Axis("trainer.logger", ("[console,jsonl]", "[]")),
    ]
    trials = draw_trials(axes, None)
    assert len(trials) == 4
    assert trials[0] == {"actor.optim.lr": "1e-5", "trainer.logger": "[console,jsonl]"}


def test_samples_draw_distinct_grid_points_or_log_uniform_values():
    axes = parse_grid(["a.b=1,2,3", "c.d=x,y"])
    picked = draw_trials(axes, 4, seed=1)
    assert len(picked) == 4 and len({tuple(t.values()) for t in picked}) == 4
    assert picked == draw_trials(axes, 4, seed=1)  # seeded
    ranged = draw_trials(parse_grid(["actor.optim.lr=log:1e-6..1e-3"]), 20, seed=0)
    values = [float(t["actor.optim.lr"]) for t in ranged]
    assert all(1e-6 <= v <= 1e-3 for v in values) and len(set(values)) == 20
    with pytest.raises(ConfigError, match="more than the grid's 6 points"):
        draw_trials(axes, 7)
    with pytest.raises(ConfigError, match="needs --samples"):
        draw_trials(parse_grid(["actor.optim.lr=log:1e-6..1e-3"]), None)


@pytest.mark.parametrize(
    "grid,message",
    [
        (
            "actor.optim.lrr=1e-5,1e-4",
            "unknown key 'actor.optim.lrr'; did you mean 'actor.optim.lr'?",
        ),
        ("actor.optim.lr=1e-5,", "--grid 'actor.optim.lr=1e-5,': an empty value"),
        ("actor.optim.lr=", "an empty value"),
        ("actor.optim.lr=1e-5,fast", "actor.optim.lr: expected"),
        ("actor.optim.lr=log:1e-3..1e-6", "a range is log:LOW..HIGH with 0 < LOW < HIGH"),
        ("trainer.total_training_steps=5,10", "the sweep sets this key for every trial"),
        ("actor.optim.lr", "is not key=v1,v2"),
    ],
)
def test_bad_grid_is_one_line_and_writes_nothing(grid, message, tiny_workspace, tmp_path, capsys):
    root, out = tiny_workspace, tmp_path / "sweep"
    code = main(["sweep", f"model.path={root / 'model'}",
                 f"data.train_files={root / 'data' / 'train.parquet'}", "--grid", grid,
                 "--samples", "2", "--out", str(out)]
                if "log:" in grid else
                ["sweep", f"model.path={root / 'model'}",
                 f"data.train_files={root / 'data' / 'train.parquet'}", "--grid", grid,
                 "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("lmrl sweep: error: ") and "\n" not in err, err
    assert message in err
    assert not out.exists()


# ---------------------------------------------------------------- ranking and stopping
def test_validation_gain_per_step_ranks_and_flat_validation_falls_back_to_the_train_slope():
    # 0.30 -> 0.50 over 10 steps: +0.02 per step
    assert rank_score({0: 0.30, 5: 0.45, 10: 0.50}, {1: 0.9}) == (pytest.approx(0.02), "val")
    # 0.30 -> 0.305 is flat (|0.005| <= 0.01): the train score's slope, (1,1),(2,3),(3,2) ->
    # 0.5, orders it inside the flat band of 0.01 / 10 steps: 0.001 * 0.5 / (0.5 + 0.01)
    assert slope({1: 1.0, 2: 3.0, 3: 2.0}) == pytest.approx(0.5)
    flat_rising = rank_score({0: 0.30, 10: 0.305}, {1: 1.0, 2: 3.0, 3: 2.0})
    assert flat_rising == (pytest.approx(0.001 * 0.5 / 0.51), "train")
    flat_falling = rank_score({0: 0.30, 10: 0.30}, {1: 3.0, 2: 1.0})  # slope -2
    assert flat_falling == (pytest.approx(0.001 * -2 / 2.01), "train")
    # below a trial whose validation rose by just over the flat band, above one that fell
    assert rank_score({0: 0.30, 10: 0.311}, {})[0] > flat_rising[0] > flat_falling[0]
    assert flat_falling[0] > rank_score({0: 0.30, 10: 0.289}, {})[0]
    # without validation, the train slope itself
    assert rank_score({}, {1: 1.0, 2: 3.0, 3: 2.0}) == (pytest.approx(0.5), "train")
    # a drop is not flat: -0.1 over 4 steps
    assert rank_score({0: 0.3, 4: 0.2}, {}) == (pytest.approx(-0.025), "val")
    assert rank_score({0: 0.3, 4: 0.3}, {}) == (0.0, "val")
    assert rank_score({}, {}) == (None, "none")
    # acc averaged over sources; reward/mean where no source has acc; a named key
    metrics = {"val/a/acc": 0.2, "val/b/acc": 0.4, "val/a/reward/mean": 0.9}
    assert validation_score(metrics) == pytest.approx(0.3)
    assert validation_score({"val/a/reward/mean": 0.9}) == 0.9
    assert validation_score(metrics, "val/a/reward/mean") == 0.9


def test_successive_halving_is_ashas_rule():
    rule = SuccessiveHalving(first=5, last=20, eta=2)
    assert sorted(rule.rungs) == [5, 10]  # 20 is the end, not a rung
    assert rule.keep(0, 5, 0.10)  # nobody before it at rung 5
    assert rule.keep(0, 10, 0.20)
    assert not rule.keep(1, 5, 0.05)  # below the median of [0.10]
    assert rule.keep(2, 5, 0.30)  # median of [0.10, 0.05] is 0.075
    # at step 15 the highest rung reached is 10, where [0.20] was recorded: -1.0 is below it
    assert not rule.keep(2, 15, -1.0)
    assert rule.rungs[10] == {0: 0.20, 2: -1.0}


def test_rank_puts_completed_trials_first_then_later_stops():
    def record(index, status, steps, gain):
        return TrialRecord(index, {}, "", steps, status, {0: 0.0, steps: gain * steps})

    ranked = rank([record(0, "stopped", 5, 0.5), record(1, "completed", 20, 0.02),
                   record(2, "completed", 20, 0.03), record(3, "stopped", 10, 0.01),
                   record(4, "failed", 0, 0.0)])  # fmt: skip
    assert [r.index for r in ranked] == [2, 1, 3, 0, 4]


# ---------------------------------------------------------------- sweeps that run
def _tiny_sweep_args(root: Path, tmp_path: Path) -> list[str]:
    reward = tmp_path / "reward.py"
    reward.write_text(COUNTING_REWARD)
    return [
        f"model.path={root / 'model'}",
        f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}",
        "data.max_prompt_length=64", "data.max_response_length=4", "data.train_batch_size=4",
        "rollout.n=2", "actor.ppo_mini_batch_size=4", "algorithm.adv_estimator=grpo",
        "model.enable_gradient_checkpointing=false", "trainer.device=cpu", "trainer.logger=[]",
        "reward.num_workers=0", f"reward.custom_reward_function.path={reward}",
    ]  # fmt: skip


def test_local_sweep_stops_the_worse_trial_at_the_first_rung(tiny_workspace, tmp_path, capsys):
    out = tmp_path / "sweep"
    code = main(["sweep", *_tiny_sweep_args(tiny_workspace, tmp_path), "--grid",
                 "reward.custom_reward_function.reward_kwargs.scale=1,-1", "--steps", "4",
                 "--test-freq", "1", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    rows = list(csv.DictReader((out / "trials.csv").open()))
    by_scale = {r["reward.custom_reward_function.reward_kwargs.scale"]: r for r in rows}
    assert by_scale["1"]["status"] == "completed" and by_scale["1"]["steps"] == "4"
    assert by_scale["-1"]["status"] == "stopped early at step 1"
    assert [r["rank"] for r in (by_scale["1"], by_scale["-1"])] == ["1", "2"]
    assert float(by_scale["1"]["gain_per_step"]) > 0 > float(by_scale["-1"]["gain_per_step"])
    assert (out / "sweep.png").stat().st_size > 10_000
    assert (out / "trials" / "00" / "final").is_dir()  # a trial is a normal run
    best = (out / "best.txt").read_text().strip()
    assert best.startswith("lmrl train model.path=") and best in printed
    assert best.endswith("reward.custom_reward_function.reward_kwargs.scale=1")
    assert "total_training_steps" not in best  # the sweep's own settings stay out of it


def test_trials_probe_their_run_directories_under_a_trials_dir_that_stays(tiny_workspace, tmp_path):
    """Trials launched at once (Ray Tune) each probe their run directory, and a probe removes
    the directories it made: trials/ is the sweep's own, made before any trial, so one trial's
    probe cannot remove it under another's mkdir (a CI failure: "trials/01 is not writable: No
    such file or directory")."""
    from lmrl.run.resume import check_run_dir
    from lmrl.sweep import plan_sweep, run_sweep

    sweep = plan_sweep(
        None, _tiny_sweep_args(tiny_workspace, tmp_path),
        ["reward.custom_reward_function.reward_kwargs.scale=1,2"], out=tmp_path / "sweep",
    )  # fmt: skip

    class Launched(Exception):
        pass

    def launch(sweep, stop):
        check_run_dir(sweep.trial_dir(0))  # trial 00's probe, as it starts
        assert sweep.trial_dir(0).parent.is_dir()  # trial 01 still finds trials/
        check_run_dir(sweep.trial_dir(1))
        raise Launched

    with pytest.raises(Launched):
        run_sweep(sweep, launch)


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def test_sigterm_stops_the_sweep_saved_and_the_same_command_resumes_it(tiny_workspace, tmp_path):
    """SIGTERM in trial 01: it saves, the table is written, exit 143; meanwhile a second sweep
    into the folder is refused (its lock), and so is another sweep's definition. The same
    command then keeps trial 00 and resumes trial 01 from its checkpoint."""
    out = tmp_path / "sweep"
    args = [*_tiny_sweep_args(tiny_workspace, tmp_path), "trainer.save_freq=1", "--grid",
            "reward.custom_reward_function.reward_kwargs.scale=1,2", "--steps", "6",
            "--test-freq", "6", "--out", str(out)]  # fmt: skip
    command = [sys.executable, "-m", "lmrl.cli", "sweep", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        _wait_for(out / "trials" / "00" / "global_step_1", proc)
        assert main(["sweep", *args]) == 2  # the folder is the running sweep's
        _wait_for(out / "trials" / "01" / "global_step_1", proc)
        proc.send_signal(signal.SIGTERM)
        printed, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "run the same command to resume" in printed
    rows = {r["trial"]: r for r in csv.DictReader((out / "trials.csv").open())}
    assert rows["00"]["status"] == "completed"
    assert rows["01"]["status"].startswith("interrupted at step")
    stopped_at = int(rows["01"]["steps"])
    assert 1 <= stopped_at < 6 and (out / "trials" / "01" / f"global_step_{stopped_at}").is_dir()
    assert not (out / "trials" / "01" / "final").exists()
    assert (out / "best.txt").read_text().strip().endswith("scale=1")
    kept = (out / "trials" / "00" / "sweep_trial.json").stat().st_mtime_ns

    assert main(["sweep", *args[:-6], "--steps", "5", *args[-4:]]) == 2  # another sweep

    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {out / 'trials' / '01' / f'global_step_{stopped_at}'}" in again.stderr
    assert (out / "trials" / "00" / "sweep_trial.json").stat().st_mtime_ns == kept  # not re-run
    rows = {r["trial"]: r for r in csv.DictReader((out / "trials.csv").open())}
    assert [rows[t]["status"] for t in ("00", "01")] == ["completed", "completed"]
    assert rows["01"]["steps"] == "6"
    resumed = json.loads((out / "trials" / "01" / "sweep_trial.json").read_text())
    assert sorted(resumed["val"]) == ["0", "6"]  # its validation before training kept
    assert (out / "trials" / "01" / "final").is_dir()
    assert not (out / ".lmrl.lock").exists()


def test_a_failing_trial_is_marked_failed_and_the_others_run(
    tiny_workspace, tmp_path, monkeypatch, capsys
):
    """A trial that raises (here a bug's IndexError, as a sampler on NaN weights raised) is
    failed with its error in the table and a traceback beside its run; the next one runs."""
    from lmrl.trainer import Trainer

    step = Trainer.step

    def failing_step(self):
        if self.start.run_dir.name == "00":
            raise IndexError("index 259 is out of bounds for dimension 0 with size 259")
        return step(self)

    monkeypatch.setattr(Trainer, "step", failing_step)
    out = tmp_path / "sweep"
    code = main(["sweep", *_tiny_sweep_args(tiny_workspace, tmp_path), "--grid",
                 "reward.custom_reward_function.reward_kwargs.scale=1,2", "--steps", "1",
                 "--out", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err[-3000:]
    rows = {r["trial"]: r for r in csv.DictReader((out / "trials.csv").open())}
    assert rows["01"]["status"] == "completed" and rows["01"]["rank"] == "1"
    assert rows["00"]["status"] == "failed: IndexError: index 259 is out of bounds for " \
        "dimension 0 with size 259"  # fmt: skip
    assert "Traceback" in (out / "trials" / "00" / "error.txt").read_text()
    assert "failed: IndexError" in (out / "trials.md").read_text()
    assert (out / "best.txt").read_text().strip().endswith("scale=2")


@pytest.mark.parametrize("case", ["out_file", "out_under_file", "metric_form", "metric_source",
                                  "gpus"])  # fmt: skip
def test_sweep_refusals_are_one_line(case, tiny_workspace, tmp_path, capsys):
    out = tmp_path / "sweep"
    extra, message = [], ""
    if case in ("out_file", "out_under_file"):
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" if case == "out_file" else tmp_path / "file" / "sub"
        message = "is a file, not a folder" if case == "out_file" else "is inside"
    elif case == "metric_form":  # refused before any trial runs
        extra, message = ["--metric", "val/digits/accc"], "is not a validation metric"
    elif case == "metric_source":  # refused at the first validation
        extra = ["--metric", "val/digitz/acc"]
        message = "is not a metric of this run's validation; it logs val/digits/mean@1"
    else:
        pytest.importorskip("ray.tune")
        import torch

        gpus = torch.cuda.device_count()
        extra = ["--backend", "ray", "--gpus-per-trial", str(gpus + 1)]
        message = f"--gpus-per-trial {gpus + 1}: this machine has {gpus} GPU(s)"
    code = main(["sweep", *_tiny_sweep_args(tiny_workspace, tmp_path), "--grid",
                 "reward.custom_reward_function.reward_kwargs.scale=1,2", "--steps", "1",
                 "--out", str(out), *extra])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err, err
    assert err[-1].startswith("lmrl sweep: error: ") and message in err[-1], err[-1]
    assert not any(line.startswith("Traceback") for line in err)
    assert not (out / "trials" / "00" / "sweep_trial.json").exists()
    if case == "metric_source":  # nothing scored: the corrected metric resumes the folder
        from lmrl.sweep import plan_sweep

        plan_sweep(None, _tiny_sweep_args(tiny_workspace, tmp_path),
                   ["reward.custom_reward_function.reward_kwargs.scale=1,2"], out=out, steps=1,
                   metric="val/digits/acc")  # fmt: skip


def test_ray_trials_stop_saved_at_the_sweeps_stop_file(tiny_workspace, tmp_path):
    """The Ray backend's stop path without Ray: the sweep's first SIGTERM (handled after Ray
    took SIGTERM for itself) writes DIR/.stop; a trial reading it stops after its step, saved
    and resumable, and a trial not started returns at once."""
    pytest.importorskip("ray.tune")
    from lmrl.sweep import STOP_FILE, StopFile, plan_sweep, run_trial
    from lmrl.sweep.tune import _StopTrials, _trainable

    sweep = plan_sweep(
        None, [*_tiny_sweep_args(tiny_workspace, tmp_path), "trainer.save_freq=-1"],
        ["reward.custom_reward_function.reward_kwargs.scale=1,2"], out=tmp_path / "sweep",
        steps=3, test_freq=3,
    )  # fmt: skip
    sweep.trial_dir(0).parent.mkdir(parents=True)
    stop = StopFile(sweep.out / STOP_FILE)
    previous = signal.getsignal(signal.SIGTERM)
    with _StopTrials(stop) as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    assert signal.getsignal(signal.SIGTERM) is previous
    assert signals.requested == "SIGTERM" and stop.requested == "SIGTERM"

    class AfterLoad:  # the request comes once the trial's models have loaded
        reads = 0

        @property
        def requested(self):
            self.reads += 1
            return stop.requested if self.reads > 1 else None

    record = run_trial(sweep, 0, stop=AfterLoad())
    assert record.status == "interrupted" and record.steps == 1
    assert (sweep.trial_dir(0) / "global_step_1").is_dir()
    assert not (sweep.trial_dir(0) / "final").exists()
    assert _trainable({"index": 1}, sweep, 1) is None
    assert not sweep.trial_dir(1).exists()


def test_a_resumed_sweeps_early_stopping_holds_the_kept_trials_scores(tmp_path):
    """The scores the folder's trials were judged on at each rung, replayed into the local
    rule and into Ray's ASHA: a resumed trial is judged as it would have been."""
    pytest.importorskip("ray.tune")
    from ray.tune.schedulers import ASHAScheduler

    from lmrl.sweep import Sweep, records_on_disk, replay
    from lmrl.sweep.tune import _replay_rungs

    sweep = Sweep(None, (), ({"k": "1"}, {"k": "2"}), steps=4, test_freq=1, out=tmp_path)
    TrialRecord(0, {"k": "1"}, str(sweep.trial_dir(0)), 4, "completed",
                {0: 0.1, 1: 0.2, 2: 0.3, 4: 0.5}).save()  # fmt: skip
    TrialRecord(1, {"k": "2"}, str(sweep.trial_dir(1)), 1, "stopped", {0: 0.1, 1: 0.0}).save()
    halving = SuccessiveHalving(1, 4)
    for record in records_on_disk(sweep).values():
        replay(halving, sweep, record)
    # gain per step at each rung: trial 0 +0.1 at steps 1 and 2, trial 1 -0.1 at step 1
    assert halving.rungs == {1: {0: pytest.approx(0.1), 1: pytest.approx(-0.1)},
                             2: {0: pytest.approx(0.1)}}  # fmt: skip
    assert not halving.keep(2, 1, -0.05)  # below the median of [0.1, -0.1]
    scheduler = ASHAScheduler(time_attr="step", max_t=4, grace_period=1, reduction_factor=2)
    _replay_rungs(scheduler, sweep)
    rungs = {milestone: recorded for milestone, recorded in scheduler._brackets[0]._rungs}
    assert rungs[1] == {"sweep-trial-00": pytest.approx(0.1), "sweep-trial-01": pytest.approx(-0.1)}
    assert rungs[2] == {"sweep-trial-00": pytest.approx(0.1)}


def test_ray_tune_sweep_runs_both_trials_and_stops_ray(tiny_workspace, tmp_path, capsys):
    pytest.importorskip("ray.tune")
    from lmrl.sweep import plan_sweep, run_sweep
    from lmrl.sweep.tune import run_ray
    from lmrl.workers.ray_cluster import ray_processes

    sweep = plan_sweep(
        None, _tiny_sweep_args(tiny_workspace, tmp_path),
        ["reward.custom_reward_function.reward_kwargs.scale=1,2"], out=tmp_path / "sweep",
        steps=2, test_freq=1,
    )  # fmt: skip
    records, paths = run_sweep(sweep, partial(run_ray, cpus_per_trial=1, num_cpus=2))
    assert {r.status for r in records} <= {"completed", "stopped"}
    assert any(r.status == "completed" for r in records)
    assert all(r.val for r in records) and paths["best"] is not None
    assert (tmp_path / "sweep" / "tune").is_dir()
    assert not ray_processes(f"/tmp/lmrl-ray-{os.getpid()}-"), "a Ray process outlived the sweep"


@pytest.mark.learning  # ~55 s: in `make test-learning`, out of CI's 15 minutes
@pytest.mark.timeout(1200)
def test_lr_sweep_on_the_demos_warm_start_picks_the_rate_that_learns(tmp_path):
    """The demo's SFT warm start (greedy exact match ~0.33), then 20-step GRPO trials with the
    demo's settings over lr {1e-6, 3e-4, 1e-3}: 3e-4 learns (0.33 -> 0.53 measured), 1e-6 does
    not move, 1e-3 knocks the warm start down (docs/demo.md) and is stopped early."""
    from lmrl.demos.digits import run_sft, write_demo_data
    from lmrl.models.tiny import build_tiny_model
    from lmrl.sweep import plan_sweep, run_sweep

    model = build_tiny_model(tmp_path / "model", arch="qwen2", size="small", seed=0)
    data = write_demo_data(tmp_path / "data", 0, 10_000, 128, None)
    sft = run_sft(model, data, tmp_path / "sft", seed=0, target_acc=0.3, max_steps=400, lr=1e-3,
                  batch_size=64, max_new_tokens=8, console=False)  # fmt: skip
    base = [
        f"model.path={sft['model']}", f"data.train_files={data['train']}",
        f"data.val_files={data['test']}", "data.max_prompt_length=64",
        "data.max_response_length=8", "data.train_batch_size=16", "rollout.n=8",
        "algorithm.adv_estimator=grpo", "actor.ppo_mini_batch_size=16",
        "actor.optim.lr_warmup_steps=10", "rollout.temperature=0.7", "actor.use_kl_loss=false",
        "model.enable_gradient_checkpointing=false", "reward.num_workers=0",
        "trainer.logger=[]", "trainer.device=cpu",
    ]  # fmt: skip
    sweep = plan_sweep(None, base, ["actor.optim.lr=1e-6,3e-4,1e-3"], out=tmp_path / "sweep",
                       steps=20, test_freq=5)  # fmt: skip
    records, paths = run_sweep(sweep)
    by_lr = {r.keys["actor.optim.lr"]: r for r in records}
    assert paths["best"].endswith("actor.optim.lr=3e-4"), (paths["best"], [
        (r.keys, r.val, r.status) for r in records])  # fmt: skip
    assert rank(records)[-1] is by_lr["1e-3"]
    assert by_lr["1e-3"].status == "stopped"
    assert json.loads((Path(by_lr["3e-4"].run_dir) / "sweep_trial.json").read_text())["val"]
    assert os.path.getsize(tmp_path / "sweep" / "sweep.png") > 10_000
