"""Every implementation of a worker role against its `typing.Protocol` (``lmrl.workers.roles``):
the same method names, with the same parameter names, kinds and defaults, for the local
workers, the Ray stand-ins and the trainer tests' fakes; and the Ray actor's log-probs with the
entropy, dispatched over in-process ranks. No Ray anywhere: the stand-ins are plain classes.
"""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from lmrl.batch import Batch
from lmrl.models import load_causal_lm
from lmrl.rewards.managers import BatchRewardManager, DAPORewardManager, RewardManager
from lmrl.rollout.agent import AgentLoop
from lmrl.rollout.base import RolloutEngine
from lmrl.rollout.copy import CopyEngine
from lmrl.rollout.hf import HFEngine
from lmrl.rollout.vllm import VLLMEngine  # imports without vLLM: vllm is imported in methods
from lmrl.workers.actor import ActorWorker
from lmrl.workers.critic import CriticWorker
from lmrl.workers.dist import DataParallel
from lmrl.workers.group import RankWorker, RayWorkerGroup
from lmrl.workers.precision import PrecisionEngine
from lmrl.workers.reference import ReferenceWorker
from lmrl.workers.reward import RewardWorker
from lmrl.workers.roles import ActorRole, CriticRole, EngineRole, ReferenceRole, RewardRole
from lmrl.workers.stand_ins import (
    GroupActor,
    GroupCritic,
    GroupEngine,
    GroupReference,
    GroupReward,
    _Trained,
)


