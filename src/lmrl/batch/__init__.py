"""The `Batch`: the one object passed between the stages of a training step.

A `Batch` holds ``N`` rows (one per sequence) as

- ``tensors``: a ``tensordict.TensorDict`` with ``batch_size [N]``; every tensor has ``N``
  rows, e.g. ``prompts`` (N, P), ``responses`` (N, T), ``response_mask`` (N, T) bool;
- ``non_tensors``: per-row Python values (``uid``, ``data_source``, ``ground_truth``,
  ``extra_info``, ``raw_prompt``...) as 1-D numpy arrays of ``dtype=object`` and length ``N``;
- ``meta``: batch-level information (sampling temperature, timings) that is never sliced and
  is carried over (shallow-copied) by every operation that returns a new `Batch`.

The choice made here: a `Batch` is a thin checked container; its keys are declared apart, in
`lmrl.batch.schema` (dtype, shape, role, meaning, the one stage that writes each). A stage
reads the keys it needs and adds its own with ``batch[key] = value``; every write checks that
the value has ``N`` rows and raises a ``ValueError`` naming the key otherwise, and with
``LMRL_STRICT_BATCH=1`` (the tests) that the key is declared there. Operations that return a
new `Batch` (``index``, ``split``, ``select``...) share or slice the tensors, they never copy
``meta``'s values. ``concat`` requires equal trailing shapes (no implicit re-padding): padding
is the producer's job, with `pad_2d`.

The module also holds the padding helpers used to build batches: `pad_2d` and
`lengths_to_mask`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import numpy as np
import torch
from tensordict import TensorDict

from lmrl.batch.schema import ColumnKey, TensorKey, check_write, strict

__all__ = ["Batch", "last_true", "lengths_to_mask", "pad_2d", "response_tokens_mask"]

Index = torch.Tensor | np.ndarray | Sequence[int] | slice | int


def _as_object_column(key: str, value: Any) -> np.ndarray:
    """Turn a sequence of per-row values into a 1-D ``dtype=object`` numpy array.

    Elements are kept as they are (a list element stays a list, it is not broadcast into a
    second dimension).
    """
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        raise ValueError(
            f"non-tensor column {key!r} must be a sequence or numpy array with one value per "
            f"row, got {type(value).__name__}"
        )
    if isinstance(value, np.ndarray) and value.ndim == 0:
        raise ValueError(f"non-tensor column {key!r} must be 1-D, got a 0-d numpy array")
    column = np.empty(len(value), dtype=object)
    for i, item in enumerate(value):
        column[i] = item
    return column


def _same_column(a: Any, b: Any) -> bool:
    """True when two columns (tensors or object arrays) hold the same values."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b.to(a.device))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.shape != b.shape:
            return False
        for x, y in zip(a, b, strict=True):
            if x is y:
                continue
            try:
                equal = x == y
                if not isinstance(equal, bool):
                    equal = bool(np.all(equal))
            except (TypeError, ValueError):
                return False
            if not equal:
                return False
        return True
    return False


