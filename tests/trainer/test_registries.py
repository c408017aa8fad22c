"""Nothing validates that does not run: every name of every registry family either trains one
tiny step with finite metrics, or is refused by ``load_config`` (a ``ConfigError`` naming
the key) before anything loads."""

from __future__ import annotations

import math
import typing
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
    """The values of a ``Literal[...]`` config field."""
    return typing.get_args(typing.get_type_hints(cls)[name])


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
    try:
        cfg = load_config(None, args)
    except ConfigError as err:
        key = overrides[-1].split("=")[0]
        assert key in str(err), f"{case}: refused without naming {key}: {err}"
        return
    parts = build_run(cfg)
    try:
        metrics = Trainer(parts, cfg.trainer).step()
    finally:
        parts.close()
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    assert not bad, bad
    assert "actor/pg_loss" in metrics
