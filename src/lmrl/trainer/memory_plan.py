"""``lmrl plan``: the peak device memory of each phase of an RL step, before any weights load.

Read from the run's plan (`lmrl.trainer.plan.RunPlan`, the object the run itself is built
from) and the models' ``config.json`` alone, with the per-model arithmetic of
`lmrl.models.memory`. One row per phase of the step that the run executes (`RunPlan.stages`:
no old log-probs phase when they come from the update or the rollout, no ref phase for the
full KL, whose reference runs inside the actor's update), on one rank, and one column per
part:

- ``params``: weights in the dtype the phase computes in (the fp32 masters themselves when
  there is no mixed precision; under mixed precision the compute copies: all of them in one
  process or DDP (autocast's cast weights), one unsharded layer plus the root's embedding and
  head under FSDP2);
- ``masters``: the fp32 master weights under mixed precision (their FSDP2 shard);
- ``grads``: gradients of what trains (LoRA: the adapter only), in the masters' dtype;
- ``optimizer``: AdamW's two moments of what trains, in the masters' dtype;
- ``activations``: what the forward keeps for backward over one micro-batch of
  ``micro x (max_prompt_length + max_response_length)`` tokens, with or without gradient
  checkpointing, plus the attention masks; a forward without grad keeps one layer's;
- ``logprob``: lmrl's chunked log-prob head over the micro-batch's response tokens (without
  grad it runs after the layers' transients are freed: what it adds beyond them); a
  critic's (B, L) values;
- ``kv_cache``: the rollout's keys and values at the longest prompt + response;
- ``vllm``: vLLM's reserved share (``gpu_memory_utilization`` of the device) while it
  generates;
- ``resident``: what other models keep on the device during the phase (the actor's states
  while the critic or reference computes, a colocated critic's, a separate reference's, the
  hf engine's ``rollout.dtype`` copy, vLLM's share when it does not sleep between rollouts).

FSDP2 (``actor.strategy=fsdp2`` under ``trainer.backend=ray``) divides params, grads,
optimizer and masters over ``resources.n_gpus_per_node x nnodes`` ranks; ``offload`` moves
those shards to the CPU. The largest micro-batch that fits (``device_memory`` given) is the
largest ``actor.ppo_micro_batch_size`` (and the critic's, equal) under which both update
phases fit; the other phases depend on other keys, which the summary names when they do not.

The table's short column names: master, optim, acts, logp, kv, other (= ``resident``).

Upper bounds by design: every response is as long as ``max_response_length`` (the first step
of a run may be); GRPO's shared prompts (`lmrl.models.forward`) would save a little.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmrl.errors import ModelError
from lmrl.models.loading import ModelPathError
from lmrl.models.memory import (
    DTYPE_BYTES,
    ModelShape,
    dtype_bytes,
    embedding_grad_bytes,
    format_bytes,
)
from lmrl.rollout.engines import ENGINES
from lmrl.trainer.plan import RunPlan

PARTS = ("params", "masters", "grads", "optimizer", "activations", "logprob", "kv_cache",
         "vllm", "resident")  # fmt: skip


SHORT = {"masters": "master", "optimizer": "optim", "activations": "acts", "logprob": "logp",
         "kv_cache": "kv", "resident": "other"}  # fmt: skip
# the phases whose size follows actor/critic.ppo_micro_batch_size, and what lowers the others
UPDATE_PHASES = ("critic update", "actor update")
PHASE_KNOBS = {
    "rollout": "lower data.train_batch_size or rollout.n, or lengths",
    "old log-probs": "set rollout.log_prob_micro_batch_size",
    "ref": "set ref.log_prob_micro_batch_size",
}


@dataclass(frozen=True)
class Phase:
    """One phase of the step on one rank: bytes per part (`PARTS`)."""

    name: str
    parts: dict[str, int]
    note: str = ""

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of a run: its phases, where they run and, with a device size, whether they fit."""

    phases: list[Phase]
    ranks: int
    micro_batch: int
    critic_micro_batch: int | None
    lengths: tuple[int, int]
    device_memory: int | None = None
    max_micro_batch: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.peak.total <= self.device_memory

    def summary(self) -> str:
        """One line: the peak phase and its size, and whether it fits the device."""
        peak = self.peak
        line = (
            f"memory plan: peak {format_bytes(peak.total)} per rank in {peak.name} "
            f"(micro-batch {self.micro_batch} x {sum(self.lengths)} tokens, {self.ranks} rank"
            f"{'s' if self.ranks > 1 else ''})"
        )
        if self.device_memory is None:
            return line
        line += f"; {'fits' if self.fits else 'does NOT fit'} in {format_bytes(self.device_memory)}"
        if self.max_micro_batch:
            line += f"; largest micro-batch that fits: {self.max_micro_batch}"
        over = [p for p in self.phases if p.total > self.device_memory]
        fixed = [p for p in over if p.name not in UPDATE_PHASES]
        if fixed:
            line += "; over at any micro-batch: " + ", ".join(
                f"{p.name} ({format_bytes(p.total)}: {PHASE_KNOBS[p.name]})" for p in fixed
            )
        elif not self.max_micro_batch and over:
            line += "; not even at micro-batch 1"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {
            "phases": [
                {"name": p.name, **p.parts, "total": p.total, "note": p.note} for p in self.phases
            ],
            "peak_phase": self.peak.name,
            "peak_bytes": self.peak.total,
            "ranks": self.ranks,
            "micro_batch": self.micro_batch,
            "critic_micro_batch": self.critic_micro_batch,
            "max_prompt_length": self.lengths[0],
            "max_response_length": self.lengths[1],
            "device_memory": self.device_memory,
            "fits": self.fits,
            "max_micro_batch": self.max_micro_batch,
            "settings": self.settings,
            "summary": self.summary(),
        }

    def table(self):
        """A ``rich`` table in GiB: one row per phase, one column per part that is not 0
        anywhere (short names: master, optim, acts, logp, kv, other = ``resident``); the
        phases' notes are its caption."""
        from rich import box
        from rich.table import Table

        used = [k for k in PARTS if any(p.parts.get(k) for p in self.phases)]
        notes = "\n".join(f"{p.name}: {p.note}" for p in self.phases if p.note)
        table = Table(
            title="lmrl plan: peak device memory per rank, GiB",
            title_justify="left",
            caption=notes,
            caption_justify="left",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            padding=(0, 0, 0, 1),
        )
        table.add_column("phase", no_wrap=True)
        for name in (*used, "total"):
            table.add_column(SHORT.get(name, name), justify="right", no_wrap=True)
        for p in self.phases:
            cells = [f"{p.parts[k] / 2**30:.2f}" if p.parts.get(k) else "-" for k in used]
            total = f"{p.total / 2**30:.2f}"
            if self.device_memory is not None and p.total > self.device_memory:
                total = f"[bold red]{total}[/]"
            table.add_row(p.name, *cells, total)
        return table


