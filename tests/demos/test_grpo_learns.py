"""Learning, not just running: GRPO on the ``digits`` task raises the mean reward.

The demo's recipe (a ~2M-parameter Qwen2, a short SFT warm start that leaves the model mostly
wrong, then GRPO with 16 prompts x 8 samples), capped at 40 GRPO steps with no early stop,
from a warm start stopped at 0.3 rather than the demo's 0.4: a weaker start leaves a wider
rise in 40 steps (from the 0.4 start, seed 0's mean score rises by only ~0.1).
Measured on seed 0: the batch's mean score goes from ~0.55 over the first steps to ~0.73
around step 40, greedy validation accuracy from ~0.3 to ~0.5. About a minute on 2 cores.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from lmrl.demos.digits import run_demo

pytestmark = pytest.mark.slow

SCORE = "critic/score/mean"


def test_grpo_raises_the_mean_reward_on_digits(tmp_path):
    summary = run_demo(
        tmp_path / "demo",
        seed=0,
        sft_target_acc=0.3,
        rl_steps=40,
        target_acc=2.0,
        test_freq=20,
        console=False,
    )
    lines = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    scores = [line[SCORE] for line in lines if SCORE in line]
    assert len(scores) == 40
    first, last = statistics.fmean(scores[:8]), statistics.fmean(scores[-8:])
    assert last > first + 0.08, (first, last)
    # and the policy itself got better, measured greedily on held-out prompts
    assert summary["acc_after_rl"] > summary["acc_before_rl"] + 0.05, summary
