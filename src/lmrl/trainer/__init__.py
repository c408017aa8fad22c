"""Running a training: assembly, the step, validation, checkpoints, SFT and the demo.

- ``build_run(cfg)`` (``trainer/run.py``) assembles a run's parts into a frozen ``RunParts``.
- ``Trainer(parts, cfg.trainer)`` (``trainer/trainer.py``) runs the step over them, with
  validation, checkpoints, exact resume and clean interruption.
- ``evaluate(cfg, checkpoint)``: ``lmrl eval``, validation on the parts without a trainer.
- ``SFTTrainer`` (``trainer/sft.py``): ``lmrl sft``, the warm start.

Exports are lazy, so importing one module of the package does not import the others.
"""

from lmrl._lazy import lazy_exports

_EXPORTS = {
    "RunParts": "lmrl.trainer.run",
    "StepPlan": "lmrl.trainer.run",
    "build_run": "lmrl.trainer.run",
    "evaluate": "lmrl.trainer.run",
    "Trainer": "lmrl.trainer.trainer",
    "SFTTrainer": "lmrl.trainer.sft",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
