"""Shared fixtures of the trainer tests: the overrides of a tiny run (``tiny_workspace`` is in
tests/conftest.py), and ``lmrl train`` in a subprocess that a fault may kill."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FAULT_RUNNER = Path(__file__).with_name("fault_run.py")


@pytest.fixture(scope="session")
def train_subprocess():
    """``train_subprocess(overrides, fault=None)``: ``lmrl train`` in a subprocess; with
    ``fault``, SIGKILLed at that stage (fault_run.py)."""
    return _train_subprocess


def _train_subprocess(
    overrides: list[str], fault: str | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "lmrl.cli", "train", *overrides]
    if fault:
        args = [sys.executable, str(FAULT_RUNNER), fault, *overrides]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="session")
def flow_workspace(tmp_path_factory):
    """The shapes task (64 images) and a tiny image model pre-trained for 3 steps."""
    from lmrl.data.tasks import write_task
    from lmrl.flow.matching import pretrain_image_flow

    root = tmp_path_factory.mktemp("flow")
    paths = write_task("shapes", root / "data", seed=0, num_images=64)
    pretrain_image_flow(paths["images"], root / "model", steps=3, block_out_channels=(8, 16))
    return root


@pytest.fixture(scope="module")
def tiny_overrides():
    """``tiny_overrides(root, run_dir, *extra)``: the key=value list of a tiny run."""
    return _tiny_overrides


def _tiny_overrides(root: Path, run_dir: Path, *extra: str) -> list[str]:
    """A 2-step GRPO run of the tiny model on digits, in-process reward."""
    return [
        f"model.path={root / 'model'}",
        f"data.train_files={root / 'data' / 'train.parquet'}",
        "data.max_prompt_length=64",
        "data.max_response_length=6",
        "data.train_batch_size=4",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=1e-2",
        "algorithm.adv_estimator=grpo",
        "model.enable_gradient_checkpointing=false",
        "trainer.device=cpu",
        "trainer.total_training_steps=2",
        "trainer.save_freq=1",
        "trainer.logger=[]",
        f"trainer.default_local_dir={run_dir}",
        "reward.num_workers=0",
        *extra,
    ]


def linked_workspace(source: Path, root: Path, **files: str) -> Path:
    """``root`` with links to ``source``'s ``model`` and ``data`` (a shared workspace's model
    and data under a module's own directory) and ``files`` written there (name -> text)."""
    for name in ("model", "data"):
        (root / name).symlink_to(source / name)
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def trainable_state(trainer) -> dict:
    """``{"actor.<name>" / "critic.<name>": tensor}`` of the trainable parameters, copied as
    float32 CPU tensors (comparable across devices and dtypes)."""
    models = {"actor": trainer.parts.actor.model}
    if trainer.parts.critic is not None:
        models["critic"] = trainer.parts.critic.model
    return {
        f"{prefix}.{name}": p.detach().float().cpu().clone()
        for prefix, model in models.items()
        for name, p in model.named_parameters()
        if p.requires_grad
    }
