"""The memory probe (``trainer.memory_probe``): the longest step first, nothing changed after."""

from __future__ import annotations

import pytest
import torch

from lmrl.cli import main
from lmrl.config import load_config
from lmrl.trainer import Trainer, build_run
from lmrl.trainer.memory_probe import probe_prompts, wants_probe
from lmrl.workers.actor import ActorWorker

from .conftest import trainable_state

# PPO with a critic and a KL loss against the reference: every stage the probe runs
PPO = [
    "algorithm.adv_estimator=gae",
    "actor.use_kl_loss=true",
    "actor.kl_loss_coef=0.1",
    "critic.optim.lr=1e-2",
    "data.max_response_length=8",
    "actor.ppo_micro_batch_size=2",
]


def test_probe_defaults_to_a_gpu_only():
    assert wants_probe(None, "cuda:0") and wants_probe(None, "cuda")
    assert not wants_probe(None, "cpu")
    assert wants_probe(True, "cpu") and not wants_probe(False, "cuda")
    assert not wants_probe(None, "cuda", "ray") and wants_probe(True, "cuda", "ray")


def test_probe_prompts_repeat_the_longest_prompt_to_the_limit(tiny_workspace, tmp_path):
    cfg = load_config(None, _overrides(tiny_workspace, tmp_path / "plain", False))
    data = build_run(cfg).train_data
    longest = max((data[i]["input_ids"] for i in range(len(data))), key=len)
    prompts = probe_prompts(data, rows=3, length=2 * len(longest) + 1)
    assert prompts["input_ids"].shape == (3, 2 * len(longest) + 1)
    assert prompts["input_ids"][1, : len(longest)].tolist() == longest
    assert prompts["input_ids"][2, -1].item() == longest[0]
    assert prompts["attention_mask"].all()


def _overrides(root, run_dir, probe: bool, *extra: str) -> list[str]:
    return [
        f"model.path={root / 'model'}",
        f"data.train_files={root / 'data' / 'train.parquet'}",
        "data.max_prompt_length=64",
        "data.train_batch_size=4",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=1e-2",
        "model.enable_gradient_checkpointing=false",
        "trainer.device=cpu",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.logger=[]",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.memory_probe={str(probe).lower()}",
        "reward.num_workers=0",
        *PPO,
        *extra,
    ]


def test_the_probe_runs_the_longest_step_and_changes_nothing(tiny_workspace, tmp_path, monkeypatch):
    """Two PPO steps with and without the probe end with the same weights, bit for bit; the
    probe's update saw prompts of max_prompt_length and responses of max_response_length."""
    cfg = load_config(None, _overrides(tiny_workspace, tmp_path / "plain", False))
    plain = Trainer(build_run(cfg), cfg.trainer)
    plain.fit()

    shapes = []
    update = ActorWorker.update_actor

    def recording(self, batch, **kwargs):
        shapes.append((tuple(batch["prompts"].shape), tuple(batch["responses"].shape),
                       batch["response_mask"].all().item()))  # fmt: skip
        return update(self, batch, **kwargs)

    monkeypatch.setattr(ActorWorker, "update_actor", recording)
    cfg = load_config(None, _overrides(tiny_workspace, tmp_path / "probe", True))
    probed = Trainer(build_run(cfg), cfg.trainer)
    assert shapes == [((4, 64), (4, 8), True)]  # one mini-batch: 2 prompts x 2 samples
    history = probed.fit()

    assert history[0]["perf/memory_probe_s"] > 0 and "perf/memory_probe_s" not in history[1]
    a, b = trainable_state(plain), trainable_state(probed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "the probe changed the run"


def test_a_resumed_run_probes_and_still_ends_exactly(tiny_workspace, tmp_path):
    """A resume (Adam moments already there, which the probe's step moves) with the probe
    ends with the uninterrupted run's weights."""
    whole = load_config(None, _overrides(tiny_workspace, tmp_path / "plain", False))
    uninterrupted = Trainer(build_run(whole), whole.trainer)
    uninterrupted.fit()

    first = load_config(
        None, _overrides(tiny_workspace, tmp_path / "r", False, "trainer.save_freq=1")
    )
    head = Trainer(build_run(first), first.trainer)
    head.fit(on_step_end=lambda step, metrics: True)  # stops (and saves) after step 1
    rest = load_config(
        None, _overrides(tiny_workspace, tmp_path / "r", True, "trainer.save_freq=1")
    )
    resumed = Trainer(build_run(rest), rest.trainer)
    assert resumed.global_step == 1
    resumed.fit()
    a, b = trainable_state(uninterrupted), trainable_state(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a), "the probe changed the resumed run"


def test_an_out_of_memory_in_the_probe_ends_the_run_before_its_first_step(
    tiny_workspace, tmp_path, capsys, monkeypatch
):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(ActorWorker, "update_actor", oom)
    code = main(["train", *_overrides(tiny_workspace, tmp_path / "probe", True)])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "out of memory: CUDA out of memory. Tried to allocate 9.00 GiB; memory plan" in err
    assert "Traceback" not in err
    assert not list((tmp_path / "probe").rglob("global_step_*"))  # no step ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_probe_runs_by_default_and_reports_its_peak(tiny_workspace, tmp_path):
    extra = ["trainer.device=cuda", "trainer.memory_probe=null"]
    cfg = load_config(None, _overrides(tiny_workspace, tmp_path / "gpu", False, *extra))
    trainer = Trainer(build_run(cfg), cfg.trainer)
    history = trainer.fit()
    assert 0 < history[0]["perf/memory_probe_peak_gib"] < 80
    plain = _overrides(tiny_workspace, tmp_path / "off", False, "trainer.device=cuda")
    cfg = load_config(None, plain)
    off = Trainer(build_run(cfg), cfg.trainer)
    off.fit()
    a, b = trainable_state(trainer), trainable_state(off)
    assert all(torch.equal(a[k], b[k]) for k in a), "the probe changed the run on CUDA"
