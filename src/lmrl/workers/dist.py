"""Data parallelism inside a trainable worker: which rows a rank trains on, and its collectives.

A worker of a Ray group is one ``torch.distributed`` rank. For an update every rank holds the
*whole* batch: the mini-batch loop (epochs, shuffling with the worker's generator) runs
identically everywhere, the loss normalizers (``AggNorm``: global token and sequence counts)
come from the whole mini-batch, and each rank forwards and backwards only its share of the
mini-batch's rows (`DataParallel.shard`: whole prompt groups, balanced by token count). Each rank's loss is then its
share of the mini-batch loss, so the SUM of the ranks' gradients is the single-process
gradient, and the optimizer step that follows is the same on every rank. The per-rank metrics
are shares too and are summed the same way.

Sending every rank the whole batch costs one object-store copy per node, not one per rank, and
buys exactness for any mini-batch, epoch and shuffle setting (no mini-batch is cut differently
from the local run). The forward-only passes (log-probs, values, generation) are split across
ranks by the worker group instead, since their rows are independent.

``DataParallel`` is the one-rank case (every method a no-op, what the local backend uses);
``DDP`` all-reduces gradients over gloo (CPU) or NCCL (GPU); ``lmrl.workers.fsdp.FSDP2``
shards parameters, gradients and optimizer state.

The ranks meet at a rendezvous (`rendezvous_store`) served on a port the system picks and
holds from then on, and join the group through it (`join_process_group`). A port found free
and closed again for the ranks to bind later can be taken meanwhile by any process of the
machine: rank 0 then fails to bind it, and a rank of another group can join the wrong one.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lmrl.batch import Batch
from lmrl.models.grad import wire_device
from lmrl.models.layout import MicroLayout, distinct_rows
from lmrl.models.loading import refuse_other_shapes

__all__ = [
    "DDP",
    "DataParallel",
    "balanced_partition",
    "join_process_group",
    "model_state",
    "partition_rows",
    "rendezvous_store",
    "row_tokens",
]

RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=30)


def rendezvous_store(host: str, timeout: datetime.timedelta = RENDEZVOUS_TIMEOUT) -> dist.TCPStore:
    """The rendezvous of one process group: a ``TCPStore`` served from this process on
    ``host`` at a port the system picks (``.port``), bound from now until the store is dropped,
    so no other process can take it before the ranks arrive."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)


def join_process_group(
    backend: str, rank: int, world_size: int, address: tuple[str, int],
    store: dist.Store | None = None, timeout: datetime.timedelta = RENDEZVOUS_TIMEOUT,
) -> None:  # fmt: skip
    """Join the default process group at the rendezvous ``address`` (host, port), as a client
    of its store, or through ``store`` itself in the process that serves it."""
    if store is None:
        host, port = address
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)  # fmt: skip


def row_tokens(batch: Batch) -> torch.Tensor:
    """Tokens each row costs a forward pass: ``attention_mask.sum(-1)``, (B,) long."""
    return batch["attention_mask"].long().sum(-1)


def partition_rows(batch: Batch, parts: int) -> list[np.ndarray]:
    """The rows of each rank: whole prompt groups, balanced by token count.

    The samples of one prompt stay together (when there are at least ``parts`` distinct
    prompts), so a rank's forward runs each of its prompts once (the shared-prompt prefill of
    ``lmrl.models.forward``) exactly as the single process does: the same sums in the same
    groups, and no prompt prefilled on two ranks. Otherwise rows are balanced one by one.

    Args:
        batch: ``input_ids`` (B, P + T), ``responses`` (B, T), ``attention_mask``; the groups
            and token counts are the host's layout of the rows where the batch carries one
            (`lmrl.models.layout`: nothing is read back from the device).
        parts: ranks.
    Returns:
        ``parts`` sorted row-index arrays covering ``range(B)`` once.
    """
    layout = MicroLayout.of(batch)
    if layout is not None:
        tokens = layout.spans[:, 2]  # `RowSpan.count`: the row's attended columns
        _, rows = np.unique(layout.groups, return_inverse=True)
    else:
        tokens = row_tokens(batch).cpu().numpy()
        prompt_width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
        rows = distinct_rows(batch["input_ids"][:, :prompt_width])[1].cpu().numpy()
    groups = int(rows.max()) + 1 if len(rows) else 0
    if groups < parts:
        return balanced_partition(tokens, parts)
    load = np.bincount(rows, weights=tokens, minlength=groups).astype(np.int64)
    return [np.flatnonzero(np.isin(rows, g)) for g in balanced_partition(load, parts)]


def balanced_partition(lengths: torch.Tensor | np.ndarray, parts: int) -> list[np.ndarray]:
    """Split rows into ``parts`` groups of (almost) equal count and token load.

    Greedy longest-first: rows sorted by length (longest first, ties by index), each placed
    on the least-loaded group that still has room; groups hold ``ceil(B / parts)`` or one
    fewer rows, so every group is non-empty when ``B >= parts``. Deterministic: every rank
    computes the same partition from the same lengths.

    Args:
        lengths: (B,) tokens per row.
        parts: number of groups (ranks).
    Returns:
        ``parts`` sorted index arrays that together cover ``range(B)`` once.
    """
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.cpu().numpy()
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    capacity = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    load = np.zeros(parts, dtype=np.int64)
    groups: list[list[int]] = [[] for _ in range(parts)]
    for row in sorted(range(n), key=lambda i: (-lengths[i], i)):
        open_ = [g for g in range(parts) if len(groups[g]) < capacity[g]]
        g = min(open_, key=lambda g: (load[g], g))
        groups[g].append(row)
        load[g] += lengths[row]
    return [np.array(sorted(g), dtype=np.int64) for g in groups]


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, contiguous, detached, on CPU (tied weights saved once)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue  # safetensors refuses shared storage; the tie is restored on load
        seen.add(tensor.data_ptr())
        out[name] = tensor.detach().contiguous().cpu()
    return out


