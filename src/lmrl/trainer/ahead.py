"""Async training: stages 1-2 (rollout and reward) run ahead of the update, with a staleness
bound (``async_training``; verl's one-step-off and fully-async recipes).

`RolloutAhead` runs stages 1-2 for the coming steps in threads of their own while the
trainer's thread runs stages 3-8: a generator thread generates, and a scoring thread scores
each batch while the next one generates (the reward in flight; inline instead under DAPO's
dynamic sampling and ReMax, whose scores decide or join the generation). With the local
backend the engine generates with a copy of the weights that the trainer hands over
(``follow=False``: the weights being updated are never read); with Ray the engine is a
rollout worker group of its own and the threads only wait on it. Either way the threads
spend their time in torch ops, tool calls, reward calls or Ray waits, all of which release
the GIL.

**The schedule is fixed.** The batch of step ``s`` is generated with weights version
``v(s) = T * floor(max(s - K, 0) / T)`` (`weights_version_for`: ``K`` the staleness
threshold, ``T`` the sync interval), never with "whatever is newest". The trainer pushes each
version some step needs (a CPU copy of the weights, or a Ray object) right after the update
that made it; the thread loads it into the engine before the first batch that needs it,
between two requests, never during one. So the rows of a step are a function of the seed
and ``v(s)`` alone, whatever the timing: a run repeats itself, staleness is exactly
``s - v(s) <= K + T - 1``, and with ``K = 0, T = 1`` it is the synchronous step. Each row is
stamped with its version (the ``weights_version`` column).

**A checkpoint holds what is in flight.** Saving at step ``g`` waits until every batch that
needs a version older than ``g`` is done (those versions are not in the checkpoint), then
writes every finished batch not yet trained on, with the sampler's position after the last of
them; a resumed run trains on them first and generates the rest from the checkpoint's
weights, so it ends with the weights of an uninterrupted run. Batches are stored as tensors
plus their per-row columns as JSON (``state.pt`` is read with ``weights_only=True``).

**Validation** takes the engine between two batches, loads the trainer's current weights,
validates, and puts the thread's version back.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from lmrl.batch import Batch
from lmrl.config.async_training import weights_version_for
from lmrl.errors import CheckpointError
from lmrl.run.timing import StageTimer
from lmrl.trainer.stages import generate, rollout_and_score, score, scored_apart

log = logging.getLogger("lmrl.trainer")

__all__ = ["Ahead", "RolloutAhead", "batch_from_state", "batch_state"]

Weights = Mapping[str, torch.Tensor]  # the actor's weights, CPU tensors (``sync_weights``'s)


@dataclasses.dataclass
class Ahead:
    """One finished batch, waiting for its step.

    Attributes:
        step: the step it is for.
        version: the weights version that generated it.
        batch: rows generated and scored (stages 1-2), stamped ``weights_version``.
        metrics: the stages' metrics (reward, filter groups, their timings, the thread's wait).
        sampler: the prompt sampler's state after this batch's prompts were drawn.
    """

    step: int
    version: int
    batch: Batch
    metrics: dict[str, float]
    sampler: dict


class RolloutAhead:
    """Generate and score the batches of the coming steps in a thread, at most ``staleness +
    sync_every - 1`` updates behind the trainer.

    Args:
        parts: the run's parts (engine, reward, train data and sampler, plan).
        staleness: ``K``, whole batches (``ceil(async_training.staleness_threshold)``).
        sync_every: ``T`` (``async_training.trigger_parameter_sync_step``).
        total_steps: steps of the run (nothing is generated past them).
        load: ``load(weights)`` puts a pushed version into the engine.
        on_stage: called with each stage's name as it starts in the thread (``gen``,
            ``reward``): the trainer's fault-injection seam.
    """

    def __init__(
        self, parts, staleness: int, sync_every: int, total_steps: int,
        load: Callable[[Weights], None], on_stage: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        self.parts, self.staleness, self.sync_every = parts, staleness, sync_every
        self.total_steps, self._load, self._on_stage = total_steps, load, on_stage
        self._cond = threading.Condition()
        self._engine = threading.Lock()  # held while a batch generates, or a validation runs
        self._reward = threading.Lock()  # held while a batch is scored, or a validation runs
        # stage 2 in flight: a batch is scored in a thread of its own while the next one
        # generates (in order: one worker), unless its scores decide what to generate
        self._apart = scored_apart(parts.plan)
        self._scorer: concurrent.futures.ThreadPoolExecutor | None = None
        self._items: dict[int, Ahead] = {}
        self._pending: dict[int, Weights] = {}  # pushed versions not loaded yet
        self._loaded: tuple[int, Weights] | None = None  # the engine's version and weights
        self._next = 0  # the next step to generate
        self._done = 0  # the next step to finish (generated and scored)
        self._taken = parts.sampler.state_dict()  # the sampler after the last batch taken
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------- trainer side
    def version_for(self, step: int) -> int:
        return weights_version_for(step, self.staleness, self.sync_every)

    def wants(self, version: int) -> bool:
        """Whether a step still to generate is generated with ``version``."""
        if self._next >= self.total_steps:
            return False
        first, last = self.version_for(self._next), self.version_for(self.total_steps - 1)
        return version % self.sync_every == 0 and first <= version <= last

    def push(self, version: int, weights: Callable[[], Weights]) -> None:
        """Hand over weights ``version`` (updates done) if a step still needs it;
        ``weights()`` makes the copy only then."""
        with self._cond:
            if not self.wants(version):
                return
        copy = weights()
        with self._cond:
            self._pending[version] = copy
            self._cond.notify_all()

    def take(self, step: int) -> tuple[Batch, dict[str, float]]:
        """The batch of ``step`` and its metrics, waiting for it; starts the thread.

        Raises:
            whatever generating or scoring raised in the thread (a ``WorkerError`` naming the
            worker, a ``RewardError``...).
        """
        self._start()
        with self._cond:
            while step not in self._items and self._error is None:
                self._cond.wait()
            self._raise()
            item = self._items.pop(step)
            self._taken = item.sampler
            self._cond.notify_all()
        metrics = dict(item.metrics)
        metrics["async/staleness"] = float(step - item.version)
        metrics["async/weights_version"] = float(item.version)
        metrics["async/ready_batches"] = float(len(self._items))
        # the epoch of this batch's prompts (the sampler itself is batches ahead)
        metrics["training/epoch"] = float(item.sampler["epoch"])
        return item.batch, metrics

    def exclusive(self, weights: Weights | None, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (validation) with the engine holding ``weights`` (the trainer's current
        ones; None = as it is), between two batches; the thread's version is put back."""
        with self._engine, self._reward:
            if weights is not None:
                self._load(weights)
            try:
                return fn()
            finally:
                if weights is not None and self._loaded is not None:
                    self._load(self._loaded[1])

    def state_dict(self, step: int) -> dict:
        """What a checkpoint at ``step`` (updates done) holds of the batches in flight: every
        finished batch not yet taken, once each batch that needs a version older than
        ``step`` is finished, and the sampler's position after the last of them."""
        last_old = max((s for s in range(step, self.total_steps)
                        if self.version_for(s) < step), default=None)  # fmt: skip
        if last_old is not None:
            self._start()
        with self._cond:
            while last_old is not None and self._done <= last_old and self._error is None:
                self._cond.wait()
            self._raise()
            items = sorted(self._items.values(), key=lambda it: it.step)
            return {
                "items": [
                    {"step": it.step, "version": it.version, "metrics": dict(it.metrics),
                     "sampler": dict(it.sampler), **batch_state(it.batch)}
                    for it in items
                ],
                "sampler": dict(items[-1].sampler if items else self._taken),
            }  # fmt: skip

    def load_state_dict(self, state: dict | None, step: int) -> None:
        """Continue at ``step`` from a checkpoint's `state_dict` (None: nothing in flight),
        the sampler already loaded at the position after them. Stops a running thread first
        (a rollback to a checkpoint)."""
        self.close()
        self._stop, self._error = False, None
        self._items, self._pending, self._loaded = {}, {}, None
        for it in state["items"] if state is not None else []:
            self._items[it["step"]] = Ahead(it["step"], it["version"], batch_from_state(it),
                                            dict(it["metrics"]), dict(it["sampler"]))  # fmt: skip
        self._next = self._done = step + len(self._items)
        self._taken = self.parts.sampler.state_dict()  # read only once the items are taken

    def close(self) -> None:
        """Stop the thread after the batch it is on (safe to call twice)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=600)
            self._thread = None
        if self._scorer is not None:
            self._scorer.shutdown(wait=True)
            self._scorer = None

    # -------------------------------------------------------------------- the thread
    def _start(self) -> None:
        if self._thread is None and not self._stop:
            if self._apart:
                self._scorer = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="lmrl-reward-ahead"
                )
            self._thread = threading.Thread(target=self._run, name="lmrl-rollout-ahead",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            while True:
                waited = time.perf_counter()
                with self._cond:
                    step = self._next
                    version = self.version_for(step)
                    while (
                        not self._stop
                        and self._error is None
                        and step < self.total_steps
                        and not (
                            version in self._pending
                            or (self._loaded is not None and self._loaded[0] == version)
                        )
                    ):
                        self._cond.wait()
                    if self._stop or self._error is not None or step >= self.total_steps:
                        return
                    weights = self._pending.get(version)
                    for v in [v for v in self._pending if v <= version]:
                        del self._pending[v]
                waited = time.perf_counter() - waited
                with self._engine:
                    if weights is not None:
                        self._load(weights)
                        self._loaded = (version, weights)
                    metrics: dict = {}
                    timer = StageTimer(on_enter=self._on_stage)
                    with timer("ahead"):
                        if self._apart:
                            batch, _ = generate(self.parts, step, timer)
                        else:
                            batch = rollout_and_score(self.parts, step, timer, metrics)
                    sampler = self.parts.sampler.state_dict()
                batch["weights_version"] = torch.full((len(batch),), version, dtype=torch.long)
                busy = timer.seconds.pop("ahead")
                metrics["async/generator_idle_frac"] = waited / max(waited + busy, 1e-9)
                item = Ahead(step, version, batch, metrics, sampler)
                with self._cond:
                    self._next = step + 1
                if self._apart:
                    if self._scorer is None:  # _start makes it before the thread when apart
                        raise RuntimeError("rollout ahead: scoring apart without its scorer thread")
                    self._scorer.submit(self._score, item, timer)
                else:
                    self._finish(item, timer)
        except BaseException as err:  # handed to the trainer's thread at its next take
            self._fail(err)

    def _score(self, item: Ahead, timer: StageTimer) -> None:
        """Stage 2 of a generated batch, in the scoring thread."""
        try:
            with self._reward, timer("reward"):
                score(self.parts.reward, item.batch, item.metrics)
            self._finish(item, timer)
        except BaseException as err:
            self._fail(err)

    def _finish(self, item: Ahead, timer: StageTimer) -> None:
        item.metrics |= timer.metrics()
        with self._cond:
            self._items[item.step] = item
            self._done = item.step + 1
            self._cond.notify_all()

    def _fail(self, err: BaseException) -> None:
        with self._cond:
            self._error = err
            self._cond.notify_all()


# ------------------------------------------------------------------ batches on disk


def batch_state(batch: Batch) -> dict:
    """A `Batch` as tensors and JSON text (what ``torch.load(weights_only=True)`` reads)."""
    try:
        columns = json.dumps({k: [_plain(v) for v in batch[k]] for k in batch.non_tensor_keys()})
        meta = json.dumps(_plain(batch.meta))
    except TypeError as err:
        raise CheckpointError(
            f"a batch in flight has a per-row value that cannot be saved ({err}); "
            "save with async_training.enable=false, or keep dataset columns to JSON types"
        ) from None
    return {"tensors": {k: batch[k] for k in batch.tensor_keys()}, "columns": columns,
            "meta": meta}  # fmt: skip


def batch_from_state(state: dict) -> Batch:
    """The `Batch` that `batch_state` wrote."""
    return Batch(state["tensors"], json.loads(state["columns"]), json.loads(state["meta"]))


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
