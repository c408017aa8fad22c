"""The table of generation engines by name (``rollout.name``): ``hf`` and ``vllm``.

``build_engine(name, model, tokenizer, **options)`` is the one way the workers make an engine,
so a new engine is one registration here. ``vllm`` is a known name on every machine; without
vLLM installed, building it fails with a message that says how to get it.
"""

from __future__ import annotations

import math

from torch import nn

from lmrl.algos.registry import Registry
from lmrl.errors import LmrlError
from lmrl.models.loading import resolve_dtype
from lmrl.rollout.base import RolloutEngine
from lmrl.rollout.copy import CopyEngine
from lmrl.rollout.hf import HFEngine

__all__ = ["ENGINES", "build_engine", "engine_options", "with_tools"]

ENGINES: Registry = Registry("rollout engine")


# traits: ``shares_weights``, it may generate with the actor's own module (then its log-probs
# are the actor's); ``reports_rows``, it reports each row as it stops (`HFEngine.row_done`);
# ``reserves_memory``, it holds a share of the device of its own (vLLM's
# ``gpu_memory_utilization``)
@ENGINES.register("hf", traits=("shares_weights", "reports_rows"))
def _hf_engine(
    model: nn.Module, tokenizer=None, *, dtype: str | None = None, follow: bool = True, **options
):
    """`HFEngine` over the actor's own module, or `CopyEngine` (a copy of the weights in
    ``dtype``) when ``dtype`` is another than the actor's or the engine must not follow the
    actor's weights (``follow=False``: an async run, which hands each version over itself)."""
    first = next(model.parameters(), None)
    same = dtype is None or first is None or resolve_dtype(dtype, first.device) == first.dtype
    if same and follow:
        return HFEngine(model, tokenizer, **options)
    if not dtype:  # a copy in the actor's own dtype (not following its weights)
        if first is None:
            raise ValueError(
                "a rollout engine that copies the weights needs a dtype: the model has no "
                "parameters"
            )
        dtype = str(first.dtype).removeprefix("torch.")
    return CopyEngine(model, tokenizer, dtype=dtype, follow=follow, **options)


@ENGINES.register("vllm", traits=("reserves_memory",))
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


def _vllm_options(cfg) -> dict:
    v = cfg.rollout.vllm  # its options, named as VLLMEngine's keyword arguments
    max_model_len = v["max_model_len"] or cfg.data.max_prompt_length + cfg.data.max_response_length
    dtype = v["dtype"] or cfg.rollout.dtype
    return {**v, "model_path": cfg.model.path, "max_model_len": max_model_len, "dtype": dtype}


def _hf_options(cfg) -> dict:
    hf = dict(cfg.rollout.hf)  # decode, check_every: HFEngine's keyword arguments
    return {**hf, "dtype": cfg.rollout.dtype} if cfg.rollout.dtype else hf


# an engine's settings beyond the model, tokenizer and seed, read from a run's config
_OPTIONS = {"vllm": _vllm_options, "hf": _hf_options}


def engine_options(cfg) -> dict:
    """The keyword arguments ``cfg.rollout.name``'s engine takes from the config."""
    options = _OPTIONS.get(cfg.rollout.name)
    return options(cfg) if options is not None else {}


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


def with_tools(cfg, engine: RolloutEngine, tokenizer) -> RolloutEngine:
    """``engine`` wrapped in the multi-turn agent loop when ``rollout.multi_turn.enable``
    (its tools made from the config), else ``engine`` itself.

    Raises:
        ToolLoadError: a tool cannot be made (unknown name, bad tool file, unreadable corpus).
    """
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return engine
    from lmrl.rollout.agent import AgentLoop
    from lmrl.tools.loading import load_tools

    r = cfg.retriever
    server = isinstance(r.source, str) and r.source.startswith(("http://", "https://"))
    python = mt.python
    options = {
        "search": {
            "corpus": None if server else r.source,
            "url": r.source if server else None,
            "topk": r.topk,
        },
        "python": {
            "timeout_s": python["timeout_s"],
            "cpu_s": max(1, math.ceil(python["timeout_s"])),
            "memory_mb": python["memory_mb"],
            "disk_mb": python["disk_mb"],
        },
    }
    tools = load_tools(
        mt.tools, mt.tool_path, options, processes=mt.tool_processes, timeout_s=mt.tool_timeout_s
    )
    return AgentLoop(
        engine, tools, tokenizer, max_turns=mt.max_turns, format=mt.format,
        state_masking=cfg.actor.state_masking, max_obs_length=mt.max_obs_length,
        tool_timeout_s=mt.tool_timeout_s, max_tool_error_fraction=mt.max_tool_error_fraction,
        pipeline_groups=mt.pipeline_groups,
    )  # fmt: skip