class Batch:
    """(N, L) tensors under string keys plus per-row non-tensor columns and batch-level meta.

    Args:
        tensors: tensors with ``N`` rows each (leading dimension ``N``), e.g. ``input_ids``
            (N, P+T). Stored in a ``TensorDict`` with ``batch_size [N]``.
        non_tensors: per-row values, one sequence (or numpy array) of length ``N`` per key;
            stored as 1-D ``dtype=object`` numpy arrays.
        meta: batch-level information, never sliced.

    ``N`` is taken from the first tensor (or the first column when there are no tensors); a
    `Batch` without any key has ``N = 0`` until its first key is set. A key lives either among
    the tensors or among the non-tensors, never both.

    Raises:
        ValueError: a value whose length differs from ``N``, a 0-d tensor, a string given as a
            column, or a key given both as a tensor and as a non-tensor.
        lmrl.batch.schema.UndeclaredKeyError: in strict mode, a key the schema does not
            declare (or a tensor under a column's key, or the reverse).
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor] | TensorDict | None = None,
        non_tensors: dict[str, Sequence | np.ndarray] | None = None,
        meta: dict | None = None,
    ) -> None:
        tensors = dict(tensors.items()) if tensors is not None else {}
        non_tensors = dict(non_tensors) if non_tensors is not None else {}
        both = sorted(set(tensors) & set(non_tensors))
        if both:
            raise ValueError(f"keys {both} given both as tensors and as non-tensors")
        n = None
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"tensor {key!r} must be a torch.Tensor, got {type(value).__name__}; "
                    "put per-row Python values in non_tensors"
                )
            if value.dim() == 0:
                raise ValueError(f"tensor {key!r} must have a leading batch dimension, got 0-d")
            if n is None:
                n = value.shape[0]
            elif value.shape[0] != n:
                raise ValueError(
                    f"tensor {key!r} has {value.shape[0]} rows, expected {n} "
                    f"(rows of the first tensor {next(iter(tensors))!r})"
                )
        if strict():
            for key in tensors:
                check_write(key, True)
            for key in non_tensors:
                check_write(key, False)
        columns = {key: _as_object_column(key, value) for key, value in non_tensors.items()}
        for key, column in columns.items():
            if n is None:
                n = len(column)
            elif len(column) != n:
                raise ValueError(f"non-tensor column {key!r} has {len(column)} rows, expected {n}")
        self._n = 0 if n is None else n
        self.tensors: TensorDict = TensorDict(tensors, batch_size=[self._n])
        self.non_tensors: dict[str, np.ndarray] = columns
        self.meta: dict = dict(meta) if meta is not None else {}

    # ----------------------------------------------------------------- dict-like access
    def __len__(self) -> int:
        return self._n

    @property
    def batch_size(self) -> int:
        """The number of rows ``N`` (same as ``len(batch)``)."""
        return self._n

    def keys(self) -> list[str]:
        """All keys: the tensor keys, then the non-tensor keys."""
        return self.tensor_keys() + self.non_tensor_keys()

    def tensor_keys(self) -> list[str]:
        """The keys of the tensors."""
        return list(self.tensors.keys())

    def non_tensor_keys(self) -> list[str]:
        """The keys of the non-tensor columns."""
        return list(self.non_tensors)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (key in self.non_tensors or self._has_tensor(key))

    @overload
    def __getitem__(self, key: TensorKey) -> torch.Tensor: ...
    @overload
    def __getitem__(self, key: ColumnKey) -> np.ndarray: ...
    @overload
    def __getitem__(self, key: str) -> torch.Tensor | np.ndarray: ...

    def __getitem__(self, key: str) -> torch.Tensor | np.ndarray:
        """The tensor or the non-tensor column stored under ``key``.

        Raises:
            KeyError: ``key`` is not in the batch (the message lists the keys there are).
        """
        if not isinstance(key, str):
            raise TypeError(
                f"Batch keys are strings, got {type(key).__name__}; use batch.index(...) "
                "to select rows"
            )
        if key in self.non_tensors:
            return self.non_tensors[key]
        if self._has_tensor(key):
            return self.tensors[key]
        raise KeyError(f"{key!r} is not in the batch; keys: {self.keys()}")

    def get(self, key: str, default: Any = None) -> Any:
        """``batch[key]`` if the key is there, else ``default``."""
        try:
            return self[key]
        except KeyError:
            return default

    def _has_tensor(self, key: str) -> bool:
        # TensorDict refuses ``key in td``: membership goes through its keys view.
        return key in self.tensors.keys()  # noqa: SIM118

    def __setitem__(self, key: str, value: Any) -> None:
        """Store a tensor (leading dimension ``N``) or a per-row column (length ``N``).

        A tensor goes to ``tensors``, anything else (a list, a numpy array) to
        ``non_tensors`` as an object array. Setting a key replaces it wherever it was. In a
        `Batch` without any key, the first value sets ``N``.

        Raises:
            ValueError: the value does not have ``N`` rows, or is a 0-d tensor or a string.
            lmrl.batch.schema.UndeclaredKeyError: in strict mode, a key the schema does not
                declare (or a tensor under a column's key, or the reverse).
        """
        if not isinstance(key, str):
            raise TypeError(f"Batch keys are strings, got {type(key).__name__}")
        if strict():
            check_write(key, isinstance(value, torch.Tensor))
        empty = not self.keys()
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                raise ValueError(f"tensor {key!r} must have a leading batch dimension, got 0-d")
            rows = value.shape[0]
            if rows != self._n and not empty:
                raise ValueError(f"tensor {key!r} has {rows} rows, the batch has {self._n}")
            if empty and rows != self._n:
                self._n = rows
                self.tensors = TensorDict({}, batch_size=[rows])
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
            return
        column = _as_object_column(key, value)
        if len(column) != self._n and not empty:
            raise ValueError(
                f"non-tensor column {key!r} has {len(column)} rows, the batch has {self._n}"
            )
        if empty and len(column) != self._n:
            self._n = len(column)
            self.tensors = TensorDict({}, batch_size=[self._n])
        if self._has_tensor(key):
            del self.tensors[key]
        self.non_tensors[key] = column

    def __delitem__(self, key: str) -> None:
        if key in self.non_tensors:
            del self.non_tensors[key]
        elif self._has_tensor(key):
            del self.tensors[key]
        else:
            raise KeyError(f"{key!r} is not in the batch; keys: {self.keys()}")

    def pop(self, key: str, *default: Any) -> Any:
        """Remove ``key`` and return its value (or ``default`` when given and the key is absent)."""
        if key not in self:
            if default:
                return default[0]
            raise KeyError(f"{key!r} is not in the batch; keys: {self.keys()}")
        value = self[key]
        del self[key]
        return value

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
            for k, v in self.tensors.items()
        )
        return (
            f"Batch(N={self._n}, tensors={{{tensors}}}, "
            f"non_tensors={self.non_tensor_keys()}, meta={sorted(self.meta)})"
        )

    # ----------------------------------------------------------------- new batches
    def _new(self, tensors: TensorDict, non_tensors: dict[str, np.ndarray], n: int) -> Batch:
        """A batch from already-checked parts (no re-validation, ``meta`` shallow-copied)."""
        out = Batch.__new__(Batch)
        out._n = n
        out.tensors = tensors
        out.non_tensors = non_tensors
        out.meta = dict(self.meta)
        return out

    def select(self, *keys: str) -> Batch:
        """A batch with only ``keys`` (tensors shared, not copied); ``meta`` is kept.

        Raises:
            KeyError: a key is not in the batch.
        """
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"keys {missing} are not in the batch; keys: {self.keys()}")
        tensor_keys = [k for k in keys if self._has_tensor(k)]
        tensors = self.tensors.select(*tensor_keys) if tensor_keys else self._empty_tensors()
        non_tensors = {k: self.non_tensors[k] for k in keys if k in self.non_tensors}
        return self._new(tensors, non_tensors, self._n)

    def _empty_tensors(self, n: int | None = None) -> TensorDict:
        return TensorDict({}, batch_size=[self._n if n is None else n])

    def index(self, idx: Index) -> Batch:
        """The rows picked by ``idx``, in that order (reorder, filter or repeat rows).

        Args:
            idx: a slice, an int (a one-row batch), a sequence / numpy array / tensor of row
                indices (negative allowed, repeats allowed), or a bool mask of length ``N``.
        Returns:
            A new `Batch` (tensors gathered, ``meta`` kept).

        Raises:
            ValueError: a bool mask of the wrong length, or indices that are not integers.
            IndexError: an index out of range.
        """
        if isinstance(idx, slice):
            rows = np.arange(self._n)[idx]
            if idx.step is None or idx.step == 1:
                tensors = self.tensors[idx]
                non_tensors = {k: v[idx] for k, v in self.non_tensors.items()}
                return self._new(tensors, non_tensors, len(rows))
            idx = rows
        if isinstance(idx, int | np.integer):
            idx = [int(idx)]
        if isinstance(idx, torch.Tensor):
            idx = idx.detach().cpu().numpy()
        idx = np.asarray(idx)
        if idx.ndim != 1:
            raise ValueError(f"idx must be 1-D, got shape {idx.shape}")
        if idx.dtype == bool:
            if len(idx) != self._n:
                raise ValueError(f"bool idx has length {len(idx)}, the batch has {self._n} rows")
            idx = np.flatnonzero(idx)
        elif idx.size == 0:
            idx = idx.astype(np.int64)
        elif not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"idx must hold integers or bools, got dtype {idx.dtype}")
        if idx.size and (idx.max() >= self._n or idx.min() < -self._n):
            raise IndexError(f"row index out of range for a batch of {self._n} rows")
        rows = torch.as_tensor(idx % max(self._n, 1), dtype=torch.long)
        if self.tensor_keys():
            tensors = self.tensors[rows.to(self._tensor_device())]
        else:
            tensors = self._empty_tensors(len(idx))
        non_tensors = {k: v[idx] for k, v in self.non_tensors.items()}
        return self._new(tensors, non_tensors, len(idx))

    def _tensor_device(self) -> torch.device:
        first = next(iter(self.tensors.values()), None)
        return first.device if first is not None else torch.device("cpu")

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of ``size`` rows (the last one may be smaller).

        Raises:
            ValueError: ``size`` < 1.
        """
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"split size must be a positive int, got {size!r}")
        return [self.index(slice(start, start + size)) for start in range(0, self._n, size)]

    def chunk(self, n: int) -> list[Batch]:
        """``n`` consecutive pieces whose sizes differ by at most one (larger ones first).

        Like ``numpy.array_split``: exactly ``n`` pieces, some empty when ``n > N``.

        Raises:
            ValueError: ``n`` < 1.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"chunk count must be a positive int, got {n!r}")
        base, extra = divmod(self._n, n)
        pieces, start = [], 0
        for i in range(n):
            stop = start + base + (1 if i < extra else 0)
            pieces.append(self.index(slice(start, stop)))
            start = stop
        return pieces

    def repeat_interleave(self, n: int) -> Batch:
        """Each row ``n`` times in a row: rows ``[a, b]`` become ``[a, a, b, b]`` for ``n=2``.

        This is how the ``G`` samples of a prompt are laid out (contiguously).

        Raises:
            ValueError: ``n`` < 1.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"repeat count must be a positive int, got {n!r}")
        return self.index(np.repeat(np.arange(self._n), n))

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Stack batches along the rows; ``meta`` is the first batch's.

        All batches must have the same keys, and each tensor the same trailing shape and
        dtype (no implicit re-padding: pad first with `pad_2d`).

        Raises:
            ValueError: no batches, different keys, or a tensor whose trailing shape or dtype
                differs (the message names the key).
        """
        batches = list(batches)
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        t_keys, nt_keys = set(first.tensor_keys()), set(first.non_tensor_keys())
        for i, b in enumerate(batches[1:], start=1):
            if set(b.tensor_keys()) != t_keys or set(b.non_tensor_keys()) != nt_keys:
                raise ValueError(
                    f"batch {i} has keys {sorted(b.keys())}, batch 0 has {sorted(first.keys())}"
                )
            for key in t_keys:
                a, c = first.tensors[key], b.tensors[key]
                if a.shape[1:] != c.shape[1:] or a.dtype != c.dtype:
                    raise ValueError(
                        f"tensor {key!r}: batch {i} has trailing shape {tuple(c.shape[1:])} "
                        f"{c.dtype}, batch 0 has {tuple(a.shape[1:])} {a.dtype}"
                    )
        n = sum(len(b) for b in batches)
        if t_keys:
            tensors = torch.cat([b.tensors for b in batches], dim=0)
        else:
            tensors = TensorDict({}, batch_size=[n])
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in nt_keys}
        non_tensors = {k: non_tensors[k] for k in first.non_tensor_keys()}
        return first._new(tensors, non_tensors, n)

    def to(self, device: torch.device | str) -> Batch:
        """A batch with every tensor on ``device`` (non-tensors and ``meta`` unchanged)."""
        tensors = TensorDict(
            {k: v.to(device) for k, v in self.tensors.items()}, batch_size=[self._n]
        )
        return self._new(tensors, dict(self.non_tensors), self._n)

    def union(self, other: Batch) -> Batch:
        """A batch with the keys of both (same ``N``); ``meta`` merged, ``other``'s winning.

        A key present in both must hold the same values in both.

        Raises:
            ValueError: different ``N``, or a shared key with different values.
        """
        if len(other) != self._n:
            raise ValueError(f"union of batches of {self._n} and {len(other)} rows")
        tensors = self.tensors.clone(recurse=False)
        non_tensors = dict(self.non_tensors)
        for key in other.tensor_keys() + other.non_tensor_keys():
            value = other[key]
            if key in self and not _same_column(self[key], value):
                raise ValueError(f"key {key!r} is in both batches with different values")
            if isinstance(value, torch.Tensor):
                if key in non_tensors:
                    raise ValueError(f"key {key!r} is a tensor in one batch, a column in the other")
                tensors[key] = value
            else:
                if self._has_tensor(key):
                    raise ValueError(f"key {key!r} is a tensor in one batch, a column in the other")
                non_tensors[key] = value
        out = self._new(tensors, non_tensors, self._n)
        out.meta.update(other.meta)
        return out


def pad_2d(
    seqs: Sequence[Sequence[int] | torch.Tensor],
    pad_value: int | float,
    side: str = "right",
    length: int | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Stack 1-D sequences of different lengths into one (N, L) tensor, padded on one side.

    Prompts are padded on the ``"left"`` (the last prompt token of every row is at column
    ``L - 1``, where generation continues), responses on the ``"right"``.

    Args:
        seqs: N sequences (lists of numbers or 1-D tensors).
        pad_value: the value written in the padding, e.g. the tokenizer's pad id, ``0`` or
            ``False``.
        side: ``"left"`` or ``"right"``.
        length: the width ``L``; default the longest sequence.
        dtype: the result's dtype; default the first tensor's dtype, or ``torch.long`` for
            lists.
    Returns:
        (N, L) tensor.

    Raises:
        ValueError: ``side`` is not left/right, a sequence is not 1-D, or is longer than
            ``length``.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    rows = [s if isinstance(s, torch.Tensor) else torch.as_tensor(list(s)) for s in seqs]
    for i, r in enumerate(rows):
        if r.dim() != 1:
            raise ValueError(f"seqs[{i}] must be 1-D, got shape {tuple(r.shape)}")
    if dtype is None:
        given = [s for s in seqs if isinstance(s, torch.Tensor)]
        dtype = given[0].dtype if given else torch.long
    longest = max((len(r) for r in rows), default=0)
    width = longest if length is None else length
    if longest > width:
        raise ValueError(f"a sequence of length {longest} does not fit length={width}")
    device = rows[0].device if rows else None
    out = torch.full((len(rows), width), pad_value, dtype=dtype, device=device)
    for i, r in enumerate(rows):
        if len(r) == 0:
            continue
        if side == "right":
            out[i, : len(r)] = r.to(dtype)
        else:
            out[i, width - len(r) :] = r.to(dtype)
    return out


def lengths_to_mask(
    lengths: torch.Tensor | Sequence[int], length: int | None = None, side: str = "right"
) -> torch.Tensor:
    """Bool (N, L) mask with ``lengths[i]`` True positions per row, on the ``side`` given.

    Args:
        lengths: (N,) number of valid positions per row.
        length: the width ``L``; default ``max(lengths)``.
        side: ``"right"`` padding (valid positions first) or ``"left"`` (valid positions last).
    Returns:
        bool (N, L); e.g. ``lengths_to_mask([1, 3], side="left")`` is
        ``[[False, False, True], [True, True, True]]``.

    Raises:
        ValueError: ``side`` is not left/right, or a length is negative or exceeds ``length``.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D, got shape {tuple(lengths.shape)}")
    width = int(lengths.max()) if length is None and lengths.numel() else (length or 0)
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > width):
        raise ValueError(f"lengths must lie in [0, {width}], got {lengths.tolist()}")
    positions = torch.arange(width, device=lengths.device)
    if side == "right":
        return positions[None, :] < lengths[:, None]
    return positions[None, :] >= (width - lengths)[:, None]


def response_tokens_mask(batch: Any) -> torch.Tensor:
    """bool (B, T): the real response tokens of a rollout batch, the ones the model reads.

    That is ``attention_mask``'s last T columns when the batch has one, else
    ``response_mask``. The two differ in a multi-turn rollout under state masking: tool
    observations are read (here) but not trained (not in ``response_mask``).
    """
    width = batch["responses"].shape[1]
    if "attention_mask" in batch:
        return batch["attention_mask"][:, -width:].bool()
    return batch["response_mask"].bool()


def last_true(mask: torch.Tensor) -> torch.Tensor:
    """(B,) long: the index of each row's last True of ``mask`` (B, T); 0 for an all-False
    row. A prefix mask gives ``length - 1``; a multi-turn response mask gives the last
    sampled token, past the last observation."""
    mask = mask.bool()
    idx = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, idx, 0).amax(dim=1) if mask.shape[1] else mask.sum(dim=1)
