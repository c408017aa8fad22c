"""A micro-batch's shape: its trimmed columns, its prompt groups and its attention masks, from
what the host knows of the rows, so that a micro-batch's forward never reads the device back.

A batch holds ``input_ids = cat(prompts, responses)`` (B, P+T), left-padded prompts and
right-padded responses. Each micro-batch's forward (`lmrl.models.forward`) asks questions of its
rows whose answers decide shapes: which columns any row uses (trimming, `trim_batch`), which
rows share a prompt (one prompt pass per group, `prompt_groups`), how long the packed rows are
and whether every response is a prefix of its columns (`lmrl.models.packing`), and whether the
attention needs a padding mask at all (transformers' sdpa mask reads the mask to decide). Asked
of tensors on a GPU, each answer is a host read (``.tolist()``, ``torch.unique``, ``.item()``)
that waits for every kernel queued before it, so the host cannot queue the next micro-batch's
work while the GPU runs this one.

`with_row_layout` answers them once, on the driver's CPU batch before it moves to the device,
per row: a `RowSpan` in the non-tensor column `LAYOUT_KEY`, and the row's prompt group as the
tensor column `GROUP_KEY`. Both follow every reordering, shard and split of the batch, so a
micro-batch's `MicroLayout` is read from its rows on the host; its prompt groups are rebuilt on
the device from the group ids with sizes the host already knows, and an sdpa model gets its
attention mask built here (none where no row is padded). The answers equal those the tensors
give (which are read when a batch carries no layout): the forward is bitwise the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from lmrl.batch import Batch
from lmrl.batch.schema import keys as schema_keys

__all__ = [
    "GROUP_KEY",
    "LAYOUT_KEY",
    "LAYOUT_KEYS",
    "MICRO_KEYS",
    "REQUIRED_KEYS",
    "MicroLayout",
    "RowSpan",
    "Trimmed",
    "check_keys",
    "distinct_rows",
    "micro_batches",
    "on_device",
    "prompt_groups",
    "sdpa_mask",
    "trim_batch",
    "with_row_layout",
]

LAYOUT_KEY = "row_layout"  # non-tensor column: a `RowSpan` per row
GROUP_KEY = "prompt_group"  # (B,) long tensor column: the row's prompt, numbered over the batch
LAYOUT_KEYS = schema_keys(writer="layout")  # (LAYOUT_KEY, GROUP_KEY)
REQUIRED_KEYS = schema_keys(needed_by="forward")  # input_ids, attention_mask, responses
MICRO_KEYS = schema_keys(read_by="forward")  # a micro-batch's forward: those, the rest optional


def distinct_rows(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of ``key`` (B, ...), a shared prompt's rows being equal.

    Returns:
        ``(first, inverse)``: ``first`` (U,) the index of each distinct row's first
        occurrence, ``inverse`` (B,) the distinct row of each row (numbered in the rows'
        lexicographic order).
    """
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(key.shape[0], device=key.device)
    first = torch.full((len(distinct),), key.shape[0], dtype=torch.long, device=key.device)
    return first.scatter_reduce(0, inverse, rows, reduce="amin"), inverse


class RowSpan(NamedTuple):
    """One row of a ``(B, P + T)`` batch, as the host needs it.

    ``first``, ``last``: its first and last attended columns (``-1`` both when none is).
    ``count``: its attended columns (``last - first + 1`` when it has no hole).
    ``group``: its prompt's number (rows with equal prompt columns share it).
    ``length``: its attended response columns. ``prefix``: they are the first ``length``.
    """

    first: int
    last: int
    count: int
    group: int
    length: int
    prefix: bool


