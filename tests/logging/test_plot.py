"""``lmrl plot``: a PNG of the expected size from a recorded run, clear errors otherwise."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from lmrl.cli import main
from lmrl.errors import DataError
from lmrl.logging.plot import DPI, FIGSIZE, draw_run, ema, load_metrics, plot_run

RECORDED = Path(__file__).parent / "data" / "grpo_digits"  # 15 steps of `lmrl train`, GRPO
PANELS = ["Reward", "Validation", "Response length", "KL", "Entropy", "Clip fraction"]
# a run with one on-policy update per batch and no KL term: KL and the clip fraction are 0 by
# construction, so their panels show the gradient norm and the time per step instead
FALLBACK_PANELS = ["Reward", "Validation", "Response length", "Gradient norm", "Entropy",
                   "Time per step"]  # fmt: skip


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG header; fails on anything that is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def assert_text_fits(fig) -> None:
    """Every title, legend and written note lies inside the figure, every legend and note
    inside its own panel."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # the layout runs at draw time
    renderer = canvas.get_renderer()
    page = fig.bbox
    for ax in fig.axes:
        box = ax.get_window_extent(renderer)
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        for artist in texts + ([ax.get_legend()] if ax.get_legend() else []):
            if not artist.get_visible() or not getattr(artist, "get_text", lambda: "x")():
                continue
            extent = artist.get_window_extent(renderer)
            assert page.x0 - 1 <= extent.x0 and extent.x1 <= page.x1 + 1, (ax.get_title(), artist)
            assert page.y0 - 1 <= extent.y0 and extent.y1 <= page.y1 + 1, (ax.get_title(), artist)
        for artist in ax.texts + ([ax.get_legend()] if ax.get_legend() else []):
            extent = artist.get_window_extent(renderer)
            assert box.x0 <= extent.x0 and extent.x1 <= box.x1, (ax.get_title(), artist)
            assert box.y0 <= extent.y0 and extent.y1 <= box.y1, (ax.get_title(), artist)


def no_data_panels(fig) -> list[str]:
    return [
        ax.get_title() for ax in fig.axes
        if any(t.get_text() == "no data" for t in ax.texts)
    ]  # fmt: skip


def test_plot_command_on_a_recorded_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(RECORDED, run_dir)
    assert main(["plot", str(run_dir)]) == 0
    out = run_dir / "plot.png"
    assert f"plot written to {out}" in capsys.readouterr().out
    assert png_size(out) == (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))

    fig = draw_run(load_metrics(run_dir / "metrics.jsonl"))
    assert [ax.get_title() for ax in fig.axes[:6]] == FALLBACK_PANELS  # ppo_epochs=1, no KL
    assert no_data_panels(fig) == ["Validation"]  # validation is not in this recording
    assert_text_fits(fig)


def test_plot_synthetic_run_with_validation_and_smoothing(synthetic_run, tmp_path):
    out = plot_run(synthetic_run, out=tmp_path / "img" / "curves.png", smooth=0.6)
    assert out == tmp_path / "img" / "curves.png"
    assert png_size(out) == (1320, 880)
    fig = draw_run(load_metrics(synthetic_run / "metrics.jsonl"))
    assert [ax.get_title() for ax in fig.axes[:6]] == PANELS  # KL and clipping to show
    assert no_data_panels(fig) == []
    assert_text_fits(fig)
    val_ax = fig.axes[1]
    assert [line.get_label() for line in val_ax.get_lines()] == [
        "digits acc", "digits mean@4", "digits pass@4"
    ]  # fmt: skip
    steps, acc = load_metrics(synthetic_run / "metrics.jsonl")["val/digits/acc"]
    assert steps.tolist() == [0, 10, 20, 30, 40, 50, 60]
    assert acc[0] == 0.1 and np.all(np.diff(acc) > 0)
    reward_labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert "val digits reward" in reward_labels and "train score (mean)" in reward_labels


def test_empty_panels_say_no_data():
    fig = draw_run({"actor/entropy": (np.array([1.0, 2.0]), np.array([2.0, 1.9]))})
    assert no_data_panels(fig) == [p for p in PANELS if p != "Entropy"]


def test_missing_metrics_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(DataError, match=r"metrics\.jsonl not found"):
        plot_run(tmp_path)
    assert main(["plot", str(tmp_path)]) == 2
    assert "lmrl plot: error:" in capsys.readouterr().err
    with pytest.raises(DataError, match="does not exist"):
        plot_run(tmp_path / "nope")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no metrics"):
        plot_run(tmp_path)