# -- reading the config ----------------------------------------------------------------------


def load_plan_config(config_file, overrides) -> Any:
    """The run's ``Config`` as `lmrl.config.load_config` reads it (only ``model.path``
    required), except that ``rollout.name=vllm`` is planned where vLLM is not installed (a
    plan is often made away from the GPU machine).

    Raises:
        ConfigError: every other problem of the config.
    """
    import dataclasses

    from lmrl.config import load_config
    from lmrl.config.errors import ConfigError

    try:
        return load_config(config_file, overrides, required=("model.path",))
    except ConfigError as err:
        if not any("needs vLLM, which is not installed" in e for e in err.errors):
            raise
        if len(err.errors) > 1:
            raise ConfigError([e for e in err.errors if "needs vLLM" not in e]) from None
    cfg = load_config(config_file, [*overrides, "rollout.name=hf"], required=("model.path",))
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, name="vllm"))


def read_model_config(path: str | None, what: str = "model.path") -> dict[str, Any]:
    """The ``config.json`` of a local model directory, as a dict; nothing else is read.

    Raises:
        ModelPathError: no path, a path that does not exist, a diffusers pipeline directory
            (``model_index.json``: an image model, which lmrl plan does not plan), or a
            directory without a readable ``config.json`` holding a JSON object (one line naming
            the path).
        ModelError: a ``model_index.json`` that is not valid JSON.
    """
    from lmrl.flow.pipelines import read_model_index

    if not path:
        raise ModelPathError(f"{what} is not set: lmrl plan reads the model's config.json")
    directory = Path(path).expanduser()
    file = directory / "config.json"
    if not directory.is_dir():
        raise ModelPathError(
            f"{what}={path!r} is not a directory (lmrl plan reads config.json from a local "
            "model directory)"
        )
    index = read_model_index(directory)
    if index is not None:
        kind = index.get("_class_name") or "of unknown kind"
        raise ModelPathError(
            f"{what}={path!r} is a diffusers pipeline ({kind}, model_index.json), an image "
            "model: lmrl plan plans the RL step of a causal language model policy (lmrl "
            "train); image runs (lmrl train-flow) have no memory plan"
        )
    if not file.is_file():
        raise ModelPathError(f"{what}={path!r} has no config.json: not a Hugging Face model dir")
    try:
        found = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelPathError(f"cannot read {file}: {err}") from err
    if not isinstance(found, dict):
        raise ModelPathError(f"cannot read {file}: a JSON {type(found).__name__}, not an object")
    return found


