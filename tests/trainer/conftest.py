"""Shared fixtures of the trainer tests: a tiny model and the digits task in a temp dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmrl.data.tasks import write_task
from lmrl.models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("workspace")
    build_tiny_model(root / "model", arch="qwen2", size="tiny", seed=0)
    write_task("digits", root / "data", seed=0, num_train=16, num_test=4)
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
