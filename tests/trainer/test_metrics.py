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


def two_source_batch():
    """Six rows of two data sources, interleaved: digits in groups a (rows 0, 1) and b (rows
    4, 5), sort in group c (rows 2, 3); responses 4 wide, the score on the last token."""
    import numpy as np
    import torch

    from lmrl.batch import Batch

    lengths = [4, 2, 4, 4, 3, 1]
    scores = [1.0, 0.0, 0.2, 0.2, 0.5, 0.5]
    mask = torch.tensor([[j < n for j in range(4)] for n in lengths])
    token_scores = torch.zeros(6, 4)
    for i, (n, s) in enumerate(zip(lengths, scores, strict=True)):
        token_scores[i, n - 1] = s
    return Batch(
        {"responses": torch.ones(6, 4, dtype=torch.long), "response_mask": mask,
         "token_level_scores": token_scores},
        {"data_source": np.array(["digits", "digits", "sort", "sort", "digits", "digits"],
                                 dtype=object),
         "uid": np.array(["a", "a", "c", "c", "b", "b"], dtype=object)},
    )  # fmt: skip


def test_per_source_metrics_of_a_two_source_batch_by_hand():
    from lmrl.trainer.metrics import source_metrics

    batch = two_source_batch()
    given = {"critic/score/mean": 0.4, "train/digits/reward_errors": 1.0,
             "train/sort/reward_errors": 0.0, "train/digits/acc": 0.75}  # fmt: skip
    out = source_metrics(given, batch, max_response_length=4)
    assert out == pytest.approx(given | {
        # digits: scores 1, 0, 0.5, 0.5; lengths 4, 2, 3, 1 (one of 4 at the limit);
        # group a scored 1 and 0, group b 0.5 and 0.5: one group of two all alike
        "train/digits/score/mean": 0.5,
        "train/digits/response_length/mean": 2.5,
        "train/digits/response_length/clip_ratio": 0.25,
        "train/digits/score/zero_spread_frac": 0.5,
        # sort: scores 0.2, 0.2 (its one group all alike), lengths 4 and 4
        "train/sort/score/mean": 0.2,
        "train/sort/response_length/mean": 4.0,
        "train/sort/response_length/clip_ratio": 1.0,
        "train/sort/score/zero_spread_frac": 1.0,
    })  # fmt: skip
    assert all(documented(k) for k in out)


def test_rows_no_reward_function_scored_are_out_of_the_score_statistics():
    """Rows with ``scored_mask`` False (every reward function declined them) count in the
    lengths but not in the scores, their means or their groups' spread; a source none of
    whose rows was scored has no score mean at all."""
    import torch

    from lmrl.trainer.metrics import data_metrics, source_metrics

    batch = two_source_batch()
    batch["scored_mask"] = torch.tensor([True, False, False, False, True, True])
    out = source_metrics({}, batch, max_response_length=4)
    assert out["train/digits/score/mean"] == pytest.approx((1.0 + 0.5 + 0.5) / 3)
    assert "train/sort/score/mean" not in out and "train/sort/score/zero_spread_frac" not in out
    assert out["train/sort/response_length/mean"] == 4.0
    assert out["train/digits/score/zero_spread_frac"] == 1.0  # group a is one row now: only b
    batch_wide = data_metrics(batch, max_response_length=4)
    assert batch_wide["critic/score/mean"] == pytest.approx(2.0 / 3)
    assert batch_wide["critic/score/min"] == 0.5
    assert batch_wide["critic/score/zero_spread_frac"] == 1.0
    assert batch_wide["response_length/mean"] == pytest.approx(18 / 6)


def test_a_single_source_batch_logs_nothing_per_source():
    import numpy as np

    from lmrl.trainer.metrics import source_metrics, source_reward_metrics

    batch = two_source_batch()
    batch["data_source"] = np.array(["digits"] * 6, dtype=object)
    given = {"critic/score/mean": 0.4, "train/digits/reward_errors": 0.0}
    assert source_metrics(given, batch, max_response_length=4) == {"critic/score/mean": 0.4}
    assert source_reward_metrics(batch, {"acc": np.ones(6)}) == {}


def test_per_source_acc_skips_samples_without_one():
    import numpy as np

    from lmrl.trainer.metrics import source_reward_metrics

    acc = np.array([1.0, 0.0, np.nan, 0.0, 1.0, 1.0])  # digits 1, 0, 1, 1; sort -, 0
    assert source_reward_metrics(two_source_batch(), {"acc": acc}) == {
        "train/digits/acc": 0.75,
        "train/sort/acc": 0.0,
    }
    assert source_reward_metrics(two_source_batch(), {"score": acc}) == {}  # no acc