def read_model_shape(path: str | None, what: str = "model.path") -> ModelShape:
    """The `ModelShape` of the causal LM whose ``config.json`` is in ``path``.

    Raises:
        ModelPathError: what `read_model_config` raises.
        ModelError: a config of another kind of model (a ViT, a diffusers UNet, one without
            ``hidden_size``...) or a field of the wrong type (``"hidden_size": "64"``): one
            line naming the path and the problem.
    """
    config = read_model_config(path, what)
    try:
        return ModelShape.from_config(config)
    except ValueError as err:
        file = Path(str(path)).expanduser() / "config.json"
        raise ModelError(f"{what}={path!r} ({file}): {err}") from None


@dataclass(frozen=True)
class _Model:
    """One model's states on a rank, in bytes."""

    shape: ModelShape
    stored: int  # its weights on the device: the masters under mixed precision, else the only copy
    in_flight: int  # compute copies while it computes (FSDP2's gathered units, autocast's casts)
    full_copy: int  # all weights in the compute dtype (FSDP2's gather for generation)
    grads: int
    optimizer: int
    mixed: bool
    head_trains: bool

    def parts(self, training: bool = False) -> dict[str, int]:
        """The ``params``/``masters``/``grads``/``optimizer`` parts while it computes."""
        params = self.in_flight + (0 if self.mixed else self.stored)
        return {
            "params": params,
            "masters": self.stored if self.mixed else 0,
            "grads": self.grads if training else 0,
            "optimizer": self.optimizer,
        }

    @property
    def resident(self) -> int:
        """What stays on the device while another model computes."""
        return self.stored + self.optimizer


def _model_states(
    shape: ModelShape, *, master: int, compute: int, mixed: bool, ranks: int, sharded: bool,
    offload: bool, lora_rank: int = 0, target_modules: Any = "all-linear",
    value_head: bool = False, trains: bool = True,
) -> _Model:  # fmt: skip
    total = shape.num_params(value_head)
    trainable = 0
    if trains:
        trainable = shape.lora_params(lora_rank, target_modules) if lora_rank else total
    stored = (total + (trainable if lora_rank else 0)) * master
    grads = trainable * master
    optimizer = 2 * trainable * master  # AdamW's moments, in the masters' dtype
    shard = ranks if sharded else 1
    stored, grads, optimizer = stored // shard, grads // shard, optimizer // shard
    in_flight = 0
    if sharded:  # one layer unsharded, plus the root module (embedding, head, final norm)
        root = shape.embedding_params() + shape.head_params() + shape.hidden_size
        in_flight = (shape.layer_params() + root) * compute
    elif mixed:  # autocast's cast copies of the layers' linear weights (the embedding and
        # norms compute in the masters' dtype; the fused head casts its own: `logprob`)
        linear = sum(i * o for i, o, _ in shape.linear_shapes().values())
        in_flight = shape.num_layers * linear * compute
    if offload:
        stored = grads = optimizer = 0
    return _Model(
        shape=shape, stored=stored, in_flight=in_flight,
        full_copy=total * compute if (sharded or mixed) else 0, grads=grads,
        optimizer=optimizer, mixed=mixed,
        head_trains=trains and not lora_rank and not value_head,
    )  # fmt: skip


