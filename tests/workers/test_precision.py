"""Mixed precision (issue 32 §1): bf16 compute over fp32 masters, on this CPU.

One actor step in mixed bf16 against the same step in fp32; the masters, their gradients and
Adam's moments stay fp32; the critic's values come back fp32; a run resumes bitwise and exports
fp32; SFT and Flow-GRPO in mixed bf16; DDP and FSDP2 on two gloo ranks in mixed precision; the
config and the bad inputs; the GPU default (marked ``gpu``).

The tolerances: bf16 keeps 8 bits of mantissa, a relative rounding of 2^-8 = 0.4% per value.
The gradient of one micro-batch through the tiny model came out 0.57% off the fp32 gradient
(relative L2 over all parameters), so ``GRAD_RTOL`` = 2% (~5 roundings) passes with margin
and fails if anything ran in lower precision than intended (an fp16 or bf16 log-softmax is
off by far more). Adam's first step is ``lr * g / (|g| + eps)``, about ``lr * sign(g)``: the
few weights whose gradient is smaller than the bf16 noise flip sign and move the other way,
so the update's relative error (8.5% measured) is larger than the gradient's; ``STEP_RTOL``
= 15%. Against that, an update in another direction is off by ~140%.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from lmrl.config import ModelConfig
from lmrl.config.schema import MixedPrecisionConfig
from lmrl.errors import ModelError
from lmrl.models import forward_log_probs, load_causal_lm
from lmrl.workers.actor import ActorWorker
from lmrl.workers.precision import Precision

from ..trainer.conftest import flow_workspace  # noqa: F401  (a fixture)
from .conftest import N, actor_config, add_log_probs, make_batch
from .test_dist import join, leave, spawn_two_ranks

GRAD_RTOL = 0.02
STEP_RTOL = 0.15
MIXED = Precision(master=torch.float32, compute=torch.bfloat16)


def _actor(model_dir, precision=None, dp=None, **overrides) -> ActorWorker:
    model = load_causal_lm(str(model_dir), dtype="float32", device="cpu")
    return ActorWorker(
        model, actor_config(**overrides), rollout_n=N, max_response_length=4, temperature=0.8,
        log_prob_micro_batch_size=None, total_steps=10, dp=dp, precision=precision,
    )  # fmt: skip


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all tensors."""
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    return math.sqrt(num / sum(float(b[k].double().pow(2).sum()) for k in b))


def _grads(worker: ActorWorker, batch) -> dict[str, torch.Tensor]:
    worker.model.zero_grad()
    with worker.autocast():
        log_probs, _ = forward_log_probs(worker.model, batch, 0.8)
    (log_probs * batch["advantages"]).sum().backward()
    return {n: p.grad.clone() for n, p in worker.model.named_parameters()}


def test_a_mixed_bf16_step_matches_the_fp32_step(tiny_dir):
    fp32, mixed = _actor(tiny_dir), _actor(tiny_dir, MIXED)
    batch = add_log_probs(make_batch(seed=3), fp32)
    # the forward really ran in bf16, and its log-probs came back in fp32
    own, _ = fp32.compute_log_probs(batch)
    low, _ = mixed.compute_log_probs(batch)
    assert low.dtype == torch.float32
    assert 1e-4 < float((low - own).abs().max()) < 0.05

    g32, gmixed = _grads(fp32, batch), _grads(mixed, batch)
    assert all(g.dtype == torch.float32 for g in gmixed.values())  # on the fp32 masters
    assert _rel(gmixed, g32) < GRAD_RTOL

    start = {k: v.clone() for k, v in fp32.model.state_dict().items()}
    m32, mmixed = fp32.update_actor(batch), mixed.update_actor(batch)
    step32 = {k: v - start[k] for k, v in fp32.model.state_dict().items()}
    step_mixed = {k: v - start[k] for k, v in mixed.model.state_dict().items()}
    assert _rel(step_mixed, step32) < STEP_RTOL
    assert float(mmixed["actor/pg_loss"]) == pytest.approx(float(m32["actor/pg_loss"]), rel=1e-2)
    assert float(mmixed["actor/grad_norm"]) == pytest.approx(
        float(m32["actor/grad_norm"]), rel=1e-2
    )


