"""What SFT learned: the task's score on greedy answers to the validation prompts, the answers'
prior (the commonest training answer) and the end-of-run line that compares them. Tiny model,
built-in digits rows."""

from __future__ import annotations

import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmrl.config.sft import load_sft_config
from lmrl.data.tasks import write_task
from lmrl.models import build_tiny_model
from lmrl.rewards.scorers import default_compute_score
from lmrl.trainer import sft_score
from lmrl.trainer.sft import SFTTrainer, build_sft


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), size="tiny", seed=0)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_task("digits", tmp_path_factory.mktemp("digits"), num_train=48, num_test=12)


def trainer_for(model_dir, train, val, run_dir, *extra) -> SFTTrainer:
    cfg = load_sft_config(
        None,
        [
            f"model.path={model_dir}",
            f"data.train_files={train}",
            f"data.val_files={val}",
            "data.response_from_ground_truth=true",
            "data.train_batch_size=8",
            "optim.lr=3e-3",
            "trainer.total_training_steps=2",
            f"trainer.default_local_dir={run_dir}",
            "model.enable_gradient_checkpointing=false",
            "trainer.device=cpu",
            "trainer.logger=[]",
            *extra,
        ],
    )
    return SFTTrainer(build_sft(cfg))


def same_answer(path, out, answer):
    rows = pq.read_table(path).to_pylist()
    for row in rows:
        row["reward_model"]["ground_truth"] = answer
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


def test_score_and_prior_are_logged_and_an_equal_score_does_not_beat_the_prior(
    tmp_path, model_dir, digits, caplog
):
    """Every answer the same: the prior answers all of them right (1.0), the model cannot beat
    it, and the run's end says so in a warning naming what the model answers."""
    train = same_answer(digits["train"], tmp_path / "train.parquet", "12345")
    val = same_answer(digits["test"], tmp_path / "val.parquet", "12345")
    trainer = trainer_for(model_dir, train, val, tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="lmrl.sft"):
        history = trainer.fit()
    last = history[-1]
    assert last["val/digits/prior_acc"] == 1.0
    assert 0.0 <= last["val/digits/acc"] <= 1.0 and "val/sft_loss" in last
    assert "val/digits/acc" not in history[0]  # scored at validation steps only
    warned = [r for r in caplog.records if "does not beat the answers' prior" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "'12345'" in warned[0].getMessage() and "the model " in warned[0].getMessage()
    assert "train longer or check the data" in warned[0].getMessage()


def test_prior_is_the_commonest_training_answer_scored_by_the_task(tmp_path, model_dir, digits):
    rows = pq.read_table(digits["train"]).to_pylist()
    for row in rows[:5]:
        row["reward_model"]["ground_truth"] = "999"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    trainer = trainer_for(model_dir, tmp_path / "train.parquet", digits["test"], tmp_path / "r")
    assert trainer.score is not None and trainer.score.prior == "999"
    val = pq.read_table(digits["test"]).to_pylist()
    val[0]["reward_model"]["ground_truth"] = "999"  # one validation row the prior answers
    pq.write_table(pa.Table.from_pylist(val), tmp_path / "val.parquet")
    trainer = trainer_for(model_dir, tmp_path / "train.parquet", tmp_path / "val.parquet",
                          tmp_path / "r2")  # fmt: skip
    metrics = trainer.validate()
    expected = sum(
        default_compute_score("digits", "999", r["reward_model"]["ground_truth"])["acc"]
        for r in val
    ) / len(val)
    assert metrics["val/digits/prior_acc"] == pytest.approx(expected) == pytest.approx(1 / 12)
    assert trainer.score.max_new_tokens == max(sum(m) for _, m in trainer.train_data.examples)


def test_a_model_that_answers_right_beats_the_prior(tmp_path, model_dir, digits, monkeypatch,
                                                    caplog):  # fmt: skip
    """Generation stubbed to answer every prompt right: score 1.0 beats the prior by its gap."""
    trainer = trainer_for(model_dir, digits["train"], digits["test"], tmp_path / "run")
    score = trainer.score
    assert score is not None and score.active

    def right(model, engine, tokenizer, prompts, max_new_tokens):
        return [f"{t}<|im_end|>" for t in prompts["ground_truth"]], prompts

    monkeypatch.setattr(sft_score, "greedy_texts", right)
    metrics = trainer.validate()
    assert metrics["val/digits/acc"] == 1.0 and metrics["val/digits/prior_acc"] < 1.0
    with caplog.at_level(logging.INFO, logger="lmrl.sft"):
        trainer.export()
    lines = [r.getMessage() for r in caplog.records if "beats the answers' prior" in r.getMessage()]
    gap = 1.0 - metrics["val/digits/prior_acc"]
    assert lines == [
        f"SFT validation score 1.000 beats the answers' prior "
        f"{metrics['val/digits/prior_acc']:.3f} by {gap:.3f} (greedy answers to 12 validation "
        "prompts)"
    ]


def test_rows_without_a_scorer_skip_the_score_and_say_why(tmp_path, model_dir, digits, caplog):
    rows = pq.read_table(digits["test"]).to_pylist()
    for row in rows:
        row["data_source"] = "my_task"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "val.parquet")
    with caplog.at_level(logging.INFO, logger="lmrl.sft"):
        trainer = trainer_for(model_dir, digits["train"], tmp_path / "val.parquet", tmp_path / "r")
    said = [r.getMessage() for r in caplog.records if "no validation score" in r.getMessage()]
    assert said == ["sft: no validation score on greedy answers: no built-in scorer for "
                    "data_source my_task"]  # fmt: skip
    assert set(trainer.validate()) == {"val/sft_loss"}


