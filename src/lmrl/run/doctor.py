"""The run doctor's rollback (``trainer.max_rollbacks``): a collapsed run goes back to its best
validated checkpoint and on at a lower learning rate.

The health checks (`lmrl.run.health`) only say what they see. With ``trainer.max_rollbacks``
> 0 the run acts on two of them, the collapse (the policy's entropy under a floor while
validation falls from its best) and the divergence (the entropy climbing steadily while the
score falls), both flagged in ``RunHealth.collapse``, because they have a known good state to
return to and a known change:

1. **Keep the best.** Every validation that beats the best so far (by the health's
   ``validation_score`` where it has one: an image run's prompt fidelity; else
   `lmrl.run.health.validation_score`, the accuracy or the reward) is saved as a checkpoint
   (the validation before the first step as ``global_step_0``), ``max_ckpt_to_keep`` never
   prunes the best one, and ``run_dir/best_validation.json`` names it for a resumed run.
2. **Roll back.** On a collapse or a divergence, the checkpoints of the abandoned steps move to
   ``run_dir/rolled_back/<n>/`` (kept, never deleted; a resume then continues from the best
   one), the program loads the best checkpoint (weights, optimizer, data position, RNGs), and
   the actor's learning rate is multiplied by ``trainer.rollback_lr_factor``. The lower rate
   is part of the actor's checkpoint state (``lr_scale``), so a resumed run keeps it.
3. **At most** ``trainer.max_rollbacks`` times (the folders in ``rolled_back/`` count them,
   so a resume does not reset the count); after that the collapse is only said.

A rollback is all or nothing: its intent, ``run_dir/rollback.json`` (its number, the step it
returns to, the step it left, the lr factor), is written first (atomically), then the
checkpoints move, the best one is loaded and saved again at the lower lr (its manifest marked
``"rollback": {"number", "lr_scale"}``), and the intent is removed last. A run killed anywhere
in between and resumed with ``trainer.resume_mode=auto`` finishes the rollback before its next
step (each part is done once: moves of what is left, the lr lowered only when the marked
re-save is missing), so it goes on as the uninterrupted run does; a run that starts over or
resumes from a named checkpoint drops the intent with a warning.

A rollback logs ``doctor/rollback`` (its number), ``doctor/rolled_back_from`` (the step it
left) and ``doctor/lr_scale`` at the step it returns to, and ``lmrl plot`` marks it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmrl.errors import CheckpointError
from lmrl.run.checkpoint import (
    check_checkpoint,
    checkpoint_step,
    finish_replace,
    fsync_path,
    list_checkpoints,
    manifest_field,
)
from lmrl.run.health import validation_score

log = logging.getLogger("lmrl.trainer")

__all__ = ["INTENT", "ROLLED_BACK", "Doctor", "Rollback"]

ROLLED_BACK = "rolled_back"
BEST_FILE = "best_validation.json"  # {"score", "step"}: the checkpoint a rollback returns to
INTENT = "rollback.json"  # a rollback under way (`Rollback`), removed once it is done


@dataclass(frozen=True)
class Rollback:
    """One rollback, as its intent record holds it.

    Attributes:
        number: its number (its folder ``rolled_back/<number>/``).
        to: the step of the best checkpoint it returns to.
        came_from: the step it left.
        lr_factor: what it multiplies the actor's learning rate by.
    """

    number: int
    to: int
    came_from: int
    lr_factor: float


def _write_json(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` to ``path`` atomically: a temporary file, fsynced, renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


class Doctor:
    """Keeps the best validated checkpoint and rolls a collapsed run back to it.

    Args:
        run_dir: the run directory (its ``global_step_<N>`` checkpoints).
        max_rollbacks: rollbacks at most over the whole run.
        lr_factor: what each rollback multiplies the actor's learning rate by, in (0, 1).
        resumed: the run resumes from a checkpoint (its best so far is read back).
        resume_mode: ``trainer.resume_mode``: with ``auto`` a rollback a kill interrupted is
            finished (`interrupted`); with another mode its intent is dropped.
        score: what a validation's metrics rank by (higher is better; None = not ranked).
    """

    def __init__(
        self,
        run_dir: Path,
        max_rollbacks: int,
        lr_factor: float,
        resumed: bool = False,
        resume_mode: str = "auto",
        score: Callable[[Mapping[str, float]], float | None] = validation_score,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.score = score
        self.max_rollbacks = max_rollbacks
        self.lr_factor = lr_factor
        self.best: tuple[float, int] | None = None  # (validation score, step)
        self.said: set[str] = set()
        self.resume_mode = resume_mode
        interrupted = resume_mode == "auto" and (self.run_dir / INTENT).is_file()
        saved = self.run_dir / BEST_FILE  # a resumed run's best so far
        if (resumed or interrupted) and saved.is_file():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = json.loads(saved.read_text())
                self.best = (float(record["score"]), int(record["step"]))

    def interrupted(self) -> Rollback | None:
        """The rollback a kill interrupted (its intent is still on disk), which the run
        finishes before its next step; None when there is none, or when the run starts over
        or resumes from a named checkpoint (the intent is then dropped, with a warning). Its
        best checkpoint is put back in place if the kill fell inside its save.

        Raises:
            CheckpointError: the intent record cannot be read.
        """
        path = self.run_dir / INTENT
        if not path.is_file():
            return None
        try:
            rollback = Rollback(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as err:
            raise CheckpointError(
                f"{path}: unreadable ({err}); it holds a rollback a kill interrupted: restore "
                "it, or delete it to resume without finishing that rollback"
            ) from None
        target = self.run_dir / f"global_step_{rollback.to}"
        with contextlib.suppress(OSError):
            finish_replace(self.run_dir, rollback.to)  # a kill inside its re-save
        why = (
            f"trainer.resume_mode={self.resume_mode}" if self.resume_mode != "auto"
            else f"{target} is not a complete checkpoint" if check_checkpoint(target)
            else None
        )  # fmt: skip
        if why is None:
            return rollback
        log.warning("run doctor: rollback %d (from step %d back to step %d) was interrupted and "
                    "is dropped: %s", rollback.number, rollback.came_from, rollback.to,
                    why)  # fmt: skip
        path.unlink()
        return None

    @property
    def rollbacks(self) -> int:
        """Rollbacks done so far in this run directory (resumed runs included)."""
        folder = self.run_dir / ROLLED_BACK
        return sum(1 for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else 0

    def is_new_best(self, step: int, val_metrics: dict[str, float]) -> bool:
        """Record a validation at ``step``; True when it is the best so far (save it)."""
        score = self.score(val_metrics)
        if score is None or (self.best is not None and score <= self.best[0]):
            return False
        self.best = (score, step)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.run_dir / BEST_FILE, {"score": score, "step": step})
        return True

    def keep(self) -> Path | None:
        """The best validated checkpoint, which pruning must spare."""
        if self.best is None:
            return None
        path = self.run_dir / f"global_step_{self.best[1]}"
        return path if path.is_dir() else None

    def can_roll_back(self, collapse) -> bool:
        """A collapse was seen, a best checkpoint exists, and rollbacks are left."""
        if collapse is None:
            return False
        if self.rollbacks >= self.max_rollbacks:
            self._once(f"run doctor: the policy collapsed again after {self.rollbacks} "
                       "rollbacks (trainer.max_rollbacks); going on")  # fmt: skip
            return False
        if self.keep() is None:
            self._once("run doctor: the policy collapsed but no validated checkpoint exists "
                       "to roll back to; going on")  # fmt: skip
            return False
        return True

    def _once(self, message: str) -> None:
        if message not in self.said:
            self.said.add(message)
            log.warning("%s", message)

    def begin(self, came_from: int) -> Rollback:
        """Write the intent of a rollback from step ``came_from`` to the best checkpoint."""
        assert self.best is not None, "a rollback needs a best checkpoint (can_roll_back)"
        rollback = Rollback(self.rollbacks + 1, self.best[1], came_from, self.lr_factor)
        _write_json(self.run_dir / INTENT, asdict(rollback))
        return rollback

    def abandon(self, rollback: Rollback) -> Path:
        """Move every checkpoint after the step ``rollback`` returns to into
        ``rolled_back/<number>/`` (those a kill left behind, on a resume); returns the folder."""
        folder = self.run_dir / ROLLED_BACK / str(rollback.number)
        folder.mkdir(parents=True, exist_ok=True)
        for path in list_checkpoints(self.run_dir):
            if checkpoint_step(path) > rollback.to:
                shutil.move(str(path), str(folder / path.name))
        return folder

    def saved_scale(self, rollback: Rollback) -> float | None:
        """The lr scale the best checkpoint was saved again with in ``rollback``, or None
        while that save is not done (its manifest's ``rollback`` mark)."""
        mark = manifest_field(self.run_dir / f"global_step_{rollback.to}", "rollback")
        if isinstance(mark, dict) and mark.get("number") == rollback.number:
            return float(mark["lr_scale"])
        return None

    def done(self) -> None:
        """The rollback under way is complete: remove its intent."""
        (self.run_dir / INTENT).unlink(missing_ok=True)
        fsync_path(self.run_dir)
