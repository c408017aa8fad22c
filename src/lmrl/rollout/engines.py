"""The table of generation engines by name (``rollout.name``): ``hf`` and ``vllm``.

``build_engine(name, model, tokenizer, **options)`` is the one way the workers make an engine,
so a new engine is one registration here. ``vllm`` is a known name on every machine; it needs
the ``[vllm]`` extra and CUDA, and without them building it fails with a message that says so.
"""

from __future__ import annotations

import importlib.util

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
    """The vLLM engine (GPU only, ``pip install lmrl[vllm]``).

    Raises:
        LmrlError: vLLM is not installed or CUDA is not available; or, where both are, that
            this version of lmrl has no vLLM engine yet (use ``rollout.name=hf``).
    """
    import torch

    if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
        raise LmrlError(
            "the vllm engine needs vLLM and CUDA, and neither is available here; use "
            "rollout.name=hf on this machine"
        )
    raise LmrlError("the vllm engine is not part of this version of lmrl; use rollout.name=hf")


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