def with_row_layout(batch):
    """``batch`` (a `lmrl.batch.Batch`) with `LAYOUT_KEY` and `GROUP_KEY` set from its
    ``input_ids``, ``attention_mask``, ``responses`` and optional ``position_ids``.

    Call it where the batch is still on the CPU (one read of each tensor, no device wait); the
    columns then travel with the rows. Prompt groups are numbered in the order of their prompt
    columns' contents, as `distinct_rows` orders them.
    """
    mask = batch["attention_mask"].bool()
    length, resp_len = mask.shape[1], batch["responses"].shape[1]
    prompt_len = length - resp_len
    cols = torch.arange(length, device=mask.device)
    any_used = mask.any(1)
    first = torch.where(mask, cols, length).amin(1)
    last = torch.where(mask, cols, -1).amax(1)
    key = [batch["input_ids"][:, :prompt_len], mask[:, :prompt_len].long()]
    if "position_ids" in batch:
        key.append(batch["position_ids"][:, :prompt_len])
    _, group = distinct_rows(torch.cat(key, dim=1))
    valid = mask[:, prompt_len:]
    lengths = valid.sum(1)
    prefix = (valid == (cols[None, :resp_len] < lengths[:, None])).all(1)
    rows = zip(
        torch.where(any_used, first, -1).tolist(), last.tolist(), mask.sum(1).tolist(),
        group.tolist(), lengths.tolist(), prefix.tolist(), strict=True,
    )  # fmt: skip
    batch[LAYOUT_KEY] = [RowSpan(*row) for row in rows]
    batch[GROUP_KEY] = group.to(batch["input_ids"].device)
    return batch


