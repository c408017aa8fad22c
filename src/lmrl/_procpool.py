"""A persistent pool of worker processes with a per-call timeout: the reward functions' and
the user tools' (a leaf: it imports nothing of lmrl).

Why not ``multiprocessing.Pool`` or ``ProcessPoolExecutor``: neither can kill one hung task
and carry on. Here each worker owns a pipe; the parent hands it a chunk of tasks, the worker
sends back one result per task as soon as it has it, and the parent restarts a task's clock at
every result. A worker whose current task runs past ``timeout_s`` is killed; that task gets a
``"timeout"`` outcome, the rest of its chunk goes back to the queue, and a fresh worker
replaces it. A worker that dies (a segfault, ``os._exit``) costs its current task an
``"error"`` the same way, whose message gives the exit code or the signal. Tasks are only
sent to workers that said they are ready, so a send never blocks on a process that is still
starting.

Timeouts run in parallel, not one after another: a call running past a quarter of its
timeout makes its worker look hung, and every task waiting behind it (its own unstarted ones
included) gets a stand-in worker at once (a bounded number beyond ``num_workers``, stopped
after the run), so N hanging calls cost about one timeout of wall time plus worker start-up,
not ``N / num_workers`` timeouts.

Choices: workers are fresh interpreters, ``python -m lmrl._procworker``, talking over a
socket pair. Not ``fork`` (the parent holds torch threads, maybe CUDA), and not
``multiprocessing``'s ``spawn``, which re-imports the parent's ``__main__`` (failing from a
notebook or stdin, and re-running a script without a ``__main__`` guard). Workers import only
what unpickling the functions imports (no torch for the reward scorers), so a replacement
starts in a fraction of a second on an idle machine. Tasks are sent in chunks (about four per
worker per call) to keep the per-batch overhead small for cheap calls. A worker asks Linux to
kill it when the *thread* that started it ends (``PR_SET_PDEATHSIG``), so call `run` from a
thread that lives as long as the pool (the main thread), not from a short-lived one.

A task is a tuple ``(function index, *arguments)``; the worker answers
``functions[index].call(arguments)``. What a failed task gets instead is the subclass's
(`ProcessPool.failure`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
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

# the worker must find lmrl even when the parent found it through a sys.path edit; the rest
# of the parent's sys.path reaches it through the handshake.
_LMRL_ROOT = str(Path(__file__).resolve().parents[1])
_PYTHONPATH = os.pathsep.join(p for p in (_LMRL_ROOT, os.environ.get("PYTHONPATH", "")) if p)

Task = tuple  # (function index, *arguments)


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    started: float
    ready: bool = False
    chunk: deque = field(default_factory=deque)  # task ids sent and not yet answered, in order
    clock: float = 0.0  # when the current task started (the last answer or the send)
    handed_back: bool = False  # the rest of its chunk went back to the queue (it looked hung)


def _exit_reason(process: subprocess.Popen) -> str:
    """How a worker process ended: ``exited with code 3``, ``was killed by SIGSEGV``."""
    try:
        code = process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return "closed its connection without exiting"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ProcessPool:
    """Worker processes that run tasks with a per-call timeout.

    Timeouts run in parallel: a call running longer than ``stand_in_after_s`` makes its
    worker look hung; the tasks queued behind it (its own unstarted ones included) then get
    stand-in workers at once, up to ``max_stand_ins`` processes beyond ``num_workers``, so that
    8 hanging calls cost about one timeout of wall time rather than ``8 / num_workers``. A
    call that finishes is answered by whichever worker gets there first; after the run, busy
    workers (still on tasks answered elsewhere) and stand-ins beyond ``num_workers`` stop.

    Args:
        functions: objects with a ``name`` and a ``call(arguments)`` that the tasks refer to
            by index; pickled once per worker.
        num_workers: number of processes (>= 1).
        timeout_s: seconds one call may run (one sample for a per-sample function, one whole
            call for a batched one); None = no limit.
        batch_timeout_s: seconds one `run` may take in all; when it is up, every unfinished
            task times out (busy workers are replaced). None = no limit.
        startup_timeout_s: seconds a new worker may take to become ready.
        stand_in_after_s: seconds after which a running call makes its worker look hung;
            default ``timeout_s / 4`` (None with no ``timeout_s``: no stand-ins).
        max_stand_ins: the most processes beyond ``num_workers``; default
            ``max(num_workers, 8)``.

    Subclasses set ``what`` (the word for their workers in messages: ``reward``, ``tool``),
    ``load_error`` (the exception raised when the functions cannot be sent to or loaded by a
    worker), and `failure` (what a task that timed out or lost its worker gets).

    Raises:
        ValueError: ``num_workers < 1``, a non-positive timeout, or a negative
            ``max_stand_ins``.
        load_error: functions that cannot be pickled (`unpicklable` says why and the fix).
    """

    what = "pool"
    load_error: type[Exception] = RuntimeError
    log = logging.getLogger("lmrl")

    def __init__(
        self,
        functions: Sequence[Any],
        num_workers: int,
        timeout_s: float | None,
        batch_timeout_s: float | None = None,
        startup_timeout_s: float = 120.0,
        stand_in_after_s: float | None = None,
        max_stand_ins: int | None = None,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 for a pool, got {num_workers}")
        for name, value in (
            ("timeout_s", timeout_s),
            ("batch_timeout_s", batch_timeout_s),
            ("stand_in_after_s", stand_in_after_s),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        if max_stand_ins is not None and max_stand_ins < 0:
            raise ValueError(f"max_stand_ins must be >= 0 or None, got {max_stand_ins}")
        try:
            self._payload = pickle.dumps(list(functions))
        except Exception as err:
            raise self.load_error(self.unpicklable(err)) from err
        self._names = [f.name for f in functions]
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.startup_timeout_s = startup_timeout_s
        if stand_in_after_s is None and timeout_s is not None:
            stand_in_after_s = timeout_s / 4
        self.stand_in_after_s = stand_in_after_s
        self.max_stand_ins = max(num_workers, 8) if max_stand_ins is None else max_stand_ins
        self._workers: list[_Worker] = []
        self.restarts = 0  # workers lost to a timeout or a crash, over the pool's life
        self._startup_failures = 0

    # ------------------------------------------------------------------ processes
    def _spawn(self) -> _Worker:
        mine, theirs = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-m", "lmrl._procworker", str(theirs.fileno())],
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
            self.log.warning(
                "%s worker %d did not exit after SIGKILL", self.what, worker.process.pid
            )
        worker.conn.close()

    def _remove(self, worker: _Worker, lost: bool = True) -> None:
        """Kill ``worker`` and drop it; ``lost`` counts it in ``restarts``."""
        self._kill(worker)
        self._workers.remove(worker)
        self.restarts += lost

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

    def _looks_hung(self, worker: _Worker, now: float) -> bool:
        return (
            self.stand_in_after_s is not None
            and bool(worker.chunk)
            and now - worker.clock > self.stand_in_after_s
        )

    def _top_up(self, queued: int, now: float) -> None:
        """Spawn workers: back up to ``num_workers`` that do not look hung, and while one
        looks hung, one for every queued entry no idle or starting worker will take."""
        hung = sum(self._looks_hung(w, now) for w in self._workers)
        free = len(self._workers) - hung
        want = self.num_workers
        if hung and queued:
            busy = sum(bool(w.chunk) and not self._looks_hung(w, now) for w in self._workers)
            want = max(want, queued + busy)
        room = self.num_workers + self.max_stand_ins - len(self._workers)
        for _ in range(min(want - free, room)):
            self._workers.append(self._spawn())

    def _finish(self) -> None:
        """After a run: stop workers still busy (on tasks answered elsewhere) and the
        stand-ins beyond ``num_workers``, starting ones first."""
        for worker in [w for w in self._workers if w.chunk]:
            self._remove(worker, lost=False)
        for worker in sorted(self._workers, key=lambda w: w.ready)[
            : max(0, len(self._workers) - self.num_workers)
        ]:
            self._remove(worker, lost=False)

    # ------------------------------------------------------------------ running tasks
    def unpicklable(self, err: Exception) -> str:
        """The message when the functions cannot be pickled (``err`` is pickle's error)."""
        return f"functions cannot be sent to worker processes ({type(err).__name__}: {err})"

    def failure(self, task: Task, status: str, message: str) -> Any:
        """What a task gets that timed out (``status`` ``"timeout"``) or whose worker died
        (``"error"``); ``message`` already names the function."""
        return (status, message)

    def run(self, tasks: Sequence[Task]) -> list[Any]:
        """Run ``tasks`` and return their results in order.

        A task that times out or whose worker dies gets `failure` (the message names the
        function, and the worker's exit code or signal); nothing here raises for a function's
        misbehaviour.

        Raises:
            load_error: a worker cannot load the functions (a file imports in this process
                but not in a fresh one).
            RuntimeError: workers repeatedly fail to start (a broken environment, not a
                function).
        """
        if not tasks:
            return []
        self.start()
        n = len(tasks)
        results: list[Any] = [None] * n
        remaining = n
        size = max(1, -(-n // (4 * self.num_workers)))
        queue = deque(list(range(i, min(i + size, n))) for i in range(0, n, size))
        give_up = time.monotonic() + self.batch_timeout_s if self.batch_timeout_s else None

        def record(task_id: int, outcome: Any) -> None:
            nonlocal remaining
            if results[task_id] is None:  # the first answer wins
                results[task_id] = outcome
                remaining -= 1

        def fail(task_id: int, status: str, message: str) -> None:
            task = tasks[task_id]
            record(task_id, self.failure(task, status, f"{self._names[task[0]]}: {message}"))

        def hand_back(worker: _Worker) -> None:
            """The unanswered tasks behind ``worker``'s current one go back to the queue,
            one per entry, so that stand-ins can take them."""
            if not worker.handed_back:
                rest = [t for t in list(worker.chunk)[1:] if results[t] is None]
                queue.extendleft([t] for t in reversed(rest))
                worker.handed_back = True

        while remaining:
            now = time.monotonic()
            pending = [c for c in ([t for t in c if results[t] is None] for c in queue) if c]
            queue = deque(pending)
            self._top_up(len(queue), now)
            for worker in list(self._workers):
                if worker.ready and not worker.chunk and queue:
                    chunk = queue.popleft()
                    try:
                        worker.conn.send([(tid, tasks[tid]) for tid in chunk])
                    except (OSError, ValueError):
                        queue.appendleft(chunk)
                        self._remove(worker)
                        continue
                    worker.chunk, worker.clock, worker.handed_back = deque(chunk), now, False
            if not self._workers:  # each was found dead at the send (killed while idle)
                continue  # start others before waiting on any
            deadlines = [give_up] if give_up is not None else []
            for w in self._workers:
                if not w.ready:
                    deadlines.append(w.started + self.startup_timeout_s)
                elif w.chunk and self.timeout_s:
                    deadlines.append(w.clock + self.timeout_s)
                if w.chunk and self.stand_in_after_s and not self._looks_hung(w, now):
                    deadlines.append(w.clock + self.stand_in_after_s)
            wait_s = max(0.0, min(deadlines) - now + 1e-3) if deadlines else None
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
                            raise self.load_error(
                                f"a {self.what} worker process could not load the {self.what} "
                                f"functions {self._names}: {message[1]}"
                            )
                        else:
                            task_id, outcome = message
                            worker.chunk.popleft()
                            worker.clock = time.monotonic()
                            record(task_id, outcome)
                except (EOFError, OSError):
                    dead = True
                if dead or worker.process.poll() is not None:
                    why = _exit_reason(worker.process)
                    if worker.chunk:
                        fail(worker.chunk[0], "error", f"the {self.what} worker process {why}")
                        hand_back(worker)
                    if not worker.ready:
                        self._startup_failed(f"it {why}")
                    self._remove(worker)
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.chunk and self.timeout_s and now - worker.clock > self.timeout_s:
                    fail(
                        worker.chunk[0], "timeout", f"call exceeded timeout_s={self.timeout_s:g} s"
                    )
                    hand_back(worker)
                    self._remove(worker)
                elif worker.chunk and self._looks_hung(worker, now):
                    hand_back(worker)
                elif not worker.ready and now - worker.started > self.startup_timeout_s:
                    self._startup_failed(f"not ready after {self.startup_timeout_s:g} s")
                    self._remove(worker)
            if give_up is not None and remaining and now > give_up:
                why = f"{self.what} batch exceeded batch_timeout_s={self.batch_timeout_s:g} s"
                for worker in [w for w in self._workers if w.chunk]:
                    self._remove(worker)
                for task_id in range(n):
                    if results[task_id] is None:
                        fail(task_id, "timeout", why)
                queue.clear()
        self._finish()
        return results

    def _startup_failed(self, why: str) -> None:
        self._startup_failures += 1
        self.log.warning("a %s worker failed to start (%s)", self.what, why)
        if self._startup_failures > 3 * self.num_workers:
            self.close()
            raise RuntimeError(f"{self.what} workers keep failing to start ({why})")
