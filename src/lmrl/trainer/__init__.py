"""The programs of the run loop (`lmrl.run`), and the RL step's own parts.

- RL: ``RunPlan.from_config(cfg)`` (``trainer/plan.py``) decides the run's shape once;
  ``build_run(cfg)`` (``trainer/build.py``) assembles a run's parts into a frozen
  ``RunParts``; ``Trainer(parts, cfg.trainer)`` (``trainer/trainer.py``) is the step over them.
- ``evaluate(cfg, checkpoint)``: ``lmrl eval``, validation on the parts without a trainer.
- SFT: ``build_sft`` and ``SFTTrainer`` (``trainer/sft.py``): ``lmrl sft``, the warm start.
- Flow-GRPO: ``build_flow`` and ``FlowTrainer`` (``trainer/flow.py``): ``lmrl train-flow``.
- ``lmrl plan``'s memory plan (``trainer/memory_plan.py``) and the memory probe.

Exports are lazy, so importing one module of the package does not import the others.
"""

from lmrl._lazy import lazy_exports

_EXPORTS = {
    "RunParts": "lmrl.trainer.build",
    "RunPlan": "lmrl.trainer.plan",
    "build_run": "lmrl.trainer.build",
    "evaluate": "lmrl.trainer.build",
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
