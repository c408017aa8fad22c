"""``lmrl train`` on a GPU (skipped without CUDA): the same samples, losses and update as on
the CPU, a checkpoint that a CPU run resumes, and bfloat16 training (``model.dtype=auto``).

The rollout's sampling is counter-based (``lmrl.rollout.hf.Draws``), a function of the seed
and the row alone, so a float32 run on CUDA draws the CPU run's tokens: the rewards match
exactly, the losses to float rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from lmrl.config import load_config
from lmrl.trainer import Trainer, build_run

pytestmark = pytest.mark.gpu

RECIPES = {
    "grpo": ["algorithm.adv_estimator=grpo"],
    "ppo_critic": ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-2"],
    "lora_kl_loss": [
        "algorithm.adv_estimator=grpo",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "actor.use_kl_loss=true",
        "actor.kl_loss_type=low_var_kl",
    ],
    "dapo_kl_in_reward": [
        "algorithm.adv_estimator=grpo",
        "actor.clip_ratio_high=0.28",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=4",
        "reward.manager=dapo",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=2",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.target_kl=0.01",
    ],
    "clip_cov_dual_clip": [
        "algorithm.adv_estimator=rloo",
        "actor.policy_loss.loss_mode=clip_cov",
        "actor.policy_loss.clip_cov_ratio=0.3",
        "actor.clip_ratio_c=3.0",
    ],
}
EXACT = ("critic/score/mean", "response_length/mean")  # the same tokens were sampled
CLOSE = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/advantages/mean")


# every group has spread (the share of digits, and a little for the length), so every step
# trains on real gradients, not on weight decay alone
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if not solution_str:
        return 0.0
    return sum(c.isdigit() for c in solution_str) / len(solution_str) + 0.01 * len(solution_str)
"""


def _trainer(root, run, tiny_overrides, device: str, *extra: str) -> Trainer:
    reward = run.parent / "reward.py"
    reward.write_text(REWARD)
    overrides = tiny_overrides(root, run, f"trainer.device={device}",
                               f"reward.custom_reward_function.path={reward}", *extra)  # fmt: skip
    cfg = load_config(None, overrides)
    return Trainer(build_run(cfg), cfg.trainer)


def _trainable(trainer: Trainer) -> dict[str, torch.Tensor]:
    models = {"actor": trainer.parts.actor.model}
    if trainer.parts.critic is not None:
        models["critic"] = trainer.parts.critic.model
    return {
        f"{prefix}.{name}": p.detach().float().cpu().clone()
        for prefix, model in models.items()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_run_on_a_gpu_samples_and_trains_as_on_the_cpu(
    tiny_workspace, tiny_overrides, tmp_path, recipe
):
    extra = ("model.dtype=float32", *RECIPES[recipe])
    deltas, histories = {}, {}
    for device in ("cpu", "cuda"):
        run = tmp_path / f"run{len(deltas)}"
        trainer = _trainer(tiny_workspace, run, tiny_overrides, device, *extra)
        assert next(trainer.parts.actor.model.parameters()).device.type == device
        before = _trainable(trainer)
        histories[len(deltas)] = trainer.fit()
        after = _trainable(trainer)
        deltas[len(deltas)] = {k: after[k] - v for k, v in before.items()}
    for cpu, gpu in zip(histories[0], histories[1], strict=True):
        for key in EXACT:
            assert gpu[key] == pytest.approx(cpu[key], rel=1e-6), key
        for key in CLOSE:
            assert gpu[key] == pytest.approx(cpu[key], rel=1e-3, abs=1e-5), key
        assert all(math.isfinite(v) for v in gpu.values())
    # Adam moves each weight by ~lr, its sign from a gradient that may be ~0: compared as a
    # whole, the two updates point the same way and are the same size
    cpu = torch.cat([d.flatten() for d in deltas[0].values()])
    gpu = torch.cat([d.flatten() for d in deltas[1].values()])
    assert float(cpu.norm()) > 0
    assert float(torch.nn.functional.cosine_similarity(cpu, gpu, dim=0)) > 0.999
    assert float((gpu - cpu).norm() / cpu.norm()) < 0.03
    moved = [{k for k, d in run.items() if d.abs().max() > 0} for run in deltas.values()]
    assert moved[0] == moved[1]  # the same tensors trained (zero-gradient biases stay put)


def test_a_gpu_checkpoint_resumes_on_the_cpu(tiny_workspace, tiny_overrides, tmp_path):
    run = tmp_path / "run"
    gpu = _trainer(tiny_workspace, run, tiny_overrides, "cuda", "model.dtype=float32")
    gpu.fit()
    saved = load_file(run / "global_step_2" / "actor.safetensors")
    cpu = _trainer(tiny_workspace, run, tiny_overrides, "cpu", "model.dtype=float32",
                   "trainer.total_training_steps=3")  # fmt: skip
    assert cpu.global_step == 2
    for name, value in cpu.parts.actor.model.state_dict().items():
        assert torch.equal(value, gpu.parts.actor.model.state_dict()[name].cpu()), name
        if name in saved:
            assert torch.equal(saved[name], value), name
    assert len(cpu.fit()) == 1 and (run / "global_step_3").is_dir()


def test_auto_dtype_on_a_gpu_trains_in_bfloat16(tiny_workspace, tiny_overrides, tmp_path):
    trainer = _trainer(
        tiny_workspace, tmp_path / "bf16", tiny_overrides, "cuda", "model.dtype=auto"
    )
    params = list(trainer.parts.actor.model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16} and params[0].is_cuda
    before = _trainable(trainer)
    history = trainer.fit()
    after = _trainable(trainer)
    for metrics in history:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, bad
        assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped_steps"] == 0, metrics
    moved = [k for k, v in before.items() if not torch.equal(v, after[k])]
    assert len(moved) > len(before) // 2, sorted(set(before) - set(moved))[:5]
