"""Data parallelism: the token-balanced partition, and an update over 2 gloo ranks (DDP, DDP
with gradient checkpointing, FSDP2, FSDP2 with CPU offload) equal to the single-process update
on the same batch, for the actor and the critic; a sharded reference scoring uneven rows.

The ranks are plain processes here (``torch.multiprocessing``); the Ray tests run the same
workers inside Ray actors.
"""

from __future__ import annotations

import errno
import os
import socket
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.host_reads import HostReads

from lmrl.models import load_causal_lm
from lmrl.models.critic import load_critic
from lmrl.models.layout import with_row_layout
from lmrl.workers.actor import ActorWorker
from lmrl.workers.critic import CriticWorker
from lmrl.workers.dist import (
    DDP,
    balanced_partition,
    join_process_group,
    partition_rows,
    rendezvous_store,
)
from lmrl.workers.fsdp import FSDP2

from .conftest import N, actor_config, add_log_probs, critic_config, make_batch


@pytest.mark.parametrize("n,parts", [(6, 2), (7, 3), (2, 2), (5, 1), (9, 4)])
def test_balanced_partition_covers_every_row_once_with_equal_counts(n, parts):
    lengths = torch.tensor([(i * 7919) % 13 + 1 for i in range(n)])
    groups = balanced_partition(lengths, parts)
    assert len(groups) == parts
    assert sorted(np.concatenate(groups).tolist()) == list(range(n))
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1


def test_balanced_partition_balances_tokens():
    lengths = torch.tensor([100, 1, 1, 1, 90, 2, 2, 3])
    loads = [int(lengths[g].sum()) for g in balanced_partition(lengths, 2)]
    assert sorted(loads) == [97, 103]  # not [104, 96] as a contiguous cut would give
    # deterministic: every rank computes the same partition
    again = balanced_partition(lengths, 2)
    assert all((a == b).all() for a, b in zip(balanced_partition(lengths, 2), again, strict=True))


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_the_partition_from_the_rows_layout_is_the_partition_from_the_tensors(parts):
    """With the host's layout of the rows (what every update carries), the ranks' rows are the
    same whole prompt groups as the tensors give, found without reading the device back."""
    batch = make_batch(seed=4)
    batch = batch.index(torch.tensor([0, 2, 1, 3, 4, 5, 5, 4]))  # 3 prompts: 2, 2 and 4 rows
    from_tensors = partition_rows(batch, parts)
    laid_out = with_row_layout(batch.select("input_ids", "attention_mask", "responses"))
    with HostReads() as reads:
        from_layout = partition_rows(laid_out, parts)
    assert reads.reads == []
    assert all(np.array_equal(a, b) for a, b in zip(from_layout, from_tensors, strict=True))


# ------------------------------------------------------------------ two gloo ranks
def spawn_two_ranks(fn, *args) -> None:
    """``fn(rank, 2, port, *args)`` in two spawned processes that meet at a rendezvous this
    process serves (`rendezvous_store`: its port held until both are done, so no other process
    takes it meanwhile and no rank of another test joins)."""
    store = rendezvous_store("127.0.0.1")
    mp.start_processes(fn, args=(2, store.port, *args), nprocs=2, start_method="spawn")
    del store  # served until both ranks are done


def join(rank: int, world: int, port: int) -> None:
    """A spawned rank's start: one torch thread, and the group of `spawn_two_ranks`."""
    torch.set_num_threads(1)
    join_process_group("gloo", rank, world, ("127.0.0.1", port))


def leave() -> None:
    """A rank's end once its work is done: meet the peer, leave the group, and exit the process
    now. FSDP2's DTensor caches keep the process group past ``destroy_process_group``, so
    gloo's threads would still run while the interpreter tears down around them (the peer
    closing its sockets meanwhile); a rank that raised skips this and reports its error."""
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_a_rendezvous_holds_its_port_until_the_ranks_are_done():
    """A port found free and released (``free_port``) can be taken by any process of the
    machine before rank 0 binds it, and a rank can then join another group; a rendezvous is
    bound from the moment its port is known."""
    store = rendezvous_store("127.0.0.1")
    with socket.socket() as other, pytest.raises(OSError) as err:
        other.bind(("127.0.0.1", store.port))
    assert err.value.errno == errno.EADDRINUSE


