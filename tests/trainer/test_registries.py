"""Nothing validates that does not run: every name of every registry family either trains one
tiny step with finite metrics, or is refused by ``load_config`` (a ``ConfigError`` naming
the key) before anything loads. Which of the two is pinned per name in ``EXPECTED``: a name
that starts or stops being refused fails here, and so does a new name without an entry."""

from __future__ import annotations

import importlib.util
import math
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmrl.algos import advantage_estimators, kl_controllers, kl_estimators, policy_losses
from lmrl.algos.agg import LOSS_AGG_MODES
from lmrl.config import ConfigError, load_config
from lmrl.config.schema import RolloutConfig, RolloutCorrectionConfig
from lmrl.rewards.managers import REWARD_MANAGERS
from lmrl.rollout.engines import ENGINES
from lmrl.trainer import Trainer, build_run

# a reward with spread inside every group: the share of digits in the response
REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""


def _choices(cls, name: str) -> tuple[str, ...]:
    """The values of a ``Literal[...]`` config field (``Literal[...] | None``: its values)."""
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) is not typing.Literal:  # an optional Literal
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_args(hint)


CASES: list[tuple[str, list[str]]] = []
CASES += [
    (f"adv_estimator={n}", [f"algorithm.adv_estimator={n}"]) for n in advantage_estimators.names()
]
CASES += [(f"loss_mode={n}", [f"actor.policy_loss.loss_mode={n}"]) for n in policy_losses.names()]
CASES += [
    (f"kl_loss_type={n}", ["actor.use_kl_loss=true", f"actor.kl_loss_type={n}"])
    for n in kl_estimators.names()
]
CASES += [
    (f"kl_penalty={n}", ["algorithm.use_kl_in_reward=true", f"algorithm.kl_penalty={n}"])
    for n in kl_estimators.names()
]
CASES += [
    (f"kl_ctrl={n}", ["algorithm.use_kl_in_reward=true", f"algorithm.kl_ctrl.type={n}"])
    for n in kl_controllers.names()
]
CASES += [(f"loss_agg_mode={m}", [f"actor.loss_agg_mode={m}"]) for m in LOSS_AGG_MODES]
CASES += [(f"reward.manager={n}", [f"reward.manager={n}"]) for n in REWARD_MANAGERS.names()]
CASES += [(f"rollout.name={n}", [f"rollout.name={n}"]) for n in ENGINES.names()]
CASES += [
    (f"log_prob_mode={m}", [f"rollout.log_prob_mode={m}"])
    for m in _choices(RolloutConfig, "log_prob_mode")
]
CASES += [
    (
        f"correction={level}/{mode}",
        [
            "rollout.log_prob_mode=rollout_correction",
            f"rollout.correction.level={level}",
            f"rollout.correction.mode={mode}",
        ],
    )
    for level in _choices(RolloutCorrectionConfig, "level")
    for mode in _choices(RolloutCorrectionConfig, "mode")
]


@dataclass(frozen=True)
class Refused:
    """Refused by ``load_config``: a ``ConfigError`` naming the key and containing ``reason``."""

    reason: str


TRAINS = "trains"  # validates and trains one step with finite metrics

