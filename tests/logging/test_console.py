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