@dataclass(frozen=True)
class MicroLayout:
    """A micro-batch's `RowSpan` columns, on the host, and its group ids on the device.

    ``spans``: (B, 6) int64 of `RowSpan` fields. ``group_ids``: (B,) long, where the model runs.
    """

    spans: np.ndarray
    group_ids: torch.Tensor

    @classmethod
    def of(cls, batch) -> MicroLayout | None:
        """The layout of a micro-batch carrying `LAYOUT_KEYS`, else None."""
        if LAYOUT_KEY not in batch or GROUP_KEY not in batch:
            return None
        spans = np.array([tuple(row) for row in batch[LAYOUT_KEY]], dtype=np.int64)
        return cls(spans.reshape(-1, len(RowSpan._fields)), batch[GROUP_KEY])

    def to(self, device: torch.device | str) -> MicroLayout:
        return MicroLayout(self.spans, self.group_ids.to(device))

    def used_columns(self) -> tuple[int, int] | None:
        """``(first, last)`` column any row attends, None when no row attends any."""
        used = self.spans[self.spans[:, 0] >= 0]
        return (int(used[:, 0].min()), int(used[:, 1].max())) if len(used) else None

    def dense(self, first: int, last: int | None) -> bool:
        """Every row attends every column from ``first`` to ``last`` (None: to its own last
        column), with no hole: no padding there."""
        spans = self.spans
        return bool(
            (spans[:, 0] == first).all()
            and (last is None or (spans[:, 1] == last).all())
            and (spans[:, 2] == spans[:, 1] - spans[:, 0] + 1).all()
        )

    @property
    def groups(self) -> np.ndarray:
        return self.spans[:, 3]

    @property
    def distinct(self) -> int:
        """The number of distinct prompts among the rows."""
        return len(np.unique(self.groups))

    @property
    def all_prefix(self) -> bool:
        """Every row's attended response columns are a prefix of its response."""
        return bool(self.spans[:, 5].all())

    def packed_tokens(self) -> int:
        """The most response tokens one packed row holds: per prompt, the sum over its rows of
        their response but its last token (`lmrl.models.packing`)."""
        _, inverse = np.unique(self.groups, return_inverse=True)
        return int(np.bincount(inverse, weights=np.maximum(self.spans[:, 4] - 1, 0)).max())

    def device_groups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(first, inverse)`` as `prompt_groups` gives them, built on the
        device from the group ids with the sizes the host knows: no host read."""
        ids = self.group_ids
        rows = len(self.spans)
        present = torch.zeros(int(self.groups.max()) + 1, dtype=torch.long, device=ids.device)
        present[ids] = 1
        inverse = (present.cumsum(0) - 1)[ids]
        first = torch.full((self.distinct,), rows, dtype=torch.long, device=ids.device)
        arange = torch.arange(rows, device=ids.device)
        return first.scatter_reduce(0, inverse, arange, reduce="amin"), inverse


@dataclass
class Trimmed:
    """One micro-batch cut to its used columns.

    ``input_ids``, ``attention_mask``, ``position_ids``: (B, L') on the model's device.
    ``start``: column of the output that predicts response token 0. ``kept``: response columns
    kept (``T`` minus the all-padding tail). ``response_length``: ``T``. ``response_valid``:
    (B, T) bool, True at real response tokens. ``labels``: (B, kept) response tokens.
    ``layout``: what the host knows of the rows, None when the batch carries none (the tensors
    are read instead). ``dense``, ``prompt_dense``: the layout knows that every row attends
    every column (every prompt column) of the trimmed batch.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    response_valid: torch.Tensor
    start: int
    kept: int
    response_length: int
    layout: MicroLayout | None = None
    dense: bool = False
    prompt_dense: bool = False

    def model_inputs(self, own: str | None = None) -> dict[str, Any]:
        """The model's inputs for the whole trimmed batch, its mask as `attention` gives it.

        Given no mask and no cache, transformers reads the position ids back to look for packed
        sequences. Where no row is padded, a model whose decoder takes the mapping of masks
        already made per layer type (``own="mapping"``: Qwen2, Qwen3) gets that mapping with no
        mask in it (sdpa's causal kernel); another (``"4d"``) gets the causal `sdpa_mask`.
        """
        mask = self.attention(self.attention_mask, own)
        if mask is None:
            mask = {"full_attention": None} if own == "mapping" else sdpa_mask(self.attention_mask)
        return {
            "input_ids": self.input_ids,
            "attention_mask": mask,
            "position_ids": self.position_ids,
            "use_cache": False,
        }

    def attention(
        self, mask: torch.Tensor, own: str | None, dense: bool | None = None, past: int = 0
    ) -> torch.Tensor | None:
        """The ``attention_mask`` to pass for key columns ``mask`` (B, K), the queries being its
        last ``K - past`` columns (a cache holds the first ``past``): the 2-D mask as
        transformers takes it when ``own`` is None (`lmrl.models.forward.own_mask`) or the batch
        has no layout; else, so that transformers does not read the mask to choose, none where
        the host knows that no row is padded (``dense``, default: the whole trimmed batch's)
        and the `sdpa_mask` built here where one is."""
        if own is None or self.layout is None:
            return mask.long()
        return None if (self.dense if dense is None else dense) else sdpa_mask(mask, past)

    def to_full(self, values: torch.Tensor) -> torch.Tensor:
        """(B, kept) -> (B, T): pad the trimmed tail and zero padded response positions."""
        values = F.pad(values, (0, self.response_length - self.kept))
        return torch.where(
            self.response_valid, values, torch.zeros((), dtype=values.dtype, device=values.device)
        )


def check_keys(batch) -> None:
    """Raise a ValueError naming the first of ``REQUIRED_KEYS`` that ``batch`` lacks."""
    for key in REQUIRED_KEYS:
        if key not in batch:
            raise ValueError(f"batch has no {key!r} (needs {list(REQUIRED_KEYS)})")


def trim_batch(batch, device: torch.device | str | None = None) -> Trimmed:
    """Cut a (micro-)batch to the columns any row uses, keeping at least one response column.

    Args:
        batch: a ``Batch`` (or any mapping) with ``input_ids`` (B, P+T), ``attention_mask``
            (B, P+T), ``responses`` (B, T) and optionally ``position_ids`` (B, P+T) (derived
            from the mask when absent).
        device: move the trimmed tensors there.
    """
    check_keys(batch)
    input_ids, mask, responses = (
        batch["input_ids"],
        batch["attention_mask"].bool(),
        batch["responses"],
    )
    if input_ids.dim() != 2 or mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(mask.shape)} must be "
            "the same (B, P+T) shape"
        )
    length, resp_len = input_ids.shape[1], responses.shape[1]
    if responses.dim() != 2 or responses.shape[0] != input_ids.shape[0] or resp_len >= length:
        raise ValueError(
            f"responses {tuple(responses.shape)} must be (B, T) with T < the input_ids length "
            f"{length}"
        )
    if "position_ids" in batch:
        position_ids = batch["position_ids"]
    else:
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    prompt_len = length - resp_len
    device = device if device is not None else input_ids.device
    layout = MicroLayout.of(batch)
    if layout is not None:  # the host knows the used columns: no read of the mask
        layout = layout.to(device)
        used = layout.used_columns() or (0, 0)
    else:
        columns = mask.any(0).nonzero().flatten().tolist()
        used = (columns[0], columns[-1]) if columns else (0, 0)
    first = min(used[0], prompt_len - 1)
    last = max(used[1], prompt_len)  # at least one response column
    cols = slice(first, last + 1)
    kept = last + 1 - prompt_len
    return Trimmed(
        input_ids=input_ids[:, cols].to(device),
        attention_mask=mask[:, cols].to(device),
        position_ids=position_ids[:, cols].to(device),
        labels=responses[:, :kept].to(device),
        response_valid=mask[:, prompt_len:].to(device),
        start=prompt_len - 1 - first,
        kept=kept,
        response_length=resp_len,
        layout=layout,
        dense=layout is not None and layout.dense(first, last),
        prompt_dense=layout is not None and layout.dense(first, None),
    )