def test_rank_0_of_a_ray_group_holds_the_port_it_hands_to_its_peers():
    from lmrl.workers.group import RankWorker

    rank0 = RankWorker("actor", 0, 2)
    host, port = rank0.master_address()
    try:
        with socket.socket() as other, pytest.raises(OSError) as err:
            other.bind((host, port))
        assert err.value.errno == errno.EADDRINUSE
    finally:
        rank0.stop()
    assert rank0.store is None


def _rank(rank: int, world: int, port: int, model_dir: str, kind: str, out: str,
          strategy: str = "ddp", dtype: str = "float64") -> None:  # fmt: skip
    join(rank, world, port)
    if strategy.startswith("fsdp2"):
        dp = FSDP2(rank, world, param_offload=strategy == "fsdp2-offload")
    else:
        dp = DDP(rank, world)
    _update(model_dir, kind, dp, out if rank == 0 else None, dtype, strategy.endswith("-ckpt"))
    leave()


def _update(model_dir: str, kind: str, dp, out: str | None, dtype: str = "float64",
            checkpointing: bool = False) -> None:  # fmt: skip
    """Two updates (2 epochs x 2 shuffled mini-batches x micro-batches of 2); save weights."""
    torch.manual_seed(0)
    batch = make_batch(seed=3)
    common = {"rollout_n": N, "max_response_length": 4, "total_steps": 10, "dp": dp}
    if kind == "actor":
        model = load_causal_lm(model_dir, dtype=dtype, device="cpu",
                               gradient_checkpointing=checkpointing)  # fmt: skip
        cfg = actor_config(ppo_mini_batch_size=2, ppo_micro_batch_size=2, shuffle=True,
                           ppo_epochs=2, clip_ratio=0.1)  # fmt: skip
        worker = ActorWorker(model, cfg, temperature=0.8, log_prob_micro_batch_size=None,
                             **common)  # fmt: skip
        add_log_probs(batch, worker)
        metrics = [worker.update_actor(batch) for _ in range(2)]
    else:
        model = load_critic(model_dir, dtype=dtype, device="cpu",
                            gradient_checkpointing=checkpointing)  # fmt: skip
        cfg = critic_config(ppo_mini_batch_size=2, ppo_micro_batch_size=2, shuffle=True)
        worker = CriticWorker(model, cfg, **common)
        batch["values"] = worker.compute_values(batch)
        noise = torch.randn(batch["values"].shape, generator=torch.Generator().manual_seed(5))
        batch["returns"] = torch.where(batch["response_mask"], noise, 0.0)
        metrics = [worker.update_critic(batch) for _ in range(2)]
    weights = worker.model_state()  # every rank: gathering sharded weights is collective
    if out is not None:
        metrics = [{k: float(v) for k, v in m.items()} for m in metrics]
        torch.save({"weights": weights, "metrics": metrics}, out)


#: (rtol, atol) of two ranks against one process: float64 agrees to rounding; float32 sums
#: the two ranks' gradients in another order than one process does (not bitwise), and Adam's
#: normalized step turns that into weight differences up to 1.2e-5 seen (a weight whose
#: gradient is near 0), so atol 5e-5
TOLERANCE = {"float64": (1e-5, 1e-7), "float32": (1e-4, 5e-5)}


@pytest.mark.parametrize(
    "kind,strategy,dtype",
    [("actor", "ddp", "float64"), ("critic", "ddp", "float64"), ("actor", "fsdp2", "float64"),
     # gradient checkpointing on both sides: groups share their prompt pass under it
     ("actor", "ddp-ckpt", "float64"), ("critic", "ddp-ckpt", "float64"),
     ("critic", "fsdp2", "float64"), ("actor", "fsdp2-offload", "float64"),
     # issue 31 §4: fsdp2 reduced with gloo's missing PREMUL_SUM in float32
     ("actor", "fsdp2", "float32"), ("critic", "fsdp2", "float32")],
)  # fmt: skip
def test_an_update_over_two_ranks_equals_the_single_process_update(
    tiny_dir, tmp_path, kind, strategy, dtype
):
    from lmrl.workers.dist import DataParallel

    local = tmp_path / "local.pt"
    _update(str(tiny_dir), kind, DataParallel(), str(local), dtype, strategy.endswith("-ckpt"))
    shared = tmp_path / "ddp.pt"
    spawn_two_ranks(_rank, str(tiny_dir), kind, str(shared), strategy, dtype)
    a, b = torch.load(local), torch.load(shared)
    assert a["weights"].keys() == b["weights"].keys()
    rtol, atol = TOLERANCE[dtype]
    for name, w in a["weights"].items():
        assert w.dtype == getattr(torch, dtype)
        torch.testing.assert_close(b["weights"][name], w, rtol=rtol, atol=atol)
    # the update really moved the weights (so equality is not trivially of the initial ones)
    start = (load_causal_lm if kind == "actor" else load_critic)(str(tiny_dir), dtype=dtype,
                                                                 device="cpu").state_dict()  # fmt: skip
    moved = max(float((a["weights"][k] - start[k]).abs().max()) for k in a["weights"] if k in start)
    assert moved > 1e-4
    for ma, mb in zip(a["metrics"], b["metrics"], strict=True):
        assert ma.keys() == mb.keys()
        for k in ma:
            assert mb[k] == pytest.approx(ma[k], rel=1e-4 if dtype == "float64" else 1e-3,
                                          abs=1e-6 if dtype == "float64" else 1e-5), k  # fmt: skip


