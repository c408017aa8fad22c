"""Async training (``async_training``): generation ahead of the update with a staleness bound.

The schedule (`weights_version_for`) as a property; `RolloutAhead` over a scripted engine whose
calls finish at random times (the bound holds, each row carries the version that generated
it, weights reach the engine only between requests); and the trainer end to end: staleness 0
is the synchronous run, staleness 1 trains one step off with rollout correction, a
checkpoint holds the batches in flight, and a run killed anywhere resumes bitwise exact.
"""

from __future__ import annotations

import dataclasses
import json
import random
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tests.trainer.conftest import _tiny_overrides, linked_workspace

from lmrl.batch import Batch
from lmrl.config import ConfigError, load_config
from lmrl.config.async_training import weights_version_for
from lmrl.data.sampler import PromptSampler
from lmrl.run.checkpoint import latest_checkpoint, load_state
from lmrl.trainer import Trainer, build_run
from lmrl.trainer.ahead import RolloutAhead, batch_from_state, batch_state

ASYNC = ["async_training.enable=true"]


# ------------------------------------------------------------------------ the schedule


def test_the_schedule_bounds_staleness_and_never_waits_for_its_own_step():
    rng = random.Random(0)
    for _ in range(300):
        k, t = rng.randrange(0, 5), rng.randrange(1, 5)
        versions = [weights_version_for(s, k, t) for s in range(60)]
        for s, v in enumerate(versions):
            assert v % t == 0 and 0 <= s - v <= k + t - 1, (k, t, s, v)
            assert v <= max(s - k, 0)  # never newer than the bound asks
        assert versions == sorted(versions)
    assert [weights_version_for(s, 0, 1) for s in range(5)] == [0, 1, 2, 3, 4]  # synchronous
    assert [weights_version_for(s, 1, 1) for s in range(5)] == [0, 0, 1, 2, 3]  # one-step-off


# --------------------------------------------------------- RolloutAhead, scripted engine


class ScriptedEngine:
    """Generates 2 rows per prompt after a random delay; each row's value is the version of
    the weights loaded when the call started; records loads that land during a call."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.version = None
        self.busy = False
        self.mid_call_loads = 0
        self.pad_id = 0

    def load(self, weights):
        if self.busy:
            self.mid_call_loads += 1
        time.sleep(self.rng.random() * 0.002)
        self.version = weights["version"]

    def generate(self, prompts, n, sampling):
        self.busy = True
        version = self.version
        time.sleep(self.rng.random() * 0.004)
        self.busy = False
        rows = len(prompts) * n
        return Batch({"responses": torch.full((rows, 2), version), "response_mask":
                      torch.ones(rows, 2, dtype=torch.bool)}, {"uid": [str(i) for i in range(rows)]})  # fmt: skip


@dataclasses.dataclass
class Sampling:
    seed: int | None = None


def scripted_parts(engine):
    plan = SimpleNamespace(
        filter_groups=SimpleNamespace(enable=False), n=2, train_batch_size=2, seed=0,
        sampling=Sampling(), estimator_needs=frozenset(),
    )  # fmt: skip
    data = SimpleNamespace(get_batch=lambda idx: Batch(non_tensors={"index": list(idx)}))

    def reward(batch):
        return SimpleNamespace(token_level_scores=torch.zeros(len(batch), 2), extras={},
                               metrics={})  # fmt: skip

    return SimpleNamespace(plan=plan, train_data=data, engine=engine, reward=reward,
                           sampler=PromptSampler(100, 2, seed=0, shuffle=True))  # fmt: skip


@pytest.mark.parametrize("k,t", [(0, 1), (1, 1), (2, 1), (1, 2), (3, 2)])
def test_staleness_never_exceeds_the_bound_whatever_the_finish_times(k, t):
    steps, engine = 12, ScriptedEngine(seed=10 * k + t)
    parts = scripted_parts(engine)
    ahead = RolloutAhead(parts, k, t, steps, load=engine.load)
    rng = random.Random(k + t)
    try:
        ahead.push(0, lambda: {"version": 0})
        for step in range(steps):
            batch, metrics = ahead.take(step)
            version = weights_version_for(step, k, t)
            assert metrics["async/staleness"] == step - version <= k + t - 1
            # each row: the version the engine held when it generated it, and its stamp
            assert torch.all(batch["responses"] == version)
            assert torch.all(batch["weights_version"] == version)
            time.sleep(rng.random() * 0.004)  # the update
            ahead.push(step + 1, lambda s=step: {"version": s + 1})
    finally:
        ahead.close()
    assert engine.mid_call_loads == 0  # weights only ever land between requests


def test_an_error_in_the_thread_reaches_the_trainer_and_the_thread_ends():
    engine = ScriptedEngine(seed=0)

    def broken(prompts, n, sampling):
        raise RuntimeError("ray worker actor rank 0 died")

    engine.generate = broken
    parts = scripted_parts(engine)
    ahead = RolloutAhead(parts, 1, 1, 3, load=engine.load)
    ahead.push(0, lambda: {"version": 0})
    with pytest.raises(RuntimeError, match="rank 0 died"):
        ahead.take(0)
    ahead.close()
    assert not any(t.name == "lmrl-rollout-ahead" for t in threading.enumerate())


def test_a_batch_in_flight_round_trips_through_a_checkpoint_file(tmp_path):
    batch = Batch(
        {"responses": torch.arange(6).reshape(3, 2),
         "response_mask": torch.ones(3, 2, dtype=torch.bool)},
        {"extra_info": [{"a": np.int64(1)}, {"b": [1, 2]}, {}], "ground_truth": ["x", "y", "z"]},
        {"temperature": 1.0},
    )  # fmt: skip
    torch.save(batch_state(batch), tmp_path / "s.pt")
    back = batch_from_state(torch.load(tmp_path / "s.pt", weights_only=True))
    assert torch.equal(back["responses"], batch["responses"])
    assert list(back["extra_info"]) == [{"a": 1}, {"b": [1, 2]}, {}]
    assert list(back["ground_truth"]) == ["x", "y", "z"] and back.meta == {"temperature": 1.0}


# ------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def workspace(tiny_workspace, tmp_path_factory) -> Path:
    reward = (
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)\n"
    )
    return linked_workspace(
        tiny_workspace, tmp_path_factory.mktemp("async"), **{"reward.py": reward}
    )


def args(root: Path, run: str, *extra: str) -> list[str]:
    """The tiny run of ``tests/trainer/conftest.py`` with this file's reward, 4 steps."""
    return _tiny_overrides(
        root,
        root / run,
        "trainer.total_training_steps=4",
        "trainer.save_freq=-1",
        f"reward.custom_reward_function.path={root / 'reward.py'}",
        *extra,
    )


