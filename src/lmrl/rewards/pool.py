"""A persistent pool of reward worker processes with a per-call timeout.

Why not ``multiprocessing.Pool`` or ``ProcessPoolExecutor``: neither can kill one hung task
and carry on. Here each worker owns a pipe; the parent hands it a chunk of tasks, the worker
sends back one result per task as soon as it has it, and the parent restarts a task's clock at
every result. A worker whose current task runs past ``timeout_s`` is killed; that task gets a
``"timeout"`` outcome, the rest of its chunk goes back to the queue, and a fresh worker
replaces it. A worker that dies (a segfault, ``os._exit``) costs its current task an
``"error"`` the same way. Tasks are only sent to workers that said they are ready, so a send
never blocks on a process that is still starting.

Choices: workers are fresh interpreters, ``python -m lmrl.rewards._worker``, talking over a
socket pair. Not ``fork`` (the parent holds torch threads, maybe CUDA), and not
``multiprocessing``'s ``spawn``, which re-imports the parent's ``__main__`` (failing from a
notebook or stdin, and re-running a script without a ``__main__`` guard). Workers import only
``lmrl.rewards.functions``/``scorers`` (no torch), so a replacement starts in a fraction of a
second on an idle machine. Tasks are sent in chunks (about four per
worker per call) to keep the per-batch overhead small for cheap scorers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from lmrl.rewards.functions import Outcome, RewardFunction, failed

log = logging.getLogger("lmrl.rewards")

# the worker must find lmrl even when the parent found it through a sys.path edit; the rest
# of the parent's sys.path reaches it through the handshake.
_LMRL_ROOT = str(Path(__file__).resolve().parents[2])
_PYTHONPATH = os.pathsep.join(p for p in (_LMRL_ROOT, os.environ.get("PYTHONPATH", "")) if p)

Task = tuple[int, str, tuple]  # (function index, "sample" | "batch", arguments)


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    started: float
    ready: bool = False
    chunk: deque = field(default_factory=deque)  # task ids sent and not yet answered
    clock: float = 0.0  # when the current task started (the last result or the send)


class ScoringPool:
    """Worker processes that run reward-function tasks with a per-call timeout.

    Args:
        functions: the reward functions the tasks refer to by index; pickled once per worker.
        num_workers: number of processes (>= 1).
        timeout_s: seconds one call may run (one sample for a per-sample function, one whole
            call for a batched one); None = no limit.
        batch_timeout_s: seconds one `run` may take in all; when it is up, every unfinished
            task times out (busy workers are replaced). None = no limit, so a function that
            hangs on every sample costs ``len(tasks) * timeout_s / num_workers``.
        startup_timeout_s: seconds a new worker may take to become ready.

    Raises:
        ValueError: ``num_workers < 1``, a non-positive timeout, or functions that cannot be
            pickled (define them in a file and use ``load_reward_fn``, or use
            ``num_workers=0`` in the reward manager).
    """

    def __init__(
        self,
        functions: Sequence[RewardFunction],
        num_workers: int,
        timeout_s: float | None,
        batch_timeout_s: float | None = None,
        startup_timeout_s: float = 120.0,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 for a pool, got {num_workers}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s}")
        if batch_timeout_s is not None and batch_timeout_s <= 0:
            raise ValueError(f"batch_timeout_s must be positive or None, got {batch_timeout_s}")
        try:
            self._payload = pickle.dumps(list(functions))
        except Exception as err:
            raise ValueError(
                f"reward functions cannot be sent to worker processes ({type(err).__name__}: "
                f"{err}); define them at the top level of a file and load them with "
                "load_reward_fn, or score in-process with num_workers=0"
            ) from err
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._workers: list[_Worker] = []
        self.restarts = 0  # workers replaced after a timeout or a crash, over the pool's life
        self._startup_failures = 0

    # ------------------------------------------------------------------ processes
    def _spawn(self) -> _Worker:
        mine, theirs = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-m", "lmrl.rewards._worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": _PYTHONPATH},
        )
        theirs.close()
        conn = Connection(mine.detach())
        conn.send((sys.path, self._payload))
        return _Worker(process, conn, time.monotonic())

    def _kill(self, worker: _Worker) -> None:
        if worker.process.poll() is None:
            worker.process.kill()
        try:
            worker.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.warning("reward worker %d did not exit after SIGKILL", worker.process.pid)
        worker.conn.close()

    def _replace(self, worker: _Worker) -> None:
        self._kill(worker)
        self._workers[self._workers.index(worker)] = self._spawn()
        self.restarts += 1

    def start(self) -> None:
        """Start the workers (done by the first `run` otherwise)."""
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())

    def close(self) -> None:
        """Stop every worker (politely, then by force)."""
        for worker in self._workers:
            with contextlib.suppress(OSError, ValueError):
                worker.conn.send(None)
        deadline = time.monotonic() + 2.0
        for worker in self._workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            self._kill(worker)
        self._workers = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ running tasks
    def run(self, tasks: Sequence[Task]) -> list[Outcome | list[Outcome]]:
        """Run ``tasks`` and return their outcomes in order.

        A ``"sample"`` task gives one `Outcome`, a ``"batch"`` task a list (one per completion).
        A task that times out or whose worker dies gets ``"timeout"``/``"error"`` outcomes;
        nothing here raises for a reward function's misbehaviour.

        Raises:
            RuntimeError: workers repeatedly fail to start (a broken environment, not a
                reward function).
        """
        if not tasks:
            return []
        self.start()
        results: list[Any] = [None] * len(tasks)
        size = max(1, -(-len(tasks) // (4 * self.num_workers)))
        queue = deque(list(range(i, min(i + size, len(tasks)))) for i in range(0, len(tasks), size))
        remaining = len(tasks)
        give_up = time.monotonic() + self.batch_timeout_s if self.batch_timeout_s else None

        def settle(task_id: int, status: str, message: str) -> None:
            nonlocal remaining
            kind, args = tasks[task_id][1], tasks[task_id][2]
            outcome = failed(status, message)
            results[task_id] = [outcome] * len(args[1]) if kind == "batch" else outcome
            remaining -= 1

        def requeue(worker: _Worker) -> None:
            if worker.chunk:
                queue.appendleft(list(worker.chunk))
            worker.chunk = deque()

        while remaining:
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.ready and not worker.chunk and queue:
                    chunk = queue.popleft()
                    try:
                        worker.conn.send([(tid, tasks[tid]) for tid in chunk])
                    except (OSError, ValueError):
                        queue.appendleft(chunk)
                        self._replace(worker)
                        continue
                    worker.chunk, worker.clock = deque(chunk), now
            deadlines = [
                w.clock + self.timeout_s for w in self._workers if w.chunk and self.timeout_s
            ]
            deadlines += [w.started + self.startup_timeout_s for w in self._workers if not w.ready]
            deadlines += [give_up] if give_up is not None else []
            wait_s = max(0.0, min(deadlines) - now) if deadlines else None
            wait([w.conn for w in self._workers], timeout=wait_s)
            for worker in list(self._workers):
                dead = False
                try:
                    while worker.conn.poll():
                        message = worker.conn.recv()
                        if message[0] == "ready":
                            worker.ready = True
                            self._startup_failures = 0
                        elif message[0] == "init_error":
                            self.close()
                            raise RuntimeError(
                                f"reward worker could not load the functions: {message[1]}"
                            )
                        else:
                            task_id, outcome = message
                            results[task_id] = outcome
                            remaining -= 1
                            worker.chunk.popleft()
                            worker.clock = time.monotonic()
                except (EOFError, OSError):
                    dead = True
                if dead or worker.process.poll() is not None:
                    code = worker.process.poll()
                    if worker.chunk:
                        settle(
                            worker.chunk.popleft(),
                            "error",
                            f"reward worker died (exit code {code})",
                        )
                    if not worker.ready:
                        self._startup_failed(f"exit code {code}")
                    requeue(worker)
                    self._replace(worker)
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.chunk and self.timeout_s and now - worker.clock > self.timeout_s:
                    settle(
                        worker.chunk.popleft(),
                        "timeout",
                        f"reward call exceeded {self.timeout_s:g} s",
                    )
                    requeue(worker)
                    self._replace(worker)
                elif not worker.ready and now - worker.started > self.startup_timeout_s:
                    self._startup_failed(f"not ready after {self.startup_timeout_s:g} s")
                    self._replace(worker)
            if give_up is not None and remaining and now > give_up:
                why = f"reward batch exceeded batch_timeout_s={self.batch_timeout_s:g} s"
                for worker in list(self._workers):
                    if worker.chunk:
                        queue.appendleft(list(worker.chunk))
                        worker.chunk = deque()
                        self._replace(worker)
                for chunk in queue:
                    for task_id in chunk:
                        settle(task_id, "timeout", why)
                queue.clear()
        return results

    def _startup_failed(self, why: str) -> None:
        self._startup_failures += 1
        log.warning("a reward worker failed to start (%s)", why)
        if self._startup_failures > 3 * self.num_workers:
            self.close()
            raise RuntimeError(f"reward workers keep failing to start ({why})")
