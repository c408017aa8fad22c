"""``strategy=fsdp2``: parameters, gradients and optimizer state sharded with PyTorch's
``fully_shard`` (FSDP2), on gloo (CPU) or NCCL (GPU).

The actor, the critic and the reference's frozen copy (`FSDP2.prepare_frozen`; a LoRA
reference is the sharded actor itself) are sharded alike. Each decoder layer is its own FSDP
unit and the root holds the rest (embeddings, final norm,
output head: tied weights stay in one unit). A unit's parameters are all-gathered before its
forward and backward and freed after; gradients are reduce-scattered, summed (not averaged:
each rank's loss is already its share of the mini-batch loss, see ``lmrl.workers.dist``) with
``ReduceOp.SUM`` in every dtype (gloo has no ``PREMUL_SUM``, FSDP2's op for a float32 factor).

Mixed precision is FSDP2's ``MixedPrecisionPolicy``: fp32 shards (the masters, and the
optimizer's), all-gathered cast to the compute dtype, gradients reduce-scattered in
``reduce_dtype`` (fp32 by default) onto the fp32 shards.

What this strategy changes in the worker loop:

- ``micro_batches``: every rank runs the *same number* of forwards (each forward all-gathers),
  padding its list with an all-masked copy of one of its rows (zero loss, zero gradient);
- ``sync_grads``: gradients are reduce-scattered on the last micro-batch only;
- ``full_params``: forward-only passes whose number differs between ranks (generation stops
  at EOS on each rank) run on parameters unsharded once, so no forward needs a collective;
- checkpoints hold full (unsharded) weights and an optimizer state in the single-process
  layout, gathered to every rank's CPU, so a checkpoint written under N ranks loads under the
  local backend and the other way round.

Log-probs of a sharded model come from its own forward and logits (``fused_head`` is None):
calling the decoder body directly would skip the root unit's all-gather, so neither the
fused output head nor the shared-prompt prefill of ``lmrl.models.forward`` applies. The
results are the same in exact arithmetic; memory holds a (micro-batch, T, V) logits tensor.

``param_offload`` keeps the sharded parameters (and their gradients and optimizer step) on the
CPU between uses (``CPUOffloadPolicy``); ``optimizer_offload`` alone does the same (FSDP2 keeps
the optimizer state with its parameters, so offloading one offloads both). On a CPU mesh the
shards already live there: the policy runs (unpinned), and moves nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

from lmrl.batch import Batch
from lmrl.models.grad import wire_device
from lmrl.models.loading import refuse_other_shapes
from lmrl.workers.dist import DDP

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import OptimizerStateType, ValueType
    from torch.distributed.fsdp import FSDPModule

__all__ = ["FSDP2"]


class FSDP2(DDP):
    """Sharded data parallelism.

    Args:
        rank, world_size: this process's place in the default process group.
        param_offload, optimizer_offload: keep shards on the CPU between uses (verl's
            ``fsdp_config`` flags; either turns on ``CPUOffloadPolicy``).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        param_offload: bool = False,
        optimizer_offload: bool = False,
    ) -> None:
        super().__init__(rank, world_size)
        self.offload = param_offload or optimizer_offload
        self.model: nn.Module | None = None

    # ---------------------------------------------------------------------- sharding
    def prepare(self, model: nn.Module, precision=None) -> nn.Module:
        self._shard(model, precision)
        for unit in self._units(model):  # each unit's own setting: sum, not mean
            unit.set_gradient_divide_factor(1.0)
            # and reduced with SUM: a factor in float32/bf16 otherwise becomes NCCL's
            # PREMUL_SUM(1/factor), which gloo lacks (float64 already takes the SUM path)
            unit.set_force_sum_reduction_for_comms(True)
        self.model = model
        return model

    def prepare_frozen(self, model: nn.Module, precision=None) -> nn.Module:
        """The reference's frozen copy, sharded like the policy (gathered for each forward)."""
        self._shard(model, precision)
        return model

    def _shard(self, model: nn.Module, precision=None) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (self.world_size,))
        # pinned host memory needs an accelerator; on a CPU mesh the shards already live there
        pinned = device.type != "cpu"
        policy = CPUOffloadPolicy(pin_memory=pinned) if self.offload else OffloadPolicy()
        # the shards are the masters; a mixed precision all-gathers them cast to its compute
        # dtype and reduce-scatters the gradients in its reduce dtype before they land on the
        # masters' shards
        mp = MixedPrecisionPolicy()
        if precision is not None:
            mp = MixedPrecisionPolicy(
                param_dtype=precision.compute if precision.mixed else None,
                reduce_dtype=precision.reduce,
            )
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=mesh, offload_policy=policy, mp_policy=mp)
        fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=mp)

    def _units(self, model: nn.Module) -> list[FSDPModule]:
        from torch.distributed.fsdp import FSDPModule

        return [m for m in model.modules() if isinstance(m, FSDPModule)]

    # ---------------------------------------------------------------- the update loop
    def micro_batches(self, batch: Batch, size: int) -> list[Batch]:
        count = torch.tensor([-(-len(batch) // size)], dtype=torch.long, device=wire_device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        n = int(count)
        pieces = batch.chunk(n) if len(batch) else [batch] * n
        return [p if len(p) else _masked_copy(batch) for p in pieces]

    def sync_grads(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        # a model this data parallelism prepared: fully_shard made it an FSDPModule
        cast("FSDPModule", model).set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def reduce_grads(self, params: list[nn.Parameter]) -> None:
        """Nothing: the last micro-batch's backward reduce-scattered them."""

    @contextlib.contextmanager
    def full_params(self, model: nn.Module) -> Iterator[None]:
        units = self._units(model)
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(True, recurse=False)

    # ------------------------------------------------------------------- checkpoints
    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full weights on rank 0's CPU; ``{}`` on the other ranks (the gather is collective)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False
        )
        # a model's full state dict holds tensors only (ValueType covers optimizer states too)
        state = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
        for name in _tied_duplicates(model):
            state.pop(name, None)  # saved once, as the single process saves it
        return {k: v.contiguous() for k, v in state.items()}

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        refuse_other_shapes(model, state)
        full: dict[str, ValueType] = dict(state)
        for name, source in _tied_duplicates(model).items():
            if name not in full and source in full:
                full[name] = full[source]
        options = StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(model, full, options=options)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The full state in ``torch.optim``'s own layout (parameters by index) on rank 0;
        ``{}`` on the others (gathering with ``cpu_offload`` keeps it on rank 0 only)."""
        from torch.distributed.checkpoint.state_dict import (
            DictValueType,
            ListDictValueType,
            StateDictOptions,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        by_name = get_optimizer_state_dict(model, optimizer, options=options)
        if not by_name:
            return {}
        names = _trainable_names(model)
        index = {n: i for i, n in enumerate(names)}
        # keyed by parameter name: "state" a dict, "param_groups" a list of dicts whose
        # "params" are names (the casts torch's own _flatten_optim_state_dict makes)
        groups = []
        for group in cast(ListDictValueType, by_name["param_groups"]):
            params = cast(list[str], group["params"])
            groups.append({**group, "params": [index[n] for n in params]})
        state = {index[n]: s for n, s in cast(DictValueType, by_name["state"]).items()}
        return {"state": state, "param_groups": groups}

    def load_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        names = _trainable_names(model)
        by_name: OptimizerStateType = {
            "state": {names[int(i)]: s for i, s in state["state"].items()},
            "param_groups": [
                {**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]
            ],
        }
        set_optimizer_state_dict(
            model, optimizer, by_name, options=StateDictOptions(full_state_dict=True)
        )


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face decoder (``model.layers`` or ``h``), if found."""
    for module in model.modules():
        for name in ("layers", "h"):
            blocks = getattr(module, name, None)
            if isinstance(blocks, nn.ModuleList) and len(blocks):
                return list(blocks)
    return []


def _trainable_names(model: nn.Module) -> list[str]:
    """Names of the trainable parameters in ``model.parameters()`` order (the optimizer's)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _tied_duplicates(model: nn.Module) -> dict[str, str]:
    """``{name: first name}`` of parameters that are the same tensor as an earlier one."""
    seen: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied[name] = seen[id(p)]
        else:
            seen[id(p)] = name
    return tied


def _masked_copy(batch: Batch) -> Batch:
    """One row of ``batch`` with every training mask False: a forward that adds nothing.

    The row still runs through the model (the collectives of the forward and backward line up
    with the other ranks'), but its loss terms are masked out, so its gradient is exactly 0.
    """
    row = batch.index([0])
    for key in ("response_mask", "loss_mask"):
        if key in row:
            row[key] = torch.zeros_like(row[key])
    return row
