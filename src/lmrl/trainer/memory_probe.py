"""The memory probe: the longest step the config allows, run once before the first real one.

A run's memory peak comes from its longest prompts and responses, and a real batch may not
hold them until hours in: the out-of-memory error then costs the run. The probe runs, at the
start of every run (fresh or resumed), each stage of a step at its worst shape:

- **generation** of ``data.train_batch_size * rollout.n`` rows (DAPO's ``gen_batch_size``
  when it is larger), every prompt
  ``data.max_prompt_length`` tokens long (the dataset's longest prompt, repeated to that
  length), every response exactly ``data.max_response_length`` tokens (EOS and stop strings
  ignored; an agent loop's engine is probed without its tools, since ``max_response_length``
  bounds all of a row's tokens);
- **old log-probs**, **reference log-probs** and **values** of those rows, in the workers'
  own micro-batches;
- **the critic's and the actor's update** on one mini-batch of them (``ppo_epochs`` passes),
  with its optimizer step, so the Adam moments are allocated while the gradients are alive,
  as in every later step.

Then everything the probe changed is put back: the trained workers' weights, their optimizer,
schedule, loss scale and shuffling generator, and the global RNGs, all snapshotted on the host
before (copies, since on a CPU ``model_state`` aliases the parameters). The run goes on exactly
as without the probe; the tests check the weights bit for bit. An out-of-memory error in the
probe is the run's out-of-memory error, which ``lmrl train`` reports in one line with
``lmrl plan``'s summary, in the first minute instead of at the first long batch.

``trainer.memory_probe``: null (the default) probes on a GPU in one process, where memory is
a hard limit; a CPU run pages instead of failing, and under Ray the host snapshot would travel
through the object store, so there it runs only when asked for (``true``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from lmrl.batch import Batch
from lmrl.rollout.agent import AgentLoop
from lmrl.run.checkpoint import rng_state, set_rng_state

log = logging.getLogger("lmrl.trainer")

__all__ = ["probe_prompts", "run_memory_probe", "wants_probe"]


def wants_probe(setting: bool | None, device: str, backend: str = "local") -> bool:
    """Whether to probe: ``trainer.memory_probe``; null = on CUDA in one process only (under
    Ray the snapshot would bring every weight and optimizer moment through the object store
    to the driver, so there it runs only when asked for)."""
    if setting is not None:
        return bool(setting)
    return device.startswith("cuda") and backend == "local"


def probe_prompts(dataset, rows: int, length: int) -> Batch:
    """``rows`` copies of the dataset's longest prompt, repeated to ``length`` tokens.

    Returns:
        A prompts `Batch`: ``input_ids`` (rows, length) long, ``attention_mask`` (rows,
        length) bool all True, ``position_ids`` (rows, length).
    """
    longest = max((dataset[i]["input_ids"] for i in range(len(dataset))), key=len)
    ids = torch.tensor(longest, dtype=torch.long).repeat(length // len(longest) + 1)[:length]
    return Batch(
        {
            "input_ids": ids.expand(rows, length).clone(),
            "attention_mask": torch.ones(rows, length, dtype=torch.bool),
            "position_ids": torch.arange(length).expand(rows, length).clone(),
        }
    )


def _to_host(obj: Any) -> Any:
    """A deep copy of ``obj`` with every tensor copied to the host (never aliased)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def run_memory_probe(parts, max_prompt_length: int) -> dict[str, float]:
    """Run the worst-case step on ``parts`` (a ``RunParts``) and restore every state it moved.

    Args:
        parts: the run's parts; ``train_data``, ``actor`` and ``engine`` must be there.
        max_prompt_length: ``data.max_prompt_length``.
    Returns:
        ``perf/memory_probe_s`` and, on CUDA, ``perf/memory_probe_peak_gib``
        (``torch.cuda.max_memory_allocated`` of this process).
    Raises:
        torch.OutOfMemoryError: the worst case does not fit (nothing to restore: the run ends).
    """
    plan, start = parts.plan, time.perf_counter()
    trained = {"actor": parts.actor, "critic": parts.critic}
    trained = {name: w for name, w in trained.items() if w is not None}
    saved = {
        name: (_to_host(w.model_state()), _to_host(w.state_dict())) for name, w in trained.items()
    }
    rng = rng_state()
    try:
        batch = _worst_step(parts, max_prompt_length)
    finally:
        for name, worker in trained.items():
            weights, state = saved[name]
            worker.load_model_state(weights)
            worker.load_state_dict(state)
        set_rng_state(rng)
    out = {"perf/memory_probe_s": time.perf_counter() - start}
    shape = f"{len(batch)} rows of {max_prompt_length} + {plan.max_response_length} tokens"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["perf/memory_probe_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        shape += f", peak {out['perf/memory_probe_peak_gib']:.1f} of {total / 2**30:.1f} GiB"
    log.info("memory probe: the longest step fits (%s) in %.1f s", shape,
             out["perf/memory_probe_s"])  # fmt: skip
    return out


def _worst_step(parts, max_prompt_length: int) -> Batch:
    """Every stage of a step at the config's longest shapes; returns the generated batch."""
    plan = parts.plan
    engine = parts.engine.engine if isinstance(parts.engine, AgentLoop) else parts.engine
    rows = parts.sampler.batch_size  # a generation batch (DAPO's gen_batch_size, if larger)
    prompts = probe_prompts(parts.train_data, rows, max_prompt_length)
    sampling = dataclasses.replace(plan.sampling, ignore_eos=True, stop=[], seed=plan.seed)
    batch = engine.generate(prompts, plan.n, sampling)
    batch["old_log_probs"], _ = parts.actor.compute_log_probs(batch)
    if parts.reference is not None:
        batch["ref_log_probs"] = parts.reference.compute_log_probs(batch)
    rows = plan.workers.actor.mini_batch_rows  # one mini-batch
    update = batch.index(slice(0, min(rows, len(batch))))
    zeros = torch.zeros_like(update["old_log_probs"])
    update["advantages"], update["returns"] = zeros, zeros
    if parts.critic is not None:
        update["values"] = parts.critic.compute_values(update)
        parts.critic.update_critic(update)
    parts.actor.update_actor(update)
    return batch
