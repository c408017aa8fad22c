"""The table of generation engines by name (``rollout.name``): ``hf`` and ``vllm``.

``build_engine(name, model, tokenizer, **options)`` is the one way the workers make an engine,
so a new engine is one registration here. ``vllm`` is a known name on every machine; without
vLLM installed, building it fails with a message that says how to get it.
"""

from __future__ import annotations

from torch import nn

from lmrl.algos.registry import Registry
from lmrl.errors import LmrlError
from lmrl.rollout.base import RolloutEngine
from lmrl.rollout.hf import HFEngine

__all__ = ["ENGINES", "build_engine"]

ENGINES: Registry = Registry("rollout engine")
ENGINES.register("hf")(HFEngine)


@ENGINES.register("vllm")
def _vllm_engine(model: nn.Module, tokenizer=None, **options) -> RolloutEngine:
    """The vLLM engine (`lmrl.rollout.vllm.VLLMEngine`), imported only when asked for.

    Raises:
        LmrlError: vLLM is not installed here (the message says how to get it).
    """
    from lmrl.rollout.vllm import VLLMEngine, vllm_missing

    missing = vllm_missing()
    if missing:
        raise LmrlError(missing)
    return VLLMEngine(model, tokenizer, **options)


def build_engine(name: str, model: nn.Module, tokenizer=None, **options) -> RolloutEngine:
    """Make the engine registered as ``name``.

    Args:
        name: ``"hf"`` or ``"vllm"``.
        model: the actor's causal LM (the ``hf`` engine generates with this very module).
        tokenizer: its tokenizer (EOS and pad ids, stop strings).
        **options: the engine's own keyword arguments, e.g. ``micro_batch_size``, ``seed``
            for `HFEngine`.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    return ENGINES.get(name)(model, tokenizer, **options)
