"""Faults around the step end cleanly: Ctrl-C twice, a changed resume, an unwritable run
directory at start or mid-run, a failed final save, a launch that fails after validation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lmrl.cli import main as cli_main
from lmrl.config import load_config
from lmrl.errors import CheckpointError
from lmrl.run.checkpoint import latest_checkpoint
from lmrl.trainer import Trainer, build_run

HANGING_REWARD = """
import pathlib, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    pathlib.Path({marker!r}).touch()
    time.sleep(1000)
    return 0.0
"""


def fit(overrides: list[str]) -> Trainer:
    cfg = load_config(None, overrides)
    trainer = Trainer(build_run(cfg), cfg.trainer)
    trainer.fit()
    return trainer


def test_second_ctrl_c_stops_a_hanging_in_process_reward_with_130(
    tiny_workspace, tiny_overrides, tmp_path
):
    marker = tmp_path / "hanging"
    (tmp_path / "reward.py").write_text(HANGING_REWARD.format(marker=str(marker)))
    args = tiny_overrides(
        tiny_workspace,
        tmp_path / "run",
        f"reward.custom_reward_function.path={tmp_path / 'reward.py'}",
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmrl.cli", "train", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.time() + 120
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "the reward function never started"
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert proc.poll() is None  # the first Ctrl-C waits for the step
    proc.send_signal(signal.SIGINT)
    try:  # the reward sleeps 1000 s: the run ends only if the second Ctrl-C stops it now
        _out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the second Ctrl-C did not stop the run while its reward hung")
    assert proc.returncode == 130, err[-2000:]
    assert "saving after this step; press Ctrl-C again to stop now" in err
    assert "Traceback" not in err


def test_resume_with_a_new_lr_is_refused_then_applied_when_allowed(
    tiny_workspace, tiny_overrides, tmp_path
):
    run_dir = tmp_path / "run"
    fit(tiny_overrides(tiny_workspace, run_dir))
    saved = (run_dir / "config.yaml").read_text()

    longer = tiny_overrides(tiny_workspace, run_dir, "trainer.total_training_steps=3")
    changed = [*longer, "actor.optim.lr=0.5"]
    with pytest.raises(CheckpointError) as err:
        build_run(load_config(None, changed))
    assert "actor.optim.lr: 0.01 -> 0.5" in str(err.value)
    assert "trainer.allow_config_change=true" in str(err.value)
    assert (run_dir / "config.yaml").read_text() == saved  # refused: nothing rewritten

    trainer = fit([*changed, "trainer.allow_config_change=true"])
    assert trainer.global_step == 3
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()][-1]
    assert last["step"] == 3 and last["actor/lr"] == pytest.approx(0.5)
    group = trainer.parts.actor.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(0.5) and group["initial_lr"] == pytest.approx(0.5)
    assert (run_dir / "config.step2.yaml").read_text() == saved  # the old settings kept
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["actor"]["optim"]["lr"] == 0.5


def test_extending_a_run_needs_no_permission(tiny_workspace, tiny_overrides, tmp_path):
    run_dir = tmp_path / "run"
    fit(tiny_overrides(tiny_workspace, run_dir))
    trainer = fit(tiny_overrides(tiny_workspace, run_dir, "trainer.total_training_steps=3"))
    assert trainer.global_step == 3
    assert not list(run_dir.glob("config.step*.yaml"))


def test_unwritable_run_dir_is_one_line_before_any_model_loads(tiny_workspace, tiny_overrides, tmp_path, capsys,
                                                               monkeypatch):  # fmt: skip
    (tmp_path / "a-file").write_text("")
    loaded = []
    monkeypatch.setattr("lmrl.trainer.build.load_tokenizer", lambda *a, **k: loaded.append(1))
    code = cli_main(["train", *tiny_overrides(tiny_workspace, tmp_path / "a-file" / "run")])
    err = capsys.readouterr().err
    assert code == 2 and not loaded
    assert err.count("\n") == 1 and "a-file is a file, not a directory" in err


def test_a_launch_that_fails_after_validation_leaves_no_run_dir(
    tiny_workspace, tiny_overrides, tmp_path
):
    bad_model = tmp_path / "model"
    bad_model.mkdir()
    (bad_model / "config.json").write_text("{not json")
    run_dir = tmp_path / "run"
    overrides = [*tiny_overrides(tiny_workspace, run_dir), f"model.path={bad_model}"]
    with pytest.raises(Exception):  # noqa: B017 - any loading error; what matters is the dir
        build_run(load_config(None, overrides))
    assert not run_dir.exists()


def test_resume_from_a_missing_path_says_it_does_not_exist(
    tiny_workspace, tiny_overrides, tmp_path
):
    missing = tmp_path / "nowhere" / "global_step_3"
    overrides = tiny_overrides(tiny_workspace, tmp_path / "run", f"trainer.resume_mode={missing}")
    with pytest.raises(CheckpointError, match="does not exist"):
        build_run(load_config(None, overrides))


def test_a_failed_periodic_save_is_logged_and_the_run_finishes(tiny_workspace, tiny_overrides, tmp_path,
                                                               monkeypatch, caplog):  # fmt: skip
    from lmrl.run import loop as trainer_module  # the run loop saves

    real_save = trainer_module.save_checkpoint
    calls = []

    def flaky_save(run_dir, step, *args, **kwargs):
        calls.append(step)
        if step == 1:  # the disk is full at step 1, freed by step 2
            raise OSError(28, "No space left on device")
        return real_save(run_dir, step, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "save_checkpoint", flaky_save)
    run_dir = tmp_path / "run"
    with caplog.at_level("ERROR", logger="lmrl.trainer"):
        trainer = fit(tiny_overrides(tiny_workspace, run_dir))
    assert trainer.global_step == 2 and calls == [1, 2]
    assert "No space left on device" in caplog.text and "next save retries" in caplog.text
    assert latest_checkpoint(run_dir).name == "global_step_2"


def test_a_failed_final_save_ends_the_run_with_one_line(tiny_workspace, tiny_overrides, tmp_path, monkeypatch,
                                                        capsys):  # fmt: skip
    from lmrl.run import loop as trainer_module  # the run loop saves

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer_module, "save_checkpoint", full_disk)
    code = cli_main(["train", *tiny_overrides(tiny_workspace, tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert "final checkpoint could not be written" in err and "Traceback" not in err


def test_a_run_killed_before_its_first_save_resumes_fresh(tiny_workspace, tiny_overrides, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".global_step_1.tmp").mkdir()  # an interrupted save
    trainer = fit(tiny_overrides(tiny_workspace, run_dir, "trainer.total_training_steps=1"))
    assert trainer.global_step == 1
    assert Path(latest_checkpoint(run_dir)).name == "global_step_1"


def test_a_damaged_run_directory_resumes_from_its_last_good_checkpoint_or_says_what_to_fix(
    tiny_workspace, tiny_overrides, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    fit(tiny_overrides(tiny_workspace, run_dir))  # checkpoints at steps 1 and 2
    damaged = run_dir / "global_step_2" / "actor.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])  # a disk that lost the file's tail
    trainer = fit(tiny_overrides(tiny_workspace, run_dir, "trainer.total_training_steps=3"))
    assert trainer.global_step == 3  # went on from global_step_1, the last complete one

    (run_dir / "config.yaml").write_text("actor: [broken\n")
    args = tiny_overrides(tiny_workspace, run_dir, "trainer.total_training_steps=4")
    assert cli_main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.yaml: unreadable (line 2, column 1" in err
    assert "delete it to resume without comparing them" in err
    assert latest_checkpoint(run_dir).name == "global_step_3"  # nothing lost
