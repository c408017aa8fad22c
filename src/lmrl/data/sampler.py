"""The prompt sampler: seeded per-epoch shuffles with an exactly resumable position.

Choice: the state is ``(epoch, offset)``, the offset counting prompts already served in the
epoch, and each epoch's order is a pure function of ``(seed, epoch)``
(``numpy.random.default_rng([seed, epoch]).permutation``). So a checkpoint stores two
integers, and a resumed run draws the very next prompt, also across an epoch boundary, and
whatever happened to the global RNGs in between. No ``torch.utils.data`` sampler/loader is
involved: the trainer asks for the next batch of indices.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from lmrl.errors import CheckpointError, DataError


class PromptSampler:
    """Batches of prompt indices, epoch after epoch, resumable to the exact prompt.

    Args:
        num_items: the dataset size.
        batch_size: prompts per batch.
        seed: the shuffle seed.
        shuffle: a new permutation per epoch (else the natural order).
        drop_last: skip an epoch's last incomplete batch (else yield it, smaller).

    Raises:
        ValueError: non-positive sizes, or ``drop_last`` with fewer items than one batch.
    """

    def __init__(
        self,
        num_items: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if num_items < 1 or batch_size < 1:
            raise ValueError(
                f"num_items and batch_size must be >= 1, got {num_items}, {batch_size}"
            )
        if drop_last and num_items < batch_size:
            raise DataError(
                f"batch_size {batch_size} (data.train_batch_size) is larger than the dataset ({num_items} prompts) "
                "with drop_last=True"
            )
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.offset = 0
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_items, self.batch_size)
        return full + (0 if self.drop_last or rest == 0 else 1)

    @property
    def epoch_end(self) -> int:
        """The offset at which an epoch ends (the last full batch with ``drop_last``)."""
        if self.drop_last:
            return self.num_items - self.num_items % self.batch_size
        return self.num_items

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of prompt indices used in ``epoch``."""
        if not self.shuffle:
            return np.arange(self.num_items)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def next_batch(self) -> list[int]:
        """The next batch of indices, moving to the next epoch when this one is done."""
        if self.offset >= self.epoch_end:
            self.epoch += 1
            self.offset = 0
            self._order = None
        if self._order is None:
            self._order = self.order(self.epoch)
        end = min(self.offset + self.batch_size, self.epoch_end)
        batch = self._order[self.offset : end].tolist()
        self.offset = end
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        """Batches forever (the trainer decides when to stop), from the current position."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The exact position, plus what must match on resume."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "num_items": self.num_items,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (the batch size may differ: the offset counts prompts).

        Raises:
            CheckpointError: a state from another dataset size, seed or shuffle setting, an
                offset past the end of an epoch, or a state of mixed sources
                (`lmrl.data.mixture.MixtureSampler`) or of a curriculum
                (`lmrl.data.curriculum.CurriculumSampler`).
        """
        if "curriculum" in state:
            raise CheckpointError(
                "the checkpoint's sampler chooses prompts by pass rate (data.curriculum); "
                "resume with data.curriculum.enable=true and the settings it was saved with"
            )
        if "mixture" in state:
            raise CheckpointError(
                "the checkpoint's sampler mixes sources (data.mixture); resume with the "
                "data.mixture it was saved with"
            )
        for key in ("num_items", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise CheckpointError(
                    f"sampler state has {key}={state[key]!r}, this sampler has "
                    f"{getattr(self, key)!r}; resume with the same data and seed"
                )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= self.num_items:
            raise CheckpointError(
                f"sampler state has an invalid position epoch={epoch}, offset={offset}"
            )
        self.epoch, self.offset, self._order = epoch, offset, None
