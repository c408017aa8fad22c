"""Seconds that the bounded paths take: hung reward calls and tool calls, and 100 kB inputs to
the built-in scorers. The unit tests check what these paths do (which limit stopped a call,
how many calls hung at once); this script prints how long they took.

Rows:
- 8 hanging reward calls on a 2-worker `ScoringPool` with ``timeout_s=2``: in parallel (the
  stand-ins) about one timeout plus worker start-ups; one after another it would be 8 s;
- 4 hanging calls on 1 worker with ``timeout_s=30`` and ``batch_timeout_s=1``: about 1 s;
- `run_calls` with a tool that sleeps 30 s and ``timeout_s=0.5``: about 0.5 s;
- a 100 kB completion through gsm8k (strict and flexible) and countdown (50,000 nested
  parentheses, then 100 kB of letters).

Usage:
    python benchmarks/bounded_calls.py            # ~10 s on 2 cores
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

HANG = """
import time

def compute_score(solution_str):
    time.sleep(10_000)
"""
BIG = 100_000


def timed(label: str, fn) -> None:
    start = time.perf_counter()
    fn()
    print(f"{label:<58} {time.perf_counter() - start:7.3f} s")


def main() -> None:
    from lmrl.rewards import load_reward_fn
    from lmrl.rewards.pool import ScoringPool
    from lmrl.rewards.scorers import countdown, gsm8k
    from lmrl.tools import Tool, ToolCall, run_calls

    path = Path(tempfile.mkdtemp(prefix="lmrl-bounded-")) / "hang.py"
    path.write_text(HANG)
    hang = (0, "sample", ("digits", "hang", "1", {}))

    def pool_run(n: int, **kwargs) -> None:
        pool = ScoringPool([load_reward_fn(path)], **kwargs)
        try:
            pool.start()
            out = pool.run([hang] * n)
            assert [o.status for o in out] == ["timeout"] * n
        finally:
            pool.close()

    timed("8 hanging reward calls, 2 workers, timeout_s=2",
          lambda: pool_run(8, num_workers=2, timeout_s=2.0))  # fmt: skip
    timed("4 hanging reward calls, 1 worker, batch_timeout_s=1",
          lambda: pool_run(4, num_workers=1, timeout_s=30.0, batch_timeout_s=1.0))  # fmt: skip

    release = threading.Event()

    class Slow(Tool):
        name = "slow"

        def __call__(self, arguments):
            release.wait(30)  # set once timed, so that the process need not wait for it

    timed("a 30 s tool call, run_calls timeout_s=0.5",
          lambda: run_calls([ToolCall("slow", {})], {"slow": Slow()}, timeout_s=0.5))  # fmt: skip
    release.set()

    response = "1 " * (BIG // 2) + "#### 42"
    timed("gsm8k, 100 kB completion, strict", lambda: gsm8k.compute_score(response, "42"))
    timed("gsm8k, 100 kB completion, flexible",
          lambda: gsm8k.compute_score(response, "42", method="flexible"))  # fmt: skip
    cd = {"target": 16, "numbers": [5, 3, 2]}
    deep = "<answer>" + "(" * (BIG // 2) + "5" + ")" * (BIG // 2) + "</answer>"
    timed("countdown, 100 kB of nested parentheses", lambda: countdown.compute_score(deep, cd))
    timed("countdown, 100 kB without an answer", lambda: countdown.compute_score("x" * BIG, cd))


if __name__ == "__main__":
    main()
