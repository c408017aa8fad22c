"""The trainer tests' fixtures, for the sweep's tests (a tiny run, a run killed at a stage)."""

from tests.trainer.conftest import flow_workspace, tiny_overrides, train_subprocess

__all__ = ["flow_workspace", "tiny_overrides", "train_subprocess"]
