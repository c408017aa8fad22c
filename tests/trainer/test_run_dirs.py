"""A run directory belongs to the command that made it (issue 31 §3).

Real tiny runs of ``lmrl train``, ``lmrl sft`` and ``lmrl train-flow`` (two steps each, a
checkpoint after each step) are made once; each test copies one and points another command at
it: the command is refused in one line naming both commands, and nothing in the directory
changes. Then the checkpoints that cannot be resumed from: a run none of whose checkpoints
loads is refused unless ``trainer.resume_mode=disable`` starts it over.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lmrl.cli import main
from lmrl.config import load_config
from lmrl.config.loader import save_config
from lmrl.errors import CheckpointError
from lmrl.run.checkpoint import (
    check_checkpoint,
    checkpoint_command,
    list_checkpoints,
    load_model_state,
    save_checkpoint,
)
from lmrl.run.loop import resume
from lmrl.run.resume import RunStart, open_run, run_owner


def snapshot(path: Path) -> dict[str, bytes]:
    """The bytes of every file under ``path``."""
    return {
        str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()
    }


def refused(argv: list[str], capsys) -> str:
    """``lmrl argv`` exits 2 with one line on stderr, no traceback; returns that line."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert err.count("\n") == 1, err
    return err.strip()


def config_of(run_dir: Path, *extra: str):
    """The RL config a run (or its copy) was saved with, pointed at ``run_dir``."""
    return load_config(run_dir / "config.yaml", [f"trainer.default_local_dir={run_dir}", *extra])


def sft_args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    """A 2-step SFT run of the tiny model on digits, a checkpoint after each step."""
    return [
        f"model.path={root / 'model'}",
        f"data.train_files={root / 'data' / 'train.parquet'}",
        "data.response_from_ground_truth=true", "data.train_batch_size=4",
        "model.enable_gradient_checkpointing=false", "trainer.device=cpu",
        "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.logger=[]",
        f"trainer.default_local_dir={run_dir}", *extra,
    ]  # fmt: skip


def flow_args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    """A 2-step Flow-GRPO run of the tiny image model, a checkpoint after each step."""
    return [
        f"model.path={root / 'model'}",
        f"data.train_files={root / 'data' / 'train.parquet'}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[]", "trainer.total_training_steps=2", "trainer.save_freq=1",
        "data.train_batch_size=2", "sampler.n=2", "sampler.num_steps=4",
        "actor.micro_batch_size=2", "actor.ppo_mini_batch_size=2", "trainer.device=cpu",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tiny_workspace, flow_workspace, tiny_overrides, tmp_path_factory) -> dict[str, Path]:
    """One finished run of each command: ``{"train": dir, "sft": dir, "train-flow": dir}``."""
    root = tmp_path_factory.mktemp("runs")
    out = {name: root / name for name in ("train", "sft", "train-flow")}
    assert main(["train", *tiny_overrides(tiny_workspace, out["train"])]) == 0
    assert main(["sft", *sft_args(tiny_workspace, out["sft"])]) == 0
    assert main(["train-flow", *flow_args(flow_workspace, out["train-flow"])]) == 0
    return out


@pytest.fixture
def copy_of(runs, tmp_path):
    """``copy_of(command)``: a copy of that command's run, for a test to try things on."""

    def copy(command: str) -> Path:
        return Path(shutil.copytree(runs[command], tmp_path / command))

    return copy


# ------------------------------------------------------------------ each run names its command
@pytest.mark.parametrize("command", ["train", "sft", "train-flow"])
def test_config_yaml_and_every_manifest_name_the_command(runs, command):
    run_dir = runs[command]
    assert run_owner(run_dir) == f"lmrl {command}"
    checkpoints = list_checkpoints(run_dir)
    assert [p.name for p in checkpoints] == ["global_step_1", "global_step_2"]
    assert all(checkpoint_command(p) == f"lmrl {command}" for p in checkpoints)


def test_the_header_save_config_writes_is_what_run_owner_reads(tmp_path):
    cfg = load_config(None, ["model.path=m", "data.train_files=d.parquet"])
    save_config(cfg, tmp_path / "config.yaml", command="lmrl sft")
    assert run_owner(tmp_path) == "lmrl sft"
    (tmp_path / "config.yaml").unlink()
    save_checkpoint(tmp_path, 3, {"model": {"w": torch.zeros(1)}}, {}, command="lmrl train-flow")
    assert run_owner(tmp_path) == "lmrl train-flow"  # no config.yaml: the manifest says