# Every case's expected outcome. A new registry name fails until it has its entry here.
EXPECTED: dict[str, str | Refused] = {
    "adv_estimator=gae": TRAINS,
    "adv_estimator=grpo": TRAINS,
    "adv_estimator=grpo_passk": TRAINS,
    "adv_estimator=opo": TRAINS,
    "adv_estimator=reinforce_plus_plus": TRAINS,
    "adv_estimator=reinforce_plus_plus_baseline": TRAINS,
    "adv_estimator=remax": TRAINS,
    "adv_estimator=rloo": TRAINS,
    "loss_mode=cispo": TRAINS,
    "loss_mode=clip_cov": TRAINS,
    "loss_mode=geo_mean": TRAINS,
    "loss_mode=gspo": TRAINS,
    "loss_mode=kl_cov": TRAINS,
    "loss_mode=reinforce": TRAINS,
    "loss_mode=sapo": TRAINS,
    "loss_mode=vanilla": TRAINS,
    "kl_loss_type=abs": TRAINS,
    "kl_loss_type=full": TRAINS,
    "kl_loss_type=k1": TRAINS,
    "kl_loss_type=k2": TRAINS,
    "kl_loss_type=k3": TRAINS,
    "kl_penalty=abs": TRAINS,
    # the KL over the whole vocabulary needs the logits: a loss term only
    "kl_penalty=full": Refused("needs the logits"),
    "kl_penalty=k1": TRAINS,
    "kl_penalty=k2": TRAINS,
    "kl_penalty=k3": TRAINS,
    "kl_ctrl=adaptive": TRAINS,
    "kl_ctrl=fixed": TRAINS,
    "loss_agg_mode=token-mean": TRAINS,
    "loss_agg_mode=token-sum": TRAINS,
    "loss_agg_mode=seq-mean-token-sum": TRAINS,
    "loss_agg_mode=seq-mean-token-mean": TRAINS,
    "loss_agg_mode=seq-mean-token-sum-norm": TRAINS,
    "reward.manager=batch": TRAINS,
    "reward.manager=dapo": TRAINS,
    "reward.manager=naive": TRAINS,
    "rollout.name=hf": TRAINS,
    # refused where vLLM is not installed (this venv); where it is, it must train
    "rollout.name=vllm": (
        TRAINS
        if importlib.util.find_spec("vllm")
        else Refused("needs vLLM, which is not installed")
    ),
    "log_prob_mode=decoupled": TRAINS,
    "log_prob_mode=bypass": TRAINS,
    "log_prob_mode=rollout_correction": TRAINS,
    "correction=token/truncate": TRAINS,
    "correction=token/mask": TRAINS,
    "correction=sequence/truncate": TRAINS,
    "correction=sequence/mask": TRAINS,
    "correction=geometric/truncate": TRAINS,
    "correction=geometric/mask": TRAINS,
}


def test_every_case_has_an_expected_outcome():
    cases = [c for c, _ in CASES]
    missing = [c for c in cases if c not in EXPECTED]
    assert not missing, (
        f"new registry names without an expected outcome: {missing}; add each to EXPECTED in "
        f"{__file__} as TRAINS or Refused('<words of its ConfigError>')"
    )
    stale = sorted(set(EXPECTED) - set(cases))
    assert not stale, f"EXPECTED names cases that no registry has any more: {stale}"


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reward") / "reward.py"
    path.write_text(REWARD_FILE)
    return path


@pytest.mark.parametrize(("case", "overrides"), CASES, ids=[c for c, _ in CASES])
def test_every_registry_name_trains_a_step_or_is_refused_at_config_time(
    tiny_workspace, tiny_overrides, reward_file, tmp_path, case, overrides
):
    args = tiny_overrides(
        tiny_workspace,
        tmp_path / "run",
        "data.max_response_length=4",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=1",
        f"reward.custom_reward_function.path={reward_file}",
        *overrides,
    )
    expected = EXPECTED.get(case)
    if expected is None:
        pytest.fail(f"{case}: no expected outcome; add it to EXPECTED (TRAINS or Refused(...))")
    try:
        cfg = load_config(None, args)
    except ConfigError as err:
        if not isinstance(expected, Refused):
            raise AssertionError(f"{case}: expected to train, refused: {err}") from err
        key = overrides[-1].split("=")[0]
        assert key in str(err), f"{case}: refused without naming {key}: {err}"
        assert expected.reason in str(err), f"{case}: refused for another reason: {err}"
        return
    assert not isinstance(expected, Refused), (
        f"{case}: expected to be refused ({expected.reason!r}), but load_config accepts it; "
        "if it now trains, mark it TRAINS in EXPECTED"
    )
    parts = build_run(cfg)
    try:
        metrics = Trainer(parts, cfg.trainer).step()
    finally:
        parts.close()
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    assert not bad, bad
    assert "actor/pg_loss" in metrics
