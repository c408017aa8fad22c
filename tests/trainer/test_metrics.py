"""The metric table: documented once, and the docs are generated from it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lmrl.trainer.metrics import METRICS, metrics_markdown


def test_docs_table_is_generated_from_the_code():
    docs = Path(__file__).parents[2] / "docs" / "metrics.md"
    assert docs.read_text() == metrics_markdown(), (
        "run: python -m lmrl.trainer.metrics > docs/metrics.md"
    )


def test_issue_metric_names_are_documented():
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
                 "actor/grad_norm", "critic/vf_loss", "critic/vf_explained_var",
                 "response_length/clip_ratio", "perf/throughput"):  # fmt: skip
        assert name in METRICS
    for prefix in ("critic/score/", "critic/rewards/", "critic/advantages/", "timing_s/"):
        assert prefix in METRICS


def documented(name: str) -> bool:
    """In METRICS by name, or under one of its prefixes (keys ending in "/")."""
    return name in METRICS or any(k.endswith("/") and name.startswith(k) for k in METRICS)


def test_every_metric_the_trainer_emits_is_documented(tiny_workspace, tiny_overrides, tmp_path):
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    runs = {
        "ppo": [
            "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true",
            "actor.use_kl_loss=true", "actor.entropy_coeff=0.01",
            "rollout.log_prob_mode=rollout_correction", "rollout.correction.mode=mask",
            f"data.val_files={tiny_workspace / 'data' / 'test.parquet'}",
        ],
        "dapo": [
            "algorithm.filter_groups.enable=true", "reward.manager=dapo",
            "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2",
            "actor.clip_ratio_c=3.0",
        ],
        "clip_cov": ["actor.policy_loss.loss_mode=clip_cov"],
        "kl_cov": ["actor.policy_loss.loss_mode=kl_cov", "actor.ppo_epochs=2"],
    }  # fmt: skip
    emitted: set[str] = set()
    for name, extra in runs.items():
        cfg = load_config(None, tiny_overrides(tiny_workspace, tmp_path / name, *extra))
        trainer = Trainer(build_run(cfg), cfg.trainer)
        for metrics in trainer.fit():
            emitted |= metrics.keys()
    assert {"critic/vf_loss", "actor/kl_loss", "rollout_corr/is_weight_mean",
            "filter_groups/kept_fraction", "actor/reward_kl_penalty", "actor/cov_clipfrac",
            "actor/cov_klfrac"} <= emitted  # fmt: skip
    assert any(k.startswith("val/") for k in emitted)
    missing = sorted(k for k in emitted if not documented(k))
    assert not missing, f"emitted but not in METRICS (lmrl.trainer.metrics): {missing}"


def test_documented_is_not_a_blanket_yes():
    assert documented("actor/pg_loss") and documented("timing_s/gen")
    assert not documented("actor/pg_losss") and not documented("made_up/metric")


def test_the_engine_gap_is_the_masked_mean_and_max():
    import torch

    from lmrl.trainer.metrics import engine_gap

    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    rollout = torch.tensor([[-1.1, -2.0, -9.0], [-0.25, -0.5, 7.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])  # the 6.0 and 7.0 are pads
    gap = engine_gap(old, rollout, mask)
    assert float(gap["rollout/actor_logprob_abs_diff"]) == pytest.approx((0.1 + 0.25) / 4)
    assert float(gap["rollout/actor_logprob_abs_diff_max"]) == pytest.approx(0.25)
    # r = pi_old / pi_rollout: e^0.1, 1, e^-0.25, 1 -> k3 = r - 1 - log r; outside [0.9, 1.1]:
    # e^0.1 = 1.105 and e^-0.25 = 0.78, so 2 tokens of 4
    k3 = [math.exp(d) - 1 - d for d in (0.1, 0.0, -0.25, 0.0)]
    assert float(gap["rollout/mismatch_k3"]) == pytest.approx(sum(k3) / 4)
    assert float(gap["rollout/ratio_outside_frac"]) == pytest.approx(0.5)


def test_the_hf_engine_gap_is_rounding_when_old_log_probs_are_recomputed(
    tiny_workspace, tiny_overrides, tmp_path
):
    """Two mini-batches a step: the old log-probs are recomputed, and the gap is logged."""
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    cfg = load_config(None, tiny_overrides(tiny_workspace, tmp_path / "run"))
    history = Trainer(build_run(cfg), cfg.trainer).fit()
    for metrics in history:
        assert metrics["actor/old_log_prob_recomputed"] == 1.0
        assert metrics["rollout/actor_logprob_abs_diff_max"] < 1e-4
