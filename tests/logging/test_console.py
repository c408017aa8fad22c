"""The console step line shows reward failures whenever there are any, and nothing when not."""

from __future__ import annotations

import io

from lmrl.logging.console import ConsoleTracker, reward_failures, summarize

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
