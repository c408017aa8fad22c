"""The step over fake parts: no model, every value chosen by hand.

Two prompts, two samples each, four response tokens; the reward sits on the last token.
Rollout correction in mask mode rejects the last token of sample 0 (its rollout log-prob is
log(1/10) below the trainer's, a ratio of 10 > the threshold 2). The rejection must land in
``loss_mask`` only: ``response_mask`` keeps the token, so sample 0's outcome score still
reaches the group estimator, ``critic/score`` and ``response_length`` are unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from lmrl.batch import Batch
from lmrl.config import TrainerConfig, load_config
from lmrl.trainer import RunParts, RunPlan, Trainer

B, T, P = 4, 4, 2
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0])


def rollout() -> Batch:
    prompts = torch.ones(B, P, dtype=torch.long)
    responses = torch.arange(B * T).reshape(B, T) % 7 + 2
    mask = torch.ones(B, T, dtype=torch.bool)
    attention = torch.ones(B, P + T, dtype=torch.bool)
    rollout_lp = torch.full((B, T), -1.0)
    rollout_lp[0, -1] = -1.0 - math.log(10.0)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention,
            "position_ids": torch.arange(P + T).expand(B, -1),
            "response_mask": mask,
            "rollout_log_probs": rollout_lp,
        },
        {"uid": ["a", "a", "b", "b"], "data_source": ["fake"] * B},
    )


class FakeActor:
    """An ``lmrl.workers.roles.ActorRole``: log-probs of -1, updates recorded."""

    def __init__(self) -> None:
        self.updated: list[tuple[Batch, bool]] = []

    def compute_log_probs(self, batch: Batch, with_entropy: bool = False):
        return torch.full(batch["responses"].shape, -1.0), None

    def update_actor(self, batch: Batch, *, old_log_probs_from_update: bool = False):
        self.updated.append((batch, old_log_probs_from_update))
        return {"actor/pg_loss": torch.tensor(0.5)}

    def model_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        pass

    def scale_lr(self, factor: float) -> float:
        return factor

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class FakeReward:
    """An ``lmrl.workers.roles.RewardRole``: ``SCORES`` on the last token."""

    def __call__(self, batch: Batch):
        scores = torch.zeros(len(batch), T)
        scores[:, -1] = SCORES[: len(batch)]
        return SimpleNamespace(token_level_scores=scores, extras={}, metrics={})

    def check_dataset(self, dataset) -> None:
        pass

    def close(self) -> None:
        pass


def parts(plan: RunPlan, actor: FakeActor) -> RunParts:
    sampler = SimpleNamespace(next_batch=lambda: [0, 1], epoch=0)
    return RunParts(
        config=None, plan=plan, run_dir=None, resume_from=None, config_changes=[],
        tokenizer=None, train_data=SimpleNamespace(get_batch=lambda idx: idx), sampler=sampler,
        val_data=None, policy=None, actor=actor, critic=None, reference=None,
        engine=SimpleNamespace(
            generate=lambda prompts, n, sampling: rollout(), pad_id=0, shares_weights=True
        ),
        reward=FakeReward(), kl_ctrl=None, trackers=None, total_steps=1,
    )  # fmt: skip


@pytest.fixture
def plan(tmp_path) -> RunPlan:
    cfg = load_config(
        None,
        [
            "model.path=unused", "data.train_files=unused", "data.train_batch_size=2",
            "rollout.n=2", "actor.ppo_mini_batch_size=2", "algorithm.adv_estimator=grpo",
            f"data.max_response_length={T}",
        ],
        required=(),
    )  # fmt: skip
    return RunPlan.from_config(cfg)


def test_token_rejection_of_the_last_token_keeps_the_outcome_score(plan):
    correction = dataclasses.replace(plan.correction, level="token", mode="mask", threshold=2.0)
    plan = dataclasses.replace(plan, log_prob_mode="rollout_correction", correction=correction)
    actor = FakeActor()
    metrics = Trainer(parts(plan, actor), TrainerConfig()).step()

    batch, from_update = actor.updated[0]
    assert not from_update  # rollout correction needs old log-probs before the update
    assert batch["response_mask"].all()  # never overwritten
    expected = torch.ones(B, T, dtype=torch.bool)
    expected[0, -1] = False
    assert torch.equal(batch["loss_mask"], expected)
    # GRPO on scores (1, 0) and (0, 1): +-1/sqrt(2) on every token, sample 0 included
    adv = batch["advantages"][:, 0]
    torch.testing.assert_close(adv, torch.tensor([1, -1, -1, 1]) / math.sqrt(2), atol=1e-4, rtol=0)
    assert metrics["critic/score/mean"] == pytest.approx(0.5)
    assert metrics["response_length/mean"] == pytest.approx(T)
    assert metrics["rollout_corr/is_masked_fraction"] == pytest.approx(1 / (B * T))


def test_one_pass_update_takes_old_log_probs_from_its_own_forward(plan):
    actor = FakeActor()
    metrics = Trainer(parts(plan, actor), TrainerConfig()).step()
    batch, from_update = actor.updated[0]
    assert from_update and "old_log_probs" not in batch
    assert metrics["actor/old_log_prob_recomputed"] == 0.0
    assert "timing_s/old_log_prob" not in metrics

    two_epochs = dataclasses.replace(plan, update_rows=0)
    actor = FakeActor()
    metrics = Trainer(parts(two_epochs, actor), TrainerConfig()).step()
    batch, from_update = actor.updated[0]
    assert not from_update and "old_log_probs" in batch
    assert metrics["actor/old_log_prob_recomputed"] == 1.0


def test_bypass_uses_the_rollout_log_probs(plan):
    actor = FakeActor()
    plan = dataclasses.replace(plan, log_prob_mode="bypass", update_rows=0)
    Trainer(parts(plan, actor), TrainerConfig()).step()
    batch, _ = actor.updated[0]
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])


@pytest.mark.parametrize(
    ("change", "rows", "step", "shares", "expected"),
    [
        ({}, 4, 0, True, True),  # one epoch, one mini-batch of 2 prompts x 2 samples
        ({}, 5, 0, True, False),  # more rows than one mini-batch: the weights move in between
        ({}, 0, 0, True, False),
        ({}, 4, 0, False, False),  # an engine with its own weights: the gap is measured
        ({"critic_warmup": 2}, 4, 1, True, False),  # the actor does not update yet
        ({"critic_warmup": 2}, 4, 2, True, True),
        ({"log_prob_mode": "bypass"}, 4, 0, True, False),
        ({"update_rows": 0}, 4, 0, True, False),  # several epochs or a KL in the reward
    ],
)
def test_one_place_decides_whether_old_log_probs_come_from_the_update(
    plan, change, rows, step, shares, expected
):
    assert plan.update_rows == 4 and plan.engine_shares_weights
    plan = dataclasses.replace(plan, engine_shares_weights=shares, **change)
    assert plan.old_log_probs_from_update(rows, step) is expected
    # the plan lists the stage exactly when the step runs it
    assert ("old_log_prob" in plan.stages(step, rows)) is not (
        expected or plan.log_prob_mode == "bypass"
    )
