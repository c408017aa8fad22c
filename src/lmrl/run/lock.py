"""One owner per run directory: an exclusive lock held for the run's life.

Two commands writing one run directory (a re-queued job, a second terminal) would interleave
``metrics.jsonl`` and overwrite each other's checkpoints and ``config.yaml``. `RunDirLock`
takes ``DIR/.lmrl.lock`` with ``fcntl.flock`` and keeps it open while the run lasts. The kernel
drops the lock when the process ends in any way (an exception, Ctrl-C, SIGKILL, a crash), so a
lock file a dead process left behind is stale by construction and the next run takes it. The
owner writes its pid and command line into the file; a second command is refused in one line
naming them.

- Re-entrant within one process: a nested acquire of a directory this process already holds
  (an eval inside a run, a sweep's trial) counts up instead of refusing; the lock goes with the
  last release.
- A child forked from the owner does not keep the lock alive after the owner dies: the child
  closes its copy of the file at fork.
- On release the lock file is removed, and the directories the lock made, if they are still
  empty (a run refused before it wrote anything leaves no empty run directory behind).

`refuse_sweep_folder` refuses a run writing into a sweep's folder (a folder holding
``sweep.json``: its trials are the runs, each in its own folder inside it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shlex
import sys
import threading
from pathlib import Path
from types import TracebackType

from lmrl.errors import CheckpointError

LOCK_FILE = ".lmrl.lock"
SWEEP_FILE = "sweep.json"

# directory (resolved) -> [fd, count, made] for the locks this process holds
_held: dict[Path, list] = {}
_guard = threading.Lock()


def _forget_after_fork() -> None:
    """In a forked child: close the copies of the parent's lock files, so the lock ends with
    the parent (closing a copy leaves the parent's lock in place)."""
    global _guard
    _guard = threading.Lock()  # another thread of the parent may have held it at the fork
    for fd, *_ in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def default_command() -> str:
    """This process's command line, quoted as a shell would need it; ``lmrl train key=value
    ...`` for ``python -m lmrl.cli`` as for the ``lmrl`` script."""
    argv = list(sys.argv) or ["python"]
    program = Path(argv[0]).name
    if program == "__main__.py" and "lmrl" in Path(argv[0]).parts:
        program = "lmrl"
    return shlex.join([program, *argv[1:]])


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _owner(path: Path) -> tuple[str | None, str | None]:
    """``(pid, command)`` that the owner wrote into its lock file, None where unreadable."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None, None
    pid = lines[0].strip() if lines and lines[0].strip().isdigit() else None
    command = lines[1].strip() if len(lines) > 1 and lines[1].strip() else None
    return pid, command


class RunDirLock:
    """The exclusive lock of one run directory (``DIR/.lmrl.lock``), for a run's life.

    Use it as a context manager, or call `acquire` and `release`::

        with RunDirLock(run_dir, "lmrl train"):
            ...  # write the run

    Args:
        directory: the run directory (made if missing).
        command: the command line written for a refused second command to name; this
            process's own command line by default.
        key: what a refused command should give another value of (its message says so).
    """

    def __init__(
        self, directory: Path, command: str | None = None, *,
        key: str = "trainer.default_local_dir",
    ) -> None:  # fmt: skip
        self.directory = Path(directory)
        self.command = command
        self.key = key
        self._resolved: Path | None = None

    @property
    def path(self) -> Path:
        """The lock file, ``DIR/.lmrl.lock``."""
        return self.directory / LOCK_FILE

    @property
    def held(self) -> bool:
        """True while this object holds the lock (between `acquire` and `release`)."""
        return self._resolved is not None

    def acquire(self) -> RunDirLock:
        """Make the directory if needed and take its lock.

        Returns:
            self.
        Raises:
            CheckpointError: one line, when another process holds the lock (naming its pid
                and command), or when the directory cannot be made or the lock file written.
        """
        if self._resolved is not None:
            return self
        key = self.directory.resolve()
        with _guard:
            if key in _held:
                _held[key][1] += 1
                self._resolved = key
                return self
            fd, made = self._take(key)
            _held[key] = [fd, 1, made]
            self._resolved = key
        return self

    def _take(self, key: Path) -> tuple[int, list[Path]]:
        """Open, lock and stamp ``key/.lmrl.lock``; the directories it made, innermost first
        (removed again when it is refused)."""
        made: list[Path] = []
        try:
            return self._lock(key, made)
        except BaseException:
            _remove_empty(made)
            raise

    def _lock(self, key: Path, made: list[Path]) -> tuple[int, list[Path]]:
        path = key / LOCK_FILE
        while True:
            try:
                made += _make_dirs(key)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise CheckpointError(
                    f"{self.directory}: cannot lock the run directory ({err.strerror or err}): "
                    f"choose another {self.key}"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise CheckpointError(
                        f"{self.directory}: cannot lock the run directory "
                        f"({err.strerror or err}): choose another {self.key}"
                    ) from None
                raise CheckpointError(self._in_use(path)) from None
            # the owner before us may have removed the file between our open and our lock:
            # then we locked a file nobody else will see, and must start again
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        command = _one_line(self.command or default_command(), limit=1000)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n{command}\n".encode())
        except OSError as err:
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)
            raise CheckpointError(
                f"{self.directory}: cannot write its lock file ({err.strerror or err}): "
                f"choose another {self.key}"
            ) from None
        return fd, made

    def _in_use(self, path: Path) -> str:
        pid, command = _owner(path)
        who = f"pid {pid}" if pid else "another process"
        if command:
            who += f" ({_one_line(command)})"
        return (
            f"{self.directory} is in use by {who}: wait for it to end or choose another {self.key}"
        )

    def release(self) -> None:
        """Let the lock go (the last release of a nested one removes the lock file, and the
        directories `acquire` made if they are empty). Releasing an unheld lock does nothing."""
        key, self._resolved = self._resolved, None
        if key is None:
            return
        with _guard:
            entry = _held.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _held[key]
            fd, _, made = entry
            with contextlib.suppress(OSError):
                os.unlink(key / LOCK_FILE)  # while still holding it: see `_take`
            os.close(fd)
            _remove_empty(made)

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _make_dirs(directory: Path, tries: int = 5) -> list[Path]:
    """Make ``directory`` and its missing parents; the ones made, innermost first. A parent
    that another process's release removes meanwhile (it made it, and it was empty) is made
    again."""
    made: list[Path] = []
    for attempt in range(tries):
        missing: list[Path] = []
        probe = directory
        while not probe.exists():
            missing.append(probe)
            probe = probe.parent
        if not probe.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{probe} is a file, not a directory")
        try:
            for d in reversed(missing):
                try:
                    d.mkdir()
                except FileExistsError:
                    continue
                made.insert(0, d)
            return made
        except FileNotFoundError:
            if attempt == tries - 1:
                raise
    return made


def _remove_empty(made: list[Path]) -> None:
    """Remove the directories in ``made`` (innermost first) while they are empty."""
    for d in made:
        try:
            d.rmdir()
        except OSError:
            break


def holds_lock(directory: Path) -> bool:
    """True when this process holds the lock of ``directory``."""
    with _guard:
        return Path(directory).resolve() in _held


def refuse_sweep_folder(directory: Path, command: str) -> None:
    """Refuse ``command`` writing a run into a sweep's folder (one holding ``sweep.json``).

    Raises:
        CheckpointError: one line naming the folder and the fix.
    """
    if (Path(directory) / SWEEP_FILE).is_file():
        raise CheckpointError(
            f"{directory} is a sweep's folder (it holds {SWEEP_FILE}; its trials are runs in "
            f"trials/): `{command}` will not write into it: choose another "
            "trainer.default_local_dir"
        )


__all__ = ["LOCK_FILE", "SWEEP_FILE", "RunDirLock", "holds_lock", "refuse_sweep_folder"]
