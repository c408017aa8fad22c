"""Concurrent requests gathered into the engine's calls.

Requests are queued; one thread takes everything queued at each tick and makes one
``engine.generate`` call per group of requests that sample alike (temperature, top-p, top-k,
stop strings, ``n``), with the group's largest ``max_tokens``: each request's completions are
cut to its own ``max_tokens`` afterwards, which changes nothing of what it samples (a row's
draws are its own, `lmrl.rollout.sampling.Draws`). A request with a ``seed`` is a call of its
own, so its samples do not depend on the requests it arrives with. While the engine runs, new
requests queue up for the next tick, so the batches grow with the load; the engine is only
ever called from that one thread.

`Batcher.hold` keeps ticks from starting (a trainer swapping the engine's weights); each
tick reads the weights version (``version()``) under the same gate, so every sample is stamped
with the weights that made it. `Batcher.close` serves what is queued and refuses what comes
after with 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from lmrl.batch import Batch
from lmrl.rollout.base import RolloutEngine, SamplingParams
from lmrl.serve.errors import APIError, stopping

__all__ = ["Batcher", "Sample"]

log = logging.getLogger("lmrl.serve")


@dataclass
class Sample:
    """One completion: its sampled ids, their log-probs, and whether ``max_tokens`` cut it."""

    ids: list[int]
    log_probs: list[float]
    cut: bool = False


@dataclass
class _Job:
    prompts: list[list[int]]
    n: int
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    samples: list[Sample] = field(default_factory=list)

    def key(self) -> tuple:
        s = self.sampling
        alone = id(self) if s.seed is not None else None
        return (
            s.temperature,
            s.top_p,
            s.top_k,
            s.do_sample,
            tuple(s.stop),
            s.ignore_eos,
            self.n,
            alone,
        )

    def answer(self, result=None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if self.future.done():  # the client went away
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody waits
            self.loop.call_soon_threadsafe(settle)


class Batcher:
    """One thread that feeds queued requests to ``engine`` (see the module docstring).

    Args:
        engine: any `RolloutEngine`.
        pad_id: the id prompts are left-padded with.
        version: the weights version now (read at each tick, under the gate).
        max_rows: most rows (prompts x ``n``) of one engine call.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        pad_id: int,
        version: Callable[[], int] = lambda: 0,
        max_rows: int = 256,
    ) -> None:
        self.engine, self.pad_id, self.version, self.max_rows = engine, pad_id, version, max_rows
        self.calls = 0  # engine calls made
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._gate = threading.Lock()
        self._pending = 0
        self._count = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lmrl-serve-batcher", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Requests queued whose tick has not started."""
        with self._count:
            return self._pending

    async def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> tuple[list[Sample], int]:
        """``n`` samples of each prompt (``len(prompts) * n``, a prompt's contiguous) and the
        weights version that sampled them.

        Raises:
            APIError: 503 once the batcher is closing.
        """
        if self._closed:
            raise stopping()
        loop = asyncio.get_running_loop()
        job = _Job([list(p) for p in prompts], n, sampling, loop, loop.create_future())
        with self._count:
            self._pending += 1
        self._queue.put(job)
        return await job.future

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """No engine call starts inside this block (the one running finishes first)."""
        with self._gate:
            yield

    def close(self, timeout: float | None = 30.0) -> None:
        """Serve what is queued, refuse new requests (503), stop the thread."""
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                break
            with self._gate:  # what queued while the gate was held joins this tick
                jobs = [job]
                while True:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        self._queue.put(None)  # stop after this tick
                        break
                    jobs.append(more)
                with self._count:
                    self._pending -= len(jobs)
                self._tick(jobs)
        while True:  # closed: whatever is left is refused
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.answer(error=stopping())

    def _tick(self, jobs: list[_Job]) -> None:
        groups: dict[tuple, list[_Job]] = {}
        for job in jobs:
            groups.setdefault(job.key(), []).append(job)
        version = int(self.version())
        for group in groups.values():
            # calls of at most max_rows rows (a request is never split)
            batch: list[_Job] = []
            rows = 0
            for job in group:
                size = len(job.prompts) * job.n
                if batch and rows + size > self.max_rows:
                    self._call(batch, version)
                    batch, rows = [], 0
                batch.append(job)
                rows += size
            self._call(batch, version)

    def _call(self, jobs: list[_Job], version: int) -> None:
        prompts = [p for job in jobs for p in job.prompts]
        n = jobs[0].n
        most = max(job.sampling.max_new_tokens for job in jobs)
        sampling = replace(jobs[0].sampling, max_new_tokens=most)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = True
        try:
            self.calls += 1
            out = self.engine.generate(
                Batch({"input_ids": ids, "attention_mask": mask}), n, sampling
            )
        except Exception as err:
            log.exception("the engine failed on a batch of %d prompts", len(prompts))
            error = (
                err
                if isinstance(err, APIError)
                else APIError(
                    500, f"the engine failed: {type(err).__name__}: {err}", type="server_error"
                )
            )
            for job in jobs:
                job.answer(error=error)
            return
        responses = out["responses"].tolist()
        masks = out["response_mask"].tolist()
        log_probs = out["rollout_log_probs"].tolist()
        row = 0
        for job in jobs:
            samples = []
            for _ in range(len(job.prompts) * job.n):
                keep = [k for k, m in enumerate(masks[row]) if m]
                cut = len(keep) > job.sampling.max_new_tokens
                keep = keep[: job.sampling.max_new_tokens]
                samples.append(
                    Sample(
                        [responses[row][k] for k in keep], [log_probs[row][k] for k in keep], cut
                    )
                )
                row += 1
            job.answer((samples, version))