def test_a_run_dir_that_names_no_command_is_accepted(runs, tmp_path, tiny_workspace):
    """A directory written before config.yaml and the manifests named the command (or one
    whose config.yaml lost its header) is taken as any command's."""
    old = Path(shutil.copytree(runs["train"], tmp_path / "old"))
    config = old / "config.yaml"
    config.write_text(config.read_text().split("\n", 1)[1])  # no header line
    for path in list_checkpoints(old):
        manifest = json.loads((path / "manifest.json").read_text())
        del manifest["command"]
        (path / "manifest.json").write_text(json.dumps(manifest))
    assert run_owner(old) is None
    assert check_checkpoint(old / "global_step_2") is None
    cfg = config_of(old)
    start = open_run(cfg, "lmrl train")
    assert start.resume_from == old / "global_step_2" and start.config_changes == []


# ------------------------------------------------------------------ another command's directory
@pytest.mark.parametrize(
    ("owner", "command"),
    [("train", "sft"), ("sft", "train"), ("train-flow", "train"), ("train", "train-flow"),
     ("train-flow", "sft"), ("sft", "train-flow")],
)  # fmt: skip
def test_another_commands_run_dir_is_refused_in_one_line_and_left_as_it_was(
    owner, command, copy_of, tiny_workspace, flow_workspace, tiny_overrides, capsys
):
    run_dir = copy_of(owner)
    before = snapshot(run_dir)
    args = {
        "train": tiny_overrides(tiny_workspace, run_dir),
        "sft": sft_args(tiny_workspace, run_dir),
        "train-flow": flow_args(flow_workspace, run_dir),
    }[command]
    line = refused([command, *args], capsys)
    assert line.startswith(f"lmrl {command}: error: {run_dir} was made by `lmrl {owner}`; ")
    assert (
        f"`lmrl {command}` will not write into it: give another trainer.default_local_dir" in line
    )
    assert snapshot(run_dir) == before


def test_train_into_an_sft_run_names_its_model_as_the_start(copy_of, tiny_workspace,
                                                            tiny_overrides, capsys):  # fmt: skip
    run_dir = copy_of("sft")
    line = refused(["train", *tiny_overrides(tiny_workspace, run_dir)], capsys)
    assert f"(to start from its model: model.path={run_dir / 'final'})" in line


def test_resuming_a_checkpoint_of_another_command_is_refused(copy_of, tiny_workspace,
                                                             tiny_overrides, tmp_path, capsys):  # fmt: skip
    checkpoint = copy_of("sft") / "global_step_2"
    args = tiny_overrides(tiny_workspace, tmp_path / "new", f"trainer.resume_mode={checkpoint}")
    line = refused(["train", *args], capsys)
    assert f"trainer.resume_mode={checkpoint} is a checkpoint of `lmrl sft`" in line
    assert "`lmrl train` cannot resume from it" in line
    assert not (tmp_path / "new").exists()


