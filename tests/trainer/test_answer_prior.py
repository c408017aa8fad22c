"""`lmrl train`'s validation beside the answers' prior: ``val/<source>/prior_acc`` and the
spread of the answers (``val/<source>/answers/*``), and a warm start trained too briefly named
as the cause from the first validation, through ``lmrl sft`` then ``lmrl train``."""

from __future__ import annotations

import logging

import pytest
import torch

from lmrl.config import load_config
from lmrl.rewards.scorers import default_compute_score
from lmrl.trainer import Trainer, build_run
from lmrl.trainer.answers import AnswerPrior


class CharTokenizer:
    """Decodes ids as characters (0 is a special token)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids if not (skip_special_tokens and int(i) == 0))


def _output(texts: list[str], truths: list[str], source: str = "count") -> dict:
    width = max(len(t) for t in texts) + 1
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    for row, text in enumerate(texts):
        ids[row, : len(text)] = torch.tensor([ord(c) for c in text])
    return {"responses": ids, "response_mask": ids != 0, "data_source": [source] * len(texts),
            "ground_truth": truths}  # fmt: skip


def test_the_prior_is_each_sources_commonest_training_truth_scored_by_its_scorer():
    train = [{"data_source": "count", "ground_truth": t} for t in "1121301"]
    train += [{"data_source": "digits", "ground_truth": g} for g in ("123", "123", "45")]
    train += [{"data_source": "my_task", "ground_truth": "x"}]  # no built-in scorer
    val = [{"data_source": "count", "ground_truth": t, "extra_info": {}} for t in "1234"]
    val += [{"data_source": "digits", "ground_truth": "123", "extra_info": {}}]
    prior = AnswerPrior(train, val)
    assert prior.answers == {"count": "1", "digits": "123"}
    expected = sum(default_compute_score("count", "1", t)["acc"] for t in "1234") / 4
    assert prior.metrics == {"val/count/prior_acc": expected, "val/digits/prior_acc": 1.0}
    assert expected == 0.25


def test_the_spread_counts_distinct_answers_against_distinct_truths():
    prior = AnswerPrior([{"data_source": "count", "ground_truth": "1"}], [])
    truths = ["0", "1", "2", "3", "4", "0", "1", "2"]
    metrics = prior.spread([_output(["1"] * 6 + [" 2 ", "3"], truths)], CharTokenizer())
    assert metrics == {
        "val/count/answers/distinct": 3.0,
        "val/count/answers/truths": 5.0,
        "val/count/answers/top_share": 0.75,
        "val/count/answers/truth_top_share": 0.25,
    }
    assert prior.texts == {"count": ("1", "1")}


@pytest.fixture(scope="module")
def count_task(tmp_path_factory):
    from lmrl.data.tasks import write_task

    return write_task("count", tmp_path_factory.mktemp("count"), seed=0, num_train=64, num_test=16)


def _train_args(model, data, run_dir, *extra: str) -> list[str]:
    return [
        f"model.path={model}", f"data.train_files={data['train']}",
        f"data.val_files={data['test']}", "data.max_prompt_length=64",
        "data.max_response_length=4", "data.train_batch_size=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=4", "algorithm.adv_estimator=grpo",
        "model.enable_gradient_checkpointing=false", "trainer.device=cpu",
        "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.logger=[]",
        "reward.num_workers=0", f"trainer.default_local_dir={run_dir}", *extra,
    ]  # fmt: skip


def test_the_trainers_validation_logs_the_prior_and_the_answers(tiny_workspace, tmp_path):
    data = {"train": tiny_workspace / "data" / "train.parquet",
            "test": tiny_workspace / "data" / "test.parquet"}  # fmt: skip
    cfg = load_config(None, _train_args(tiny_workspace / "model", data, tmp_path / "run"))
    trainer = Trainer(build_run(cfg), cfg.trainer)
    try:
        metrics = trainer.validate()
    finally:
        trainer.close()
    assert {"val/digits/prior_acc", "val/digits/answers/distinct", "val/digits/answers/truths",
            "val/digits/answers/top_share", "val/digits/answers/truth_top_share"} <= set(metrics)  # fmt: skip
    assert metrics["val/digits/answers/truths"] == 4.0  # the 4 validation rows' answers differ
    assert set(trainer.health.answer_texts) == {"digits"}


def test_a_custom_reward_function_logs_no_prior(tiny_workspace, tmp_path):
    fn = tmp_path / "reward.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                  "    return 0.5\n")  # fmt: skip
    data = {"train": tiny_workspace / "data" / "train.parquet",
            "test": tiny_workspace / "data" / "test.parquet"}  # fmt: skip
    cfg = load_config(None, _train_args(tiny_workspace / "model", data, tmp_path / "run",
                                        f"reward.custom_reward_function.path={fn}"))  # fmt: skip
    trainer = Trainer(build_run(cfg), cfg.trainer)
    try:
        assert trainer.answers is None
        assert not any("prior" in k or "/answers/" in k for k in trainer.validate())
    finally:
        trainer.close()


def test_a_warm_start_trained_too_briefly_is_named_by_sft_and_by_the_first_validation(
    tiny_workspace, count_task, tmp_path, caplog
):
    """``lmrl sft`` for 40 steps on the learning suite's count task learns the commonest
    answer ('1') and nothing else, and says it does not beat the answers' prior; ``lmrl train``
    from it names that cause before its first step, and no warning advises a sweep."""
    from lmrl.cli import main

    sft = [
        f"model.path={tiny_workspace / 'model'}", f"data.train_files={count_task['train']}",
        f"data.val_files={count_task['test']}", "data.response_from_ground_truth=true",
        "data.train_batch_size=16", "optim.lr=3e-3", "trainer.total_training_steps=40",
        "trainer.save_freq=-1", "trainer.logger=[]", "model.enable_gradient_checkpointing=false",
        "trainer.device=cpu", f"trainer.default_local_dir={tmp_path / 'sft'}",
    ]  # fmt: skip
    with caplog.at_level(logging.INFO):
        assert main(["sft", *sft]) == 0
    said = [r.getMessage() for r in caplog.records if "answers' prior" in r.getMessage()]
    assert len(said) == 1 and "does not beat the answers' prior" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmrl.trainer"):
        code = main(["train", *_train_args(tmp_path / "sft" / "final", count_task, tmp_path / "rl",
                                           "trainer.test_freq=1")])  # fmt: skip
    assert code == 0
    warned = [r.getMessage() for r in caplog.records if r.name == "lmrl.trainer"]
    named = [m for m in warned if "before the first step" in m]
    assert len(named) == 1, warned
    assert (
        "validation on count 0.125 equals the answers' prior 0.125 (always answering '1'"
        in named[0]
    )
    assert "collapse onto 1 distinct string ('1' is 100% of them)" in named[0]
    assert "a sweep will not help" in named[0] and "longer or better SFT" in named[0]
    assert not any("lmrl sweep" in m for m in warned)
