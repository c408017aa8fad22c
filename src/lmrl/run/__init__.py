"""The one run loop and its state, for any program with a step.

- ``RunLoop`` and ``Program`` (``run/loop.py``): cadence of validation, checkpoints and logs,
  signals, the early stop, ``final/``;
- checkpoints that a run killed at any moment resumes from exactly (``run/checkpoint.py``), and
  where a run starts (``run/resume.py``: the run directory, the checkpoint, what changed);
- Ctrl-C and SIGTERM (``run/signals.py``);
- the run's health warnings (``run/health.py``) and the doctor's rollback (``run/doctor.py``);
- stage timers (``run/timing.py``).

The loop imports no program: the RL step, SFT and Flow-GRPO live in `lmrl.trainer` and bring
their step to it (``tests/test_imports.py`` holds the direction).

Exports are lazy, so importing one module of the package does not import the others.
"""

from lmrl._lazy import lazy_exports

_EXPORTS = {
    "Program": "lmrl.run.loop",
    "RunLoop": "lmrl.run.loop",
    "RunsOnLoop": "lmrl.run.loop",
    "RunStart": "lmrl.run.resume",
    "open_run": "lmrl.run.resume",
    "StageTimer": "lmrl.run.timing",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
