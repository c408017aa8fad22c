"""The metric table: documented once, and the docs are generated from it."""

from __future__ import annotations

from pathlib import Path

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
