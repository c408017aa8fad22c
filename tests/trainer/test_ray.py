"""``trainer.backend=ray``: the same run on 2 Ray CPU workers (gloo) as in one process.

Every test starts a private Ray instance on loopback through the run itself and checks that
no Ray process outlives it. Runs are float64: Adam turns float-rounding noise in gradients
that are zero in exact arithmetic (a key projection's bias) into full-size steps, so in
float32 two correct summation orders disagree far above 1e-5; in float64 they agree to ~1e-12.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmrl.config import load_config
from lmrl.errors import WorkerError
from lmrl.run.checkpoint import latest_checkpoint
from lmrl.trainer import Trainer, build_run

pytest.importorskip("ray")

RAY = ["trainer.backend=ray", "resources.n_gpus_per_node=2", "resources.num_cpus=2"]
EXACT = ["model.dtype=float64", "trainer.total_training_steps=3", "rollout.n=4"]
# a dense reward, so every group has spread and every step moves the weights
REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(ch.isdigit() for ch in solution_str)
    return digits / max(len(solution_str), 1) + 0.05 * len(solution_str)
"""


def _overrides(tiny_overrides, root: Path, run_dir: Path, *extra: str) -> list[str]:
    reward = run_dir.parent / "reward.py"
    reward.parent.mkdir(parents=True, exist_ok=True)
    reward.write_text(REWARD_FILE)
    return tiny_overrides(
        root, run_dir, *EXACT, f"reward.custom_reward_function.path={reward}", *extra
    )


def _train(overrides: list[str], on_stage=None) -> Trainer:
    cfg = load_config(None, overrides)
    trainer = Trainer(build_run(cfg), cfg.trainer, on_stage=on_stage)
    trainer.fit()
    return trainer


def _weights(run_dir: Path, name: str = "actor") -> dict[str, torch.Tensor]:
    return load_file(latest_checkpoint(run_dir) / f"{name}.safetensors")


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-9, msg=key)


def _ray_processes(driver: int | None = None, marker: str | None = None) -> list[str]:
    """Command lines of live processes of the Ray instances lmrl started from process
    ``driver`` (this one by default: its instances' temp dirs are ``/tmp/lmrl-ray-<pid>-<n>``),
    or whose command line holds ``marker``; another test's Ray, run beside this one by
    pytest-xdist, is not counted."""
    marker = marker or f"lmrl-ray-{driver or os.getpid()}-"
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd and ("raylet" in cmd or "gcs_server" in cmd or "default_worker" in cmd):
            found.append(f"{pid}: {cmd[:160]}")
    return found


@pytest.fixture(scope="module")
def reference_runs(tiny_workspace, tiny_overrides, tmp_path_factory):
    """GRPO for 3 steps, locally and on Ray (shared by the tests below)."""
    root = tmp_path_factory.mktemp("ray-grpo")
    local, ray_dir = root / "local", root / "ray"
    _train(_overrides(tiny_overrides, tiny_workspace, local))
    trainer = _train(_overrides(tiny_overrides, tiny_workspace, ray_dir, *RAY))
    return {"local": local, "ray": ray_dir, "trainer": trainer}


def test_grpo_on_two_ray_workers_equals_one_process(reference_runs, tiny_workspace):
    local, ray_run = _weights(reference_runs["local"]), _weights(reference_runs["ray"])
    _assert_same(local, ray_run)
    start = load_file(tiny_workspace / "model" / "model.safetensors")
    moved = max(float((local[k] - start[k].double()).abs().max()) for k in start)
    assert moved > 1e-3  # the runs trained: equal weights are not the initial ones
    assert not _ray_processes()


def test_ppo_with_a_critic_on_two_ray_workers_equals_one_process(
    tiny_workspace, tiny_overrides, tmp_path
):
    extra = ("algorithm.adv_estimator=gae", "critic.optim.lr=1e-2")
    _train(_overrides(tiny_overrides, tiny_workspace, tmp_path / "local", *extra))
    _train(_overrides(tiny_overrides, tiny_workspace, tmp_path / "ray", *extra, *RAY))
    for name in ("actor", "critic"):
        _assert_same(_weights(tmp_path / "local", name), _weights(tmp_path / "ray", name))
    assert not _ray_processes()


