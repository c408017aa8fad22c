"""The parity probe runs once per run, resumed runs included: whether it ran is in the
trainer's checkpoint state. A bf16 engine on the tiny model is off by ~1e-3 a token, over the
threshold 1e-4 at every step, so the probe runs at the first step it may."""

from __future__ import annotations

import pytest

from lmrl.config import load_config
from lmrl.run.checkpoint import load_state
from lmrl.trainer import Trainer, build_run
from lmrl.trainer import parity as parity_module


@pytest.fixture
def probes(monkeypatch) -> list[int]:
    """The steps at which the probe diagnosed a gap (`diagnose` calls)."""
    calls: list[int] = []
    diagnose = parity_module.diagnose

    def counted(batch, *args, **kwargs):
        calls.append(1)
        return diagnose(batch, *args, **kwargs)

    monkeypatch.setattr(parity_module, "diagnose", counted)
    return calls


def _trainer(workspace, overrides, run_dir) -> Trainer:
    """A trainer in ``run_dir``, resumed from its checkpoint if it has one."""
    cfg = load_config(None, overrides(
        workspace, run_dir, "rollout.dtype=bfloat16", "trainer.parity_threshold=1e-4"
    ))  # fmt: skip
    return Trainer(build_run(cfg), cfg.trainer)


def test_a_run_that_probed_does_not_probe_again_after_a_resume(
    tiny_workspace, tiny_overrides, tmp_path, probes
):
    first = _trainer(tiny_workspace, tiny_overrides, tmp_path)
    first.step()
    assert len(probes) == 1
    assert load_state(first.save_checkpoint())["parity"] == {"done": True}
    first.close()
    resumed = _trainer(tiny_workspace, tiny_overrides, tmp_path)
    assert resumed.global_step == 1 and resumed.parity.done
    resumed.step()
    resumed.close()
    assert len(probes) == 1  # the gap is as large at step 2: once per run


def test_a_run_stopped_before_its_probe_probes_after_a_resume(
    tiny_workspace, tiny_overrides, tmp_path, probes
):
    first = _trainer(tiny_workspace, tiny_overrides, tmp_path)
    first.parity.threshold = None  # off for this run only: it stops before probing
    first.step()
    assert not probes and load_state(first.save_checkpoint())["parity"] == {"done": False}
    first.close()
    resumed = _trainer(tiny_workspace, tiny_overrides, tmp_path)
    assert resumed.global_step == 1 and not resumed.parity.done
    resumed.step()
    resumed.close()
    assert len(probes) == 1


def test_a_checkpoint_without_the_probe_state_loads_as_not_probed():
    probe = parity_module.ParityProbe(1e-4)
    probe.done = True
    probe.load_state_dict(None)  # what the trainer passes for a checkpoint without "parity"
    assert not probe.done
    probe.load_state_dict({"done": True})
    assert probe.done and probe.state_dict() == {"done": True}