def test_eval_of_an_rl_run_and_of_its_checkpoint(runs, tiny_workspace, capsys):
    run_dir, val = runs["train"], f"data.val_files={tiny_workspace / 'data' / 'test.parquet'}"
    for path, checkpoint in (
        (run_dir, "global_step_2"),
        (run_dir / "global_step_1", "global_step_1"),
    ):
        assert main(["eval", str(path), val]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["checkpoint"] == str(run_dir / checkpoint) and "val/digits/acc" in str(out)


def test_eval_of_an_sft_run_is_one_line(copy_of, capsys):
    """(An image run's eval: tests/trainer/test_flow_run.py.)"""
    run_dir = copy_of("sft")
    for path in (run_dir, run_dir / "global_step_2"):
        line = refused(["eval", path], capsys)
        assert line == (
            f"lmrl eval: error: {run_dir} was made by `lmrl sft`; `lmrl eval` evaluates "
            "checkpoints of `lmrl train` and `lmrl train-flow`"
        )


# ------------------------------------------------------------------ checkpoints that do not load
def test_a_run_whose_only_checkpoints_do_not_load_is_refused_not_trained_over(
    copy_of, tiny_workspace, tiny_overrides, capsys
):
    run_dir = copy_of("train")
    (run_dir / "global_step_2" / "manifest.json").write_text("{not json")
    (run_dir / "global_step_1" / "manifest.json").write_bytes(b"\x00\xff")
    before = snapshot(run_dir)
    line = refused(["train", *tiny_overrides(tiny_workspace, run_dir)], capsys)
    assert f"{run_dir}: none of its checkpoints can be resumed from (global_step_2: " in line
    assert "unreadable manifest.json (Expecting property name" in line
    assert "; global_step_1: unreadable manifest.json" in line
    assert "set trainer.resume_mode=disable to start over" in line
    assert snapshot(run_dir) == before
    # told to start over, it does
    cfg = config_of(run_dir, "trainer.resume_mode=disable")
    assert open_run(cfg, "lmrl train").resume_from is None


@pytest.mark.parametrize(
    "manifest",
    ["[]", '{"files": []}', '{"files": {"actor.safetensors": 3}}', '{"step": 2}', '"files"'],
)
def test_a_manifest_of_another_layout_is_a_problem_not_a_crash(copy_of, manifest):
    run_dir = copy_of("train")
    (run_dir / "global_step_2" / "manifest.json").write_text(manifest)
    assert check_checkpoint(run_dir / "global_step_2").startswith("unreadable manifest.json (")
    assert checkpoint_command(run_dir / "global_step_2") is None
    cfg = config_of(run_dir)
    assert open_run(cfg, "lmrl train").resume_from == run_dir / "global_step_1"


def test_an_interrupted_newest_save_falls_back_to_the_older_good_one(copy_of, caplog):
    run_dir = copy_of("train")
    (run_dir / "global_step_2" / "manifest.json").unlink()  # as a save killed before it
    cfg = config_of(run_dir)
    with caplog.at_level("WARNING", logger="lmrl.trainer"):
        assert open_run(cfg, "lmrl train").resume_from == run_dir / "global_step_1"
    assert (
        "skipping checkpoint" in caplog.text and "no manifest (an interrupted save)" in caplog.text
    )


def test_checkpoint_dirs_that_hold_nothing_start_fresh(copy_of):
    run_dir = copy_of("train")
    for path in list_checkpoints(run_dir):
        shutil.rmtree(path)
        path.mkdir()  # empty: nothing to lose
    cfg = config_of(run_dir)
    assert open_run(cfg, "lmrl train").resume_from is None


def test_eval_of_a_run_none_of_whose_checkpoints_loads_is_one_line(copy_of, capsys):
    run_dir = copy_of("train")
    for path in list_checkpoints(run_dir):
        (path / "actor.safetensors").write_bytes(b"truncated")
    line = refused(["eval", run_dir], capsys)
    assert line == (
        f"lmrl eval: error: {run_dir}: no checkpoint can be read (global_step_2: "
        "actor.safetensors does not match its manifest (truncated or corrupt); global_step_1: "
        "actor.safetensors does not match its manifest (truncated or corrupt))"
    )


# ------------------------------------------------------------------ weights of another model
def test_weights_of_another_model_are_one_line(tmp_path):
    save_checkpoint(
        tmp_path, 1, {"actor": {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}}, {}
    )
    with pytest.raises(CheckpointError) as caught:
        load_model_state(torch.nn.Linear(3, 2), tmp_path / "global_step_1" / "actor.safetensors")
    message = str(caught.value)
    assert "\n" not in message
    assert message.endswith("weights of another model: weight is (2, 4), the model's (2, 3)")


def test_resuming_another_models_checkpoint_is_one_line(tmp_path):
    """torch's size-mismatch error (a line per tensor) is cut to its first tensor."""
    save_checkpoint(tmp_path, 1, {"model": torch.nn.Linear(4, 3).state_dict()}, {})

    class Program:
        start = RunStart(tmp_path, "lmrl test", None, tmp_path / "global_step_1")
        global_step = 0

        def load_checkpoint(self, path):
            from safetensors.torch import load_file

            torch.nn.Linear(3, 2).load_state_dict(load_file(path / "model.safetensors"))

    with pytest.raises(CheckpointError) as caught:
        resume(Program())
    message = str(caught.value)
    assert "\n" not in message and "size mismatch for weight" in message
    assert "(and 1 more)" in message and "trainer.resume_mode=disable" in message


# ------------------------------------------------------------------ --out of tasks and pretrain-flow
def test_out_over_a_non_empty_directory_needs_force(flow_workspace, tmp_path, capsys):
    """Refused without --force (nothing written: tests/test_cli.py's table), written with it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    line = refused(["tasks", "digits", "--out", out, "--num-train", "4"], capsys)
    assert line.startswith(f"lmrl tasks: error: {out} is not empty (it holds notes.txt)")
    assert main(["tasks", "digits", "--out", str(out), "--num-train", "4", "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "test.parquet", "train.parquet"]
    images = flow_workspace / "data" / "images.parquet"
    line = refused(["pretrain-flow", images, "--out", out, "--steps", "1"], capsys)
    assert "--force to write the model over what is there" in line
    assert main(["pretrain-flow", str(images), "--out", str(out), "--steps", "1", "--force"]) == 0
    from lmrl.flow.image_model import ImageFlow

    assert isinstance(ImageFlow.load(out), ImageFlow)
