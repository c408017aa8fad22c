"""The one run loop: cadence, early stop, signals, failed saves, trackers and health, on a fake
program (no model); then each command's program on it (``lmrl train``, ``lmrl sft``,
``lmrl train-flow``): a signal saves and stops with 143, and the same command resumes to the
weights of an uninterrupted run, bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmrl.errors import CheckpointError
from lmrl.run.checkpoint import latest_checkpoint, load_state, read_weights
from lmrl.run.loop import RunLoop, resume
from lmrl.run.resume import RunStart
from lmrl.run.signals import StopNow


@dataclass
class FakeConfig:
    a: int = 1


class Settings:
    """A ``trainer`` section: the keys the loop reads."""

    def __init__(self, **kw) -> None:
        self.save_freq, self.test_freq, self.val_before_train = -1, -1, True
        self.log_generations_freq, self.max_ckpt_to_keep = -1, None
        self.__dict__.update(kw)

    def rollbacks(self) -> tuple[int, float]:
        return 0, 1.0  # no run doctor


class Trackers:
    def __init__(self, fail: bool = False) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.generations: list[int] = []
        self.fail = fail

    def log(self, metrics, step):
        if self.fail:
            raise OSError(28, "No space left on device")
        self.logged.append((step, dict(metrics)))

    def log_generations(self, rows, step):
        self.generations.append(step)

    def close(self):
        pass


class Health:
    def __init__(self) -> None:
        self.baselines, self.checked = [], []

    def baseline(self, val):
        self.baselines.append(dict(val))

    def check(self, metrics):
        self.checked.append(metrics["loss"])
        return ["the loss is odd"] if metrics["loss"] == 3.0 else []

    collapse = None  # never: the loop's rollback is tested in tests/run/test_doctor.py

    def rewind(self, step):
        raise AssertionError("no rollback in these runs")


class FakeProgram:
    """A program whose weights are one tensor that each step adds 1 to."""

    def __init__(self, run_dir: Path, total_steps: int = 6, val: bool = True, on_step=None,
                 resume_from: Path | None = None, trackers: Trackers | None = None) -> None:  # fmt: skip
        self.start = RunStart(Path(run_dir), "lmrl test", FakeConfig(), resume_from)
        self.trackers = trackers or Trackers()
        self.health = Health()
        self.total_steps, self.global_step = total_steps, 0
        self.weight = torch.zeros(2)
        self.val = val
        self.on_step = on_step or (lambda step: None)
        self.exported = 0
        self.closed = 0
        resume(self)

    @property
    def has_validation(self) -> bool:
        return self.val

    def step(self):
        self.on_step(self.global_step + 1)
        self.weight += 1
        self.global_step += 1
        return {"loss": float(self.global_step)}

    def validate(self):
        return {"val/x/acc": float(self.weight[0]) / 10}

    def checkpoint_weights(self):
        return {"model": {"w": self.weight.clone()}}

    def state_dict(self):
        return {"global_step": self.global_step}

    def load_checkpoint(self, path):
        self.weight = read_weights(path / "model.safetensors")["w"]
        self.global_step = load_state(path)["global_step"]

    def export(self):
        self.exported += 1
        out = self.start.run_dir / "final"
        out.mkdir(exist_ok=True)
        return out

    def generations(self):
        return [{"prompt": "p"}]

    def close(self):
        self.closed += 1


def test_cadence_validation_saves_generations_health_and_export(tmp_path, caplog):
    prog = FakeProgram(tmp_path)
    loop = RunLoop(prog, Settings(save_freq=4, test_freq=2, log_generations_freq=3))
    with caplog.at_level("WARNING", logger="lmrl.trainer"):
        history = loop.run()
    assert [m["loss"] for m in history] == [1, 2, 3, 4, 5, 6]
    assert sorted(loop.validations) == [0, 2, 4, 6]
    assert prog.health.baselines == [{"val/x/acc": 0.0}]
    assert prog.health.checked == [1, 2, 3, 4, 5, 6]
    assert caplog.text.count("the loss is odd") == 1
    assert [s for s, _ in prog.trackers.logged] == [0, 1, 2, 3, 4, 5, 6]
    assert (
        "val/x/acc" in prog.trackers.logged[2][1] and "val/x/acc" not in prog.trackers.logged[1][1]
    )
    assert prog.trackers.generations == [3, 6]
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == [
        "global_step_4",
        "global_step_6",
    ]
    assert prog.exported == 1 and prog.closed == 1 and loop.exit_code == 0
    assert (
        (tmp_path / "config.yaml")
        .read_text()
        .startswith("# lmrl resolved config: load it with `lmrl test")
    )


def test_on_step_end_stops_a_run_that_is_validated_saved_and_exported_like_a_last_step(tmp_path):
    prog = FakeProgram(tmp_path, total_steps=100)
    seen = []

    def stop(step, metrics):
        seen.append(step)
        metrics["extra/added"] = 1.0  # a callback's own metric is logged with the step
        return step == 3

    history = RunLoop(prog, Settings(test_freq=10), on_step_end=stop).run()
    assert seen == [1, 2, 3] and len(history) == 3
    assert "val/x/acc" in history[-1] and "val/x/acc" not in history[-2]
    assert prog.trackers.logged[-1][1]["extra/added"] == 1.0
    assert latest_checkpoint(tmp_path).name == "global_step_3" and prog.exported == 1


def test_a_run_without_validation_data_never_validates(tmp_path):
    prog = FakeProgram(tmp_path, total_steps=2, val=False)
    loop = RunLoop(prog, Settings(test_freq=1))
    loop.run()
    assert loop.validations == {} and prog.health.baselines == []


def test_the_first_signal_saves_after_the_step_and_the_second_stops_now(
    tmp_path, capsys, monkeypatch
):
    def term(step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    prog = FakeProgram(tmp_path, on_step=term)
    loop = RunLoop(prog, Settings())
    history = loop.run()
    assert len(history) == 3 and loop.stopped_by == "SIGTERM" and loop.exit_code == 143
    assert "saving after this step" in capsys.readouterr().err
    assert latest_checkpoint(tmp_path).name == "global_step_3"
    assert prog.exported == 0  # an interrupted run is not a finished one

    resumed = FakeProgram(tmp_path, resume_from=latest_checkpoint(tmp_path))
    assert resumed.global_step == 3 and torch.equal(resumed.weight, torch.full((2,), 3.0))
    loop = RunLoop(resumed, Settings())
    assert [m["loss"] for m in loop.run()] == [4, 5, 6] and loop.exit_code == 0

    def twice(step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    watchdogs = []  # the second signal's watchdog would end this process after its grace

    class Watchdog:
        def __init__(self, seconds, function, args=()):
            watchdogs.append(seconds)
            self.daemon = True

        def start(self):
            pass

    monkeypatch.setattr("lmrl.run.signals.threading.Timer", Watchdog)
    prog = FakeProgram(tmp_path / "twice", on_step=twice)
    with pytest.raises(StopNow) as err:
        RunLoop(prog, Settings()).run()
    assert err.value.exit_code == 130 and prog.closed == 1 and watchdogs == [10.0]
    assert latest_checkpoint(tmp_path / "twice") is None


def test_a_failed_periodic_save_is_retried_and_a_failed_final_save_is_an_error(
    tmp_path, monkeypatch, caplog
):
    from lmrl.run import loop as loop_module

    real, calls = loop_module.save_checkpoint, []

    def flaky(run_dir, step, *args, **kwargs):
        calls.append(step)
        if step == 2:
            raise OSError(28, "No space left on device")
        return real(run_dir, step, *args, **kwargs)

    monkeypatch.setattr(loop_module, "save_checkpoint", flaky)
    with caplog.at_level("ERROR", logger="lmrl.trainer"):
        RunLoop(FakeProgram(tmp_path, total_steps=4), Settings(save_freq=2)).run()
    assert calls == [2, 4] and "training goes on and the next save retries" in caplog.text
    assert latest_checkpoint(tmp_path).name == "global_step_4"

    def broken(run_dir, step, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loop_module, "save_checkpoint", broken)
    with pytest.raises(CheckpointError, match="final checkpoint could not be written"):
        RunLoop(FakeProgram(tmp_path / "full", total_steps=2), Settings()).run()


def test_a_tracker_that_cannot_write_never_stops_the_run(tmp_path, caplog):
    prog = FakeProgram(tmp_path, total_steps=3, trackers=Trackers(fail=True))
    with caplog.at_level("ERROR", logger="lmrl.trainer"):
        assert len(RunLoop(prog, Settings()).run()) == 3
    assert caplog.text.count("could not write metrics") == 1


def test_a_checkpoint_of_another_program_is_one_error(tmp_path):
    FakeProgram(tmp_path, total_steps=1)  # nothing saved yet
    RunLoop(FakeProgram(tmp_path, total_steps=1), Settings()).run()

    class Other(FakeProgram):
        def load_checkpoint(self, path):
            raise KeyError("critic")

    with pytest.raises(CheckpointError, match=r"cannot resume from .*global_step_1"):
        Other(tmp_path, resume_from=latest_checkpoint(tmp_path))


# -------------------------------------------------------------------- each command's program
STEPS = 4


def _sft_args(ws: dict, run: Path, *extra: str) -> list[str]:
    root = ws["text"]
    return [
        f"model.path={root / 'model'}", f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}",
        "data.response_from_ground_truth=true", "data.train_batch_size=4", "data.max_length=64",
        "optim.lr=1e-3", "model.enable_gradient_checkpointing=false", "trainer.device=cpu",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.test_freq=2",
        f"trainer.default_local_dir={run}", *extra,
    ]  # fmt: skip


def _flow_args(ws: dict, run: Path, *extra: str) -> list[str]:
    root = ws["flow"]
    return [
        f"model.path={root / 'model'}", f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}", "trainer.val_images_per_prompt=1",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.test_freq=2",
        "data.train_batch_size=2", "sampler.n=2", "sampler.num_steps=3",
        "sampler.val_num_steps=3", "actor.micro_batch_size=2", "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=1e-3", "trainer.device=cpu", f"trainer.default_local_dir={run}", *extra,
    ]  # fmt: skip


def _train_args(ws: dict, run: Path, *extra: str) -> list[str]:
    root = ws["text"]
    return [
        f"model.path={root / 'model'}", f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}", "data.max_prompt_length=64",
        "data.max_response_length=6", "data.train_batch_size=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=2", "actor.optim.lr=1e-2", "algorithm.adv_estimator=grpo",
        "model.enable_gradient_checkpointing=false", "trainer.device=cpu",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.test_freq=2",
        "reward.num_workers=0", f"trainer.default_local_dir={run}", *extra,
    ]  # fmt: skip


def _build(command: str, args: list[str]):
    if command == "sft":
        from lmrl.config.sft import load_sft_config
        from lmrl.trainer.sft import SFTTrainer, build_sft

        return SFTTrainer(build_sft(load_sft_config(None, args)))
    if command == "train-flow":
        from lmrl.config.flow import load_flow_config
        from lmrl.trainer.flow import FlowTrainer, build_flow

        return FlowTrainer(build_flow(load_flow_config(None, args)))
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    cfg = load_config(None, args)
    return Trainer(build_run(cfg), cfg.trainer)


COMMANDS = {
    "train": (_train_args, "actor.safetensors"),
    "sft": (_sft_args, "model.safetensors"),
    "train-flow": (_flow_args, "model.safetensors"),
}


@pytest.fixture(scope="module")
def workspaces(tiny_workspace, flow_workspace):
    return {"text": tiny_workspace, "flow": flow_workspace}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_signal_saves_and_the_same_command_resumes_bitwise_exact(
    command, workspaces, tmp_path, capsys, caplog
):
    args, weights = COMMANDS[command]
    whole = _build(command, args(workspaces, tmp_path / "whole", "trainer.logger=[]"))
    whole.fit()
    assert (tmp_path / "whole" / "final").is_dir()

    cut_args = args(workspaces, tmp_path / "cut", "trainer.logger=[console]")
    cut = _build(command, cut_args)
    step = cut.step

    def step_then_signal():
        out = step()
        if cut.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's time limit does
        return out

    cut.step = step_then_signal
    cut.fit()
    assert cut.exit_code == 143 and cut.global_step == 2
    assert latest_checkpoint(tmp_path / "cut").name == "global_step_2"
    assert not (tmp_path / "cut" / "final").exists()
    out = capsys.readouterr()
    assert "step 1/4" in out.out and "saving after this step" in out.err  # progress, signal

    with caplog.at_level("INFO", logger="lmrl"):
        resumed = _build(command, cut_args)
    assert resumed.global_step == 2 and "resumed from" in caplog.text
    resumed.fit()
    assert resumed.exit_code == 0 and (tmp_path / "cut" / "final").is_dir()
    expected = load_file(tmp_path / "whole" / f"global_step_{STEPS}" / weights)
    actual = load_file(tmp_path / "cut" / f"global_step_{STEPS}" / weights)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key


@pytest.mark.parametrize("command", ["sft", "train-flow"])
def test_sigterm_to_the_command_saves_exits_143_and_the_same_command_resumes(
    command, workspaces, tmp_path
):
    args = COMMANDS[command][0](workspaces, tmp_path / "run", "trainer.total_training_steps=1000",
                                "trainer.save_freq=-1", "trainer.test_freq=-1",
                                "trainer.val_before_train=false", "trainer.logger=[]")  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lmrl.cli", command, *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "saving after this step" in err and "stopped after step" in err
    saved = latest_checkpoint(tmp_path / "run")
    step = load_state(saved)["global_step"]
    assert saved.name == f"global_step_{step}" and 1 <= step < 1000

    # the same command, now 1 step longer, resumes there instead of starting over
    longer = [*args[:-5], f"trainer.total_training_steps={step + 1}", *args[-4:]]
    again = subprocess.run([sys.executable, "-m", "lmrl.cli", command, *longer], env=env,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from {saved} at step {step}" in again.stderr
    assert (tmp_path / "run" / f"global_step_{step + 1}").is_dir()
    assert f"model: {tmp_path / 'run' / 'final'}" in again.stdout