class DataParallel:
    """One rank: the local backend's data parallelism, where every method changes nothing.

    Subclasses override what their strategy needs; the workers call every hook the same way
    whatever the strategy.
    """

    rank: int = 0
    world_size: int = 1
    comm_s: float = 0.0  # seconds spent in this strategy's own collectives (benchmarks)

    def prepare(self, model: nn.Module, precision=None) -> nn.Module:
        """Called once on a freshly built model, before its optimizer is made.

        ``precision``: its `lmrl.workers.precision.Precision` (the gradient reduction dtype,
        FSDP2's compute dtype); None = the model's own dtype everywhere.
        """
        return model

    def prepare_frozen(self, model: nn.Module, precision=None) -> nn.Module:
        """Called once on a model that is never trained (the reference's frozen copy)."""
        return model

    def shard(self, batch: Batch) -> Batch:
        """This rank's rows of a mini-batch that every rank holds whole."""
        return batch

    def micro_batches(self, batch: Batch, size: int) -> list[Batch]:
        """This rank's micro-batches of ``size`` rows (of its shard)."""
        return batch.split(size) if len(batch) else []

    def sync_grads(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward and backward; ``last`` = the mini-batch's final."""
        return contextlib.nullcontext()

    def reduce_grads(self, params: list[nn.Parameter]) -> None:
        """After a mini-batch's micro-batches: make every rank's gradients the global sum."""

    def reduce_stats(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A mini-batch's metrics (each rank's share) summed over the ranks."""
        return stats

    def full_params(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Around forward-only passes whose number differs between ranks (generation)."""
        return contextlib.nullcontext()

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full weights, as CPU tensors under the model's own (HF) names."""
        return model_state(model)

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load full weights (as `model_state` wrote them; tied weights restored).

        Raises:
            ValueError: weights of another model (`refuse_other_shapes`).
            KeyError: tensors the model lacks, or that the weights lack.
        """
        refuse_other_shapes(model, state)
        missing, unexpected = model.load_state_dict(state, strict=False)
        current = model.state_dict()
        saved = {current[n].data_ptr() for n in state if n in current}
        untied = [n for n in missing if current[n].data_ptr() not in saved]
        if unexpected or untied:
            raise KeyError(f"weights do not fit the model: unexpected {unexpected[:5]}, "
                           f"missing {untied[:5]}")  # fmt: skip

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's full state, loadable by a single-process run."""
        return optimizer.state_dict()

    def load_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        optimizer.load_state_dict(state)


class DDP(DataParallel):
    """Replicated weights; gradients all-reduced (SUM) once per mini-batch.

    The gradients are flattened into one buffer per dtype and reduced in a single collective
    (a mini-batch is one optimizer step, so there is nothing to overlap with here), in the
    precision's ``reduce`` dtype (fp32 by default; mixed precision's gradients are the fp32
    masters' already, pure bf16's are upcast for the sum and cast back).

    Args:
        rank, world_size: this process's place in the default process group.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.comm_s = 0.0
        self.reduce_dtype: torch.dtype | None = None  # None = each gradient's own dtype

    @contextlib.contextmanager
    def _timed_comm(self) -> Iterator[None]:
        """Add the wall time of the collectives inside to ``comm_s`` (gloo's are blocking; an
        NCCL figure is the launch time only, the GPU runs them asynchronously)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.comm_s += time.perf_counter() - start

    def prepare(self, model: nn.Module, precision=None) -> nn.Module:
        self.reduce_dtype = precision.reduce if precision is not None else None
        # every rank loaded the same weights; make sure (a value head drawn differently would
        # silently train ``world_size`` different critics)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        return model

    def shard(self, batch: Batch) -> Batch:
        if len(batch) < self.world_size:
            raise ValueError(
                f"a mini-batch of {len(batch)} rows cannot feed {self.world_size} ranks: "
                "raise actor.ppo_mini_batch_size (prompts) or lower resources.n_gpus_per_node"
            )
        return batch.index(partition_rows(batch, self.world_size)[self.rank])

    def reduce_grads(self, params: list[nn.Parameter]) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}  # the parameters' gradients
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for dtype, group in by_dtype.items():
            # in reduce_dtype (fp32: the masters' gradients already are; pure bf16 upcasts)
            flat = torch.cat([grad.reshape(-1) for grad in group]).to(self.reduce_dtype or dtype)
            with self._timed_comm():
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for grad, g in zip(group, _unflatten(flat, group), strict=True):
                grad.copy_(g)

    def reduce_stats(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        keys = sorted(stats)
        every: list[list[str]] = [[] for _ in range(self.world_size)]  # one per rank, filled
        with self._timed_comm():
            dist.all_gather_object(every, keys)
        if any(k != keys for k in every):  # a key only some ranks produced counts 0 elsewhere
            keys = sorted({k for ks in every for k in ks})
        device = next((v.device for v in stats.values() if torch.is_tensor(v)), None)
        values = torch.stack(
            [torch.as_tensor(stats.get(k, 0.0), dtype=torch.float64).cpu() for k in keys]
        ).to(wire_device())
        with self._timed_comm():
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return {k: v.to(device or "cpu") for k, v in zip(keys, values, strict=True)}


def _unflatten(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    start = 0
    for p in params:
        yield flat[start : start + p.numel()].view_as(p)
        start += p.numel()
