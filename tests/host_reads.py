"""`HostReads`: the torch operators run in a block that would make the host wait on a GPU.

On a CPU nothing waits, so a test there cannot time it; what it can do is see the operators
whose result the host must read before it goes on: a value read (``.item()``, ``.tolist()``,
``int()``, ``bool()``), a result whose size depends on the data (``nonzero``, ``unique``,
boolean-mask indexing, ``masked_select``), ``torch.equal``, and a tensor built from host data
(``torch.tensor([...])``, which on a GPU is a blocking copy). On CUDA,
``torch.cuda.set_sync_debug_mode("error")`` is the check; this is its CPU stand-in.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = {
    aten._local_scalar_dense,
    aten.is_nonzero,
    aten.equal,
    aten.nonzero,
    aten.masked_select,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class HostReads(TorchDispatchMode):
    """Records ``(operator, where in lmrl)`` for each host read run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if (
            packet in READS
            or (packet is aten.repeat_interleave and kwargs.get("output_size") is None)
            or (packet in INDEXING and _bool_index(args))
            or (packet is aten.lift_fresh and args[0].dim() > 0)
        ):
            self.reads.append((str(func), _lmrl_frame()))
        return func(*args, **kwargs)


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _lmrl_frame() -> str:
    """The innermost frame in lmrl's sources, as ``file:line function``."""
    for frame in reversed(traceback.extract_stack()):
        if "/lmrl/" in frame.filename and "/tests/" not in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "?"