def _forward_bytes(
    shape: ModelShape, micro: int, prompt: int, response: int, compute: int, *, grad: bool,
    checkpointing: bool, lora_rank: int = 0, logprob: bool = True, head_trains: bool = True,
    stream: int | None = None, master: int | None = None, device: str = "cpu",
) -> tuple[int, int]:  # fmt: skip
    """``(activations, logprob)`` bytes of one micro-batch's forward (and backward)."""
    length = prompt + response
    tokens = micro * length
    if grad:
        acts = tokens * shape.activation_bytes_per_token(compute, checkpointing, lora_rank, stream)
        acts += shape.mask_bytes(micro, length, compute, 1 if checkpointing else None)
    else:  # no grad: the residual stream and one layer's transients at a time
        acts = tokens * shape.inference_bytes_per_token(compute, stream)
        acts += shape.mask_bytes(micro, length, compute, 1)
    if not logprob:  # a value head: (B, L) fp32 values
        return acts, micro * length * 4
    head = shape.logprob_bytes(micro * response, compute, grad, head_trains, stream, master, device)
    if not grad:  # the head runs once the layers' transients are gone: only the final hidden
        # states stay, so it adds what it needs beyond the layers' peak
        head = max(0, tokens * shape.hidden_size * (stream or compute) + head - acts)
    elif head_trains:  # the embedding's backward comes last, once the activations are freed
        head = max(head, embedding_grad_bytes(shape, master or compute) - acts)
    return acts, head


def _positive(value: int | None, default: int) -> int:
    return max(1, int(value)) if value else max(1, int(default))


