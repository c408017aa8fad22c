"""Ctrl-C and SIGTERM during training: the first saves and stops, the second stops now.

- The first SIGINT/SIGTERM is acknowledged at once on stderr ("saving after this step; press
  Ctrl-C again to stop now"); the run finishes its step, saves and returns, and the command
  exits 130 (SIGINT) or 143 (SIGTERM), so ``lmrl train ... && lmrl eval ...`` does not take an
  interrupted run for a finished one.
- The second raises :class:`StopNow` (a ``KeyboardInterrupt``) wherever the main thread is,
  a hanging in-process reward function included, and arms a watchdog that ends the process
  after ``grace_s`` seconds if the clean-up itself hangs. The last checkpoint is kept.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


class StopNow(KeyboardInterrupt):
    """The second signal: stop without saving. ``exit_code`` is 130 or 143."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.exit_code = EXIT_CODES.get(name, 130)


class StopOnSignal:
    """Within the block, SIGINT/SIGTERM request a stop; a second one raises :class:`StopNow`.

    Attributes:
        requested: the first signal's name (``"SIGINT"``), or None.
        exit_code: 130 or 143 once a signal came, else 0.

    Args:
        grace_s: after the second signal, seconds the clean-up may take before the process is
            ended with ``os._exit``.
    """

    def __init__(self, grace_s: float = 10.0) -> None:
        self.requested: str | None = None
        self.grace_s = grace_s
        self._previous: dict = {}

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.requested, 130) if self.requested else 0

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = name
            print(
                f"\nlmrl: {name}: saving after this step; press Ctrl-C again to stop now",
                file=sys.stderr,
                flush=True,
            )
            return
        print(f"\nlmrl: {name} again: stopping now", file=sys.stderr, flush=True)
        code = EXIT_CODES.get(name, 130)
        watchdog = threading.Timer(self.grace_s, os._exit, args=(code,))
        watchdog.daemon = True
        watchdog.start()
        raise StopNow(name)

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


__all__ = ["EXIT_CODES", "StopNow", "StopOnSignal"]
