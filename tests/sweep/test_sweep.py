"""``lmrl sweep``: the grid and its refusals, the ranking and stopping rules by hand, a local
sweep that stops a trial, a Ray Tune sweep, and the lr sweep on the demo's warm start."""

from __future__ import annotations

import csv
import json
import os
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

    def launch(sweep):
        check_run_dir(sweep.trial_dir(0))  # trial 00's probe, as it starts
        assert sweep.trial_dir(0).parent.is_dir()  # trial 01 still finds trials/
        check_run_dir(sweep.trial_dir(1))
        raise Launched

    with pytest.raises(Launched):
        run_sweep(sweep, launch)


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
