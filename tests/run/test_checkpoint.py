"""Checkpoints: atomic writes, corrupt ones skipped, SIGTERM saves, and a run killed with
SIGKILL at any stage resumes to weights bitwise identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.trainer.conftest import linked_workspace

from lmrl.run.checkpoint import (
    check_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_state,
    save_checkpoint,
)
from lmrl.workers.dist import model_state

STEPS = 6  # 16 prompts, 4 per step: the run crosses an epoch boundary after step 4


@pytest.fixture(scope="module")
def workspace(tiny_workspace, tmp_path_factory) -> Path:
    """The shared tiny model and data, with this module's runs in a directory of its own."""
    return linked_workspace(tiny_workspace, tmp_path_factory.mktemp("ckpt"))


def train_args(root: Path, run: str, *extra: str) -> list[str]:
    return [
        f"model.path={root / 'model'}",
        f"data.train_files={root / 'data' / 'train.parquet'}",
        "data.max_prompt_length=64", "data.max_response_length=6",
        "data.train_batch_size=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=2", "actor.ppo_epochs=2", "actor.shuffle=true",
        "actor.optim.lr=1e-2", "actor.optim.lr_warmup_steps=2",
        "algorithm.adv_estimator=grpo", "actor.use_kl_loss=true",
        "model.enable_gradient_checkpointing=false", "trainer.device=cpu",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1",
        f"trainer.default_local_dir={root / run}", "reward.num_workers=0",
        *extra,
    ]  # fmt: skip


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / f"global_step_{STEPS}" / "actor.safetensors")


@pytest.fixture(scope="module")
def reference_run(workspace, train_subprocess) -> Path:
    result = train_subprocess(train_args(workspace, "uninterrupted"))
    assert result.returncode == 0, result.stderr[-2000:]
    return workspace / "uninterrupted"


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["gen@3", "update_actor@5", "save@2", "reward@5"])
def test_sigkill_anywhere_then_resume_is_bitwise_exact(
    workspace, reference_run, fault, train_subprocess
):
    name = "killed_" + fault.replace("@", "_")
    killed = train_subprocess(train_args(workspace, name), fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = train_subprocess(train_args(workspace, name))  # resume_mode=auto is the default
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr
    expected, actual = final_weights(reference_run), final_weights(workspace / name)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
    steps = [json.loads(line)["step"] for line in (workspace / name / "metrics.jsonl").open()]
    assert steps == list(range(1, STEPS + 1))  # no step lost, none logged twice


def test_sigterm_saves_a_checkpoint_and_exits_143(workspace):
    args = [sys.executable, "-m", "lmrl.cli", "train", *train_args(workspace, "terminated", "trainer.save_freq=-1",
                      "trainer.total_training_steps=1000")]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = workspace / "terminated" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]  # an interrupted run is not a finished one
    assert "saving after this step" in err
    saved = latest_checkpoint(workspace / "terminated")
    assert saved is not None
    step = load_state(saved)["global_step"]
    assert 1 <= step < 1000 and saved.name == f"global_step_{step}"


def test_truncated_or_partial_checkpoints_are_skipped(tmp_path, caplog):
    model = torch.nn.Linear(3, 2)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"actor": model_state(model)}, {"global_step": step})
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"global_step_{i}" for i in (1, 2, 3)]
    # truncate the newest one's weights, remove the manifest of the middle one
    weights = tmp_path / "global_step_3" / "actor.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    (tmp_path / "global_step_2" / "manifest.json").unlink()
    assert "does not match" in check_checkpoint(tmp_path / "global_step_3")
    assert "no manifest" in check_checkpoint(tmp_path / "global_step_2")
    with caplog.at_level("WARNING", logger="lmrl.trainer"):
        assert latest_checkpoint(tmp_path) == tmp_path / "global_step_1"
    assert "skipping checkpoint" in caplog.text


def test_checkpoint_retention_and_weights_only_state(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, {"actor": model_state(model)},
                        {"global_step": step, "optimizer": opt.state_dict()}, max_to_keep=2)  # fmt: skip
    assert [p.name for p in list_checkpoints(tmp_path)] == ["global_step_3", "global_step_4"]
    state = load_state(tmp_path / "global_step_4")  # torch.load(weights_only=True) inside
    restored = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    restored.load_state_dict(state["optimizer"])
    assert not list(tmp_path.glob(".*.tmp"))