def prompt_groups(trimmed: Trimmed) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows of a trimmed micro-batch that share their prompt columns.

    Returns:
        ``(first, inverse)``: ``first`` (U,) a row index of each distinct prompt, ``inverse``
        (B,) the distinct prompt of each row; None when every row's prompt is distinct.
    """
    layout = trimmed.layout
    if layout is not None:  # the host knows the groups; the indices are built on the device
        return None if layout.distinct == len(layout.spans) else layout.device_groups()
    width = trimmed.start + 1  # prompt columns of the trimmed batch
    key = torch.cat(
        [
            trimmed.input_ids[:, :width],
            trimmed.attention_mask[:, :width].long(),
            trimmed.position_ids[:, :width],
        ],
        dim=1,
    )
    first, inverse = distinct_rows(key)
    return None if len(first) == key.shape[0] else (first, inverse)


def micro_batches(batch, micro_batch_size: int, keys: tuple[str, ...]) -> Iterator[dict]:
    """Consecutive row slices of the given ``keys`` of ``batch``, ``micro_batch_size`` rows each."""
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    n = batch["input_ids"].shape[0]
    present = [k for k in keys if k in batch]
    for i in range(0, n, micro_batch_size):
        yield {k: batch[k][i : i + micro_batch_size] for k in present}


def on_device(batch, device: torch.device) -> Batch:
    """The keys a forward reads (`MICRO_KEYS`), with the rows' layout read where the batch is
    (`with_row_layout`), on ``device``: one transfer for all micro-batches, and none of them
    reads the device back (a (B, P+T) `lmrl.batch.Batch` or a mapping of its tensors)."""
    check_keys(batch)
    keys = [k for k in MICRO_KEYS if k not in LAYOUT_KEYS and k in batch]
    batch = batch.select(*keys) if isinstance(batch, Batch) else Batch({k: batch[k] for k in keys})
    return with_row_layout(batch).to(device)


def sdpa_mask(mask: torch.Tensor, past: int = 0) -> torch.Tensor:
    """(B, 1, Q, K) bool, True = attend, for keys ``mask`` (B, K) and queries at the last
    ``Q = K - past`` of its columns: causal and real keys only, as transformers builds it from
    the 2-D mask; a query with no real key at all (a left-padded position, whose output is never
    used) attends itself, so that no row of the softmax is empty."""
    keys = mask.shape[1]
    square = torch.ones(keys, keys, dtype=torch.bool, device=mask.device).tril()
    out = square[past:] & mask[:, None, :]
    alone = ~out.any(-1, keepdim=True)  # (B, Q, 1)
    out |= torch.eye(keys, dtype=torch.bool, device=mask.device)[past:] & alone
    return out[:, None]
