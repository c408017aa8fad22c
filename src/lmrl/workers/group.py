"""Worker groups on Ray: the same workers in N processes, and the dispatch that splits, calls
and gathers.

A group is ``world_size`` Ray actors of one class, `RankWorker`; each is a
``torch.distributed`` rank (gloo on CPU, NCCL on GPU) that builds the ordinary workers of its
roles with ``lmrl.workers.build.build_workers``: the actor (with its engine and reference)
and, colocated or in a pool of its own, the critic, plus the reward scoring. The driver talks
to a group through stand-ins with the methods of the local workers (`GroupActor`,
`GroupEngine`, `GroupReference`, `GroupCritic`, `GroupReward` of ``lmrl.workers.stand_ins``:
the roles of ``lmrl.workers.roles``), so ``Trainer.step`` runs unchanged. How each call is dispatched:

    generate            prompts cut into contiguous chunks, one per rank, each sampled with
                        its position in the batch (``prompt_offset``), so the rollout is the
                        one a single process samples; gathered with ``concat_rollouts``
    load_policy         an async run's rollout group: the actor's weights to every rank
    log-probs, values   whole prompt groups split by token count (``partition_rows``),
                        gathered in order (the entropy too, when asked for)
    update_*            the whole batch to every rank (one object-store copy): each rank
                        trains on its share of every mini-batch and the gradients are summed
                        (``lmrl.workers.dist``); metrics from rank 0 (already summed)
    reward              rows cut into contiguous chunks; scores and counters joined

A worker that dies or raises ends the call with a `lmrl.errors.WorkerError` naming the group,
rank, process and host, after the whole group is stopped (ranks waiting in a collective for
a dead peer would otherwise hang). The remote traceback goes to the log, not the console.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from lmrl.batch import Batch
from lmrl.batch.schema import keys as schema_keys
from lmrl.config import Config
from lmrl.errors import LmrlError, WorkerError
from lmrl.workers.dist import (
    DDP,
    RENDEZVOUS_TIMEOUT,
    DataParallel,
    join_process_group,
    partition_rows,
    rendezvous_store,
)
from lmrl.workers.plan import WorkerPlan

if TYPE_CHECKING:
    from torch import nn

    from lmrl.workers.actor import ActorWorker
    from lmrl.workers.build import Workers
    from lmrl.workers.critic import CriticWorker
    from lmrl.workers.reference import ReferenceWorker
    from lmrl.workers.roles import RewardRole

log = logging.getLogger("lmrl.workers")

__all__ = [
    "RankWorker",
    "RayWorkerGroup",
    "make_dp",
]

Trained = Literal["actor", "critic"]  # the roles with checkpointed state and weights
FORWARD_KEYS = schema_keys(read_by="map_rows")  # a row-wise pass's input, split across ranks


def make_dp(strategy: str, rank: int, world_size: int, fsdp_config=None):
    """The data parallelism of a rank: ``ddp`` (replicated weights) or ``fsdp2`` (sharded)."""
    if strategy in ("fsdp2", "fsdp"):
        from lmrl.workers.fsdp import FSDP2

        offload = fsdp_config or {}
        return FSDP2(rank, world_size, **offload)
    return DDP(rank, world_size)


# --------------------------------------------------------------------------- the rank side


def _busy(method: Callable) -> Callable:
    """Record the seconds each call of a `RankWorker` method takes in ``self.busy``."""

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.busy[method.__name__].append(time.perf_counter() - start)

    return timed


class RankWorker:
    """One rank of a group: the workers of its roles, built in this process.

    A plain class: ``RayWorkerGroup`` wraps it with ``ray.remote``; tests may call it directly.

    Args:
        group: the group's name (``actor``, ``critic``), for messages.
        rank, world_size: this process's place in the group.
        threads: torch intra-op threads (the CPUs Ray gave this actor).
    """

    def __init__(self, group: str, rank: int, world_size: int, threads: int = 1) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        torch.set_num_threads(max(1, threads))
        self.workers: Workers | None = None  # these three: made by `setup`
        self.reward: RewardRole | None = None
        self.dp: DataParallel | None = None
        self.store: torch.distributed.TCPStore | None = None  # rank 0 serves the rendezvous
        self.device = torch.device("cpu")
        self.busy: dict[str, list[float]] = defaultdict(list)

    def timings(self) -> dict[str, Any]:
        """Seconds of work since the last call, then reset: ``busy`` (per method, one entry per
        call, in order) and ``comm_s`` (this rank's own collectives, inside ``busy``)."""
        out = {"busy": dict(self.busy), "comm_s": self.dp.comm_s if self.dp else 0.0}
        self.busy.clear()
        if self.dp is not None:
            self.dp.comm_s = 0.0
        return out

    # -- set-up
    def info(self) -> dict[str, Any]:
        """Process id and host: what an error about this rank names."""
        from lmrl.workers.ray_cluster import node_ip

        return {"pid": os.getpid(), "node": node_ip()}

    def master_address(self) -> tuple[str, int]:
        """Rank 0's host and the port of the group's rendezvous, served from this rank and held
        until `stop` (`lmrl.workers.dist.rendezvous_store`)."""
        from lmrl.workers.ray_cluster import node_ip

        host = node_ip()
        self.store = rendezvous_store(host, timeout=RENDEZVOUS_TIMEOUT)
        return host, self.store.port

    def setup(
        self, cfg: Config, plan: WorkerPlan, roles: Sequence[str], master: tuple[str, int],
        total_steps: int,
    ) -> dict[str, Any]:  # fmt: skip
        """Join the process group and build this rank's workers (seeded like the driver)."""
        from lmrl.models import load_tokenizer, resolve_device
        from lmrl.workers.build import build_workers, seed_everything

        device = resolve_device(cfg.trainer.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        join_process_group(
            "nccl" if device.type == "cuda" else "gloo", self.rank, self.world_size, master,
            store=self.store, timeout=RENDEZVOUS_TIMEOUT,
        )  # fmt: skip
        seed_everything(cfg.trainer.seed)
        strategy = cfg.critic.strategy if self.group == "critic" else cfg.actor.strategy
        offload = cfg.critic.offload if self.group == "critic" else cfg.actor.offload
        if self.group == "rollout":  # whole weights on each rank: it only generates
            strategy, offload = "ddp", "none"
        dp = make_dp(strategy, self.rank, self.world_size, _offload(offload))
        self.dp, self.device = dp, device
        assert cfg.model.path is not None  # load_config requires it
        tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
        parts = frozenset(roles)
        self.workers = build_workers(
            cfg, plan, tokenizer, device, total_steps=total_steps, roles=parts, dp=dp
        )
        if "reward" in parts:
            from lmrl.workers.reward import build_reward

            self.reward = build_reward(cfg, tokenizer, device)
        # a stream of its own for each rank (nothing in the step draws from it today)
        torch.manual_seed(cfg.trainer.seed + 1_000_003 * (self.rank + 1))
        w = self.workers
        return {
            **self.info(),
            "pad_id": w.engine.pad_id if w.engine is not None else None,
            "shares_weights": getattr(w.engine, "shares_weights", True),
            "parts": [k for k in ("actor", "critic", "reference") if getattr(w, k) is not None],
        }

    def stop(self) -> None:
        """Leave the process group and stop the reward workers."""
        import torch.distributed as dist

        if self.reward is not None:
            self.reward.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None  # rank 0 frees the rendezvous port

    # -- forward-only passes (every rank is called, so collectives line up under FSDP2)
    @_busy
    def generate(self, prompts: Batch, n: int, sampling, prompt_offset: int) -> Batch | None:
        w, dp = self._workers_and_dp()
        with dp.full_params(self._role("policy")):
            if len(prompts) == 0:
                return None
            out = w.engine.generate(
                prompts.to(self.device), n, sampling, prompt_offset=prompt_offset
            )
        return out.to("cpu")

    @_busy
    def actor_log_probs(
        self, batch: Batch, with_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(b, T) log-probs of this rank's rows; with ``with_entropy``, (log-probs, entropy)."""
        actor = self._role("actor")
        if not with_entropy:
            return self._rows(lambda b: actor.compute_log_probs(b)[0], batch, actor.model)
        return self._rows(
            lambda b: actor.compute_log_probs(b, with_entropy=True), batch, actor.model, outputs=2
        )

    @_busy
    def ref_log_probs(self, batch: Batch) -> torch.Tensor:
        return self._role("reference").compute_log_probs(batch.to(self.device)).cpu()

    @_busy
    def values(self, batch: Batch) -> torch.Tensor:
        critic = self._role("critic")
        return self._rows(critic.compute_values, batch, critic.model)

    def _rows(self, fn, batch: Batch, model, outputs: int = 1):
        """``fn`` on this rank's rows: a (b, T) tensor, or a tuple of ``outputs`` of them; with
        no rows, ``model``'s weights are still gathered and freed (under FSDP2 every rank takes
        part in each all-gather of a pass) and the result is empty (0, T)."""
        if len(batch) == 0:
            _, dp = self._workers_and_dp()
            with dp.full_params(model):
                empty = torch.zeros(0, batch["responses"].shape[1])
                return empty if outputs == 1 else (empty,) * outputs
        out = fn(batch.to(self.device))
        return out.cpu() if outputs == 1 else tuple(x.cpu() for x in out)

    # -- updates (the whole batch on every rank)
    @_busy
    def update_actor(self, batch: Batch, old_log_probs_from_update: bool) -> dict[str, float]:
        metrics = self._role("actor").update_actor(
            batch.to(self.device), old_log_probs_from_update=old_log_probs_from_update
        )
        return {k: float(v) for k, v in metrics.items()}

    @_busy
    def update_critic(self, batch: Batch) -> dict[str, float]:
        metrics = self._role("critic").update_critic(batch.to(self.device))
        return {k: float(v) for k, v in metrics.items()}

    # -- reward
    @_busy
    def score(self, batch: Batch):
        return self._reward()(batch) if len(batch) else None

    def check_dataset(self, dataset) -> None:
        self._reward().check_dataset(dataset)

    # -- checkpoints (every rank is called: gathering sharded state is collective)
    def state(self, role: Trained) -> dict:
        state = self._role(role).state_dict()
        state["rank_rng"] = torch.get_rng_state()
        return state

    def load_state(self, role: Trained, state: dict) -> None:
        self._role(role).load_state_dict(state)
        if "rank_rng" in state:
            torch.set_rng_state(state["rank_rng"])

    def scale_lr(self, role: Trained, factor: float) -> float:
        return self._role(role).scale_lr(factor)

    def weights(self, role: Trained) -> dict[str, torch.Tensor] | None:
        state = self._role(role).model_state()
        return state if self.rank == 0 else None

    def load_weights(self, role: Trained, state: dict[str, torch.Tensor]) -> None:
        self._role(role).load_model_state(state)

    @_busy
    def load_policy(self, state: dict[str, torch.Tensor]) -> None:
        """A rollout rank's new weights (the actor's full ``model_state``), between two
        requests; its engine follows them (the weights version is bumped)."""
        from lmrl.models.loading import bump_weights_version

        policy = self._role("policy")
        with torch.no_grad():
            result = policy.load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise KeyError(f"weights the rollout policy does not have: {result.unexpected_keys}")
        bump_weights_version(policy)

    def _workers_and_dp(self) -> tuple[Workers, DataParallel]:
        """This rank's workers and data parallelism.

        Raises:
            RuntimeError: `setup` has not run on this rank.
        """
        if self.workers is None or self.dp is None:
            raise RuntimeError(f"rank {self.rank} of the {self.group} group is not set up")
        return self.workers, self.dp

    @overload
    def _role(self, role: Literal["actor"]) -> ActorWorker: ...
    @overload
    def _role(self, role: Literal["critic"]) -> CriticWorker: ...
    @overload
    def _role(self, role: Literal["reference"]) -> ReferenceWorker: ...
    @overload
    def _role(self, role: Literal["policy"]) -> nn.Module: ...

    def _role(self, role: str) -> Any:
        """This rank's part ``role`` (a field of `Workers`).

        Raises:
            ValueError: this rank has no such part.
        """
        worker = getattr(self.workers, role)
        if worker is None:
            raise ValueError(f"rank {self.rank} of the {self.group} group has no {role}")
        return worker

    def _reward(self) -> RewardRole:
        if self.reward is None:
            raise ValueError(f"rank {self.rank} of the {self.group} group has no reward")
        return self.reward


def _offload(offload: str) -> dict[str, bool]:
    """``actor.offload`` / ``critic.offload`` as `FSDP2`'s keyword arguments."""
    return {
        "param_offload": offload in ("params", "both"),
        "optimizer_offload": offload in ("optimizer", "both"),
    }


# ------------------------------------------------------------------------- the driver side


class RayWorkerGroup:
    """``world_size`` `RankWorker` actors placed on a placement group, and their dispatch.

    Args:
        name: the group's name (``actor`` or ``critic``), in process names and errors.
        cluster: the run's ``lmrl.workers.ray_cluster.RayCluster`` (started).
        cfg: the resolved config (pickled to every rank).
        roles: what each rank builds: ``actor``, ``critic``, ``reward``.
        world_size: ranks.
        use_gpu: one GPU per rank (else one CPU process each).
        total_steps: training steps, for the learning-rate schedules.
        concurrency: calls a rank runs at once (an async run's rollout group: 2, so a batch
            is scored while the next one generates).
    """

    DEATH_GRACE_S = 5.0  # how long a failure waits for a peer's death to be the one reported

    def __init__(
        self, name: str, cluster, cfg: Config, plan: WorkerPlan, roles: Sequence[str],
        world_size: int, use_gpu: bool, total_steps: int, concurrency: int = 1,
    ) -> None:  # fmt: skip
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.world_size = name, world_size
        self.alive, self.placement = True, None
        # Ray's handles of RankWorker (ray.actor.ActorProxy): its types give a method's
        # ``.remote`` only to methods decorated with ray.method, and this class imports no ray
        self.ranks: list[Any] = []
        self.wall: dict[str, float] = defaultdict(float)  # driver seconds per method called
        self.infos: list[dict] = [{} for _ in range(world_size)]
        self.placement = cluster.placement_group(world_size, use_gpu=use_gpu, name=name)
        remote = ray.remote(RankWorker)
        threads = cluster.cpus_per_worker
        self.ranks = [
            remote.options(
                num_cpus=threads,
                max_concurrency=concurrency,
                num_gpus=1 if use_gpu else 0,
                name=f"lmrl-{name}-{rank}-{os.getpid()}",
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": _worker_env(threads)},
            ).remote(name, rank, world_size, threads)
            for rank in range(world_size)
        ]
        self.infos = self._gather([r.info.remote() for r in self.ranks], "start")
        master = self._gather([self.ranks[0].master_address.remote()], "start")[0]
        self.infos = self._gather(
            [r.setup.remote(cfg, plan, list(roles), master, total_steps) for r in self.ranks],
            "set-up",
        )

    # -- calls
    def call(self, method: str, *args, **kwargs) -> list:
        """``method(*args)`` on every rank (arguments put in the object store once)."""
        import ray

        with self._timed(method):
            sent = [ray.put(a) if isinstance(a, Batch | dict) else a for a in args]  # once
            refs = [getattr(r, method).remote(*sent, **kwargs) for r in self.ranks]
            return self._gather(refs, method)

    def call_one(self, rank: int, method: str, *args) -> Any:
        """``method(*args)`` on one rank."""
        with self._timed(method):
            return self._gather([getattr(self.ranks[rank], method).remote(*args)], method)[0]

    def call_each(self, method: str, per_rank: Sequence[tuple]) -> list:
        """``method(*per_rank[r])`` on rank ``r``."""
        with self._timed(method):
            pairs = zip(self.ranks, per_rank, strict=True)
            return self._gather([getattr(r, method).remote(*a) for r, a in pairs], method)

    @contextlib.contextmanager
    def _timed(self, method: str) -> Iterator[None]:
        """Add the driver's wall time of a call (sending, remote work, gathering) to ``wall``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wall[method] += time.perf_counter() - start

    def map_rows(
        self, method: str, batch: Batch, *args, keys: Sequence[str] = FORWARD_KEYS
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """A (B, T) result computed row-wise, the rows split across ranks by token count.

        ``method(rows, *args)`` runs on each rank; when it returns a tuple of (b, T) tensors
        (log-probs and entropy), so does this, each gathered the same way.
        """
        batch = batch.select(*(k for k in keys if k in batch))
        parts = partition_rows(batch, self.world_size)
        results = self.call_each(method, [(batch.index(p), *args) for p in parts])
        is_tuple = isinstance(results[0], tuple)
        results = [r if is_tuple else (r,) for r in results]
        full = next(r for r, p in zip(results, parts, strict=True) if len(p))
        outs = tuple(
            torch.zeros(len(batch), batch["responses"].shape[1], dtype=x.dtype) for x in full
        )
        for part, result in zip(parts, results, strict=True):
            if len(part):
                for out, x in zip(outs, result, strict=True):
                    out[torch.as_tensor(part)] = x
        return outs if is_tuple else outs[0]

    def _gather(self, refs: list, what: str) -> list:
        """Wait for every rank; on the first failure stop the group and raise `WorkerError`."""
        import ray

        pending = dict(zip(refs, range(len(refs)), strict=True))
        results: list = [None] * len(refs)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as err:
                    rank, err = self._root_cause(pending, rank, err)
                    self.kill()
                    raise self._error(err, rank, what) from None
        return results

    def _root_cause(self, pending: dict, rank: int, err: Exception) -> tuple[int, Exception]:
        """The failure to report: a rank whose collective broke is often the echo of a peer
        that died, so the other ranks get `DEATH_GRACE_S` to finish, and the first of them
        found dead is reported instead of ``rank``'s ``err``."""
        import ray

        deadline = time.monotonic() + self.DEATH_GRACE_S
        while not isinstance(err, ray.exceptions.RayActorError) and pending:
            left = deadline - time.monotonic()
            ready = ray.wait(list(pending), num_returns=1, timeout=left)[0] if left > 0 else []
            if not ready:
                break
            peer = pending.pop(ready[0])
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as died:
                return peer, died
            except Exception:  # another echo
                pass
        return rank, err

    def _error(self, err: Exception, rank: int, what: str) -> LmrlError:
        import ray

        info = self.infos[rank] if rank < len(self.infos) else {}
        where = f"the {self.name} worker of rank {rank}"
        if info:
            where += f" (pid {info.get('pid')} on {info.get('node')})"
        if isinstance(err, ray.exceptions.RayTaskError):
            cause = err.cause if isinstance(err.cause, BaseException) else None
            log.debug("%s failed in %s:\n%s", where, what, err)
            if isinstance(cause, LmrlError):
                return type(cause)(f"{where}: {cause}")
            detail = f"{type(cause).__name__}: {cause}" if cause else str(err).splitlines()[0]
            return WorkerError(f"{where} failed in {what}: {detail}")
        if isinstance(err, ray.exceptions.RayActorError | ray.exceptions.ActorDiedError):
            return WorkerError(f"{where} died during {what} (its process was killed or crashed)")
        return WorkerError(f"{where} failed in {what}: {type(err).__name__}: {err}")

    def kill(self) -> None:
        """Stop every rank now (no graceful exit: a peer may be stuck in a collective)."""
        import ray

        for rank in self.ranks:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(rank, no_restart=True)
        self.alive = False

    def close(self) -> None:
        """Let every rank leave its process group, then stop the actors and placement."""
        import ray

        if self.alive:
            with contextlib.suppress(Exception):  # closing after a failure: kill below
                ray.get([r.stop.remote() for r in self.ranks], timeout=30)
        self.kill()
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.placement)


def _worker_env(threads: int) -> dict[str, str]:
    n = str(max(1, threads))
    env = {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "TOKENIZERS_PARALLELISM": "false"}
    for key in ("HF_HUB_OFFLINE", "HF_HOME", "TRANSFORMERS_OFFLINE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env
