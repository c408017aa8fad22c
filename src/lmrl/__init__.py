"""lmrl: reinforcement-learning post-training of language models.

The packages follow the stages of one training step (see DESIGN.md): ``algos`` holds the
pure tensor maths, ``models`` and ``rollout`` the networks and generation, ``data`` and
``rewards`` the prompts and their scores, ``trainer`` the loop.
"""

__version__ = "0.1.0"