def test_the_reward_manager_counts_errors_per_data_source():
    from lmrl.rewards.managers import RewardManager

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "bad":
            raise ValueError("cannot score")
        return 1.0

    manager = RewardManager(None, reward_fns=fn, num_workers=0)
    _, _, metrics = manager.score_texts(
        ["ok", "bad", "bad", "ok", "ok"],
        data_sources=["digits", "sort", "sort", "digits", "sort"],
        ground_truths=[""] * 5,
        extra_infos=[None] * 5,
    )
    assert metrics["reward/errors"] == 2.0
    assert metrics["train/sort/reward_errors"] == 2.0
    assert metrics["train/digits/reward_errors"] == 0.0


def test_a_run_of_two_mixed_tasks_logs_each_source(tiny_workspace, tiny_overrides, tmp_path,
                                                    capsys):  # fmt: skip
    """Digits and sort mixed from two files, 2 steps: metrics.jsonl, the console line and the
    plot show each source."""
    import json

    from lmrl.config import load_config
    from lmrl.data.tasks import write_task
    from lmrl.logging.plot import draw_run, load_metrics
    from lmrl.trainer import Trainer, build_run

    digits = tiny_workspace / "data" / "train.parquet"
    sort = write_task("sort", tmp_path / "sort", seed=0, num_train=16, num_test=2)["train"]
    run_dir = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(
        tiny_workspace, run_dir, f"data.train_files=[{digits},{sort}]",
        "data.train_batch_size=6", "trainer.save_freq=0", "trainer.logger=[console]",
    ))  # fmt: skip
    Trainer(build_run(cfg), cfg.trainer).fit()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "critic/score/mean" in r]
    assert len(steps) == 2
    for record in steps:
        for source in ("digits", "sort"):
            for name in ("score/mean", "acc", "response_length/mean",
                         "response_length/clip_ratio", "score/zero_spread_frac",
                         "reward_errors"):  # fmt: skip
                assert f"train/{source}/{name}" in record, (source, name)
        assert record["train/digits/reward_errors"] == record["train/sort/reward_errors"] == 0
    console = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(console) == 2 and all("(digits " in line and " sort " in line for line in console)
    reward_ax = draw_run(load_metrics(run_dir / "metrics.jsonl")).axes[0]
    labels = [line.get_label() for line in reward_ax.get_lines()]
    assert {"train digits score", "train sort score", "train digits acc",
            "train sort acc"} <= set(labels)  # fmt: skip


class Sources:
    """The run's reward, recording the data sources of each call."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, batch):
        self.calls.append(set(batch["data_source"]))
        return self.inner(batch)


FLAKY_SORT = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "sort" and len(solution_str) % 2:
        raise ValueError("odd")
    return {"score": len(solution_str) / 12, "acc": float(len(solution_str) > 6)}
"""


def test_per_source_metrics_are_the_same_when_rows_are_scored_as_they_stop(
    tiny_workspace, tiny_overrides, tmp_path
):
    """A reward failing on some sort samples: its errors are counted against sort, in one
    call or in the calls of rows scored as they stop (calls that may hold one source)."""
    import dataclasses

    from lmrl.config import load_config
    from lmrl.data.tasks import write_task
    from lmrl.trainer import Trainer, build_run

    (tmp_path / "reward.py").write_text(FLAKY_SORT)
    sort = write_task("sort", tmp_path / "sort", seed=0, num_train=16, num_test=2)["train"]
    files = f"data.train_files=[{tiny_workspace / 'data' / 'train.parquet'},{sort}]"
    history, calls = {}, {}  # calls: the data sources of each reward call
    for name, extra in (("whole", []), ("rows", ["reward.overlap.rows=true"])):
        cfg = load_config(None, tiny_overrides(
            tiny_workspace, tmp_path / name, files, "data.train_batch_size=6",
            "trainer.save_freq=-1", 'rollout.stop=["a","e","1"]', "data.max_response_length=12",
            f"reward.custom_reward_function.path={tmp_path / 'reward.py'}",
            "reward.max_error_fraction=2", *extra,
        ))  # fmt: skip
        parts = build_run(cfg)
        reward = Sources(parts.reward)
        history[name] = Trainer(dataclasses.replace(parts, reward=reward), cfg.trainer).fit()
        calls[name] = reward.calls
    assert len(calls["whole"]) == 2 and {1} <= {len(c) for c in calls["rows"]}  # one source
    for whole, rows in zip(history["whole"], history["rows"], strict=True):
        per_source = {k: v for k, v in whole.items() if k.startswith("train/")}
        assert per_source == {k: rows[k] for k in per_source}
        assert whole["train/digits/reward_errors"] == 0
        assert whole["train/sort/reward_errors"] == whole["reward/errors"]
        assert "train/sort/acc" in whole and "train/digits/acc" in whole
    assert sum(m["reward/errors"] for m in history["whole"]) > 0