def test_prompt_response_rows_skip_the_score_naming_the_missing_column(tmp_path, model_dir,
                                                                        caplog):  # fmt: skip
    rows = [{"prompt": f"reverse {i}", "response": str(i)[::-1]} for i in range(10, 26)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pr.parquet")
    with caplog.at_level(logging.INFO, logger="lmrl.sft"):
        trainer = trainer_for(model_dir, tmp_path / "pr.parquet", tmp_path / "pr.parquet",
                              tmp_path / "r", "data.response_from_ground_truth=false")  # fmt: skip
    said = [r.getMessage() for r in caplog.records if "no validation score" in r.getMessage()]
    assert len(said) == 1 and "not RL rows" in said[0] and "'data_source': missing" in said[0]
    assert set(trainer.validate()) == {"val/sft_loss"}


def test_a_model_that_always_gives_the_commonest_answer_does_not_beat_the_prior(
    tmp_path, model_dir, digits, monkeypatch
):
    """The collapse a falling loss hides: every greedy answer is the commonest training
    answer, so the score equals the prior's and the end line says what the model answers."""
    rows = pq.read_table(digits["train"]).to_pylist()
    for row in rows[:6]:
        row["reward_model"]["ground_truth"] = "999"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    val = pq.read_table(digits["test"]).to_pylist()
    for row in val[:3]:
        row["reward_model"]["ground_truth"] = "999"
    pq.write_table(pa.Table.from_pylist(val), tmp_path / "val.parquet")
    trainer = trainer_for(model_dir, tmp_path / "train.parquet", tmp_path / "val.parquet",
                          tmp_path / "run")  # fmt: skip

    def commonest(model, engine, tokenizer, prompts, max_new_tokens):
        return ["999<|im_end|>"] * len(prompts["ground_truth"]), prompts

    monkeypatch.setattr(sft_score, "greedy_texts", commonest)
    metrics = trainer.validate()
    assert metrics["val/digits/acc"] == metrics["val/digits/prior_acc"] == 0.25
    level, line = trainer.score.verdict()
    assert level == logging.WARNING
    assert line == (
        "SFT validation score 0.250 does not beat the answers' prior 0.250 (always answering "
        "'999', the commonest training answer): the model answers '999' to 12 of 12 validation "
        "prompts; train longer or check the data"
    )


def test_val_split_holds_rows_out_of_training_and_scores_them(tmp_path, model_dir, digits):
    """``data.val_split`` with no ``data.val_files``: the held-out rows are validated (loss and
    greedy score) and never trained on; the prior comes from the trained rows only; the same
    seed holds out the same rows."""
    rows = pq.read_table(digits["train"]).to_pylist()
    for row in rows:
        row["reward_model"]["ground_truth"] = "111"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    cfg = [f"model.path={model_dir}", f"data.train_files={tmp_path / 'train.parquet'}",
           "data.response_from_ground_truth=true", "data.train_batch_size=8",
           "data.val_split=12", "trainer.device=cpu", "trainer.logger=[]"]  # fmt: skip
    parts = build_sft(load_sft_config(None, [*cfg, f"trainer.default_local_dir={tmp_path / 'a'}"]))
    assert parts.held_out is not None and len(parts.held_out) == 12
    assert len(parts.train_data) == 36 and parts.val_data is not None
    assert len(parts.val_data) == 12
    trained = {tuple(ids) for ids, _ in parts.train_data.examples}
    assert not trained & {tuple(ids) for ids, _ in parts.val_data.examples}
    again = build_sft(load_sft_config(None, [*cfg, f"trainer.default_local_dir={tmp_path / 'b'}"]))
    assert again.held_out == parts.held_out
    trainer = SFTTrainer(parts)
    assert trainer.score is not None and trainer.score.active and len(trainer.score.rows) == 12
    assert trainer.score.prior == "111"
    metrics = trainer.validate()
    assert {"val/sft_loss", "val/digits/acc", "val/digits/prior_acc"} <= set(metrics)
    assert metrics["val/digits/prior_acc"] == 1.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["data.val_split=0.2", "data.val_files=v.parquet"], "set one of them"),
        (["data.val_split=1.5"], "must be a share in [0, 1) or a whole number of rows"),
        (["data.val_split=-1"], "data.val_split=-1"),
    ],
)
def test_bad_val_split_is_one_config_error(model_dir, digits, extra, message):
    from lmrl.config.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_sft_config(None, [f"model.path={model_dir}", f"data.train_files={digits['train']}",
                               *extra])  # fmt: skip


