"""``lmrl demo``: end-to-end pipelines at toy scale on the CPU, run through the same ``fit``
users run (``lmrl.trainer``), stopped early by its ``on_step_end`` callback.

- ``digits`` (``lmrl demo``): a tiny model learns to reverse digits: SFT warm start, GRPO.
- ``search`` (``lmrl demo --task search``): multi-turn RL with a search tool (Search-R1).
- ``flow`` (``lmrl demo --task flow``): Flow-GRPO on a tiny image model.

Each module is imported on its own (``from lmrl.demos.digits import run_demo``).
"""
