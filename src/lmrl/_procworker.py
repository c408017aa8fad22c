"""A pool's worker process: ``python -m lmrl._procworker FD`` (see `lmrl._procpool`).

It talks to its `ProcessPool` over the socket ``FD`` (a ``multiprocessing`` connection):
it receives the parent's ``sys.path`` and the pickled functions, answers ``("ready",)`` (or
``("init_error", message)``), then runs chunks of tasks ``(index, *arguments)``, sending
``(task_id, functions[index].call(arguments))`` after each one, until it receives ``None`` or
the socket closes. The functions' ``call`` catches their own errors. It imports nothing but
what the functions need, and on Linux asks the kernel to kill it when its parent dies, so a
worker stuck in a hung reward function or tool never outlives training.
"""

from __future__ import annotations

import contextlib
import ctypes
import pickle
import signal
import sys
from multiprocessing.connection import Connection


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(fd: int) -> None:
    """Serve tasks on the connection ``fd`` (see the module docstring)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn = Connection(fd)
    try:
        paths, payload = conn.recv()
        sys.path[:] = list(dict.fromkeys([*paths, *sys.path]))
        functions = pickle.loads(payload)
    except Exception as err:
        conn.send(("init_error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for task_id, task in chunk:
            conn.send((task_id, functions[task[0]].call(task[1:])))


if __name__ == "__main__":
    main(int(sys.argv[1]))
