"""The run doctor's rollback (``trainer.max_rollbacks``): a collapsed run goes back to its best
validated checkpoint and on at a lower learning rate.

The health checks (`lmrl.run.health`) only say what they see. With ``trainer.max_rollbacks``
> 0 the run acts on one of them, the collapse (the policy's entropy under a floor while validation
falls from its best), because that one has a known good state to return to and a known change:

1. **Keep the best.** Every validation that beats the best so far is saved as a checkpoint
   (the validation before the first step as ``global_step_0``), ``max_ckpt_to_keep`` never
   prunes the best one, and ``run_dir/best_validation.json`` names it for a resumed run.
2. **Roll back.** On a collapse, the checkpoints of the abandoned steps move to
   ``run_dir/rolled_back/<n>/`` (kept, never deleted; a resume then continues from the best
   one), the program loads the best checkpoint (weights, optimizer, data position, RNGs), and
   the actor's learning rate is multiplied by ``trainer.rollback_lr_factor``. The lower rate
   is part of the actor's checkpoint state (``lr_scale``), so a resumed run keeps it.
3. **At most** ``trainer.max_rollbacks`` times (the folders in ``rolled_back/`` count them,
   so a resume does not reset the count); after that the collapse is only said.

A rollback logs ``doctor/rollback`` (its number), ``doctor/rolled_back_from`` (the step it
left) and ``doctor/lr_scale`` at the step it returns to, and ``lmrl plot`` marks it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path

from lmrl.run.checkpoint import checkpoint_step, list_checkpoints
from lmrl.run.health import validation_score

log = logging.getLogger("lmrl.trainer")

__all__ = ["ROLLED_BACK", "Doctor"]

ROLLED_BACK = "rolled_back"
BEST_FILE = "best_validation.json"  # {"score", "step"}: the checkpoint a rollback returns to


class Doctor:
    """Keeps the best validated checkpoint and rolls a collapsed run back to it.

    Args:
        run_dir: the run directory (its ``global_step_<N>`` checkpoints).
        max_rollbacks: rollbacks at most over the whole run.
        lr_factor: what each rollback multiplies the actor's learning rate by, in (0, 1).
        resumed: the run resumes from a checkpoint (its best so far is read back).
    """

    def __init__(
        self, run_dir: Path, max_rollbacks: int, lr_factor: float, resumed: bool = False
    ) -> None:
        self.run_dir = Path(run_dir)
        self.max_rollbacks = max_rollbacks
        self.lr_factor = lr_factor
        self.best: tuple[float, int] | None = None  # (validation score, step)
        self.said: set[str] = set()
        saved = self.run_dir / BEST_FILE  # a resumed run's best so far
        if resumed and saved.is_file():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = json.loads(saved.read_text())
                self.best = (float(record["score"]), int(record["step"]))

    @property
    def rollbacks(self) -> int:
        """Rollbacks done so far in this run directory (resumed runs included)."""
        folder = self.run_dir / ROLLED_BACK
        return sum(1 for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else 0

    def is_new_best(self, step: int, val_metrics: dict[str, float]) -> bool:
        """Record a validation at ``step``; True when it is the best so far (save it)."""
        score = validation_score(val_metrics)
        if score is None or (self.best is not None and score <= self.best[0]):
            return False
        self.best = (score, step)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / BEST_FILE).write_text(json.dumps({"score": score, "step": step}) + "\n")
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

    def abandon(self, after: int) -> Path:
        """Move every checkpoint after step ``after`` into ``rolled_back/<n>/``; returns it."""
        folder = self.run_dir / ROLLED_BACK / str(self.rollbacks + 1)
        folder.mkdir(parents=True)
        for path in list_checkpoints(self.run_dir):
            if checkpoint_step(path) > after:
                shutil.move(str(path), str(folder / path.name))
        return folder
