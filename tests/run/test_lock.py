"""One owner per run directory (``lmrl.run.lock``): a second command into a directory another
process holds is refused in one line naming that process; a lock whose holder died (SIGKILL)
is free; the lock goes when a run ends, cleanly or not; the loop and every command take it;
a sweep's folder is refused."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lmrl.cli import main as cli_main
from lmrl.config import load_config
from lmrl.errors import CheckpointError
from lmrl.run.checkpoint import save_checkpoint
from lmrl.run.lock import LOCK_FILE, RunDirLock, holds_lock, refuse_sweep_folder
from lmrl.run.loop import RunLoop
from lmrl.run.resume import RunStart, check_untouched, open_run

OWNER = "lmrl train trainer.seed=1"

# holds the lock of argv[1] as command argv[2]; with argv[3] == "fork", a child it forked
# sleeps on; prints "held <pid>" once it holds it (with a child, the child prints its own pid
# once its fork is done, the lock's at-fork handler run)
HOLDER = """
import os, sys, time
from lmrl.run.lock import RunDirLock
RunDirLock(sys.argv[1], sys.argv[2]).acquire()
child = os.fork() if sys.argv[3] == "fork" else None
if child == 0:
    print("held", os.getpid(), flush=True)
    time.sleep(600)
    os._exit(0)