def test_masters_and_adam_moments_stay_fp32(tiny_dir):
    worker = _actor(tiny_dir, MIXED)
    batch = add_log_probs(make_batch(seed=3), worker)
    worker.update_actor(batch)
    assert {p.dtype for p in worker.model.parameters()} == {torch.float32}
    moments = [s[k] for s in worker.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    assert {t.dtype for t in worker.model_state().values()} == {torch.float32}  # checkpoints


def test_the_critic_computes_in_bf16_and_returns_fp32_values(tiny_dir):
    from lmrl.models.critic import load_critic
    from lmrl.workers.critic import CriticWorker

    from .conftest import critic_config

    values = {}
    for name, precision in (("fp32", None), ("mixed", MIXED)):
        torch.manual_seed(0)  # the same value head
        model = load_critic(str(tiny_dir), dtype="float32", device="cpu")
        worker = CriticWorker(model, critic_config(), rollout_n=N, max_response_length=4,
                              total_steps=10, precision=precision)  # fmt: skip
        batch = make_batch(seed=3)
        batch["values"] = worker.compute_values(batch)
        batch["returns"] = torch.where(batch["response_mask"], 1.0, 0.0)
        metrics = worker.update_critic(batch)
        assert torch.isfinite(metrics["critic/vf_loss"])
        values[name] = worker.compute_values(batch)  # the value head starts at 0: after a step
    assert values["mixed"].dtype == torch.float32
    assert 0 < float((values["mixed"] - values["fp32"]).abs().max()) < 0.05
    assert {p.dtype for p in worker.model.parameters()} == {torch.float32}


def test_a_worker_restored_from_its_state_continues_bitwise(tiny_dir):
    a = _actor(tiny_dir, MIXED, shuffle=True, ppo_mini_batch_size=2)
    batch = add_log_probs(make_batch(seed=3), a)
    a.update_actor(batch)
    b = _actor(tiny_dir, MIXED, shuffle=True, ppo_mini_batch_size=2)
    b.load_model_state(a.model_state())
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # as read from disk: not a's tensors
    for worker in (a, b):  # the same global RNG (dropout) for both, as a resume restores it
        torch.manual_seed(1)
        worker.update_actor(batch)
    for name, w in a.model_state().items():
        assert torch.equal(b.model_state()[name], w), name


def fit(overrides: list[str]):
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    cfg = load_config(None, overrides)
    trainer = Trainer(build_run(cfg), cfg.trainer)
    trainer.fit()
    return trainer


def test_a_mixed_run_resumes_bitwise_and_exports_fp32(tiny_workspace, tmp_path):
    """Checkpoints hold the fp32 masters; 2 steps then a third after a resume give the 3-step
    run's weights bit for bit; the final model is exported in model.dtype (float32)."""
    from ..trainer.conftest import _tiny_overrides

    mixed = ("model.mixed_precision.param_dtype=bf16", "actor.use_kl_loss=true")
    whole = fit(_tiny_overrides(tiny_workspace, tmp_path / "whole", *mixed,
                                "trainer.total_training_steps=3"))  # fmt: skip
    assert whole.global_step == 3
    assert whole.parts.engine.__class__.__name__ == "PrecisionEngine"  # hf generates in bf16
    fit(_tiny_overrides(tiny_workspace, tmp_path / "cut", *mixed))
    fit(_tiny_overrides(tiny_workspace, tmp_path / "cut", *mixed, "trainer.total_training_steps=3"))
    a = load_file(tmp_path / "whole" / "global_step_3" / "actor.safetensors")
    b = load_file(tmp_path / "cut" / "global_step_3" / "actor.safetensors")
    assert a.keys() == b.keys() and {t.dtype for t in a.values()} == {torch.float32}
    for name, w in a.items():
        assert torch.equal(b[name], w), name
    final = tmp_path / "whole" / "final"
    assert {t.dtype for t in load_file(final / "model.safetensors").values()} == {torch.float32}
    assert json.loads((final / "config.json").read_text())["dtype"] == "float32"


def test_sft_steps_in_mixed_bf16_over_fp32_masters(tiny_workspace, tmp_path):
    """``lmrl sft`` takes the same keys: its first loss is the fp32 loss within bf16
    rounding, and its weights and moments stay fp32."""
    from lmrl.config.sft import load_sft_config
    from lmrl.trainer.sft import SFTTrainer, build_sft

    losses = {}
    for name, param_dtype in (("fp32", "float32"), ("mixed", "bf16")):
        cfg = load_sft_config(None, [
            f"model.path={tiny_workspace / 'model'}",
            f"data.train_files={tiny_workspace / 'data' / 'train.parquet'}",
            "data.response_from_ground_truth=true", "data.train_batch_size=8",
            "model.enable_gradient_checkpointing=false", "trainer.device=cpu",
            "trainer.logger=[]", f"trainer.default_local_dir={tmp_path / name}",
            f"model.mixed_precision.param_dtype={param_dtype}",
        ])  # fmt: skip
        trainer = SFTTrainer(build_sft(cfg))
        losses[name] = float(trainer.step()["sft/loss"])
    worker = trainer.worker
    assert worker.precision.mixed
    assert {p.dtype for p in worker.model.parameters()} == {torch.float32}
    assert {t.dtype for s in worker.optimizer.state.values() for t in s.values()
            if t.is_floating_point() and t.dim()} == {torch.float32}  # fmt: skip
    assert losses["mixed"] == pytest.approx(losses["fp32"], rel=1e-2)
    assert losses["mixed"] != losses["fp32"]  # it really computed in bf16


def test_flow_grpo_steps_in_mixed_bf16_over_fp32_weights(flow_workspace, tmp_path):  # noqa: F811
    """``lmrl train-flow`` takes model.mixed_precision: the velocity runs in bf16 and comes
    back fp32 (the Gaussian log-probs in fp32), the weights and moments stay fp32, and the
    first step's loss is fp32's within bf16 rounding."""
    from lmrl.config.flow import load_flow_config
    from lmrl.trainer.flow import FlowTrainer, build_flow

    from ..trainer.test_flow_run import _args

    metrics = {}
    for name in ("float32", "bf16"):
        args = _args(flow_workspace, tmp_path / name, f"model.mixed_precision.param_dtype={name}")
        trainer = FlowTrainer(build_flow(load_flow_config(None, args)))
        metrics[name] = trainer.step()
    assert trainer.grpo.precision.mixed
    x = torch.zeros(1, *trainer.image_shape)
    velocity = trainer.grpo.velocity(
        x, torch.full((1,), 0.5), trainer._cond([trainer.train_prompts[0]])
    )
    assert velocity.dtype == torch.float32
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert {t.dtype for s in trainer.optimizer.state.values() for t in s.values()
            if t.is_floating_point() and t.dim()} == {torch.float32}  # fmt: skip
    assert metrics["bf16"]["actor/grad_norm"] == pytest.approx(  # 0.04% measured
        metrics["float32"]["actor/grad_norm"], rel=GRAD_RTOL
    )
    assert metrics["bf16"]["actor/grad_norm"] != metrics["float32"]["actor/grad_norm"]


# ------------------------------------------------------------------ two gloo ranks
def _rank(rank: int, world: int, port: int, model_dir: str, strategy: str, out: str) -> None:
    from lmrl.workers.dist import DDP
    from lmrl.workers.fsdp import FSDP2

    join(rank, world, port)
    dp = FSDP2(rank, world) if strategy == "fsdp2" else DDP(rank, world)
    weights, dtypes = _mixed_update(model_dir, dp)
    if rank == 0:
        torch.save({"weights": weights, "dtypes": dtypes}, out)
    leave()


def _mixed_update(model_dir: str, dp=None):
    """One update in mixed bf16 (2 mini-batches x micro-batches of 2 rows): the weights, and
    the dtypes of the (sharded) masters and Adam moments."""
    torch.manual_seed(0)
    worker = _actor(model_dir, MIXED, dp=dp, ppo_mini_batch_size=2, ppo_micro_batch_size=2)
    batch = make_batch(seed=3)
    own, _ = worker.compute_log_probs(batch)
    batch["old_log_probs"] = own
    worker.update_actor(batch)
    state = worker.optimizer.state.values()
    dtypes = {p.dtype for p in worker.model.parameters()}
    dtypes |= {s[k].dtype for s in state for k in ("exp_avg", "exp_avg_sq")}
    return worker.model_state(), dtypes


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_in_mixed_precision_give_the_one_process_weights(tiny_dir, tmp_path, strategy):
    """DDP (autocast, fp32 all-reduce) and FSDP2 (MixedPrecisionPolicy: bf16 all-gathered
    params, fp32 reduce-scatter) keep fp32 masters and Adam moments. DDP runs the
    one-process ops on micro-batches of other rows (other padding, other bf16 roundings):
    one weight in 16,576 flipped its Adam sign, 0.6% of the update, so ``GRAD_RTOL``.
    FSDP2 runs every op in bf16 (norms and embeddings too, which autocast keeps in fp32):
    6.8% of the update, within ``STEP_RTOL``."""
    weights, dtypes = _mixed_update(str(tiny_dir))
    assert dtypes == {torch.float32}
    out = tmp_path / "ranks.pt"
    spawn_two_ranks(_rank, str(tiny_dir), strategy, str(out))
    got = torch.load(out)
    assert got["dtypes"] == {torch.float32}
    assert {t.dtype for t in got["weights"].values()} == {torch.float32}
    start = load_causal_lm(str(tiny_dir), dtype="float32", device="cpu").state_dict()
    step = {k: w - start[k] for k, w in weights.items()}
    rel = _rel({k: got["weights"][k] - start[k] for k in step}, step)
    assert rel < (GRAD_RTOL if strategy == "ddp" else STEP_RTOL)  # 0.6% and 6.8% measured


def test_ddp_reduces_pure_bf16_gradients_in_fp32(monkeypatch):
    """reduce_dtype=float32 over bf16 weights: the all-reduce sees fp32, the gradients come
    back bf16 (the collective is recorded here, one rank stands in for many)."""
    from lmrl.workers import dist as dist_module
    from lmrl.workers.dist import DDP

    seen = []
    monkeypatch.setattr(dist_module.dist, "broadcast", lambda tensor, src: None)
    monkeypatch.setattr(dist_module.dist, "all_reduce", lambda t, op: seen.append(t.dtype))
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    pure = Precision(torch.bfloat16, torch.bfloat16, reduce=torch.float32)
    dp = DDP(0, 1)
    dp.prepare(model, pure)
    model(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    dp.reduce_grads(list(model.parameters()))
    assert seen == [torch.float32]
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.gpu
def test_the_gpu_default_is_bf16_compute_over_fp32_masters(tiny_dir):
    precision = Precision.from_config(ModelConfig(dtype="auto"), "cuda")
    assert (precision.master, precision.compute) == (torch.float32, torch.bfloat16)
    model = load_causal_lm(str(tiny_dir), dtype=precision.master, device="cuda")
    worker = ActorWorker(
        model, actor_config(), rollout_n=N, max_response_length=4, temperature=0.8,
        log_prob_micro_batch_size=None, total_steps=10, precision=precision,
    )  # fmt: skip
    batch = add_log_probs(make_batch(seed=3), worker)
    assert batch["old_log_probs"].dtype == torch.float32
    metrics = worker.update_actor(batch)
    assert torch.isfinite(metrics["actor/grad_norm"])
    assert {p.dtype for p in worker.model.parameters()} == {torch.float32}
    moments = [s[k] for s in worker.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert {m.dtype for m in moments} == {torch.float32}


# ------------------------------------------------------------------ config and bad inputs
def _model(dtype="float32", **mp_) -> ModelConfig:
    return ModelConfig(dtype=dtype, mixed_precision=MixedPrecisionConfig(**mp_))


def test_the_defaults_are_fp32_on_a_cpu_and_bf16_over_fp32_masters_on_a_gpu(monkeypatch):
    assert not Precision.from_config(_model(), "cpu").mixed
    assert Precision.from_config(_model("auto"), "cpu").master == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    gpu = Precision.from_config(_model("auto"), "cuda")
    assert (gpu.master, gpu.compute, gpu.reduce) == (torch.float32, torch.bfloat16, torch.float32)
    pure = Precision.from_config(_model("bfloat16", param_dtype="bfloat16"), "cuda")
    assert not pure.mixed and pure.master == torch.bfloat16 and pure.reduce == torch.float32
    assert Precision.from_config(_model("bfloat16"), "cpu").compute == torch.bfloat16  # pure
    exact = Precision.from_config(_model("float64"), "cpu")  # exactness checks: no autocast
    assert not exact.mixed and exact.compute == exact.reduce == torch.float64
    assert not Precision.from_config(_model("float64"), "cuda").mixed


@pytest.mark.parametrize(
    "model,device,message",
    [(_model(param_dtype="float16"), "cpu", "float16 compute on a CPU is not supported"),
     (_model("float16"), "cpu", "float16 compute on a CPU is not supported"),
     (_model(param_dtype="bf16"), "cuda", "this GPU does not support bfloat16"),
     (_model("bfloat16", param_dtype="float32"), "cpu", "cannot compute over")],
)  # fmt: skip
def test_a_dtype_the_device_cannot_run_is_one_line(monkeypatch, model, device, message):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ModelError) as err:
        Precision.from_config(model, device)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_fp16_scales_the_loss_and_backs_off_on_overflow():
    from lmrl.workers.precision import LossScaler

    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(2))
    scaler.scale_loss((p * 3).sum()).backward()
    scaler.unscale([p])
    assert torch.equal(p.grad, torch.full((2,), 3.0))
    scaler.update(stepped=False)
    assert scaler.scale == 4.0
    scaler.update(True), scaler.update(True)
    assert scaler.scale == 8.0 and scaler.state_dict() == {"scale": 8.0, "good_steps": 0}