def _load(path: Path) -> ModuleType:
    """A test module by its path (the trainer tests' fakes live in theirs)."""
    spec = importlib.util.spec_from_file_location(f"_roles_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEP_PARTS = _load(Path(__file__).parents[1] / "trainer" / "test_step_parts.py")

IMPLEMENTATIONS = {
    ActorRole: [ActorWorker, GroupActor, STEP_PARTS.FakeActor],
    CriticRole: [CriticWorker, GroupCritic],
    ReferenceRole: [ReferenceWorker, GroupReference],
    # every engine and wrapper; vLLM's by signature (the class imports without vLLM)
    EngineRole: [
        RolloutEngine, HFEngine, CopyEngine, VLLMEngine, AgentLoop, PrecisionEngine, GroupEngine,
    ],
    RewardRole: [
        RewardManager, BatchRewardManager, DAPORewardManager, RewardWorker, GroupReward,
        STEP_PARTS.FakeReward,
    ],
}  # fmt: skip


def role_methods(role: type) -> list[str]:
    """The methods a role declares, its own and its bases' (``__call__`` included)."""
    return sorted(
        {
            name
            for cls in role.__mro__
            if cls.__module__ == ActorRole.__module__  # not Protocol, Generic, object
            for name, member in vars(cls).items()
            if inspect.isfunction(member) and (not name.startswith("_") or name == "__call__")
        }
    )


def role_attributes(role: type) -> list[str]:
    """The data attributes a role declares (``pad_id: int``), its own and its bases'."""
    return sorted(
        {
            name
            for cls in role.__mro__
            if cls.__module__ == ActorRole.__module__
            for name in vars(cls).get("__annotations__", {})
        }
    )


def _declared(cls: type, name: str) -> bool:
    """Whether a class of ``cls``'s MRO assigns or annotates ``name`` at class level."""
    return any(name in vars(c) or name in vars(c).get("__annotations__", {}) for c in cls.__mro__)


def _defined(cls: type, name: str):
    """``name`` as a class of ``cls``'s MRO defines it (never ``type.__call__``), or None."""
    return next((vars(c)[name] for c in cls.__mro__[:-1] if name in vars(c)), None)


def _params(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def mismatches(role: type, cls: type) -> list[str]:
    """How ``cls`` differs from ``role``: a method or a class-level attribute missing, or
    another parameter list."""
    problems = [
        f"{cls.__qualname__} declares no {name} (the {role.__name__} attribute)"
        for name in role_attributes(role)
        if not _declared(cls, name)
    ]
    for name in role_methods(role):
        got = _defined(cls, name)
        if got is None:
            problems.append(f"{cls.__qualname__} has no {name} (the {role.__name__} method)")
            continue
        want = getattr(role, name)
        if _params(got) != _params(want):
            problems.append(
                f"{cls.__qualname__}.{name}{inspect.signature(got)} is not "
                f"{role.__name__}.{name}{inspect.signature(want)}"
            )
    return problems


CASES = [(role, cls) for role, classes in IMPLEMENTATIONS.items() for cls in classes]


@pytest.mark.parametrize(
    "role,cls", CASES, ids=[f"{r.__name__}-{c.__qualname__}" for r, c in CASES]
)
def test_every_implementation_has_the_methods_and_arguments_of_its_role(role, cls):
    assert mismatches(role, cls) == []


def test_the_roles_declare_verl_s_method_names():
    trained = ["load_model_state", "load_state_dict", "model_state", "scale_lr", "state_dict"]
    assert role_methods(ActorRole) == sorted(["compute_log_probs", "update_actor", *trained])
    assert role_methods(CriticRole) == sorted(["compute_values", "update_critic", *trained])
    assert role_methods(ReferenceRole) == ["compute_log_probs"]
    assert role_methods(RewardRole) == ["__call__", "check_dataset", "close"]
    assert role_methods(EngineRole) == [
        "close", "generate", "set_row_done", "sync_weights", "view",
    ]  # fmt: skip
    assert role_attributes(EngineRole) == ["pad_id", "reports_rows", "shares_weights"]


class _Renamed(_Trained):  # update_actor under its old name
    compute_log_probs = GroupActor.compute_log_probs
    update_policy = GroupActor.update_actor


class _OtherDefault(_Trained):
    update_actor = GroupActor.update_actor

    def compute_log_probs(self, batch, with_entropy=True): ...


class _Positional(_Trained):
    compute_log_probs = GroupActor.compute_log_probs

    def update_actor(self, batch, old_log_probs_from_update=False): ...


class _OtherName(_Trained):
    update_actor = GroupActor.update_actor

    def compute_log_probs(self, rows, with_entropy=False): ...


@pytest.mark.parametrize("cls", [_Renamed, _OtherDefault, _Positional, _OtherName])
def test_a_method_or_argument_changed_on_one_implementation_is_caught(cls):
    assert len(mismatches(ActorRole, cls)) == 1


def test_the_roles_and_the_ray_stand_ins_import_without_ray():
    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # any `import ray` fails\n"
        "import lmrl.workers.roles, lmrl.workers.group, lmrl.workers.backend\n"
        "import lmrl.workers.reward, lmrl.trainer\n"
        "sys.modules['vllm'] = None\n"
        "import lmrl.rollout.vllm  # the engine class without vLLM\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


class InProcessGroup:
    """A group's dispatch (`RayWorkerGroup.map_rows`) over `RankWorker`s of this process."""

    map_rows = RayWorkerGroup.map_rows

    def __init__(self, ranks: list[RankWorker]) -> None:
        self.ranks, self.world_size = ranks, len(ranks)

    def call_each(self, method: str, per_rank) -> list:
        return [getattr(r, method)(*a) for r, a in zip(self.ranks, per_rank, strict=True)]


@pytest.mark.parametrize("world_size", [2, 8])  # 8 ranks for 6 rows: two ranks get none
def test_the_group_actor_gathers_log_probs_and_entropy_like_one_worker(
    tiny_dir, batch_factory, actor_factory, world_size
):
    actor = actor_factory(load_causal_lm(tiny_dir).double())
    ranks = []
    for rank in range(world_size):
        worker = RankWorker("actor", rank, world_size, threads=torch.get_num_threads())
        worker.workers, worker.dp = SimpleNamespace(actor=actor), DataParallel()
        ranks.append(worker)
    group = GroupActor(InProcessGroup(ranks))
    batch = batch_factory()
    want, want_entropy = actor.compute_log_probs(batch, with_entropy=True)

    log_probs, entropy = group.compute_log_probs(batch, with_entropy=True)
    torch.testing.assert_close(log_probs, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-10, rtol=1e-10)
    assert (entropy[batch["response_mask"]] > 0).all()
    only, none = group.compute_log_probs(batch)
    torch.testing.assert_close(only, want, atol=1e-10, rtol=1e-10)
    assert none is None


def test_the_group_reward_joins_the_ranks_extras_even_when_a_rank_lacks_one():
    """Rank 0's samples returned a text ``pred``, rank 1's none: the joined column keeps the
    text with None for rank 1's rows, and ``acc`` stays numeric."""
    import numpy as np

    from lmrl.rewards.result import RewardResult, split_extras

    def result(extras):
        return RewardResult(torch.zeros(2, 3), extras, {"reward/errors": 1.0})

    ranks = [
        result({"score": np.ones(2), "acc": np.array([1.0, 0.0]), "pred": np.array(["a", "b"])}),
        result({"score": np.zeros(2), "acc": np.array([0.0, 1.0])}),
    ]
    group = SimpleNamespace(world_size=2, call_each=lambda method, args: ranks)
    joined = GroupReward(group)(Batch({"responses": torch.zeros(4, 1)}))
    numeric, text = split_extras(joined.extras)
    assert list(text["pred"]) == ["a", "b", None, None]
    np.testing.assert_array_equal(numeric["acc"], [1.0, 0.0, 0.0, 1.0])
    assert joined.metrics["reward/errors"] == 2.0 and joined.token_level_scores.shape == (4, 3)


@pytest.mark.parametrize("peer", ["died", "succeeded", "echo"])
def test_a_failure_reports_the_rank_that_died_rather_than_its_echo(monkeypatch, peer):
    """Rank 0's collective breaks first (a peer's death reaches it as a RuntimeError); when
    rank 1 then turns out dead, the error names rank 1, else rank 0's own failure."""
    ray = pytest.importorskip("ray")
    from lmrl.errors import WorkerError

    group = object.__new__(RayWorkerGroup)
    group.name, group.ranks, group.alive = "actor", [], True
    group.infos = [{"pid": 10, "node": "n"}, {"pid": 11, "node": "n"}]
    outcomes = {
        "r0": RuntimeError("gloo: Connection closed by peer"),
        "r1": {
            "died": ray.exceptions.ActorDiedError(),
            "succeeded": 1.0,
            "echo": RuntimeError("gloo: timed out"),
        }[peer],
    }

    def wait(refs, num_returns=1, timeout=None):
        return [next(r for r in ("r0", "r1") if r in refs)], []

    def get(ref):
        if isinstance(outcomes[ref], Exception):
            raise outcomes[ref]
        return outcomes[ref]

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(WorkerError) as err:
        group._gather(["r0", "r1"], "update_actor")
    if peer == "died":
        assert "rank 1 (pid 11 on n) died during update_actor" in str(err.value)
    else:
        assert "rank 0 (pid 10 on n) failed in update_actor: RuntimeError: gloo: Connection" in (
            str(err.value)
        )
    assert not group.alive