def test_val_split_that_holds_out_no_row_names_the_counts(tmp_path, model_dir, digits):
    from lmrl.errors import DataError

    cfg = load_sft_config(None, [f"model.path={model_dir}", f"data.train_files={digits['train']}",
                                 "data.response_from_ground_truth=true", "data.val_split=0.001",
                                 f"trainer.default_local_dir={tmp_path}", "trainer.device=cpu",
                                 "trainer.logger=[]"])  # fmt: skip
    with pytest.raises(DataError, match=r"data.val_split=0.001 holds out 0 of the 48 training"):
        build_sft(cfg)


SCORE_FN = """
calls = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = solution_str.replace("<|im_end|>", "").strip()
    if data_source == "broken":
        raise RuntimeError("no scorer for this row")
    return {"score": 0.5, "acc": float(answer == ground_truth)}
"""


def test_custom_reward_function_scores_rows_without_a_built_in_scorer(tmp_path, model_dir,
                                                                      digits, caplog):  # fmt: skip
    """``reward.custom_reward_function`` (the same keys as ``lmrl train``) scores greedy answers
    of rows no built-in scorer knows; its ``acc`` is the score; a function that raises scores
    0, said once."""
    (tmp_path / "score.py").write_text(SCORE_FN)
    rows = pq.read_table(digits["test"]).to_pylist()
    for row in rows:
        row["data_source"] = "my_task"
    train = same_answer(digits["train"], tmp_path / "train.parquet", "777")
    rows[0]["reward_model"]["ground_truth"] = "777"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "val.parquet")
    fn = f"reward.custom_reward_function.path={tmp_path / 'score.py'}"
    trainer = trainer_for(model_dir, train, tmp_path / "val.parquet", tmp_path / "r", fn)
    assert trainer.score is not None and trainer.score.active
    metrics = trainer.validate()
    assert metrics["val/my_task/prior_acc"] == pytest.approx(1 / 12)  # acc, not the 0.5 score
    assert 0.0 <= metrics["val/my_task/acc"] <= 1.0
    for row in rows:
        row["data_source"] = "broken"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    trainer = trainer_for(model_dir, train, tmp_path / "bad.parquet", tmp_path / "r2", fn)
    with caplog.at_level(logging.WARNING, logger="lmrl.sft"):
        metrics = trainer.validate()
    assert metrics["val/broken/acc"] == 0.0 == metrics["val/broken/prior_acc"]
    said = [r.getMessage() for r in caplog.records if "score function failed" in r.getMessage()]
    assert len(said) == 1 and "no scorer for this row" in said[0]
