"""Running a training: one run loop, and the programs it runs.

- ``RunLoop`` (``trainer/loop.py``): signals, checkpoints and exact resume, validation cadence,
  health, trackers and ``final/``, for any ``Program`` (a step, validation, state, export).
- RL: ``build_run(cfg)`` (``trainer/run.py``) assembles a run's parts into a frozen
  ``RunParts``; ``Trainer(parts, cfg.trainer)`` (``trainer/trainer.py``) is the step over them.
- ``evaluate(cfg, checkpoint)``: ``lmrl eval``, validation on the parts without a trainer.
- SFT: ``build_sft`` and ``SFTTrainer`` (``trainer/sft.py``): ``lmrl sft``, the warm start.
- Flow-GRPO: ``build_flow`` and ``FlowTrainer`` (``trainer/flow.py``): ``lmrl train-flow``.

Exports are lazy, so importing one module of the package does not import the others.
"""

from lmrl._lazy import lazy_exports

_EXPORTS = {
    "Program": "lmrl.trainer.loop",
    "RunLoop": "lmrl.trainer.loop",
    "RunParts": "lmrl.trainer.run",
    "StepPlan": "lmrl.trainer.run",
    "build_run": "lmrl.trainer.run",
    "evaluate": "lmrl.trainer.run",
    "Trainer": "lmrl.trainer.trainer",
    "SFTParts": "lmrl.trainer.sft",
    "SFTTrainer": "lmrl.trainer.sft",
    "build_sft": "lmrl.trainer.sft",
    "FlowParts": "lmrl.trainer.flow",
    "FlowTrainer": "lmrl.trainer.flow",
    "build_flow": "lmrl.trainer.flow",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
