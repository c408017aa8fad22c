"""``lmrl train`` and ``lmrl sft`` on a GPU (skipped without CUDA): the same samples, tool
calls, losses and update as on the CPU, a checkpoint that a CPU run resumes, and bfloat16
training (the default bf16 compute over fp32 masters, and pure bf16).

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

from .conftest import trainable_state

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


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_run_on_a_gpu_samples_and_trains_as_on_the_cpu(
    tiny_workspace, tiny_overrides, tmp_path, recipe
):
    extra = ("model.dtype=float32", "model.mixed_precision.param_dtype=float32", *RECIPES[recipe])
    deltas, histories = {}, {}
    for device in ("cpu", "cuda"):
        run = tmp_path / f"run{len(deltas)}"
        trainer = _trainer(tiny_workspace, run, tiny_overrides, device, *extra)
        assert next(trainer.parts.actor.model.parameters()).device.type == device
        before = trainable_state(trainer)
        histories[len(deltas)] = trainer.fit()
        after = trainable_state(trainer)
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
    gpu = _trainer(
        tiny_workspace,
        run,
        tiny_overrides,
        "cuda",
        "model.dtype=float32",
        "model.mixed_precision.param_dtype=float32",
    )
    gpu.fit()
    saved = load_file(run / "global_step_2" / "actor.safetensors")
    cpu = _trainer(tiny_workspace, run, tiny_overrides, "cpu", "model.dtype=float32", "model.mixed_precision.param_dtype=float32",
                   "trainer.total_training_steps=3")  # fmt: skip
    assert cpu.global_step == 2
    for name, value in cpu.parts.actor.model.state_dict().items():
        assert torch.equal(value, gpu.parts.actor.model.state_dict()[name].cpu()), name
        if name in saved:
            assert torch.equal(saved[name], value), name
    assert len(cpu.fit()) == 1 and (run / "global_step_3").is_dir()


@pytest.mark.parametrize(
    ("overrides", "master"),
    [
        (("model.dtype=auto",), torch.float32),  # the default: bf16 compute over fp32 masters
        (("model.dtype=bfloat16", "model.mixed_precision.param_dtype=bfloat16"), torch.bfloat16),
    ],
    ids=["mixed", "pure-bf16"],
)
def test_bf16_on_a_gpu_trains(tiny_workspace, tiny_overrides, tmp_path, overrides, master):
    trainer = _trainer(tiny_workspace, tmp_path / "bf16", tiny_overrides, "cuda", *overrides)
    params = list(trainer.parts.actor.model.parameters())
    assert {p.dtype for p in params} == {master} and params[0].is_cuda
    before = trainable_state(trainer)
    history = trainer.fit()
    after = trainable_state(trainer)
    for metrics in history:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, bad
        assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped_steps"] == 0, metrics
    moved = [k for k, v in before.items() if not torch.equal(v, after[k])]
    assert len(moved) > len(before) // 2, sorted(set(before) - set(moved))[:5]


def _update_direction(before: dict, after: dict) -> torch.Tensor:
    return torch.cat([(after[k] - v).flatten() for k, v in before.items()])


def test_sft_on_a_gpu_trains_as_on_the_cpu(tiny_workspace, tmp_path):
    from lmrl.config.sft import load_sft_config
    from lmrl.trainer.sft import SFTTrainer, build_sft

    losses, moves = [], []
    for device in ("cpu", "cuda"):
        cfg = load_sft_config(None, [
            f"model.path={tiny_workspace / 'model'}", "model.dtype=float32", "model.mixed_precision.param_dtype=float32",
            f"data.train_files={tiny_workspace / 'data' / 'train.parquet'}",
            "data.response_from_ground_truth=true", "data.train_batch_size=8",
            "optim.lr=3e-3", "trainer.total_training_steps=4", f"trainer.device={device}",
            f"trainer.default_local_dir={tmp_path / f'sft{len(losses)}'}", "trainer.logger=[]",
            "model.enable_gradient_checkpointing=false",
        ])  # fmt: skip
        trainer = SFTTrainer(build_sft(cfg))
        assert next(trainer.model.parameters()).device.type == device
        before = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
        losses.append([m["sft/loss"] for m in trainer.fit()])
        after = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
        moves.append(_update_direction(before, after))
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    assert float(torch.nn.functional.cosine_similarity(moves[0], moves[1], dim=0)) > 0.999


def test_a_multi_turn_run_with_the_search_tool_on_a_gpu(search_workspace, tmp_path):
    """The agent loop's tool calls and observation masks: the CPU run's, on the GPU."""
    root = search_workspace
    histories = []
    for device in ("cpu", "cuda"):
        cfg = load_config(None, [
            f"model.path={root / 'model'}", "model.dtype=float32", "model.mixed_precision.param_dtype=float32",
            f"data.train_files={root / 'data' / 'train.parquet'}",
            "data.max_prompt_length=64", "data.max_response_length=96",
            "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2",
            "actor.optim.lr=1e-2", "algorithm.adv_estimator=grpo", "actor.use_kl_loss=true",
            "rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=2",
            "rollout.multi_turn.max_obs_length=40",
            f"retriever.source={root / 'data' / 'corpus.parquet'}", "retriever.topk=1",
            "model.enable_gradient_checkpointing=false", f"trainer.device={device}",
            "trainer.total_training_steps=2", "trainer.logger=[]", "reward.num_workers=0",
            f"trainer.default_local_dir={tmp_path / f'agent{len(histories)}'}",
        ])  # fmt: skip
        histories.append(Trainer(build_run(cfg), cfg.trainer).fit())
    for cpu, gpu in zip(*histories, strict=True):
        tool = [k for k in cpu if k.startswith(("tool/", "agent/"))]
        assert tool and cpu["response_length/mean"] == gpu["response_length/mean"]
        for key in tool:
            assert gpu[key] == pytest.approx(cpu[key], rel=1e-6), key
        assert gpu["actor/pg_loss"] == pytest.approx(cpu["actor/pg_loss"], rel=1e-3, abs=1e-5)
