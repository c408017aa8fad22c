"""On a GPU (skipped without CUDA): the actor's and the critic's forward and update equal the
CPU's in float64, alone and on one NCCL rank with DDP, FSDP2 and FSDP2 with CPU offload, and
their checkpoint state (weights, optimizer moments) is the CPU run's.

One NCCL rank takes the same code paths as many (every collective runs, on CUDA tensors
only), so a tensor left on the CPU before a collective fails here as on a GPU cluster.
"""

from __future__ import annotations

import os

import pytest
import torch

from lmrl.models import load_causal_lm
from lmrl.models.critic import load_critic
from lmrl.workers.actor import ActorWorker
from lmrl.workers.critic import CriticWorker
from lmrl.workers.dist import DDP, DataParallel
from lmrl.workers.fsdp import FSDP2

from .conftest import N, actor_config, critic_config, make_batch

pytestmark = pytest.mark.gpu


def _update(model_dir: str, kind: str, dp, device: str) -> dict:
    """Log-probs (or values), then two updates (2 epochs x 2 shuffled mini-batches x
    micro-batches of 2), in float64 on ``device``; everything returned on the CPU."""
    torch.manual_seed(0)
    batch = make_batch(seed=3).to(device)
    mask = batch["response_mask"]
    noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    noise = noise.to(device)
    common = {"rollout_n": N, "max_response_length": 4, "total_steps": 10, "dp": dp}
    if kind == "actor":
        model = load_causal_lm(model_dir, dtype="float64", device=device)
        cfg = actor_config(ppo_mini_batch_size=2, ppo_micro_batch_size=2, shuffle=True,
                           ppo_epochs=2, clip_ratio=0.1, grad_clip=0.5)  # fmt: skip
        worker = ActorWorker(model, cfg, temperature=0.8, log_prob_micro_batch_size=2, **common)
        forward, entropy = worker.compute_log_probs(batch, with_entropy=True)
        batch["old_log_probs"] = torch.where(mask, forward + 0.3 * noise, 0.0)
        metrics = [worker.update_actor(batch) for _ in range(2)]
        forward = torch.stack([forward, entropy])
    else:
        model = load_critic(model_dir, dtype="float64", device=device)
        cfg = critic_config(ppo_mini_batch_size=2, ppo_micro_batch_size=2, shuffle=True,
                            grad_clip=0.5)  # fmt: skip
        worker = CriticWorker(model, cfg, **common)
        forward = batch["values"] = worker.compute_values(batch)
        batch["returns"] = torch.where(mask, noise, 0.0)
        metrics = [worker.update_critic(batch) for _ in range(2)]
    assert forward.device.type == torch.device(device).type
    state = worker.state_dict()["optimizer"]["state"]
    return {
        "forward": forward.cpu(),
        "weights": worker.model_state(),
        "moments": {i: s["exp_avg_sq"].cpu() for i, s in state.items()},
        "metrics": [{k: float(v) for k, v in m.items()} for m in metrics],
    }


def _assert_same(cpu: dict, gpu: dict) -> None:
    torch.testing.assert_close(gpu["forward"], cpu["forward"], rtol=1e-7, atol=1e-7)
    assert gpu["weights"].keys() == cpu["weights"].keys()
    # Adam moves a weight by ~lr * g / |g|: where |g| is near its eps, a rounding difference in
    # g moves it by up to ~1e-3 * lr (critic: lr 1e-2); a wrong gradient by ~lr
    for name, w in cpu["weights"].items():
        assert gpu["weights"][name].device.type == "cpu"
        torch.testing.assert_close(
            gpu["weights"][name], w, rtol=1e-5, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert gpu["moments"].keys() == cpu["moments"].keys() and cpu["moments"]
    for i, m in cpu["moments"].items():
        torch.testing.assert_close(gpu["moments"][i], m, rtol=1e-4, atol=1e-12)
    for a, b in zip(cpu["metrics"], gpu["metrics"], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), k


@pytest.fixture(scope="module")
def cpu_runs(tiny_dir):
    return {
        kind: _update(str(tiny_dir), kind, DataParallel(), "cpu") for kind in ("actor", "critic")
    }


@pytest.mark.parametrize("kind", ["actor", "critic"])
def test_one_process_on_a_gpu_computes_and_updates_as_on_the_cpu(tiny_dir, cpu_runs, kind):
    gpu = _update(str(tiny_dir), kind, DataParallel(), "cuda")
    _assert_same(cpu_runs[kind], gpu)
    load = load_causal_lm if kind == "actor" else load_critic
    start = load(str(tiny_dir), dtype="float64", device="cpu").state_dict()
    moved = max(float((w - start[k]).abs().max()) for k, w in gpu["weights"].items())
    assert moved > 1e-4  # the update moved the weights, so equality is not of the initial ones


@pytest.fixture(scope="module")
def nccl_rank():
    """This process as the one rank of an NCCL group (torn down after the module)."""
    import torch.distributed as dist

    from lmrl.workers.ray_cluster import free_port

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "kind,strategy",
    [("actor", "ddp"), ("critic", "ddp"), ("actor", "fsdp2"), ("critic", "fsdp2"),
     ("actor", "fsdp2-offload")],
)  # fmt: skip
def test_one_nccl_rank_updates_as_one_cpu_process(tiny_dir, cpu_runs, nccl_rank, kind, strategy):
    offload = strategy == "fsdp2-offload"
    dp = DDP(0, 1) if strategy == "ddp" else FSDP2(0, 1, param_offload=offload)
    _assert_same(cpu_runs[kind], _update(str(tiny_dir), kind, dp, "cuda"))


@pytest.mark.parametrize("kind", ["actor", "critic"])
def test_no_micro_batch_of_an_update_synchronizes_on_cuda(tiny_dir, monkeypatch, kind):
    """With torch's CUDA sync debug mode set to error around each micro-batch's forward and
    loss (the actor's backward too; the driver's batch on the CPU, as the trainer hands it
    over): nothing in them waits for the GPU (tests/host_reads.py: the CPU stand-in)."""
    from lmrl.workers import actor as actor_module
    from lmrl.workers import critic as critic_module

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    batch = make_batch(seed=3)
    mask = batch["response_mask"]
    common = {"rollout_n": N, "max_response_length": 4, "total_steps": 10}
    if kind == "actor":
        model = load_causal_lm(str(tiny_dir), dtype="float32", device="cuda")
        cfg = actor_config(ppo_micro_batch_size=2, use_kl_loss=True, entropy_coeff=0.01)
        worker = ActorWorker(model, cfg, temperature=1.0, log_prob_micro_batch_size=2, **common)
        own, _ = worker.compute_log_probs(batch)
        batch["old_log_probs"] = batch["ref_log_probs"] = torch.where(mask, own - 0.1, 0.0)
        module, names, update = actor_module, (), worker.update_actor
        monkeypatch.setattr(worker, "_micro_step", _no_sync(worker._micro_step))
    else:
        model = load_critic(str(tiny_dir), dtype="float32", device="cuda")
        worker = CriticWorker(model, critic_config(ppo_micro_batch_size=2), **common)
        batch["values"] = worker.compute_values(batch)
        batch["returns"] = torch.where(mask, 0.5, 0.0)
        module, names, update = (
            critic_module,
            ("forward_values", "value_loss"),
            worker.update_critic,
        )
    for name in names:
        monkeypatch.setattr(module, name, _no_sync(getattr(module, name)))
    update(batch)


def _no_sync(fn):
    def watched(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return watched
