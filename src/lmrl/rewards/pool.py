"""The reward functions' worker processes: `lmrl._procpool.ProcessPool` with reward outcomes.

Tasks are ``(function index, "sample" | "batch", arguments)``; a worker answers
``RewardFunction.call(("sample", args))`` (one `Outcome`) or ``("batch", args)`` (a list, one
per completion). A task that times out or whose worker dies gets zero-score ``"timeout"`` /
``"error"`` outcomes whose message names the function and why. The pool's behaviour (a
per-call timeout with the worker killed and replaced, timeouts in parallel through stand-in
workers, crashes reported by exit code or signal) is described in `lmrl._procpool`.
"""

from __future__ import annotations

import logging

from lmrl._procpool import ProcessPool
from lmrl.errors import RewardError
from lmrl.rewards.functions import Outcome, failed

__all__ = ["ScoringPool"]


class ScoringPool(ProcessPool):
    """Worker processes that run reward-function tasks with a per-call timeout.

    Args: as `lmrl._procpool.ProcessPool`; ``functions`` are `RewardFunction` objects and
    ``timeout_s`` bounds one call (one sample for a per-sample function, one whole call for a
    batched one).

    Raises:
        RewardError: functions that cannot be pickled (define them in a file and use
            ``load_reward_fn``, or use ``num_workers=0`` in the reward manager), or that a
            fresh worker cannot load.
    """

    what = "reward"
    load_error = RewardError
    log = logging.getLogger("lmrl.rewards")

    def unpicklable(self, err: Exception) -> str:
        return (
            f"reward functions cannot be sent to worker processes ({type(err).__name__}: "
            f"{err}); define them at the top level of a file and load them with "
            "load_reward_fn, or score in-process with num_workers=0"
        )

    def failure(self, task: tuple, status: str, message: str) -> Outcome | list[Outcome]:
        _, kind, args = task
        outcome = failed(status, message)
        return [outcome] * len(args[1]) if kind == "batch" else outcome
