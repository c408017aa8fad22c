"""Reward managers: score placement, DAPO's overlong penalty, combining functions, and
robustness to reward functions that raise, hang, crash or return garbage."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from lmrl.batch import Batch
from lmrl.models.tiny import build_tokenizer
from lmrl.rewards import (
    REWARD_MANAGERS,
    RewardFunction,
    load_reward_fn,
    make_reward_manager,
    overlong_penalty,
    split_extras,
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def make_batch(tok, texts, truths, data_source="digits", eos=True, width=None):
    """Right-padded responses (each text + eos) with their mask and columns."""
    ids = [
        tok(t, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
        for t in texts
    ]
    T = width or max(1, max(len(x) for x in ids))
    responses = torch.full((len(ids), T), tok.pad_token_id)
    mask = torch.zeros(len(ids), T, dtype=torch.bool)
    for i, x in enumerate(ids):
        responses[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        mask[i, : len(x)] = True
    return Batch(
        {"responses": responses, "response_mask": mask},
        {
            "data_source": [data_source] * len(ids),
            "ground_truth": list(truths),
            "extra_info": [{"index": i} for i in range(len(ids))],
            "raw_prompt": [[{"role": "user", "content": f"reverse {t[::-1]}"}] for t in truths],
        },
    )


def test_naive_places_the_score_on_the_last_valid_token(tok):
    batch = make_batch(tok, ["321", "32", "", "329"], ["321", "321", "321", "321"], width=6)
    with make_reward_manager("naive", tok, num_workers=0) as manager:
        result = manager(batch)
    expected = torch.zeros(4, 6)
    expected[0, 3] = 1.0  # "321" + eos: 4 valid tokens, the eos is the last one
    expected[1, 2] = 2 / 3  # "32": 2 of max(2, 3) positions
    expected[2, 0] = 0.0  # empty response: eos only, at token 0
    expected[3, 3] = 2 / 3
    assert result.token_level_scores.dtype == torch.float32
    assert torch.allclose(result.token_level_scores, expected)
    assert torch.allclose(result.scores, expected.sum(-1))
    np.testing.assert_array_equal(result.extras["acc"], [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(result.extras["score"], [1.0, 2 / 3, 0.0, 2 / 3])
    assert result.metrics["reward/errors"] == 0.0


def test_fully_masked_response_scores_on_token_zero(tok):
    batch = make_batch(tok, ["12"], ["12"], eos=False, width=4)
    batch["response_mask"] = torch.zeros(1, 4, dtype=torch.bool)
    result = make_reward_manager("naive", tok, num_workers=0)(batch)
    assert result.token_level_scores.tolist() == [[0.0, 0.0, 0.0, 0.0]]  # "" vs "12": 0 at token 0
    batch2 = make_batch(tok, [""], [""], eos=False, width=3)
    batch2["response_mask"] = torch.zeros(1, 3, dtype=torch.bool)
    assert make_reward_manager("naive", tok, num_workers=0)(batch2).token_level_scores.tolist() == [
        [1.0, 0.0, 0.0]
    ]


def test_attention_mask_is_used_without_response_mask(tok):
    batch = make_batch(tok, ["12", "1"], ["12", "12"], width=4)
    mask = batch.pop("response_mask")
    batch["attention_mask"] = torch.cat([torch.ones(2, 3, dtype=torch.bool), mask], dim=1)
    result = make_reward_manager("naive", tok, num_workers=0)(batch)
    assert result.token_level_scores[0, 2] == 1.0 and result.token_level_scores[1, 1] == 0.5


def test_overlong_penalty_by_hand():
    # L_max = 8, buffer 4, factor 1: no penalty up to 4 tokens, then -1/4 per token
    np.testing.assert_allclose(
        overlong_penalty([0, 3, 4, 5, 6, 8], 8, 4, 1.0), [0, 0, 0, -0.25, -0.5, -1.0]
    )
    np.testing.assert_allclose(overlong_penalty([6], 8, 4, 0.5), [-0.25])


def test_dapo_adds_the_penalty_to_the_score(tok):
    texts = ["1", "12", "1234", "1234567"]  # + eos: 2, 3, 5, 8 tokens
    batch = make_batch(tok, texts, texts, width=8)
    buffer = {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True}
    manager = make_reward_manager(
        "dapo", tok, num_workers=0, overlong_buffer=buffer, max_response_length=8
    )
    result = manager(batch)
    penalty = [0.0, 0.0, -0.25, -1.0]
    np.testing.assert_allclose(result.extras["overlong_penalty"], penalty)
    np.testing.assert_array_equal(result.extras["overlong"], [0.0, 0.0, 1.0, 1.0])
    np.testing.assert_allclose(result.extras["score"], [1.0] * 4)  # before the penalty
    np.testing.assert_allclose(result.scores.numpy(), [1.0 + p for p in penalty])
    assert result.token_level_scores[3, 7] == 0.0  # 1 - 1 on the last token
    # disabled: the naive scores
    plain = make_reward_manager("dapo", tok, num_workers=0)(batch)
    assert "overlong_penalty" not in plain.extras and plain.scores.tolist() == [1.0] * 4


def test_dapo_and_factory_argument_errors(tok):
    with pytest.raises(ValueError, match="must be smaller than max_response_length"):
        make_reward_manager(
            "dapo",
            tok,
            num_workers=0,
            overlong_buffer={"enable": True, "len": 8},
            max_response_length=8,
        )
    with pytest.raises(ValueError, match="len must be > 0"):
        make_reward_manager("dapo", tok, num_workers=0, overlong_buffer={"enable": True})
    with pytest.raises(ValueError, match="unknown keys"):
        make_reward_manager("dapo", tok, num_workers=0, overlong_buffer={"enabled": True})
    with pytest.raises(
        ValueError, match="unknown reward manager 'prime'; valid names: batch, dapo, naive"
    ):
        make_reward_manager("prime", tok)
    assert REWARD_MANAGERS.names() == ["batch", "dapo", "naive"]
    with pytest.raises(ValueError, match="num_workers"):
        make_reward_manager("naive", tok, num_workers=-1)
    with pytest.raises(ValueError, match="cannot be sent to worker processes"):
        make_reward_manager("naive", tok, num_workers=1, reward_fns=lambda solution_str: 0.0)


def count_batch(prompts, completions, **columns):
    """Gives each sample the size of the call it was scored in."""
    return [float(len(completions))] * len(completions)


def test_batch_manager_calls_batched_functions_once(tok):
    batch = make_batch(tok, ["1", "2", "3"], ["1", "1", "1"])
    naive = make_reward_manager("naive", tok, num_workers=0, reward_fns=count_batch)
    whole = make_reward_manager("batch", tok, num_workers=0, reward_fns=count_batch)
    assert naive(batch).scores.tolist() == [1.0, 1.0, 1.0]
    assert whole(batch).scores.tolist() == [3.0, 3.0, 3.0]


def test_several_functions_with_weights(tok):
    def exact(solution_str, ground_truth):
        return {
            "score": float(solution_str == ground_truth),
            "acc": float(solution_str == ground_truth),
        }

    def length(prompts, completions, completion_ids, **kw):
        return [float(len(ids)) for ids in completion_ids]

    def picky(prompts, completions, data_source, **kw):
        return [None if c == "2" else 1.0 for c in completions]

    fns = [
        RewardFunction(exact, weight=2.0),
        RewardFunction(length, weight=0.5),
        RewardFunction(picky),
    ]
    batch = make_batch(tok, ["1", "22", "2"], ["1", "1", "1"], eos=False)
    result = make_reward_manager("batch", tok, num_workers=0, reward_fns=fns)(batch)
    # 2 * exact + 0.5 * tokens + picky (None -> 0)
    np.testing.assert_allclose(result.scores.numpy(), [2 + 0.5 + 1, 0 + 1.0 + 1, 0 + 0.5 + 0])
    np.testing.assert_array_equal(result.extras["exact/acc"], [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(result.extras["length/score"], [1.0, 2.0, 1.0])
    assert np.isnan(result.extras["picky/score"][2])
    assert result.metrics["reward/no_score"] == 1.0
    with pytest.raises(ValueError, match="distinct"):
        make_reward_manager("naive", tok, num_workers=0, reward_fns=[exact, exact])


def test_in_process_errors_are_counted_and_logged_once(tok, caplog):
    def flaky(solution_str):
        if solution_str == "bad":
            raise KeyError("no such key")
        return float("nan") if solution_str == "nan" else 1.0

    batch = make_batch(tok, ["ok", "bad", "nan", "bad"], ["", "", "", ""], eos=False)
    manager = make_reward_manager("naive", tok, num_workers=0, reward_fns=flaky)
    with caplog.at_level(logging.WARNING, logger="lmrl.rewards"):
        first, second = manager(batch), manager(batch)
    assert first.scores.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert first.metrics["reward/errors"] == 3.0 and second.metrics["reward/errors"] == 3.0
    errors = [r for r in caplog.records if "reward error" in r.getMessage()]
    assert len(errors) == 1 and "flaky raised KeyError" in errors[0].getMessage()


MISBEHAVING = """
import math, os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(10_000)
    if solution_str == "boom":
        raise RuntimeError("boom")
    if solution_str == "nan":
        return math.nan
    if solution_str == "str":
        return "high"
    if solution_str == "die":
        os._exit(3)
    return {"score": float(solution_str == ground_truth), "acc": 1.0}