def _reference_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    from torch.distributed.tensor import DTensor

    from lmrl.models import build_reference
    from lmrl.workers.reference import ReferenceWorker

    join(rank, world, port)
    dp = FSDP2(rank, world)
    frozen = build_reference(load_causal_lm(model_dir, dtype="float64", device="cpu"))
    frozen.model = dp.prepare_frozen(frozen.model)
    assert all(isinstance(p, DTensor) for p in frozen.model.parameters())  # sharded
    worker = ReferenceWorker(frozen, micro_batch_size=2, temperature=0.8, dp=dp)
    batch = make_batch(seed=3)
    mine = batch if rank == 0 else batch.index([])  # rank 1 has no rows to score
    log_probs = worker.compute_log_probs(mine)
    if rank == 0:
        torch.save(log_probs, out)
    leave()


def test_a_sharded_reference_scores_uneven_rows_as_one_process(tiny_dir, tmp_path):
    """fsdp2 shards the reference's frozen copy too; a rank with no rows still takes part in
    the gathering of its weights, so the other rank's pass neither hangs nor differs."""
    from lmrl.models import build_reference
    from lmrl.workers.reference import ReferenceWorker

    model = load_causal_lm(str(tiny_dir), dtype="float64", device="cpu")
    local = ReferenceWorker(build_reference(model), micro_batch_size=2, temperature=0.8)
    want = local.compute_log_probs(make_batch(seed=3))
    out = tmp_path / "ref.pt"
    spawn_two_ranks(_reference_rank, str(tiny_dir), str(out))
    torch.testing.assert_close(torch.load(out), want, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ weights of another model
def _widened(model_dir: str) -> dict[str, torch.Tensor]:
    """The tiny model's weights with every matrix one column wider: another model's."""
    state = load_causal_lm(model_dir, dtype="float32", device="cpu").state_dict()
    return {k: torch.zeros(*v.shape[:-1], v.shape[-1] + 1) if v.dim() == 2 else v
            for k, v in state.items()}  # fmt: skip


def _other_weights_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    join(rank, world, port)
    dp = FSDP2(rank, world)
    model = dp.prepare(load_causal_lm(model_dir, dtype="float32", device="cpu"))
    try:
        dp.load_model_state(model, _widened(model_dir))
    except ValueError as err:
        with open(f"{out}.{rank}", "w") as f:
            f.write(str(err))
    leave()


def test_weights_of_another_model_are_refused_in_one_line(tiny_dir, tmp_path):
    """issue 31 §4: torch's size-mismatch error is a line per tensor (the run loop's resume
    wraps this one line with the checkpoint's path); fsdp2's ranks refuse alike, before any
    collective (so none hangs waiting for the others)."""
    from lmrl.workers.dist import DataParallel

    model = load_causal_lm(str(tiny_dir), dtype="float32", device="cpu")
    embed = tuple(model.state_dict()["model.embed_tokens.weight"].shape)
    wider = (*embed[:-1], embed[-1] + 1)
    with pytest.raises(ValueError) as err:
        DataParallel().load_model_state(model, _widened(str(tiny_dir)))
    message = str(err.value)
    assert message.startswith(
        f"weights of another model: model.embed_tokens.weight is {wider}, the model's {embed} (and "
    )
    assert "\n" not in message
    out = tmp_path / "err"
    spawn_two_ranks(_other_weights_rank, str(tiny_dir), str(out))
    assert (tmp_path / "err.0").read_text() == (tmp_path / "err.1").read_text() == message
