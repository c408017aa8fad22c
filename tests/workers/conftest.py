"""Fixtures for the worker tests: a tiny model saved once, a GRPO-shaped batch built by hand,
workers from plain config sections, and the gradients each optimizer step sees."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmrl.batch import Batch
from lmrl.config import ActorConfig, CriticConfig, OptimConfig, PolicyLossConfig
from lmrl.models import build_tiny_model
from lmrl.workers.actor import ActorWorker
from lmrl.workers.critic import CriticWorker

GROUPS, N = 3, 2  # 3 prompts x 2 samples = 6 rows
PAD = 256


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", size="tiny")


def make_batch(seed: int = 0) -> Batch:
    """``GROUPS * N`` rows: each prompt (P=5, left-padded) repeated ``N`` times, responses
    (T=4, right-padded) of 4, 2 | 3, 1 | 4, 3 tokens, random ``advantages`` (0 outside the
    response). Log-probs are the test's to add (see `add_log_probs`)."""
    g = torch.Generator().manual_seed(seed)
    P, T = 5, 4
    B = GROUPS * N
    prompt_len = torch.tensor([5, 3, 4]).repeat_interleave(N)
    response_len = torch.tensor([4, 2, 3, 1, 4, 3])
    prompts = torch.randint(0, PAD, (GROUPS, P), generator=g).repeat_interleave(N, 0)
    responses = torch.randint(0, PAD, (B, T), generator=g)
    prompt_mask = torch.arange(P)[None] >= (P - prompt_len)[:, None]
    response_mask = torch.arange(T)[None] < response_len[:, None]
    prompts[~prompt_mask] = PAD
    responses[~response_mask] = PAD
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    advantages = torch.randn(B, T, generator=g)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.long().cumsum(1) - 1).clamp(min=0),
            "response_mask": response_mask,
            "advantages": torch.where(response_mask, advantages, 0.0),
        }
    )


def add_log_probs(batch: Batch, worker: ActorWorker, seed: int = 1) -> Batch:
    """``old_log_probs`` and ``ref_log_probs``: the worker's own, moved by seeded noise (so
    ratios are not all 1 and the KL is not 0)."""
    g = torch.Generator().manual_seed(seed)
    own, _ = worker.compute_log_probs(batch)
    mask = batch["response_mask"]
    for key in ("old_log_probs", "ref_log_probs"):
        noise = 0.3 * torch.randn(own.shape, generator=g, dtype=own.dtype)
        batch[key] = torch.where(mask, own + noise, 0.0)
    return batch


def actor_config(**overrides) -> ActorConfig:
    """One mini-batch of the whole batch, lr 1e-3, no weight decay, then ``overrides``
    (``loss_mode``, ``tau_pos``, ``tau_neg`` go to ``policy_loss``)."""
    loss = {k: overrides.pop(k) for k in ("loss_mode", "tau_pos", "tau_neg") if k in overrides}
    cfg = ActorConfig(
        ppo_mini_batch_size=GROUPS,
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),
        policy_loss=dataclasses.asdict(PolicyLossConfig(**loss)),
    )
    return dataclasses.replace(cfg, **overrides)


def make_actor(model, reference=None, **overrides) -> ActorWorker:
    return ActorWorker(
        model, actor_config(**overrides), rollout_n=N, max_response_length=4, temperature=0.8,
        log_prob_micro_batch_size=None, total_steps=10, reference=reference,
    )  # fmt: skip


def critic_config(**overrides) -> CriticConfig:
    """A resolved critic section (no null fields): one mini-batch of the whole batch."""
    cfg = CriticConfig(
        enable=True, optim=OptimConfig(lr=1e-2, weight_decay=0.0), ppo_epochs=1,
        ppo_mini_batch_size=GROUPS, shuffle=False, loss_agg_mode="token-mean",
    )  # fmt: skip
    return dataclasses.replace(cfg, **overrides)


def make_critic(model, **overrides) -> CriticWorker:
    return CriticWorker(
        model, critic_config(**overrides), rollout_n=N, max_response_length=4, total_steps=10
    )


@pytest.fixture(scope="session")
def batch_factory():
    """``batch_factory(seed)``: see `make_batch`."""
    return make_batch


@pytest.fixture(scope="session")
def with_log_probs():
    """``with_log_probs(batch, actor)``: see `add_log_probs`."""
    return add_log_probs


@pytest.fixture(scope="session")
def actor_factory():
    """``actor_factory(model, reference=None, **actor_overrides)``: see `make_actor`."""
    return make_actor


@pytest.fixture(scope="session")
def critic_factory():
    """``critic_factory(model, **critic_overrides)``: see `make_critic`."""
    return make_critic


@pytest.fixture(scope="session")
def grads_close():
    """``grads_close(a, b, tol)``: see `assert_grads_close`."""
    return assert_grads_close


@pytest.fixture
def step_grads(monkeypatch):
    """``steps = step_grads(module)``: every optimizer step of a worker appends ``{name: grad}``
    of the parameters it is about to step (before clipping). Every ``TrainableWorker`` steps
    through ``lmrl.workers.optim``'s ``clip_and_step``; ``module`` names the worker's."""

    def install(module) -> list[dict[str, torch.Tensor]]:
        import lmrl.workers.optim as module  # where the actor, critic and SFT step

        steps: list[dict[str, torch.Tensor]] = []
        real = module.clip_and_step

        def recording(params, optimizer, grad_clip):
            steps.append({i: p.grad.detach().clone() for i, p in enumerate(params)})
            return real(params, optimizer, grad_clip)

        monkeypatch.setattr(module, "clip_and_step", recording)
        return steps

    return install


def assert_grads_close(a: dict, b: dict, tol: float) -> None:
    """Each gradient equal up to ``tol`` times its largest entry."""
    assert a.keys() == b.keys() and a
    for name, g in b.items():
        assert (a[name] - g).abs().max() <= tol * g.abs().max().clamp(min=1e-12), name


@pytest.fixture(scope="session")
def tiny_overrides_rm():
    """``tiny_overrides_rm(root, run_dir, *extra)``: a 2-step GRPO run of the tiny model."""

    def overrides(root, run_dir, *extra):
        return [
            f"model.path={root / 'model'}",
            f"data.train_files={root / 'data' / 'train.parquet'}",
            "data.max_prompt_length=64", "data.max_response_length=6",
            "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2",
            "model.enable_gradient_checkpointing=false", "trainer.device=cpu",
            "trainer.total_training_steps=2", f"trainer.default_local_dir={run_dir}",
            "reward.num_workers=0", *extra,
        ]  # fmt: skip

    return overrides
