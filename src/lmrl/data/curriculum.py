"""Difficulty-aware sampling (``data.curriculum``): prompts chosen by their recent pass rate.

``CurriculumSampler`` is a `lmrl.data.mixture.MixtureSampler` (one source, all the training
prompts, without ``data.mixture``) whose sources give their prompts by the curriculum's rule
(`lmrl.config.curriculum`): ``skip_solved`` walks each source's seeded epoch order and lets a
prompt whose last groups were all passed or all failed sit out its turn (up to ``cooldown``
turns in a row); ``target`` draws each step's prompts without replacement, weighted by the
closeness of their pass rate to the target.

The trainer reports each scored group (`observe`): the prompts of the draw, in order, and
their samples' pass flags (`passes`). Choice: the state is the mixture's (batches drawn, each
source's position) plus each prompt's last groups as ``[passed, samples]`` pairs and its
turns sat out; the weighted draw of a step is seeded by ``(seed, source, step)``, so no RNG
state is kept and a resumed run draws the very batch the uninterrupted one would have drawn.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from lmrl.data.mixture import MixtureSampler
from lmrl.errors import CheckpointError

#: the weight of the prompt farthest from the target pass rate (``target`` mode)
FLOOR = 0.05


def passes(
    scores: np.ndarray, acc: np.ndarray | None, pass_score: float, scored: np.ndarray | None = None
) -> np.ndarray:
    """Whether each sample passed: its ``acc`` where it has a finite one, else its score >=
    ``pass_score``. Unscored samples (``scored`` False) count as neither: -1.

    Returns:
        (B,) int8: 1 passed, 0 failed, -1 not scored.
    """
    scores = np.asarray(scores, dtype=np.float64)
    out = (scores >= pass_score).astype(np.int8)
    if acc is not None:
        acc = np.asarray(acc, dtype=np.float64)
        has = np.isfinite(acc)
        out[has] = acc[has] > 0.5
    if scored is not None:
        out[~np.asarray(scored, dtype=bool)] = -1
    return out


class CurriculumSampler(MixtureSampler):
    """Batches of prompt indices chosen by the prompts' recent pass rates.

    Args:
        curriculum: the checked ``data.curriculum`` (`lmrl.config.curriculum.Curriculum`:
            ``mode``, ``history``, ``cooldown``, ``target_pass_rate``, ``pass_score``).
        names, rows, counts, batch_size, seed, shuffle: as `MixtureSampler` (one source of
            every prompt, ``counts = lambda step: [batch_size]``, without ``data.mixture``).

    Attributes:
        records: prompt index -> its last groups, each ``[passed, samples]``.
        rested: prompt index -> the turns in a row it sat out (``skip_solved``).
        skipped: prompts that sat out during the last batch drawn.
    """

    def __init__(
        self,
        curriculum: Any,
        names: Sequence[str],
        rows: Sequence[np.ndarray],
        counts: Callable[[int], Sequence[int]],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ):
        super().__init__(names, rows, counts, batch_size, seed=seed, shuffle=shuffle)
        self.curriculum = curriculum
        self.records: dict[int, list[list[int]]] = {}
        self.rested: dict[int, int] = {}
        self.skipped = 0
        self._limit = max((int(r.max()) + 1 for r in self.rows if len(r)), default=0)
        self._drawn: list[list[int]] = []  # batches drawn and not yet observed, oldest first

    # ------------------------------------------------------------------ the rule
    def settled(self, index: int) -> bool:
        """Whether the prompt's last ``history`` groups were all passed or all failed."""
        record = self.records.get(index, [])
        if len(record) < self.curriculum.history:
            return False
        return all(p == n for p, n in record) or all(p == 0 for p, _ in record)

    def pass_rate(self, index: int) -> float:
        """The prompt's pass rate over its remembered groups (the target when unseen)."""
        record = self.records.get(index)
        if not record:
            return self.curriculum.target_pass_rate
        return sum(p for p, _ in record) / max(1, sum(n for _, n in record))

    def weights(self, rows: np.ndarray) -> np.ndarray:
        """``target`` mode: each prompt's weight, 1 at the target falling linearly to
        `FLOOR` at the farthest pass rate."""
        t = self.curriculum.target_pass_rate
        rates = np.array([self.pass_rate(int(i)) for i in rows], dtype=np.float64)
        span = max(t, 1.0 - t) or 1.0
        return 1.0 - (1.0 - FLOOR) * np.abs(rates - t) / span

    def _take(self, source: int, n: int) -> list[int]:
        if self.curriculum.mode == "target":
            return self._draw_weighted(source, n)
        return self._take_unsettled(source, n)

    def _draw_weighted(self, source: int, n: int) -> list[int]:
        rows = self.rows[source]
        key = zlib.crc32(self.names[source].encode())
        rng = np.random.default_rng([self.seed, key, self.draws])
        w = self.weights(rows)
        picked = rng.choice(len(rows), size=n, replace=n > len(rows), p=w / w.sum())
        return rows[picked].tolist()

    def _take_unsettled(self, source: int, n: int) -> list[int]:
        """The next ``n`` prompts of the source's order that are not sitting out; prompts
        that sat out fill the batch when a whole pass over the source leaves it short."""
        out: list[int] = []
        sat_out: list[int] = []
        size = len(self.rows[source])
        for _ in range(size):
            if len(out) == n:
                break
            (index,) = super()._take(source, 1)
            if self.settled(index) and self.rested.get(index, 0) < self.curriculum.cooldown:
                self.rested[index] = self.rested.get(index, 0) + 1
                sat_out.append(index)
            else:
                self.rested.pop(index, None)
                out.append(index)
        fill = sat_out[: n - len(out)]
        for index in fill:
            self.rested.pop(index, None)
        self.skipped += len(sat_out) - len(fill)
        out += fill
        if len(out) < n:  # a source smaller than its count: its order again, as the mixture
            out += super()._take(source, n - len(out))
        return out

    def next_batch(self) -> list[int]:
        """The next step's batch (see `MixtureSampler.next_batch`), remembered until its
        groups are observed."""
        self.skipped = 0
        batch = super().next_batch()
        self._drawn.append(list(batch))
        return batch

    # ------------------------------------------------------------------ feedback
    def observe(self, passed: np.ndarray) -> None:
        """Record the groups of the oldest batch drawn and not yet observed.

        Args:
            passed: (B * G,) int: each sample's `passes` flag (1, 0, or -1 = not scored),
                ``G`` samples per prompt, prompts in the order drawn.

        Raises:
            ValueError: no batch is waiting, or ``passed`` is not ``G`` samples per prompt.
        """
        if not self._drawn:
            raise ValueError("observe: no batch drawn is waiting for its pass rates")
        batch = self._drawn.pop(0)
        passed = np.asarray(passed).reshape(-1)
        if len(passed) % len(batch):
            raise ValueError(f"observe: {len(passed)} samples for {len(batch)} prompts")
        groups = passed.reshape(len(batch), -1)
        keep = self.curriculum.history
        for index, group in zip(batch, groups, strict=True):
            scored = group[group >= 0]
            if not len(scored):
                continue  # no sample scored: the prompt's record does not change
            record = self.records.setdefault(int(index), [])
            record.append([int(scored.sum()), len(scored)])
            del record[:-keep]

    def metrics(self) -> dict[str, float]:
        """``curriculum/skipped`` (prompts that sat out in the last draw) and
        ``curriculum/settled_frac`` (the share of the prompts seen that are settled)."""
        seen = len(self.records)
        settled = sum(self.settled(i) for i in self.records)
        return {
            "curriculum/skipped": float(self.skipped),
            "curriculum/settled_frac": settled / seen if seen else 0.0,
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The mixture's state plus the prompts' records, their turns sat out and the
        batches drawn and not yet observed."""
        state = super().state_dict()
        state["curriculum"] = {
            "mode": self.curriculum.mode,
            "records": {int(i): [list(g) for g in r] for i, r in self.records.items()},
            "rested": {int(i): int(k) for i, k in self.rested.items()},
            "drawn": [list(b) for b in self._drawn],
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; a state without a curriculum starts the records empty.

        Raises:
            CheckpointError: as `MixtureSampler.load_state_dict`, or a prompt index past the
                data (another data set).
        """
        if "mixture" not in state:
            raise CheckpointError(
                "the checkpoint's sampler has no data.curriculum state (it was saved without "
                "data.curriculum.enable); resume with the settings it was saved with"
            )
        super().load_state_dict(state)
        cur: Mapping[str, Any] = state.get("curriculum") or {}
        records = {int(i): [[int(p), int(n)] for p, n in r] for i, r in
                   cur.get("records", {}).items()}  # fmt: skip
        if any(not 0 <= i < self._limit for i in records):
            raise CheckpointError("sampler state records prompts past the data's "
                                  f"{self._limit}; resume with the same data")  # fmt: skip
        self.records = records
        self.rested = {int(i): int(k) for i, k in cur.get("rested", {}).items()}
        self._drawn = [[int(i) for i in b] for b in cur.get("drawn", [])]
