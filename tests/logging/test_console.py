"""The console step line shows reward failures whenever there are any, and nothing when not;
a multi-turn step shows its tool errors and timeouts."""

from __future__ import annotations

import io

from lmrl.logging.console import ConsoleTracker, reward_failures, summarize, tool_failures

CLEAN = {
    "critic/score/mean": 0.5,
    "reward/acc/mean": 0.25,
    "reward/scored": 16.0,
    "reward/errors": 0.0,
    "reward/timeouts": 0.0,
    "reward/no_score": 0.0,
    "reward/worker_restarts": 0.0,
}


def test_no_failures_add_nothing():
    assert reward_failures(CLEAN) == ""
    assert summarize(CLEAN) == "score 0.5  acc 0.25"


def test_failures_follow_the_score():
    failing = CLEAN | {"critic/score/mean": 0.0, "reward/errors": 16.0}
    assert summarize(failing) == "score 0  reward errors 16/16, timeouts 0  acc 0.25"
    timeouts = CLEAN | {"reward/errors": 1.0, "reward/timeouts": 3.0}
    assert "reward errors 1/16, timeouts 3" in summarize(timeouts)
    # without a score or a denominator the counts still show
    assert summarize({"reward/timeouts": 2.0}) == "reward errors 0, timeouts 2"


def test_the_step_line_carries_them():
    buf = io.StringIO()
    tracker = ConsoleTracker(total_steps=2, file=buf, force_terminal=False)
    tracker.log(CLEAN | {"reward/errors": 16.0}, step=1)
    tracker.log(CLEAN, step=2)
    tracker.close()
    first, second = buf.getvalue().splitlines()
    assert first.startswith("step 1/2  score 0.5  reward errors 16/16, timeouts 0  acc 0.25")
    assert "reward" not in second.replace("reward/", "")


AGENT = {"agent/tool_calls/sum": 16.0, "agent/tool_errors/sum": 3.0, "agent/tool_timeouts/sum": 2.0}


def test_a_multi_turn_step_line_shows_its_tool_failures():
    assert tool_failures(CLEAN) == ""  # no multi-turn, no tool counts
    assert tool_failures(AGENT) == "tool errors 3/16, timeouts 2"
    healthy = AGENT | {"agent/tool_errors/sum": 0.0, "agent/tool_timeouts/sum": 0.0}
    assert summarize(CLEAN | healthy) == "score 0.5  tool errors 0/16, timeouts 0  acc 0.25"
    both = CLEAN | AGENT | {"reward/errors": 1.0}
    assert summarize(both) == (
        "score 0.5  reward errors 1/16, timeouts 0  tool errors 3/16, timeouts 2  acc 0.25"
    )
    buf = io.StringIO()
    tracker = ConsoleTracker(total_steps=1, file=buf, force_terminal=False)
    tracker.log(CLEAN | AGENT, step=1)
    tracker.close()
    assert buf.getvalue().startswith("step 1/1  score 0.5  tool errors 3/16, timeouts 2  acc")


TWO_SOURCES = {
    "critic/score/mean": 0.265,
    "train/digits/score/mean": 0.41,
    "train/digits/acc": 0.25,
    "train/sort/score/mean": 0.12,
    "reward/acc/mean": 0.2,
}


def test_each_source_score_follows_the_batch_score():
    assert summarize(TWO_SOURCES) == "score 0.265 (digits 0.41 sort 0.12)  acc 0.2"
    failing = TWO_SOURCES | CLEAN | {"critic/score/mean": 0.265, "reward/errors": 2.0}
    assert summarize(failing) == (
        "score 0.265 (digits 0.41 sort 0.12)  reward errors 2/16, timeouts 0  acc 0.25"
    )
    # a source whose name has a slash (verl's openai/gsm8k) keeps it
    slash = {"critic/score/mean": 0.5, "train/openai/gsm8k/score/mean": 0.5,
             "train/digits/score/mean": 0.5}  # fmt: skip
    assert summarize(slash) == "score 0.5 (openai/gsm8k 0.5 digits 0.5)"


def test_one_or_many_sources_add_nothing_to_the_line():
    assert summarize(CLEAN) == "score 0.5  acc 0.25"  # one source: no train/<source>/ keys
    many = {"critic/score/mean": 0.5} | {f"train/task{i}/score/mean": 0.5 for i in range(5)}
    assert summarize(many) == "score 0.5"
    buf = io.StringIO()
    tracker = ConsoleTracker(total_steps=1, file=buf, force_terminal=False)
    tracker.log(TWO_SOURCES, step=1)
    tracker.close()
    assert buf.getvalue().startswith("step 1/1  score 0.265 (digits 0.41 sort 0.12)  acc 0.2")


def test_sft_validation_shows_the_score_beside_the_prior():
    metrics = {"sft/loss": 0.55, "val/sft_loss": 0.61, "val/digits/acc": 0.3,
               "val/digits/prior_acc": 0.31}  # fmt: skip
    assert summarize(metrics) == "loss 0.55  val_loss 0.61  val/digits acc 0.3 prior 0.31"
