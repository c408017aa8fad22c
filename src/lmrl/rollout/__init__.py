"""Generation engines behind one interface (see `lmrl.rollout.base` for the output layout).

``build_engine("hf", model, tokenizer)`` returns an engine whose
``generate(prompts, n, SamplingParams(...))`` turns a `Batch` of left-padded prompts into a
`Batch` of ``B * n`` samples with ``responses``, ``response_mask`` and ``rollout_log_probs``.
"""

from lmrl.rollout.base import RolloutEngine, SamplingParams, check_prompts, finish_rollout
from lmrl.rollout.engines import ENGINES, build_engine
from lmrl.rollout.hf import HFEngine, default_eos_ids

__all__ = [
    "ENGINES",
    "HFEngine",
    "RolloutEngine",
    "SamplingParams",
    "build_engine",
    "check_prompts",
    "default_eos_ids",
    "finish_rollout",
]
