"""Rows no reward function scores (each returned None, TRL's "does not apply"): masked,
counted, kept out of the score means and the advantages' groups, and sent no gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmrl.batch import Batch
from lmrl.models.tiny import build_tokenizer
from lmrl.rewards import RewardFunction, make_reward_manager
from lmrl.rewards.functions import normalize_value
from lmrl.rewards.result import RewardResult, merge_results


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def make_batch(tok, texts, truths, sources):
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    T = max(len(x) for x in ids)
    responses = torch.full((len(ids), T), tok.pad_token_id)
    mask = torch.zeros(len(ids), T, dtype=torch.bool)
    for i, x in enumerate(ids):
        responses[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = True
    return Batch(
        {"responses": responses, "response_mask": mask},
        {"data_source": list(sources), "ground_truth": list(truths),
         "extra_info": [{} for _ in ids]},
    )  # fmt: skip


def exact(prompts, completions, ground_truth, **kw):
    return [
        None if g == "skip" else float(c == g)
        for c, g in zip(completions, ground_truth, strict=True)
    ]


def length(prompts, completions, data_source, **kw):
    return [
        float(len(c)) if s == "b" else None for c, s in zip(completions, data_source, strict=True)
    ]


def test_a_row_no_function_scores_is_unscored_counted_and_out_of_the_means(tok):
    batch = make_batch(tok, ["1", "2", "33", "4"], ["1", "1", "skip", "skip"], "aabb")
    fns = [RewardFunction(exact), RewardFunction(length, weight=0.5)]
    result = make_reward_manager("batch", tok, num_workers=0, reward_fns=fns)(batch)
    # the sum of the functions that apply: rows 0-1 exact only, rows 2-3 length only
    np.testing.assert_allclose(result.scores.numpy(), [1.0, 0.0, 1.0, 0.5])
    assert result.scored_mask.tolist() == [True, True, True, True]

    batch = make_batch(tok, ["1", "2", "33"], ["1", "skip", "skip"], "aab")
    result = make_reward_manager("batch", tok, num_workers=0, reward_fns=fns)(batch)
    assert result.scored_mask.tolist() == [True, False, True]  # row 1: neither applies
    np.testing.assert_allclose(result.scores.numpy(), [1.0, 0.0, 1.0])
    assert np.isnan(result.extras["score"][1]) and result.extras["score"][0] == 1.0
    assert result.metrics["reward/unscored"] == 1.0
    assert result.metrics["reward/no_score"] == 4.0  # exact on rows 1-2, length on rows 0-1
    assert result.metrics["train/a/unscored"] == 1.0 and result.metrics["train/b/unscored"] == 0


def test_a_per_sample_function_declines_with_a_dict_whose_score_is_none(tok):
    assert normalize_value({"score": None, "acc": 0.0}, "f").status == "none"
    assert normalize_value(None, "f").status == "error"  # a bare None: a missing return

    def declines(solution_str, ground_truth):
        return {"score": None} if ground_truth == "skip" else float(solution_str == ground_truth)

    batch = make_batch(tok, ["1", "2"], ["1", "skip"], "aa")
    result = make_reward_manager("naive", tok, num_workers=0, reward_fns=declines)(batch)
    assert result.scored_mask.tolist() == [True, False]
    assert result.metrics["reward/errors"] == 0.0 and result.metrics["reward/unscored"] == 1.0


def test_merged_blocks_keep_each_rows_scored_flag():
    def block(scored):
        n = len(scored)
        return RewardResult(torch.zeros(n, 2), {"score": np.zeros(n)}, {}, np.array(scored))

    plain = RewardResult(torch.zeros(1, 2), {"score": np.zeros(1)}, {})
    merged = merge_results([block([True, False]), plain, block([False])])
    assert merged.scored_mask.tolist() == [True, False, True, False]


def test_record_and_the_advantage_leave_unscored_rows_out(tok):
    """In the step: scored_mask written, the means over scored rows only, the unscored row
    its own group with a zero advantage, and loss_mask False on it (no gradient)."""
    from lmrl.algos import advantage_estimators
    from lmrl.trainer.stages import leave_out_unscored, record

    batch = make_batch(tok, ["1", "2", "3"], ["1", "3", "skip"], "aaa")
    batch["uid"] = np.array(["g", "g", "g"], dtype=object)
    result = make_reward_manager("batch", tok, num_workers=0, reward_fns=exact)(batch)
    metrics: dict = {}
    record(batch, result, metrics)
    assert batch["scored_mask"].tolist() == [True, True, False]
    assert metrics["reward/unscored_frac"] == pytest.approx(1 / 3)
    assert metrics["reward/score/mean"] == 0.5  # (1 + 0) / 2, not / 3
    index, mask = leave_out_unscored(batch)
    estimator = advantage_estimators.get("grpo")
    adv, _ = estimator(batch["token_level_scores"], mask, index=index)
    # the two scored rows are the group: scores 1 and 0, mean 0.5, std 0.707
    scored_adv = adv[:2].sum(-1) / batch["response_mask"][:2].sum(-1)
    np.testing.assert_allclose(scored_adv.numpy(), [0.7071, -0.7071], atol=1e-3)
    assert not adv[2].any()
    assert batch["loss_mask"][2].sum() == 0
    assert torch.equal(batch["loss_mask"][:2], batch["response_mask"][:2])
    # a batch with every row scored is untouched: no loss_mask, the uid as it was
    full = make_batch(tok, ["1"], ["1"], "a")
    full["uid"] = np.array(["g"], dtype=object)
    record(full, make_reward_manager("batch", tok, num_workers=0, reward_fns=exact)(full), {})
    index, mask = leave_out_unscored(full)
    assert "loss_mask" not in full and mask is full["response_mask"]


def test_a_step_whose_rows_no_function_scores_changes_no_weight(tiny_workspace, tmp_path):
    """End to end: a reward that scores none of the step's samples leaves the policy as it
    was (no policy, KL or entropy gradient) and counts every sample as unscored."""
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(prompts, completions, **kw):\n"
                      "    return [None] * len(completions)\n")  # fmt: skip
    root = tiny_workspace
    cfg = load_config(None, [
        f"model.path={root / 'model'}", f"data.train_files={root / 'data' / 'train.parquet'}",
        "data.max_prompt_length=64", "data.max_response_length=4", "data.train_batch_size=2",
        "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.optim.lr=1e-2",
        "actor.optim.weight_decay=0", "actor.use_kl_loss=true", "actor.entropy_coeff=0.01",
        "algorithm.adv_estimator=grpo", "model.enable_gradient_checkpointing=false",
        f"reward.custom_reward_function.path={reward}", "reward.num_workers=0",
        "reward.max_error_fraction=2", "trainer.device=cpu", "trainer.total_training_steps=1",
        "trainer.logger=[]", f"trainer.default_local_dir={tmp_path / 'run'}",
    ])  # fmt: skip
    trainer = Trainer(build_run(cfg), cfg.trainer)
    before = {k: v.clone() for k, v in trainer.actor.model_state().items()}
    metrics = trainer.step()
    assert metrics["reward/unscored_frac"] == 1.0 and metrics["reward/unscored"] == 4.0
    assert not trainer.last_batch["loss_mask"].any()
    assert not trainer.last_batch["advantages"].any()
    after = trainer.actor.model_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    trainer.close()
