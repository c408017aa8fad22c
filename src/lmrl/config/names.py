"""Built-in names that config keys take, whose registries live below ``lmrl.config``.

The import table (DESIGN.md) lets the config package import ``lmrl.algos`` (its registries
are read where they are) but not the packages that implement tools, scorers and image
rewards, so the names they register are listed here for the load-time checks: an unknown
name is an error naming the key, with a did-you-mean, before anything loads a model.
``tests/config/test_names.py`` pins every tuple to its registry, so they cannot drift.
"""

from __future__ import annotations

#: ``rollout.multi_turn.tools`` without a tool_path: ``lmrl.tools.BUILTIN_TOOLS``
BUILTIN_TOOLS = ("search", "python")

#: ``reward.name`` of ``lmrl train-flow`` without a path: ``lmrl.flow.rewards.IMAGE_REWARDS``
IMAGE_REWARDS = ("geneval", "geneval_strict", "brightness", "colourfulness", "compressibility")

#: the keys of ``reward.scorer_options``: ``lmrl.rewards.scorers.SCORERS`` (data sources)
DATA_SOURCES = (
    "gsm8k",
    "arithmetic",
    "openai/gsm8k",
    "math",
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "countdown",
    "knights_knaves",
    "kk_logic",
    "digits",
    "count",
    "sort",
    "add",
    "compare",
    "search_qa",
    "nq",
    "triviaqa",
    "popqa",
    "hotpotqa",
    "2wikimultihopqa",
    "musique",
    "bamboogle",
)

#: ``algorithm.filter_groups.metric``: the per-sample values DAPO's dynamic sampling compares
#: within a group (``lmrl.trainer.stages.filter_metric``): the sequence reward, and the reward
#: extras of the built-in scorers; ``rm_score`` needs the reward model and ``overlong_penalty``
#: the overlong buffer. A custom reward function may return other extras.
SEQUENCE_METRICS = ("seq_reward", "seq_final_reward")
SCORER_EXTRAS = ("score", "acc", "format")
REWARD_MODEL_EXTRAS = ("rm_score",)
OVERLONG_EXTRAS = ("overlong_penalty",)

__all__ = [
    "BUILTIN_TOOLS",
    "DATA_SOURCES",
    "IMAGE_REWARDS",
    "OVERLONG_EXTRAS",
    "REWARD_MODEL_EXTRAS",
    "SCORER_EXTRAS",
    "SEQUENCE_METRICS",
]