def train(root: Path, run: str, *extra: str):
    cfg = load_config(None, args(root, run, *extra))
    trainer = Trainer(build_run(cfg), cfg.trainer)
    metrics = trainer.fit()
    return trainer, metrics


def weights(trainer) -> dict[str, torch.Tensor]:
    return trainer.parts.actor.model_state()


def test_staleness_0_is_the_synchronous_run(workspace):
    sync, sync_m = train(workspace, "sync")
    same, same_m = train(workspace, "async0", *ASYNC, "async_training.staleness_threshold=0")
    assert same.parts.config.rollout.log_prob_mode == "decoupled"  # nothing is stale
    for a, b in zip(sync_m, same_m, strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"]
        assert b["async/staleness"] == 0.0
    expected, actual = weights(sync), weights(same)
    assert all(torch.equal(expected[k], actual[k]) for k in expected)


def test_one_step_off_trains_on_the_previous_weights_with_rollout_correction(workspace):
    assert load_config(None, args(workspace, "d", *ASYNC)).rollout.log_prob_mode == "bypass"
    trainer, metrics = train(workspace, "off1", *ASYNC, "rollout.log_prob_mode=rollout_correction")
    assert [m["async/staleness"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert [m["async/weights_version"] for m in metrics] == [0.0, 0.0, 1.0, 2.0]
    # the weights moved between generation and update: a real gap, corrected
    assert all(m["rollout/mismatch_k3"] > 1e-6 for m in metrics[1:])
    assert all(m["rollout_corr/is_eff_sample_size"] < 1.0 for m in metrics[1:])
    for key in ("async/generator_idle_frac", "async/trainer_idle_frac", "timing_s/gen"):
        assert all(m[key] >= 0.0 for m in metrics), key
    assert torch.all(trainer.last_batch["weights_version"] == 2)


def test_each_row_was_generated_by_the_weights_of_its_version(workspace):
    """The weights handed over as version v are the checkpoint of step v, unchanged by the
    updates after it (on a CPU ``model_state`` shares the parameters' storage, so they must
    be copies), and a stale batch's rollout log-probs are those of its version."""
    extra = [*ASYNC, "async_training.staleness_threshold=2", "trainer.save_freq=1",
             "trainer.total_training_steps=3"]  # fmt: skip
    cfg = load_config(None, args(workspace, "versions", *extra))
    trainer = Trainer(build_run(cfg), cfg.trainer)
    handed = {}
    push = trainer.ahead.push

    def recording_push(version, weights):
        push(version, lambda: handed.setdefault(version, weights()))

    trainer.ahead.push = recording_push
    trainer.fit()
    assert sorted(handed) == [0]  # steps 0-2 are all generated by version 0 (staleness 2)
    initial = load_file(workspace / "model" / "model.safetensors")
    assert all(torch.equal(handed[0][k], initial[k]) for k in initial)

    batch, actor = trainer.last_batch, trainer.parts.actor  # step 2, generated by version 0
    assert torch.all(batch["weights_version"] == 0)
    mask, gaps = batch["response_mask"], {}
    for version in (0, 2):
        state = initial if version == 0 else load_file(
            workspace / "versions" / f"global_step_{version}" / "actor.safetensors")  # fmt: skip
        actor.load_model_state(state)
        gaps[version] = float((actor.compute_log_probs(batch)[0] - batch["rollout_log_probs"])
                              [mask].abs().max())  # fmt: skip
    assert gaps[0] < 1e-4 < 1e-2 < gaps[2], gaps


def test_weights_handed_over_are_copies_that_later_updates_leave_alone(workspace):
    cfg = load_config(None, args(workspace, "copies", *ASYNC, "trainer.total_training_steps=4"))
    trainer = Trainer(build_run(cfg), cfg.trainer)
    handed = {}
    push = trainer.ahead.push
    trainer.ahead.push = lambda v, w: push(v, lambda: handed.setdefault(v, w()))
    trainer.fit()
    assert sorted(handed) == [0, 1, 2]  # version 3 and 4 generate nothing
    # version 2 is what the weights were after 2 updates: not the final ones
    final = trainer.parts.actor.model_state()
    assert any(not torch.equal(handed[2][k], final[k]) for k in final)
    assert any(not torch.equal(handed[1][k], handed[2][k]) for k in final)


def test_a_checkpoint_holds_the_batches_in_flight_and_resume_continues_exactly(workspace):
    extra = [*ASYNC, "async_training.staleness_threshold=2"]
    whole, _ = train(workspace, "whole", *extra)
    cfg = load_config(None, args(workspace, "part", *extra))
    part = Trainer(build_run(cfg), cfg.trainer)
    try:
        part.step(), part.step()
        part.save_checkpoint()
    finally:
        part.close()
    saved = load_state(latest_checkpoint(workspace / "part"))
    # at step 2 the batches of steps 2 and 3 need versions 0 and 1: both saved, finished
    assert [it["step"] for it in saved["ahead"]["items"]] == [2, 3]
    assert [it["version"] for it in saved["ahead"]["items"]] == [0, 1]
    resumed, metrics = train(workspace, "part", *extra)
    assert [m["async/weights_version"] for m in metrics] == [0.0, 1.0]
    expected, actual = weights(whole), weights(resumed)
    assert all(torch.equal(expected[k], actual[k]) for k in expected)


def test_loading_a_checkpoint_mid_run_restarts_the_generator_from_its_batches(workspace):
    """The run doctor's rollback: back to the checkpoint of step 2 after step 3, the run goes
    on as if step 3 never happened (the generator's batches of versions past 2 are dropped)."""
    extra = [*ASYNC, "async_training.staleness_threshold=2"]
    whole, _ = train(workspace, "rb_whole", *extra)
    cfg = load_config(None, args(workspace, "rb", *extra))
    trainer = Trainer(build_run(cfg), cfg.trainer)
    try:
        trainer.step(), trainer.step()
        saved = trainer.save_checkpoint()
        trainer.step()
        trainer.load_checkpoint(saved)
        assert trainer.global_step == 2
        trainer.step(), trainer.step()
        expected, actual = weights(whole), weights(trainer)
        assert all(torch.equal(expected[k], actual[k]) for k in expected)
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def whole_subprocess_run(workspace, train_subprocess) -> Path:
    result = train_subprocess(args(workspace, "k_whole", *KILLED))
    assert result.returncode == 0, result.stderr[-2000:]
    return workspace / "k_whole"


KILLED = [*ASYNC, "trainer.save_freq=1", "trainer.logger=[console,jsonl]"]


@pytest.mark.slow
# killed in the update of step 3: the checkpoint of step 2 holds step 2's batch (version 1)
@pytest.mark.parametrize("fault", ["update_actor@3"])
def test_sigkill_during_an_async_run_then_resume_is_bitwise_exact(
    workspace, train_subprocess, whole_subprocess_run, fault
):
    name = "k_" + fault.replace("@", "_")
    killed = train_subprocess(args(workspace, name, *KILLED), fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = train_subprocess(args(workspace, name, *KILLED))
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-2000:]
    expected = load_file(whole_subprocess_run / "global_step_4" / "actor.safetensors")
    actual = load_file(workspace / name / "global_step_4" / "actor.safetensors")
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
    lines = (workspace / name / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


def test_validation_takes_the_engine_between_batches_with_the_current_weights():
    engine = ScriptedEngine(seed=1)
    ahead = RolloutAhead(scripted_parts(engine), 1, 1, 6, load=engine.load)
    try:
        ahead.push(0, lambda: {"version": 0})
        for step in range(3):
            ahead.take(step)
            ahead.push(step + 1, lambda s=step: {"version": s + 1})
            seen = ahead.exclusive({"version": 100 + step}, lambda: (engine.version, engine.busy))
            assert seen == (100 + step, False)  # the trainer's weights, no call in progress
        batch, _ = ahead.take(3)
        assert torch.all(batch["responses"] == 2)  # the thread's own version came back
    finally:
        ahead.close()


def test_validation_of_an_async_run_is_logged(workspace):
    extra = [*ASYNC, f"data.val_files={workspace / 'data' / 'test.parquet'}",
             "trainer.test_freq=2"]  # fmt: skip
    trainer, metrics = train(workspace, "val", *extra)
    assert "val/digits/reward/mean" in metrics[1] and "val/digits/reward/mean" in metrics[3]
    assert trainer.last_batch["weights_version"][0] == 2


def test_bad_async_settings_are_one_line_each(workspace):
    for extra, message in [
        (["async_training.partial_rollout=true"], "partial_rollout=true"),
        (["async_training.trigger_parameter_sync_step=0"], "must be >= 1"),
        (["async_training.staleness_threshold=-1"], "must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, args(workspace, "bad", *ASYNC, *extra))


def test_only_an_async_training_run_gets_an_engine_that_does_not_follow(workspace):
    """``lmrl eval`` of an async run's config loads the checkpoint into the policy: its engine
    must generate with those weights, not with a copy taken before."""
    extra = [*ASYNC, f"data.val_files={workspace / 'data' / 'test.parquet'}"]
    cfg = load_config(None, args(workspace, "eval", *extra))
    train_parts = build_run(cfg)
    try:
        assert not train_parts.engine.shares_weights and not train_parts.engine.follow
    finally:
        train_parts.close()
    eval_parts = build_run(cfg, purpose="eval")
    try:
        assert eval_parts.engine.shares_weights
    finally:
        eval_parts.close()


def test_sigterm_finishes_the_step_saves_what_is_in_flight_and_exits_143(workspace):
    import os
    import subprocess
    import sys

    run = workspace / "terminated"
    argv = [sys.executable, "-m", "lmrl.cli", "train",
            *args(workspace, "terminated", *ASYNC, "async_training.staleness_threshold=2",
                  "trainer.total_training_steps=1000", "trainer.logger=[jsonl]")]  # fmt: skip
    proc = subprocess.Popen(argv, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    metrics, deadline = run / "metrics.jsonl", time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    saved = load_state(latest_checkpoint(run))
    step = saved["global_step"]
    # staleness 2: the two batches after the save were generated from versions before it
    assert [it["step"] for it in saved["ahead"]["items"]][:2] == [step, step + 1]


def test_verls_async_keys_translate(workspace):
    notices: list[str] = []
    cfg = load_config(None, args(workspace, "verl", *ASYNC,
                                 "async_training.use_rollout_log_probs=true",
                                 "async_training.checkpoint_engine.enable=true",
                                 "async_training.require_batches=1",
                                 "async_training.staleness_threshold=0.1"), notices=notices)  # fmt: skip
    assert cfg.rollout.log_prob_mode == "bypass"
    assert cfg.async_training.staleness_threshold == 0.1  # whole batches: one-step-off
    assert any("checkpoint_engine" in n for n in notices)
    cfg = load_config(None, args(workspace, "verl", *ASYNC,
                                 "async_training.compute_prox_log_prob=true"))  # fmt: skip
    assert cfg.rollout.log_prob_mode == "rollout_correction"
    with pytest.raises(ConfigError, match="require_batches"):
        load_config(None, args(workspace, "verl", *ASYNC, "async_training.require_batches=4"))
    notices = []
    load_config(None, args(workspace, "verl", "async_training.staleness_threshold=2"),
                notices=notices)  # fmt: skip
    assert any("async_training.enable=false" in n for n in notices)