def plan_memory(
    plan: RunPlan, device_memory: int | None = None, *, micro_batch: int | None = None
) -> MemoryPlan:
    """The memory plan of a run's plan (`lmrl.trainer.plan.RunPlan.from_config`): one phase
    per memory-bearing stage the run executes (`RunPlan.stages` at the first step that updates
    the actor), sized from the models' ``config.json``.

    Args:
        plan: the run's plan; ``plan.models.path`` (and ``critic_path``) name local model
            directories, of which only ``config.json`` is read. Nothing else of the config is.
        device_memory: bytes of one device; with it the plan says whether the step fits and
            the largest actor micro-batch that does.
        micro_batch: plan for this ``actor.ppo_micro_batch_size`` instead of the config's.

    Raises:
        ModelPathError: a model path without a readable ``config.json``.
        ModelError: a model that is not a causal LM lmrl plan can size, or a config field of
            the wrong type (`read_model_shape`).
    """
    m, w = plan.models, plan.workers
    device = plan.device
    master, compute = dtype_bytes(plan.dtypes[0]), dtype_bytes(plan.dtypes[1])
    mixed = master != compute
    # the stages of the first step that updates the actor (async: with the generation ahead)
    stages = tuple(dict.fromkeys(plan.generation_stages + plan.stages(plan.critic_warmup)))
    ranks = m.ranks
    prompt, response = plan.max_prompt_length, plan.max_response_length
    n = plan.n
    rows = plan.gen_batch_size * n
    rows_per_rank = math.ceil(rows / ranks)
    mini_per_rank = math.ceil(w.actor.mini_batch_rows / ranks)
    micro = _positive(micro_batch or w.actor.micro_batch_rows, mini_per_rank)
    checkpointing = w.gradient_checkpointing
    lora = m.lora_rank
    actor_sharded, critic_sharded = m.sharded(m.strategy), m.sharded(m.critic_strategy)

    shape = read_model_shape(m.path)
    actor = _model_states(
        shape, master=master, compute=compute, mixed=mixed, ranks=ranks, sharded=actor_sharded,
        offload=actor_sharded and m.offload != "none", lora_rank=lora,
        target_modules=m.target_modules,
    )  # fmt: skip
    critic = None
    if w.critic:
        critic_shape = read_model_shape(m.critic_path, "critic.model.path")
        critic = _model_states(
            critic_shape, master=master, compute=compute, mixed=mixed, ranks=ranks,
            sharded=critic_sharded, offload=critic_sharded and m.critic_offload != "none",
            value_head=True,
        )  # fmt: skip
    # autocast over fp32 masters keeps an fp32 residual stream; FSDP2 casts the weights
    actor_stream = 4 if mixed and not actor_sharded else compute
    critic_stream = 4 if mixed and not critic_sharded else compute
    colocated_critic = critic is not None and not w.separate_critic
    ref = None
    if w.reference == "frozen_copy":  # with LoRA the reference is the adapter disabled
        ref = _model_states(
            shape, master=master, compute=compute, mixed=mixed, ranks=ranks,
            sharded=actor_sharded, offload=False, trains=False,
        )  # fmt: skip
    resident_critic = critic.resident if critic is not None and colocated_critic else 0
    resident_ref = ref.stored if ref is not None else 0

    # the hf engine's own copy of the weights in rollout.dtype, when it differs
    rollout_dtype = m.rollout_dtype
    rollout_bytes = compute
    if isinstance(rollout_dtype, str) and rollout_dtype in DTYPE_BYTES:
        rollout_bytes = dtype_bytes(rollout_dtype)
    vllm = "reserves_memory" in ENGINES.traits(m.engine)
    rollout_copy = 0
    if not vllm and rollout_dtype and rollout_bytes != master:
        rollout_copy = shape.num_params() * rollout_bytes
    # vLLM keeps its share between rollouts unless it sleeps (free_cache_engine)
    vllm_opts = m.engine_options
    share = float(vllm_opts.get("gpu_memory_utilization", 0.5)) if vllm else 0.0
    vllm_awake = 0
    if vllm and not vllm_opts.get("free_cache_engine", True) and device_memory:
        vllm_awake = int(share * device_memory)
    others = resident_critic + resident_ref + rollout_copy + vllm_awake

    def phases_for(micro: int, c_micro: int) -> list[Phase]:
        out = []
        # 1. rollout: the actor's states stay; generation adds its KV cache (or vLLM's share)
        kv = rows_per_rank * (prompt + response) * shape.kv_cache_bytes_per_token(rollout_bytes)
        parts = dict.fromkeys(PARTS, 0)
        parts.update(actor.parts())
        parts["resident"] = resident_critic + resident_ref
        if vllm:
            parts["params"] = 0 if actor.mixed else actor.stored
            parts["vllm"] = int(share * device_memory) if device_memory else 0
            note = (
                f"vLLM holds {share:.0%} of the device; its KV cache needs "
                f"{format_bytes(kv)} for {rows_per_rank} sequences"
            )
            room = (
                share * device_memory - shape.num_params() * rollout_bytes
                if device_memory
                else None
            )
            if room is not None and kv > room:
                note += (
                    f" (more than the {format_bytes(max(room, 0))} left of its share: it queues)"
                )
        else:
            copies = rollout_copy or actor.full_copy
            if actor.mixed and not actor_sharded and not rollout_copy:
                # the hf engine decodes in inference mode, and there autocast's casts do not
                # accumulate: one layer's linear weights and the head's at a time (the plan of
                # every cast held over-counted the rollout by 9-13% on an H200, this one is
                # within 2%: docs/performance.md)
                copies = (
                    actor.in_flight // shape.num_layers
                    + shape.vocab_size * shape.hidden_size * compute
                )
            parts["params"] = (0 if actor.mixed else actor.stored) + copies
            parts["kv_cache"] = kv
            # the prompts' prefill without grad (its cache then grows to kv), or at every
            # later step the last position's logits and their fp32 copy
            prefill_stream = rollout_bytes if rollout_copy else actor_stream
            prefill = (
                rows_per_rank
                * prompt
                * shape.inference_bytes_per_token(rollout_bytes, prefill_stream)
            )
            prefill += shape.mask_bytes(rows_per_rank, prompt, rollout_bytes, 1)
            parts["activations"] = max(prefill, rows_per_rank * shape.vocab_size * 4 * 2)
            note = f"{rows_per_rank} sequences x {prompt + response} tokens"
        out.append(Phase("rollout", parts, note))
        # 2. old log-probs (no grad)
        log_micro = _positive(w.log_prob_micro_batch_size, rows_per_rank)
        if "old_log_prob" in stages:
            acts, lp = _forward_bytes(shape, log_micro, prompt, response, compute, grad=False,
                                      checkpointing=False, stream=actor_stream, master=master,
                                      device=device)  # fmt: skip
            parts = {**dict.fromkeys(PARTS, 0), **actor.parts()}
            parts.update(activations=acts, logprob=lp, resident=others)
            out.append(Phase("old log-probs", parts, f"micro-batch {log_micro}, no grad"))
        # 3. reference log-probs
        if "ref" in stages:
            ref_micro = _positive(w.ref_micro_batch_size, log_micro)
            acts, lp = _forward_bytes(shape, ref_micro, prompt, response, compute, grad=False,
                                      checkpointing=False, stream=actor_stream, master=master,
                                      device=device)  # fmt: skip
            parts = dict.fromkeys(PARTS, 0)
            if ref is None:  # LoRA: the actor with its adapter disabled
                parts.update(actor.parts(), resident=others)
                note = f"micro-batch {ref_micro}, the actor with LoRA disabled"
            else:
                resident = actor.resident + resident_critic + rollout_copy + vllm_awake
                parts.update(ref.parts(), resident=resident)
                note = f"micro-batch {ref_micro}, a frozen copy of the initial policy"
            parts.update(activations=acts, logprob=lp)
            out.append(Phase("ref", parts, note))
        # 4. critic values and update
        if critic is not None:
            acts, values = _forward_bytes(critic.shape, c_micro, prompt, response, compute,
                                          grad=True, checkpointing=checkpointing,
                                          logprob=False, stream=critic_stream)  # fmt: skip
            parts = {**dict.fromkeys(PARTS, 0), **critic.parts(training=True)}
            resident = (actor.resident if colocated_critic else 0) + resident_ref
            resident += rollout_copy + vllm_awake
            parts.update(activations=acts, logprob=values, resident=resident)
            out.append(Phase("critic update", parts, f"micro-batch {c_micro}"))
        # 5. actor update
        full_kl = w.ref_in_update
        acts, lp = _forward_bytes(shape, micro, prompt, response, compute, grad=True,
                                  checkpointing=checkpointing, lora_rank=lora,
                                  head_trains=actor.head_trains, stream=actor_stream,
                                  master=master, device=device)  # fmt: skip
        if full_kl:  # the reference's hidden states of the micro-batch
            acts += micro * response * shape.hidden_size * actor_stream
        parts = {**dict.fromkeys(PARTS, 0), **actor.parts(training=True)}
        parts.update(activations=acts, logprob=lp, resident=others)
        gc = "with" if checkpointing else "without"
        out.append(Phase("actor update", parts, f"micro-batch {micro}, {gc} checkpointing"))
        return out

    critic_micro = w.critic_update.micro_batch_rows if w.critic_update is not None else 0
    c_micro = _positive(micro_batch or critic_micro, mini_per_rank)
    phases = phases_for(micro, c_micro)
    largest = None
    if device_memory is not None:
        limit = max(mini_per_rank, micro)

        def fits(m: int) -> bool:
            updates = [p.total for p in phases_for(m, m) if p.name in UPDATE_PHASES]
            return max(updates) <= device_memory

        if fits(1):
            lo, hi = 1, limit
            while lo < hi:  # the largest m in [1, limit] that fits
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
            largest = lo
    settings = {
        "model": m.path, "device": device, "master_bytes": master,
        "compute_bytes": compute, "mixed_precision": mixed, "lora_rank": lora,
        "gradient_checkpointing": checkpointing, "strategy": m.strategy,
        "offload": m.offload, "rollout": m.engine, "rollout_n": n,
        "params": shape.num_params(),
        "trainable_params": shape.lora_params(lora, m.target_modules) if lora
        else shape.num_params(),
        "stages": list(stages), "reference": plan.reference,
    }  # fmt: skip
    return MemoryPlan(
        phases=phases, ranks=ranks, micro_batch=micro,
        critic_micro_batch=c_micro if critic is not None else None,
        lengths=(prompt, response), device_memory=device_memory, max_micro_batch=largest,
        settings=settings,
    )  # fmt: skip