def test_killed_driver_resumes_to_the_uninterrupted_run(
    reference_runs, tiny_workspace, tiny_overrides, tmp_path
):
    run_dir = tmp_path / "killed"
    overrides = _overrides(tiny_overrides, tiny_workspace, run_dir, *RAY)
    fault = Path(__file__).with_name("fault_run.py")
    proc = subprocess.Popen(
        [sys.executable, str(fault), "update_actor@2", *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    assert latest_checkpoint(run_dir).name == "global_step_1"
    _wait_for(lambda: not _ray_processes(proc.pid), 30)  # the reaper stops the driver's Ray
    _train(overrides)  # resumes from global_step_1
    _assert_same(_weights(reference_runs["ray"]), _weights(run_dir))


def test_a_killed_worker_ends_the_run_with_its_name_and_the_last_checkpoint(
    tiny_workspace, tiny_overrides, tmp_path
):
    run_dir = tmp_path / "worker-killed"
    overrides = _overrides(tiny_overrides, tiny_workspace, run_dir, *RAY)
    cfg = load_config(None, overrides)
    parts = build_run(cfg)
    victim = parts.backend.groups[0].infos[1]["pid"]
    trainer = Trainer(parts, cfg.trainer, on_stage=_kill_at_update(victim, 2))
    with pytest.raises(WorkerError) as err:
        trainer.fit()
    text = str(err.value)
    assert "rank 1" in text and str(victim) in text and "died" in text
    assert "global_step_1" in text and "resume" in text
    assert "Traceback" not in text and len(text.splitlines()) == 1
    assert latest_checkpoint(run_dir).name == "global_step_1"
    assert not _ray_processes()
    _train(overrides)  # and a resume from there finishes
    assert latest_checkpoint(run_dir).name == "global_step_3"


def _kill_at_update(pid: int, nth: int):
    """An ``on_stage`` that SIGKILLs process ``pid`` as the ``nth`` actor update starts."""
    seen = {"n": 0}

    def kill(stage: str) -> None:
        if stage == "update_actor":
            seen["n"] += 1
            if seen["n"] == nth:
                os.kill(pid, signal.SIGKILL)

    return kill


def _wait_for(condition, seconds: float) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still running after {seconds}s: {_ray_processes()}")
        time.sleep(0.5)


@pytest.mark.slow
def test_two_ray_nodes_run_a_step(two_ray_nodes, tiny_workspace, tiny_overrides, tmp_path):
    address, temp_dir = two_ray_nodes
    run_dir = tmp_path / "two-nodes"
    extra = ("trainer.backend=ray", f"resources.ray_address={address}", "resources.nnodes=2",
             "resources.n_gpus_per_node=1", "trainer.total_training_steps=1")  # fmt: skip
    cfg = load_config(None, _overrides(tiny_overrides, tiny_workspace, run_dir, *extra))
    parts = build_run(cfg)
    nodes = {info["node"] for info in parts.backend.groups[0].infos}
    history = Trainer(parts, cfg.trainer).fit()
    assert len(history) == 1 and latest_checkpoint(run_dir).name == "global_step_1"
    assert len(nodes) == 1  # two Ray nodes of one machine share its address...
    import ray

    assert not ray.is_initialized()  # ...and the driver left the cluster, still running
    assert _ray_processes(marker=temp_dir)


def test_a_separate_critic_pool_trains_like_the_colocated_critic(
    tiny_workspace, tiny_overrides, tmp_path
):
    extra = (
        "algorithm.adv_estimator=gae",
        "critic.optim.lr=1e-2",
        "trainer.total_training_steps=2",
    )
    pooled = (*RAY, "resources.num_cpus=3", "resources.critic_workers=1")
    _train(_overrides(tiny_overrides, tiny_workspace, tmp_path / "local", *extra))
    trainer = _train(_overrides(tiny_overrides, tiny_workspace, tmp_path / "pool", *extra, *pooled))
    assert trainer.parts is not None
    for name in ("actor", "critic"):
        _assert_same(_weights(tmp_path / "local", name), _weights(tmp_path / "pool", name))
    assert not _ray_processes()


def test_a_worker_exception_comes_back_as_one_line(tiny_workspace, tiny_overrides, tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                   "    raise KeyError('no such column: answer')\n")  # fmt: skip
    overrides = _overrides(
        tiny_overrides, tiny_workspace, tmp_path / "bad", *RAY,
        f"reward.custom_reward_function.path={bad}",
    )  # fmt: skip
    from lmrl.errors import LmrlError

    with pytest.raises(LmrlError) as err:
        _train(overrides)
    text = str(err.value)
    assert "actor worker of rank" in text and "no such column: answer" in text
    assert "Traceback" not in text and "ray" not in text.lower().replace("array", "")
    assert not _ray_processes()


def test_ctrl_c_of_the_terminal_saves_and_stops_every_ray_process(
    tiny_workspace, tiny_overrides, tmp_path
):
    """SIGINT to the driver's whole process group, as a terminal's Ctrl-C sends it."""
    import time

    run_dir = tmp_path / "interrupted"
    overrides = _overrides(tiny_overrides, tiny_workspace, run_dir, *RAY,
                           "trainer.total_training_steps=1000", "trainer.save_freq=-1",
                           "trainer.logger=[jsonl]")  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmrl.cli", "train", *overrides],
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "saving after this step" in err
    saved = latest_checkpoint(run_dir)
    assert saved is not None and int(saved.name.rsplit("_", 1)[1]) >= 2
    _wait_for(lambda: not _ray_processes(proc.pid), 30)


def test_fsdp2_with_gradient_checkpointing_on_two_ray_workers_equals_one_process(
    tiny_workspace, tiny_overrides, tmp_path, monkeypatch
):
    """PPO with a KL loss, the actor, its reference and the critic sharded over 2 Ray ranks for
    2 steps, the 3rd in one process from that checkpoint: the weights of the 3-step local run
    (a sharded checkpoint loads under the local backend).

    Gradient checkpointing on in both: it keeps working under ``fully_shard``. The local runs
    (in this process) do not share prompts, which FSDP2 does not take (its log-probs come from
    the model's own logits; a CPU shares them under checkpointing by default). The two paths
    are equal in exact arithmetic but not to 1e-5 here: Hugging Face's RMSNorm rounds through
    float32 even in a float64 model, and Adam enlarges the different roundings of two
    summation orders.
    """
    import lmrl.models.forward

    monkeypatch.setattr(lmrl.models.forward, "CHECKPOINTED_SHARING_DEVICES", ())
    recipe = ("model.enable_gradient_checkpointing=true", "algorithm.adv_estimator=gae",
              "critic.optim.lr=1e-2", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.5")  # fmt: skip
    sharded = (*RAY, "actor.strategy=fsdp2", "critic.strategy=fsdp2")
    local, run_dir = tmp_path / "local", tmp_path / "fsdp2"
    _train(_overrides(tiny_overrides, tiny_workspace, local, *recipe))
    _train(_overrides(tiny_overrides, tiny_workspace, run_dir, *recipe, *sharded,
                      "trainer.total_training_steps=2"))  # fmt: skip
    _train(_overrides(tiny_overrides, tiny_workspace, run_dir, *recipe))  # local, from step 2
    assert latest_checkpoint(run_dir).name == "global_step_3"
    for name in ("actor", "critic"):
        _assert_same(_weights(local, name), _weights(run_dir, name))
    assert not _ray_processes()


def test_async_on_a_rollout_group_of_its_own_equals_async_in_one_process(
    tiny_workspace, tiny_overrides, tmp_path, caplog
):
    """One actor rank trains while one rollout rank generates one step ahead: the fixed
    schedule makes it the run one process makes with a generation thread."""
    extra = ("async_training.enable=true",)
    split = ("trainer.backend=ray", "resources.n_gpus_per_node=1", "resources.num_cpus=2",
             "resources.rollout_workers=1")  # fmt: skip
    _train(_overrides(tiny_overrides, tiny_workspace, tmp_path / "local", *extra))
    caplog.set_level(logging.INFO, logger="lmrl.workers")
    _train(_overrides(tiny_overrides, tiny_workspace, tmp_path / "ray", *extra, *split))
    assert "1 CPU workers (actor); rollout group of 1" in caplog.text
    _assert_same(_weights(tmp_path / "local"), _weights(tmp_path / "ray"))
    assert not _ray_processes()


def test_a_dead_rollout_worker_ends_an_async_run_in_one_line(
    tiny_workspace, tiny_overrides, tmp_path
):
    """The generator thread's error reaches the trainer at its next batch: one line naming the
    rollout rank and what to resume from, no Ray process and no thread left."""
    import threading

    run_dir = tmp_path / "rollout-killed"
    split = ("trainer.backend=ray", "resources.n_gpus_per_node=1", "resources.num_cpus=2",
             "async_training.enable=true", "trainer.save_freq=1")  # fmt: skip
    overrides = _overrides(tiny_overrides, tiny_workspace, run_dir, *split)
    cfg = load_config(None, overrides)
    parts = build_run(cfg)
    victim = parts.backend.groups[-1].infos[0]["pid"]  # the rollout group's rank 0
    # killed during the first update, while it waits for that update's weights (step 2's)
    trainer = Trainer(parts, cfg.trainer, on_stage=_kill_at_update(victim, 1))
    with pytest.raises(WorkerError) as err:
        trainer.fit()
    text = str(err.value)
    assert "rollout worker of rank 0" in text and str(victim) in text and "died" in text, text
    assert "no checkpoint was written yet" in text  # it died during the first step
    assert "Traceback" not in text and len(text.splitlines()) == 1
    assert not any(t.name == "lmrl-rollout-ahead" for t in threading.enumerate())
    _wait_for(lambda: not _ray_processes(), 30)
