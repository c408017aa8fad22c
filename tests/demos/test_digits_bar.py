"""``lmrl demo`` (digits) meets its bar on seed 2, the seed that missed it with a weaker warm
start (the learning suite: ``-m learning``, not in the default run; ~2 minutes on 2 cores).

The bar (``docs/demo.md``): greedy exact match at most 0.5 after the SFT warm start, at least
0.95 after GRPO within the demo's 250-step cap. With the warm start stopped at 0.3 instead of
``run_demo``'s 0.4, seed 2 stayed at ~0.7 to the cap (the last digit of most 6-digit answers
wrong in every sample).
"""

from __future__ import annotations

import pytest

from lmrl.demos.digits import run_demo

pytestmark = [pytest.mark.learning, pytest.mark.timeout(1800)]


def test_seed_2_meets_the_bar(tmp_path):
    summary = run_demo(tmp_path / "demo", seed=2, console=False)
    print(summary)
    assert summary["acc_after_sft"] <= 0.5, summary
    assert summary["acc_after_rl"] >= 0.95, summary
