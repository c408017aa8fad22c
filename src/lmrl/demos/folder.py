"""A demo's directory and a demo a signal stopped.

``demo_dir(out, task)`` makes ``--out`` a demo's directory for the demo's life: a new or empty
directory is used as it is, a previous demo's (its ``demo.json`` names a demo, `DEMO_KEY`) is
emptied, anything else is refused before any work, so a demo never deletes what it did not
write. `DemoStopped` is raised by a demo stage that a signal stopped (its run saved), so the
demo stops there, not at its next stage, and ``lmrl demo`` exits 130 or 143.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

from lmrl.errors import DataError
from lmrl.run.lock import LOCK_FILE, RunDirLock

SUMMARY_FILE = "demo.json"
DEMO_KEY = "lmrl_demo"  # demo.json names the demo that wrote it: the mark of a demo's directory


class DemoStopped(Exception):
    """A signal stopped a stage of a demo; its run saved its checkpoint.

    Attributes:
        stage: ``SFT`` or ``GRPO``; steps: the steps it made; run_dir: its run directory;
        signal: the signal's name; exit_code: 130 (SIGINT) or 143 (SIGTERM).
    """

    def __init__(self, stage: str, steps: int, run_dir: Path, signal: str, exit_code: int):
        self.stage, self.steps, self.run_dir = stage, steps, run_dir
        self.signal, self.exit_code = signal, exit_code
        super().__init__(
            f"stopped by {signal} during {stage} after step {steps} (its checkpoint is in "
            f"{run_dir}); the demo did not finish: run the same command again to start it over"
        )

    @classmethod
    def check(cls, trainer, stage: str) -> None:
        """Raise for ``trainer`` (after its ``fit``) when a signal stopped it."""
        if trainer.exit_code:
            raise cls(stage, trainer.global_step, trainer.run_dir,
                      trainer.stopped_by or "a signal", trainer.exit_code)  # fmt: skip


def _is_demo(out: Path) -> bool:
    """``out`` holds a demo's ``demo.json`` (a JSON object naming the demo, `DEMO_KEY`)."""
    try:
        marker = json.loads((out / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and DEMO_KEY in marker


def _refuse_not_a_demo(out: Path) -> list[Path]:
    """What ``out`` holds (its lock file aside), when it is new, empty or a previous demo's.

    Raises:
        DataError: ``out`` is a file, or a non-empty directory without a demo's ``demo.json``.
    """
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out}: exists and is not a directory; pick another --out")
    held = sorted(p for p in out.iterdir() if p.name != LOCK_FILE) if out.is_dir() else []
    if held and not _is_demo(out):
        raise DataError(
            f"--out {out}: a non-empty directory that is not a previous lmrl demo (it holds "
            f"{[p.name for p in held[:5]]}, and no demo's {SUMMARY_FILE}); nothing was "
            "changed: pick another --out"
        )
    return held


@contextlib.contextmanager
def demo_dir(out: Path, task: str) -> Iterator[Path]:
    """``out`` as a demo's directory, for the demo's life.

    A new or empty directory is used as it is; a previous demo's (its ``demo.json`` names a
    demo) is emptied; anything else is refused before any work (`_refuse_not_a_demo`). The
    directory is locked while the demo runs (`lmrl.run.lock`: a second demo into it is
    refused, as is a previous demo's directory a run still writes), and ``demo.json`` is
    written first, naming the demo, so that a demo stopped half-way is replaced by the next
    one as well.

    Raises:
        DataError: ``out`` is a file or a directory that is not a demo's.
        CheckpointError: another process runs a demo in ``out``, or a run in a folder of it.
    """
    _refuse_not_a_demo(out)  # before the lock: a refused directory is not touched at all
    with RunDirLock(out, key="--out"):
        held = _refuse_not_a_demo(out)
        for entry in held:  # a run of its own in it (an `lmrl train` resuming it): refused
            if entry.is_dir() and (entry / LOCK_FILE).is_file():
                RunDirLock(entry, key="--out").acquire().release()
        for entry in held:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        (out / SUMMARY_FILE).write_text(json.dumps({DEMO_KEY: task}) + "\n")
        yield out


__all__ = ["DEMO_KEY", "SUMMARY_FILE", "DemoStopped", "demo_dir"]