if child is None:
    print("held", os.getpid(), flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def holder(directory: Path, command: str = OWNER, fork: bool = False):
    """A process holding ``directory``'s lock (killed on exit); yields ``(process, pid)``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), command, "fork" if fork else "-"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        word, pid = proc.stdout.readline().split()
        assert word == "held"
        yield proc, int(pid)
    finally:
        if fork:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        proc.kill()
        proc.wait()


def refused(argv: list[str], capsys) -> str:
    """``lmrl argv`` exits 2 with one line on stderr; returns it."""
    code = cli_main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def in_use(directory: Path, pid: int, command: str = OWNER) -> str:
    return (
        f"{directory} is in use by pid {pid} ({command}): wait for it to end or choose another "
        "trainer.default_local_dir"
    )


def sft_args(root: Path, run_dir: Path) -> list[str]:
    return [
        f"model.path={root / 'model'}", f"data.train_files={root / 'data' / 'train.parquet'}",
        "data.response_from_ground_truth=true", "trainer.device=cpu", "trainer.logger=[]",
        f"trainer.default_local_dir={run_dir}",
    ]  # fmt: skip


def flow_args(root: Path, run_dir: Path) -> list[str]:
    return [
        f"model.path={root / 'model'}", f"data.train_files={root / 'data' / 'train.parquet'}",
        "trainer.device=cpu", "trainer.logger=[]", f"trainer.default_local_dir={run_dir}",
    ]  # fmt: skip


# ------------------------------------------------------------------ the lock itself
def test_a_held_directory_is_refused_naming_the_owner_and_free_once_it_ends(tmp_path):
    run_dir = tmp_path / "run"
    with holder(run_dir) as (_, pid):
        assert (run_dir / LOCK_FILE).read_text() == f"{pid}\n{OWNER}\n"
        with pytest.raises(CheckpointError) as caught:
            RunDirLock(run_dir).acquire()
        assert str(caught.value) == in_use(run_dir, pid)
        assert not holds_lock(run_dir)
    with RunDirLock(run_dir, "lmrl sft"):  # its holder is gone
        assert holds_lock(run_dir)
        assert (run_dir / LOCK_FILE).read_text() == f"{os.getpid()}\nlmrl sft\n"
    assert not holds_lock(run_dir) and list(run_dir.iterdir()) == []
    with RunDirLock(tmp_path / "new" / "run"):
        assert (tmp_path / "new" / "run" / LOCK_FILE).is_file()
    assert not (tmp_path / "new").exists()  # what it made for the lock, it removes


def test_a_lock_is_reentrant_within_a_process_and_goes_with_the_last_release(tmp_path):
    outer, inner = RunDirLock(tmp_path), RunDirLock(tmp_path / ".")
    outer.acquire()
    inner.acquire()  # an eval inside a run, a sweep's trial: no deadlock, no refusal
    inner.release()
    assert holds_lock(tmp_path) and (tmp_path / LOCK_FILE).is_file()
    outer.release()
    outer.release()  # twice: nothing
    assert not holds_lock(tmp_path) and not (tmp_path / LOCK_FILE).exists()


def test_the_lock_of_a_killed_owner_is_stale_even_with_its_child_alive(tmp_path):
    """SIGKILL leaves the lock file (pid and command) behind, but not the lock; a child the
    owner forked does not keep it."""
    with holder(tmp_path, fork=True) as (proc, child):
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        os.kill(child, 0)  # the child lives on
        assert (tmp_path / LOCK_FILE).is_file()
        with RunDirLock(tmp_path):
            assert holds_lock(tmp_path)


def test_a_sweeps_folder_is_refused(tmp_path):
    refuse_sweep_folder(tmp_path, "lmrl train")  # no sweep.json: nothing to say
    (tmp_path / "sweep.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"is a sweep's folder \(it holds sweep\.json"):
        refuse_sweep_folder(tmp_path, "lmrl train")


# ------------------------------------------------------------------ every command takes it
def test_lmrl_train_into_a_held_run_dir_exits_2_naming_the_owner(
    tiny_workspace, tiny_overrides, tmp_path, capsys, monkeypatch
):
    run_dir = tmp_path / "run"
    loaded = []
    monkeypatch.setattr("lmrl.trainer.build.load_tokenizer", lambda *a, **k: loaded.append(1))
    with holder(run_dir) as (_, pid):
        line = refused(["train", *tiny_overrides(tiny_workspace, run_dir)], capsys)
        assert line == f"lmrl train: error: {in_use(run_dir, pid)}"
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing written
    assert not loaded  # refused before any model loads


@pytest.mark.parametrize("command", ["sft", "train-flow"])
def test_sft_and_train_flow_into_a_held_run_dir_are_refused(
    command, tiny_workspace, flow_workspace, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    args = (sft_args(tiny_workspace, run_dir) if command == "sft"
            else flow_args(flow_workspace, run_dir))  # fmt: skip
    with holder(run_dir) as (_, pid):
        assert refused([command, *args], capsys) == f"lmrl {command}: error: {in_use(run_dir, pid)}"


@pytest.mark.parametrize("command", ["train", "sft", "train-flow"])
def test_a_run_into_a_sweeps_folder_is_refused(
    command, tiny_workspace, flow_workspace, tiny_overrides, tmp_path, capsys
):
    folder = tmp_path / "sweep"
    folder.mkdir()
    (folder / "sweep.json").write_text("{}")
    args = {
        "train": lambda: tiny_overrides(tiny_workspace, folder),
        "sft": lambda: sft_args(tiny_workspace, folder),
        "train-flow": lambda: flow_args(flow_workspace, folder),
    }[command]()
    line = refused([command, *args], capsys)
    assert line.startswith(f"lmrl {command}: error: {folder} is a sweep's folder")
    assert f"`lmrl {command}` will not write into it" in line
    assert sorted(p.name for p in folder.iterdir()) == ["sweep.json"]


def test_eval_of_an_image_run_in_use_is_refused(flow_workspace, tmp_path, capsys):
    """``lmrl eval`` of a Flow-GRPO run writes its images into the run: one owner at a time."""
    from lmrl.config.flow import load_flow_config
    from lmrl.config.loader import save_config

    run_dir = tmp_path / "run"
    cfg = load_flow_config(None, flow_args(flow_workspace, run_dir))
    run_dir.mkdir()
    save_config(cfg, run_dir / "config.yaml", command="lmrl train-flow")
    save_checkpoint(run_dir, 1, {"model": {"w": torch.zeros(1)}}, {}, command="lmrl train-flow")
    with holder(run_dir) as (_, pid):
        assert refused(["eval", run_dir], capsys) == f"lmrl eval: error: {in_use(run_dir, pid)}"
    assert not (run_dir / "eval").exists()


def test_after_a_killed_owner_the_next_run_proceeds_and_lets_go_at_its_end(
    tiny_workspace, tiny_overrides, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    with holder(run_dir) as (proc, _):
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert (run_dir / LOCK_FILE).is_file()  # stale: its process is gone
        assert cli_main(["train", *tiny_overrides(tiny_workspace, run_dir)]) == 0
    assert (run_dir / "final").is_dir() and not (run_dir / LOCK_FILE).exists()
    assert not holds_lock(run_dir)


def test_a_command_that_fails_lets_go_and_leaves_no_run_dir(
    tiny_workspace, tiny_overrides, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    args = tiny_overrides(tiny_workspace, run_dir, f"model.path={tmp_path / 'no-model'}")
    line = refused(["train", *args], capsys)
    assert "no-model" in line
    assert not holds_lock(run_dir) and not run_dir.exists()


# ------------------------------------------------------------------ the loop takes it
@dataclass
class FakeConfig:
    a: int = 1


class Program:
    """The least a loop runs: steps that may fail, no validation, no weights of note."""

    def __init__(self, run_dir: Path, fail: bool = False) -> None:
        self.start = RunStart(run_dir, "lmrl test", FakeConfig())
        self.total_steps, self.global_step, self.fail = 1, 0, fail
        self.locked_during_step = None
        self.closed = 0

    has_validation = False

    def step(self):
        self.locked_during_step = holds_lock(self.start.run_dir)
        if self.fail:
            raise RuntimeError("a bug in the step")
        self.global_step += 1
        return {"loss": 1.0}

    def checkpoint_weights(self):
        return {"model": {"w": torch.zeros(1)}}

    def state_dict(self):
        return {"global_step": self.global_step}

    def export(self):
        (self.start.run_dir / "final").mkdir()
        return self.start.run_dir / "final"

    def close(self):
        self.closed += 1


class Settings:
    save_freq = test_freq = log_generations_freq = -1
    val_before_train, max_ckpt_to_keep, resume_mode = False, None, "auto"

    def rollbacks(self):
        return 0, 1.0


class Quiet:
    def log(self, metrics, step):
        pass

    def baseline(self, val):
        pass

    def check(self, metrics):
        return []

    collapse = None


@pytest.mark.parametrize("fail", [False, True])
def test_the_loop_holds_the_lock_for_the_run_and_lets_go_however_it_ends(tmp_path, fail):
    prog = Program(tmp_path, fail=fail)
    prog.trackers = prog.health = Quiet()
    with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
        RunLoop(prog, Settings()).run()
    assert prog.locked_during_step is True and prog.closed == 1
    assert not holds_lock(tmp_path) and not (tmp_path / LOCK_FILE).exists()


def test_the_loop_refuses_a_directory_another_process_holds(tmp_path):
    prog = Program(tmp_path)
    prog.trackers = prog.health = Quiet()
    with holder(tmp_path) as (_, pid), pytest.raises(CheckpointError) as caught:
        RunLoop(prog, Settings()).run()
    assert str(caught.value) == in_use(tmp_path, pid)
    assert prog.locked_during_step is None and prog.closed == 1
    assert not (tmp_path / "config.yaml").exists()


def test_a_run_dir_written_between_open_run_and_the_loop_is_refused(tmp_path):
    """Another process ran in the directory while this run loaded its models: the start
    `open_run` decided is stale."""
    cfg = load_config(None, ["model.path=m", "data.train_files=d.parquet",
                             f"trainer.default_local_dir={tmp_path}"])  # fmt: skip
    assert open_run(cfg, "lmrl train").resume_from is None
    save_checkpoint(tmp_path, 2, {"model": {"w": torch.zeros(1)}}, {}, command="lmrl train")
    with pytest.raises(CheckpointError, match="was none, is now global_step_2"):
        check_untouched(tmp_path)
    check_untouched(tmp_path)  # once: a second fit of the same program is not refused
    open_run(cfg, "lmrl train")
    check_untouched(tmp_path)  # nothing changed since


def test_the_lock_file_names_the_command_line(tmp_path, monkeypatch):
    argv = [str(Path("src", "lmrl", "cli", "__main__.py")), "train", "trainer.experiment_name=a b"]
    monkeypatch.setattr(sys, "argv", argv)
    with RunDirLock(tmp_path):
        lines = (tmp_path / LOCK_FILE).read_text().splitlines()
    assert lines == [str(os.getpid()), "lmrl train 'trainer.experiment_name=a b'"]
