"""Mixed training sources (``data.mixture``): the rows of each source and the seeded draw.

``source_rows`` finds each named source's rows in a dataset: a training file (its path as
given, its file name, or its name without the suffix) or a ``data_source`` value.
``MixtureSampler`` draws each step's batch as the step's per-source counts (a function of the
step, ``lmrl.config.mixture.step_counts``), each source taking its prompts from its own
seeded epoch order (``numpy.random.default_rng([seed, crc32(name), epoch]).permutation``),
starting its next epoch where it runs out, also inside a batch.

Choice: the state is the number of batches drawn and each source's ``(epoch, offset)``;
every order is a pure function of the seed, the source's name and its epoch, and the counts a
pure function of the step, so a resumed run draws the very batch the uninterrupted one would
have drawn.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lmrl.data.sampler import PromptSampler
from lmrl.errors import CheckpointError, DataError

log = logging.getLogger("lmrl.data")

KEY = "data.mixture"


def _file_names(path: str) -> set[str]:
    p = Path(path)
    return {path, str(p), p.name, p.stem}


def source_rows(
    rows: Sequence[Mapping[str, Any]], train_files: Sequence[str], names: Sequence[str]
) -> list[np.ndarray]:
    """The row indices of each source in ``names``, in dataset order.

    Args:
        rows: the dataset's rows (each with ``origin`` = ``(file, row)`` and ``data_source``).
        train_files: ``data.train_files`` as given.
        names: the sources of ``data.mixture``, in its order.

    Raises:
        DataError: a source that names no training file and no ``data_source`` (listing the
            valid names), a name that fits several files, a source without rows, or a row
            claimed by two sources.
    """
    sources = sorted({str(r["data_source"]) for r in rows})
    owner: dict[int, str] = {}
    out = []
    for name in names:
        files = [f for f in train_files if name in _file_names(str(f))]
        if len(files) > 1:
            raise DataError(f"{KEY}.{name}: the name fits {len(files)} training files "
                            f"({', '.join(map(str, files))}); name the file by its path")  # fmt: skip
        if files:
            picked = [i for i, r in enumerate(rows) if r["origin"][0] == str(files[0])]
        elif name in sources:
            picked = [i for i, r in enumerate(rows) if r["data_source"] == name]
        else:
            raise DataError(
                f"{KEY}.{name}: no training file or data_source of that name; valid sources: "
                + ", ".join([*map(str, train_files), *sources])
            )
        if not picked:
            raise DataError(f"{KEY}.{name}: the source has no rows (all filtered out?)")
        for i in picked:
            if i in owner:
                raise DataError(f"{KEY}.{name}: row {rows[i]['origin'][1]} of "
                                f"{rows[i]['origin'][0]} is also in source {owner[i]!r}; "
                                "each row may be in one source")  # fmt: skip
            owner[i] = name
        out.append(np.asarray(picked, dtype=np.int64))
    if len(owner) < len(rows):
        log.info("%s: %d of %d training prompts are in no source and are not drawn",
                 KEY, len(rows) - len(owner), len(rows))  # fmt: skip
    return out


class MixtureSampler(PromptSampler):
    """Batches of prompt indices mixed from several sources, resumable to the exact prompt.

    Args:
        names: the sources' names (their orders are seeded by name).
        rows: each source's row indices (``source_rows``).
        counts: ``counts(step)``: how many prompts each source gives the ``step``-th batch
            (1-based); they sum to ``batch_size``.
        batch_size: prompts per batch.
        seed: the shuffle seed.
        shuffle: a new order per source epoch (else each source's natural order).

    Attributes:
        draws: batches drawn so far (the next batch is step ``draws + 1``).
        epoch: full passes over the sources' prompts before the last batch drawn (the
            ``training/epoch`` metric).
    """

    def __init__(
        self,
        names: Sequence[str],
        rows: Sequence[np.ndarray],
        counts: Callable[[int], Sequence[int]],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ):
        num_items = sum(len(r) for r in rows)
        super().__init__(num_items, batch_size, seed=seed, shuffle=shuffle, drop_last=False)
        self.names = tuple(names)
        self.rows = [np.asarray(r, dtype=np.int64) for r in rows]
        self.counts = counts
        self.draws = 0
        self.positions = [[0, 0] for _ in self.rows]  # (epoch, offset) per source
        self._orders: dict[int, tuple[int, np.ndarray]] = {}

    def __len__(self) -> int:
        """Batches per pass over the sources' prompts (at least 1)."""
        return max(1, self.num_items // self.batch_size)

    def source_order(self, source: int, epoch: int) -> np.ndarray:
        """The row indices of ``source`` in the order of its ``epoch``."""
        rows = self.rows[source]
        if not self.shuffle:
            return rows
        key = zlib.crc32(self.names[source].encode())
        return rows[np.random.default_rng([self.seed, key, epoch]).permutation(len(rows))]

    def _take(self, source: int, n: int) -> list[int]:
        out: list[int] = []
        size = len(self.rows[source])
        while n > 0:
            epoch, offset = self.positions[source]
            if offset >= size:
                epoch, offset = epoch + 1, 0
            cached = self._orders.get(source)
            if cached is None or cached[0] != epoch:
                cached = (epoch, self.source_order(source, epoch))
                self._orders[source] = cached
            end = min(offset + n, size)
            out += cached[1][offset:end].tolist()
            n -= end - offset
            self.positions[source] = [epoch, end]
        return out

    def next_batch(self) -> list[int]:
        """The next step's batch: each source's count of prompts, sources in their order."""
        counts = list(self.counts(self.draws + 1))
        if len(counts) != len(self.rows) or sum(counts) != self.batch_size:
            raise ValueError(f"counts {counts} do not split {self.batch_size} prompts over "
                             f"{len(self.rows)} sources")  # fmt: skip
        self.epoch = self.draws * self.batch_size // self.num_items
        batch: list[int] = []
        for source, n in enumerate(counts):
            batch += self._take(source, n)
        self.draws += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The exact position (batches drawn, each source's epoch and offset), plus what must
        match on resume."""
        positions = zip(self.names, self.positions, strict=True)
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "num_items": self.num_items,
            "shuffle": self.shuffle,
            "mixture": {
                "draws": self.draws,
                "sources": {name: list(pos) for name, pos in positions},
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. A state without a mixture (a run that had no
        ``data.mixture``) starts the mixture from its first step.

        Raises:
            CheckpointError: a state from other sources, another seed or shuffle setting, or a
                position past a source's end.
        """
        mixture = state.get("mixture")
        if mixture is None:
            log.warning("the checkpoint's sampler has no data.mixture state; the mixture "
                        "starts from its first step")  # fmt: skip
            self.draws, self.epoch = 0, 0
            self.positions = [[0, 0] for _ in self.rows]
            self._orders = {}
            return
        for key in ("num_items", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise CheckpointError(
                    f"sampler state has {key}={state[key]!r}, this sampler has "
                    f"{getattr(self, key)!r}; resume with the same data and seed"
                )
        sources = mixture["sources"]
        if list(sources) != list(self.names):
            raise CheckpointError(f"sampler state mixes the sources {list(sources)}, this run "
                             f"{list(self.names)}; resume with the same data.mixture")  # fmt: skip
        positions = [[int(e), int(o)] for e, o in sources.values()]
        for (epoch, offset), rows in zip(positions, self.rows, strict=True):
            if epoch < 0 or not 0 <= offset <= len(rows):
                raise CheckpointError(f"sampler state has an invalid source position {epoch=}, "
                                 f"{offset=}")  # fmt: skip
        self.draws, self.epoch = int(mixture["draws"]), int(state["epoch"])
        self.positions, self._orders = positions, {}