def test_load_metrics_last_value_wins_and_bad_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 2, "a": 1.0, "b": null}\n'
        '{"step": 1, "a": 0.5, "flag": true}\n'
        '{"step": 2, "a": 3.0}\n'
        '{"step": 3, "a"'  # cut short by a kill: ignored
    )
    series = load_metrics(path)
    assert list(series) == ["a"]
    assert series["a"][0].tolist() == [1.0, 2.0] and series["a"][1].tolist() == [0.5, 3.0]

    path.write_text('{"step": 1, "a": 1}\nnot json\n{"step": 2, "a": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        load_metrics(path)
    path.write_text('{"a": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: .*'step'"):
        load_metrics(path)


def test_ema_by_hand():
    # w = 0.5: (0.5 * 1) / 0.5 = 1; (0.25 + 0) / 0.75 = 1/3; NaN keeps the last value
    np.testing.assert_allclose(ema(np.array([1.0, 0.0, np.nan]), 0.5), [1.0, 1 / 3, 1 / 3])
    np.testing.assert_array_equal(ema(np.array([3.0, 4.0]), 0.0), [3.0, 4.0])
    with pytest.raises(ValueError, match="smooth"):
        ema(np.array([1.0]), 1.0)


def test_one_on_policy_update_panels_say_zero_by_construction():
    steps = np.array([1.0, 2.0, 3.0])
    series = {
        "actor/old_log_prob_recomputed": (steps, np.zeros(3)),
        "actor/ppo_kl": (steps, np.zeros(3)),
        "actor/pg_clipfrac": (steps, np.zeros(3)),
        "actor/entropy": (steps, np.array([3.6, 1.0, 0.1])),
        "critic/score/zero_spread_frac": (steps, np.array([0.2, 0.6, 0.9])),
    }
    fig = draw_run(series)  # no gradient norm or step time to show instead: the panels say why
    notes = {ax.get_title(): [t.get_text() for t in ax.texts] for ax in fig.axes}
    assert any("0 by construction" in t for t in notes["KL"])
    assert any("0 by construction" in t for t in notes["Clip fraction"])
    assert_text_fits(fig)
    labels = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    assert "ppo_kl (old -> new policy)" not in labels and "pg_clipfrac" not in labels
    assert "groups scored all alike (right axis)" in labels and "actor entropy" in labels
    # recomputed old log-probs (several updates a batch): the curves are drawn
    series["actor/old_log_prob_recomputed"] = (steps, np.ones(3))
    labels = [line.get_label() for ax in draw_run(series).axes for line in ax.get_lines()]
    assert "ppo_kl (old -> new policy)" in labels and "pg_clipfrac" in labels


def test_an_image_run_gets_its_own_panels():
    steps = np.array([1.0, 2.0, 3.0])
    series = {
        "critic/score/mean": (steps, np.array([0.3, 0.4, 0.5])),
        "flow/check/shape": (steps, np.array([0.4, 0.5, 0.6])),
        "flow/check/count": (steps, np.array([0.9, 0.9, 1.0])),
        "val/shapes/reward/mean": (np.array([0.0, 3.0]), np.array([0.4, 0.6])),
        "val/shapes/check/shape": (np.array([0.0, 3.0]), np.array([0.5, 0.7])),
        "flow/zero_spread_groups": (steps, np.array([0.1, 0.0, 0.2])),
        "timing_s/step": (steps, np.array([5.0, 5.1, 5.2])),
        "perf/images_per_s": (steps, np.array([48.0, 47.0, 46.0])),
        "actor/ppo_kl": (steps, np.array([1e-4, 2e-4, 1e-4])),
        "actor/pg_clipfrac": (steps, np.array([0.0, 0.01, 0.02])),
        "actor/grad_norm": (steps, np.array([0.5, 0.4, 0.6])),
    }
    fig = draw_run(series)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["Reward", "Reward checks", "Time per step", "KL",
                      "Groups and gradient", "Clip fraction"]  # fmt: skip
    labels = {line.get_label() for ax in fig.axes for line in ax.get_lines()}
    assert {"train shape", "val shapes shape", "train count", "step", "pg_clipfrac",
            "groups scored all alike (right axis)", "images/s (right axis)",
            "val shapes reward"} <= labels  # fmt: skip
    notes = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "no data" not in notes  # no empty text-model panel


def legend_titles(fig) -> dict[str, str]:
    return {
        ax.get_title(): ax.get_legend().get_title().get_text().replace("\n", " ")
        for ax in fig.axes if ax.get_legend() is not None
    }  # fmt: skip


def test_one_on_policy_update_shows_gradient_norm_and_step_time_instead():
    steps = np.array([1.0, 2.0, 3.0])
    series = {
        "actor/old_log_prob_recomputed": (steps, np.zeros(3)),
        "actor/ppo_kl": (steps, np.zeros(3)),
        "actor/pg_clipfrac": (steps, np.zeros(3)),
        "actor/pg_clipfrac_lower": (steps, np.zeros(3)),
        "actor/grad_norm": (steps, np.array([0.5, 0.3, 0.4])),
        "timing_s/step": (steps, np.array([1.2, 1.1, 1.3])),
        "timing_s/gen": (steps, np.array([0.7, 0.6, 0.8])),
        "actor/entropy": (steps, np.array([3.6, 1.0, 0.1])),
    }
    fig = draw_run(series)
    assert [ax.get_title() for ax in fig.axes[:6]] == FALLBACK_PANELS
    lines = {ax.get_title(): [line.get_label() for line in ax.get_lines()] for ax in fig.axes}
    assert lines["Gradient norm"] == ["actor gradient norm"]
    assert lines["Time per step"] == ["step", "generation"]
    notes = legend_titles(fig)
    assert (
        notes["Gradient norm"] == "instead of KL (ppo_kl: 0 by construction; no KL loss or penalty)"
    )
    assert notes["Time per step"] == "instead of the clip fraction (0 by construction)"
    assert_text_fits(fig)

    # several updates a batch, yet nothing clipped and no KL term: flat zeros all the same
    series["actor/old_log_prob_recomputed"] = (steps, np.ones(3))
    notes = legend_titles(draw_run(series))
    assert notes["Gradient norm"] == "instead of KL (ppo_kl: 0; no KL loss or penalty)"
    assert notes["Time per step"] == "instead of the clip fraction (nothing clipped)"

    # a KL loss and some clipping: the KL and clip-fraction panels are back
    series["actor/kl_loss"] = (steps, np.array([0.0, 0.01, 0.02]))
    series["actor/pg_clipfrac"] = (steps, np.array([0.0, 0.05, 0.02]))
    fig = draw_run(series)
    assert [ax.get_title() for ax in fig.axes[:6]] == PANELS
    labels = {line.get_label() for ax in fig.axes for line in ax.get_lines()}
    assert {"kl_loss (policy || ref)", "ppo_kl (old -> new policy)", "pg_clipfrac"} <= labels
    assert "actor gradient norm" not in labels and "step" not in labels

    # an engine with its own weights (rollout.dtype, vLLM): the KL panel draws its gap (k3)
    series["rollout/mismatch_k3"] = (steps, np.array([2e-4, 3e-4, 2.5e-4]))
    lines = {ax.get_title(): [line.get_label() for line in ax.get_lines()]
             for ax in draw_run(series).axes}  # fmt: skip
    assert "rollout vs trainer (k3)" in lines["KL"]


def test_a_run_of_two_sources_draws_a_line_per_source():
    steps = np.array([1.0, 2.0, 3.0])
    series = {
        "critic/score/mean": (steps, np.array([0.2, 0.3, 0.4])),
        "train/digits/score/mean": (steps, np.array([0.3, 0.4, 0.5])),
        "train/digits/acc": (steps, np.array([0.0, 0.5, 0.5])),
        "train/sort/score/mean": (steps, np.array([0.1, 0.2, 0.3])),
        "train/sort/reward_errors": (steps, np.zeros(3)),
        "val/sort/acc": (np.array([0.0, 3.0]), np.array([0.1, 0.2])),
    }
    fig = draw_run(series)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert list(lines) == ["train score (mean)", "train digits score", "train digits acc",
                           "train sort score", "val sort acc"]  # fmt: skip
    assert lines["train sort score"].get_ydata().tolist() == [0.1, 0.2, 0.3]
    assert lines["train digits acc"].get_linestyle() == ":"
    # a source's lines and its validation points share a colour, another source has its own
    assert lines["train sort score"].get_color() == lines["val sort acc"].get_color()
    assert lines["train digits score"].get_color() == lines["train digits acc"].get_color()
    assert lines["train digits score"].get_color() != lines["train sort score"].get_color()
    assert_text_fits(fig)
    # one source: the reward panel as before, no line per source
    one = {k: v for k, v in series.items() if not k.startswith("train/")}
    assert [line.get_label() for line in draw_run(one).axes[0].get_lines()] == [
        "train score (mean)", "val sort acc"
    ]  # fmt: skip