def hang_batched(prompts, completions, **kwargs):
    time.sleep(10_000)
"""


def test_pool_survives_hangs_crashes_and_garbage(tok, tmp_path, caplog):
    path = tmp_path / "misbehaving.py"
    path.write_text(MISBEHAVING)
    texts = ["12", "hang", "boom", "12", "nan", "str", "die", "12", "13"]
    batch = make_batch(tok, texts, ["12"] * len(texts), eos=False)
    manager = make_reward_manager(
        "naive", tok, num_workers=2, timeout_s=1.0, reward_fns=load_reward_fn(path)
    )
    try:
        with caplog.at_level(logging.WARNING, logger="lmrl.rewards"):
            result = manager(batch)  # "hang" sleeps 10,000 s: it returns through the timeout
        assert result.scores.tolist() == [1.0, 0, 0, 1.0, 0, 0, 0, 1.0, 0]
        assert result.metrics["reward/timeouts"] == 1.0
        assert result.metrics["reward/errors"] == 4.0  # boom, nan, str, die
        assert result.metrics["reward/worker_restarts"] == 2.0  # the hung one and the dead one
        acc = result.extras["acc"]
        assert acc[0] == 1.0 and np.isnan(acc[1])  # a failed sample has no extras
        messages = [r.getMessage() for r in caplog.records]
        assert sum("reward timeout" in m for m in messages) == 1
        assert sum("reward error" in m for m in messages) == 1
        # the pool keeps working with its replacement workers
        again = manager(make_batch(tok, ["12", "13"], ["12", "12"], eos=False))
        assert again.scores.tolist() == [1.0, 0.0]
        assert again.metrics["reward/timeouts"] == again.metrics["reward/errors"] == 0.0
    finally:
        manager.close()


def test_batch_manager_times_out_a_hanging_batched_call(tok, tmp_path):
    path = tmp_path / "misbehaving.py"
    path.write_text(MISBEHAVING)
    fns = [load_reward_fn(path), load_reward_fn(path, "hang_batched")]
    batch = make_batch(tok, ["12", "13", "12"], ["12"] * 3, eos=False)
    with make_reward_manager(
        "batch", tok, num_workers=1, timeout_s=1.0, reward_fns=fns, max_error_fraction=2.0
    ) as manager:
        result = manager(batch)
    assert result.scores.tolist() == [1.0, 0.0, 1.0]  # the per-sample function still counts
    assert result.metrics["reward/timeouts"] == 3.0  # one call, three samples without a score


def test_batch_timeout_bounds_a_batch_where_everything_hangs(tok, tmp_path, caplog):
    path = tmp_path / "misbehaving.py"
    path.write_text(MISBEHAVING)
    batch = make_batch(tok, ["hang"] * 4, ["12"] * 4, eos=False)
    fn = load_reward_fn(path)
    with make_reward_manager(
        "naive",
        tok,
        num_workers=1,
        timeout_s=30.0,
        batch_timeout_s=1.0,
        reward_fns=fn,
        max_error_fraction=2.0,
    ) as manager:
        with caplog.at_level(logging.WARNING, logger="lmrl.rewards"):
            result = manager(batch)
        assert result.metrics["reward/timeouts"] == 4.0
        # the batch's 1 s stopped them, not each call's 30 s
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "reward batch exceeded batch_timeout_s=1 s" in messages, messages
        assert "call exceeded timeout_s" not in messages
        assert result.scores.tolist() == [0.0] * 4
        # the replacement worker serves the next batch
        assert manager(make_batch(tok, ["12"], ["12"], eos=False)).scores.tolist() == [1.0]


def verl_dapo_style(data_source, solution_str, ground_truth, extra_info=None):
    """What verl's ``math_dapo.compute_score`` returns: a bool ``acc`` and a text ``pred``;
    the last sample's ``pred`` is missing, the first one's is a number."""
    if extra_info["index"] == 2:
        return {"score": -1.0, "acc": False}
    pred = 12 if extra_info["index"] == 0 else "\\frac12"
    return {"score": 1.0, "acc": solution_str == ground_truth, "pred": pred}


def test_text_extras_are_split_from_numeric_ones(tok):
    batch = make_batch(tok, ["1", "2", "3"], ["1", "1", "1"], eos=False)
    with make_reward_manager("naive", tok, num_workers=0, reward_fns=verl_dapo_style) as m:
        result = m(batch)
    numeric, text = split_extras(result.extras)
    assert sorted(numeric) == ["acc", "score"] and list(text) == ["pred"]
    np.testing.assert_array_equal(numeric["acc"], [1.0, 0.0, 0.0])
    assert numeric["acc"].dtype == np.float64
    assert list(text["pred"]) == ["12.0", "\\frac12", None]
    assert result.metrics["reward/errors"] == 0.0


def test_a_text_extra_reaches_the_generations_log_and_numbers_the_metrics(tiny_workspace, tmp_path):
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    (tmp_path / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 1.0, 'acc': True, 'pred': '\\\\frac12'}\n"
    )
    root = tiny_workspace
    cfg = load_config(
        None,
        [
            f"model.path={root / 'model'}",
            f"data.train_files={root / 'data' / 'train.parquet'}",
            "data.max_prompt_length=64",
            "data.max_response_length=4",
            "data.train_batch_size=2",
            "rollout.n=2",
            "actor.ppo_mini_batch_size=2",
            "algorithm.adv_estimator=grpo",
            "trainer.device=cpu",
            "trainer.total_training_steps=1",
            "trainer.save_freq=0",
            "trainer.logger=[]",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "reward.num_workers=0",
            f"reward.custom_reward_function.path={tmp_path / 'reward.py'}",
        ],
    )
    trainer = Trainer(build_run(cfg), cfg.trainer)
    try:
        metrics = trainer.step()
        rows = trainer.generations()
    finally:
        trainer.close()
    assert metrics["reward/acc/mean"] == 1.0 and metrics["reward/score/mean"] == 1.0
    assert not any(key.startswith("reward/pred") for key in metrics)
    assert len(rows) == 4 and all(row["pred"] == "\\frac12" for row in rows)
    assert rows[0]["score"] == 1.0 and "response" in rows[0]


def test_every_scored_batch_has_the_text_column_so_dapo_batches_concatenate():
    """DAPO's filter_groups concatenates generation batches key for key: a batch whose
    samples returned no text (``pred`` None everywhere, a numeric column) still gets
    ``reward_texts``, as ``{}`` per sample."""
    import torch

    from lmrl.batch import Batch
    from lmrl.rewards.result import RewardResult
    from lmrl.trainer.stages import score

    def reward_returning(pred):
        return lambda batch: RewardResult(
            torch.ones(2, 3), {"score": np.ones(2), "pred": np.array(pred, dtype=object)}, {}
        )

    batches = [Batch({"responses": torch.zeros(2, 3, dtype=torch.long)}) for _ in range(2)]
    score(reward_returning(["\\frac12", None]), batches[0], {})
    score(reward_returning([None, None]), batches[1], {})
    joined = Batch.concat(batches)
    assert list(joined["reward_texts"]) == [{"pred": "\\frac12"}, {}, {}, {}]
