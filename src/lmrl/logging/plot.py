"""``lmrl plot RUN_DIR``: one PNG of a run's training curves, drawn from ``metrics.jsonl``.

Six panels over steps: reward (train score and acc, validation reward as points; a run
whose batches mixed 2+ data sources also has one score line, solid, and one acc line, dotted,
per source, from ``train/<source>/score/mean`` and ``train/<source>/acc``, in the colour of
that source's validation points),
validation (acc, mean@k, pass@k per data source), response length (mean with its min-max
band, clip ratio on a second axis), KL (ppo_kl, kl_loss, reward_kl_penalty), entropy (with
the fraction of prompt groups that scored all alike on a second axis: a collapse shows as
entropy falling while that fraction climbs) and clipfrac (in a multi-turn run, tool use
instead: turns and tool calls per sample, the answered and valid-call fractions). An image run
of ``lmrl train-flow`` (``flow/*`` metrics) has its own panels after the reward: the reward's
checks, time per step, KL, zero-spread groups with the gradient norm, and the clip fraction.
A panel without data says "no data"
rather than staying blank, so a missing metric is visible. The KL and clip-fraction panels are
empty by construction in many runs (one on-policy update per batch: ppo_epochs=1 and one
mini-batch make the PPO ratio 1, so ppo_kl and the clip fractions are 0; no KL loss or KL
penalty: no KL at all). Such a panel, with nothing but zeros to draw, shows the gradient norm
(in place of KL) and the seconds per step (in place of the clip fraction) instead, its legend
saying why. Optional smoothing is TensorBoard's debiased exponential moving average, drawn
over the faint raw curve.

The figure is built with ``matplotlib.figure.Figure`` and the Agg canvas directly, never
pyplot, so plotting changes no global backend state and needs no display.
"""

from __future__ import annotations

import json
import logging
import math
import re
import textwrap
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from lmrl.errors import DataError, LmrlError

log = logging.getLogger(__name__)

Series = dict[str, tuple[np.ndarray, np.ndarray]]  # key -> (steps, values), sorted by step

FIGSIZE = (12.0, 8.0)  # inches
DPI = 110  # -> 1320 x 880 pixels
_VAL = re.compile(r"^val/(?P<source>.+?)/(?P<name>acc|mean@\d+|pass@\d+|reward/mean)$")
_TRAIN = re.compile(r"^train/(?P<source>.+)/(?P<name>score/mean|acc)$")


def load_metrics(path: str | Path) -> Series:
    """Read a ``metrics.jsonl`` into one ``(steps, values)`` series per metric.

    A step logged twice (a resumed run, or validation logged after the step's own metrics)
    keeps the last value of each key; ``null`` values are skipped. A last line cut short (a
    run killed mid-write) is ignored; any other line that is not a JSON object with a
    ``"step"`` is an error naming the file and line.

    Args:
        path: the ``metrics.jsonl`` file.

    Returns:
        Metric name -> ``(steps, values)``, two float arrays of shape ``(S,)`` sorted by step.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start}): {err.reason}") from err
    by_key: dict[str, dict[int, float]] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if lineno == len(lines):
                log.warning("%s: ignoring the truncated last line %d", path, lineno)
                continue
            raise DataError(f"{path}:{lineno}: not a JSON line ({err})") from err
        if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)):
            raise DataError(f"{path}:{lineno}: expected a JSON object with a numeric 'step'")
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                by_key.setdefault(key, {})[step] = float(value)
    series: Series = {}
    for key, points in by_key.items():
        steps = np.array(sorted(points), dtype=float)
        series[key] = (steps, np.array([points[int(s)] for s in steps], dtype=float))
    return series


def ema(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's smoothing: debiased exponential moving average, NaNs carried over.

    Args:
        values: ``(S,)`` the raw curve.
        weight: in ``[0, 1)``; 0 returns ``values`` unchanged.

    Returns:
        ``(S,)`` the smoothed curve.
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smooth must be in [0, 1), got {weight}")
    out = np.empty_like(values, dtype=float)
    last, debias = 0.0, 0.0
    for i, v in enumerate(values):
        if math.isfinite(v):
            last = last * weight + (1 - weight) * v
            debias = debias * weight + (1 - weight)
        out[i] = last / debias if debias > 0 else math.nan
    return out


class _Panel:
    """One axes: lines, points and bands drawn from the series that exist."""

    def __init__(self, ax: Axes, series: Series, smooth: float, title: str, ylabel: str) -> None:
        self.ax, self.series, self.smooth = ax, series, smooth
        self.drawn = 0
        ax.set_title(title, fontsize=11, fontweight="bold")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3, linewidth=0.6)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    def line(self, key: str, label: str, ax: Axes | None = None, **style) -> bool:
        if key not in self.series:
            return False
        ax = ax or self.ax
        steps, values = self.series[key]
        marker = "o" if len(steps) <= 40 else None
        if self.smooth > 0 and len(steps) > 2:
            (raw,) = ax.plot(steps, values, alpha=0.25, linewidth=1, **style)
            style = {**style, "color": raw.get_color()}
            ax.plot(steps, ema(values, self.smooth), label=label, linewidth=1.8, **style)
        else:
            ax.plot(steps, values, label=label, linewidth=1.6, marker=marker, markersize=3, **style)
        self.drawn += 1
        return True

    def fraction(self, key: str, label: str, ylabel: str, **style) -> Axes | None:
        """``key`` (a fraction in [0, 1]) on a second y-axis, dashed; the axis, or None
        without that series."""
        if key not in self.series:
            return None
        twin = self.ax.twinx()
        twin.set_ylabel(ylabel)
        twin.set_ylim(-0.02, 1.02)
        self.line(key, label, ax=twin, **{"linestyle": "--", **style})
        return twin

    def band(self, low_key: str, high_key: str, color: str | None = None) -> None:
        if low_key in self.series and high_key in self.series:
            (s_lo, lo), (s_hi, hi) = self.series[low_key], self.series[high_key]
            if np.array_equal(s_lo, s_hi) and len(s_lo) > 1:
                self.ax.fill_between(s_lo, lo, hi, alpha=0.12, color=color, linewidth=0)

    def points(self, key: str, label: str, **style) -> None:
        if key in self.series:
            steps, values = self.series[key]
            self.ax.plot(steps, values, linestyle="--", marker="D", markersize=6, linewidth=1,
                         label=label, **style)  # fmt: skip
            self.drawn += 1

    def headroom(self, fraction: float = 0.45) -> None:
        """Room above the curves for the legend, so that it covers none of them."""
        low, high = self.ax.get_ylim()
        self.ax.set_ylim(low, high + fraction * (high - low))

    def finish(
        self, extra_handles_from: Axes | None = None, empty: str = "no data", note: str = ""
    ) -> None:
        """Legend (titled ``note``, if any), or ``empty`` written across a panel with nothing
        drawn; both wrapped to the panel's width."""
        if not self.drawn:
            text = textwrap.fill(empty, 34, break_on_hyphens=False)
            self.ax.text(0.5, 0.5, text, transform=self.ax.transAxes, ha="center", va="center",
                         fontsize=13 if empty == "no data" else 9, color="0.45")  # fmt: skip
            self.ax.set_yticks([])
            self.ax.set_xticks([])
            return
        handles, labels = self.ax.get_legend_handles_labels()
        if extra_handles_from is not None:
            h2, l2 = extra_handles_from.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        if handles:
            title = textwrap.fill(note, 36, break_on_hyphens=False) or None
            self.ax.legend(handles, labels, fontsize=8, loc="best", framealpha=0.85,
                           title=title, title_fontsize=7.5)  # fmt: skip


def _source_keys(series: Series, pattern: re.Pattern[str]) -> dict[str, dict[str, str]]:
    """source -> {metric name -> key} of the keys ``pattern`` matches (its ``source`` and
    ``name`` groups), sources sorted: ``_VAL``'s validation metrics (acc, mean@4, pass@4,
    reward/mean), ``_TRAIN``'s per-source train metrics (empty for a run of one source)."""
    out: dict[str, dict[str, str]] = {}
    for key in sorted(series):
        match = pattern.match(key)
        if match:
            out.setdefault(match["source"], {})[match["name"]] = key
    return out


def _nonzero(series: Series, key: str) -> bool:
    """``key`` was logged and is not 0 at every step (a flat 0 is a panel with nothing to show)."""
    return key in series and bool(np.any(np.nan_to_num(series[key][1]) != 0))


def _one_on_policy_update(series: Series) -> bool:
    """Every step took its old log-probs from the update's own forward (one epoch, one
    mini-batch): the ratio is 1, ppo_kl and the clip fractions are 0 by construction."""
    if "actor/old_log_prob_recomputed" not in series:
        return False
    return bool(np.all(series["actor/old_log_prob_recomputed"][1] == 0))


def _mark_rollbacks(ax, series: Series) -> None:
    """A dotted line at each step the run doctor rolled back to (``doctor/rolled_back_from``
    logged there), labelled with the step it left."""
    steps, left = series.get("doctor/rolled_back_from", (np.array([]), np.array([])))
    for i, (step, came_from) in enumerate(zip(steps, left, strict=True)):
        ax.axvline(step, color="0.3", linestyle=":", linewidth=1.2,
                   label=f"rollback {i + 1} (from step {came_from:.0f})")  # fmt: skip


def draw_run(series: Series, title: str = "", smooth: float = 0.0) -> Figure:
    """The six-panel figure of a run's series (see the module docstring).

    Args:
        series: from :func:`load_metrics`.
        title: the figure's title.
        smooth: EMA weight in ``[0, 1)``; 0 = raw curves.

    Returns:
        The figure, ``FIGSIZE`` inches at ``DPI``.
    """
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    axes = fig.subplots(2, 3)
    val = _source_keys(series, _VAL)

    p = _Panel(axes[0, 0], series, smooth, "Reward", "score")
    # no min-max band here: with 0/1 rewards it is the whole [0, 1] strip at every step
    p.line("critic/score/mean", "train score (mean)", color="C0")
    if "critic/rewards/mean" in series and not np.allclose(
        series["critic/rewards/mean"][1], series.get("critic/score/mean", (None, np.nan))[1]
    ):
        p.line("critic/rewards/mean", "train reward (after KL penalty)", color="C1")
    p.line("reward/acc/mean", "train acc", color="C2")
    train = _source_keys(series, _TRAIN)
    colour = {source: f"C{3 + i}" for i, source in enumerate(sorted({*train, *val}))}
    for source, names in train.items():
        if "score/mean" in names:
            p.line(names["score/mean"], f"train {source} score", color=colour[source])
        if "acc" in names:
            p.line(names["acc"], f"train {source} acc", color=colour[source], linestyle=":")
    for source, names in val.items():
        name = "reward/mean" if "reward/mean" in names else "acc" if "acc" in names else None
        if name is not None:
            p.points(names[name], f"val {source} {name.replace('/mean', '')}",
                     color=colour[source])  # fmt: skip
    _mark_rollbacks(p.ax, series)
    p.finish()

    if any(key.startswith("flow/") for key in series):  # an image run (lmrl train-flow)
        _draw_image_panels(axes, series, smooth, val)
        if title:
            fig.suptitle(title, fontsize=13)
        return fig

    p = _Panel(axes[0, 1], series, smooth, "Validation", "score / accuracy")
    styles = {"acc": ("-", "o"), "mean@": ("--", "s"), "pass@": (":", "^")}
    for i, (source, names) in enumerate(val.items()):
        for name, key in names.items():
            if name == "reward/mean":
                continue
            ls, marker = next(v for k, v in styles.items() if name.startswith(k))
            steps, values = series[key]
            p.ax.plot(steps, values, linestyle=ls, marker=marker, markersize=5, color=f"C{i}",
                      label=f"{source} {name}")  # fmt: skip
            p.drawn += 1
    _mark_rollbacks(p.ax, series)
    p.finish()

    p = _Panel(axes[0, 2], series, smooth, "Response length", "tokens")
    p.band("response_length/min", "response_length/max", color="C0")
    p.line("response_length/mean", "mean (min-max band)", color="C0")
    twin = p.fraction("response_length/clip_ratio", "clip ratio (right axis)", "clip ratio",
                      color="C3")  # fmt: skip
    p.finish(extra_handles_from=twin)

    # one on-policy update per batch: the PPO ratio is exactly 1, so ppo_kl and the clip
    # fractions are 0 by construction; a panel of flat zeros shows something else instead
    on_policy = _one_on_policy_update(series)
    by_construction = "0 by construction: one on-policy update per batch (ppo_epochs=1, one "
    by_construction += "mini-batch), so the PPO ratio is 1"
    kl_lines = [("actor/kl_loss", "kl_loss (policy || ref)", "C1"),
                ("actor/reward_kl_penalty", "reward_kl_penalty", "C2"),
                ("rollout/mismatch_k3", "rollout vs trainer (k3)", "C3")]  # fmt: skip
    if not on_policy:
        kl_lines.insert(0, ("actor/ppo_kl", "ppo_kl (old -> new policy)", "C0"))
    if not any(_nonzero(series, key) for key, _, _ in kl_lines) and _nonzero(
        series, "actor/grad_norm"
    ):
        p = _Panel(axes[1, 0], series, smooth, "Gradient norm", "L2 norm before clipping")
        p.line("actor/grad_norm", "actor gradient norm", color="C0")
        p.line("critic/grad_norm", "critic gradient norm", color="C1")
        why = ["ppo_kl: 0 by construction"] if on_policy else []
        why += ["ppo_kl: 0"] if not on_policy and "actor/ppo_kl" in series else []
        terms = any(key in series for key in ("actor/kl_loss", "actor/reward_kl_penalty"))
        why += ["KL terms: 0" if terms else "no KL loss or penalty"]
        p.headroom()
        p.finish(note=f"instead of KL ({'; '.join(why)})")
    else:
        p = _Panel(axes[1, 0], series, smooth, "KL", "KL")
        for key, label, color in kl_lines:
            p.line(key, label, color=color)
        p.finish(empty=f"ppo_kl: {by_construction}" if on_policy else "no data")

    p = _Panel(axes[1, 1], series, smooth, "Entropy", "nats / token")
    p.line("actor/entropy", "actor entropy", color="C4")
    twin = p.fraction("critic/score/zero_spread_frac", "groups scored all alike (right axis)",
                      "fraction of groups", color="C3")  # fmt: skip
    p.finish(extra_handles_from=twin)

    if "agent/turns/mean" in series:  # a multi-turn run: tool use takes the last panel
        p = _Panel(axes[1, 2], series, smooth, "Tool use", "per sample")
        p.line("agent/turns/mean", "turns", color="C0")
        p.line("agent/tool_calls/mean", "tool calls", color="C1")
        twin = p.ax.twinx()
        twin.set_ylabel("fraction")
        twin.set_ylim(-0.02, 1.02)
        p.line("agent/finish_ratio", "answered (right axis)", ax=twin, color="C2",
               linestyle="--")  # fmt: skip
        p.line("agent/valid_call_ratio", "valid calls (right axis)", ax=twin, color="C3",
               linestyle=":")  # fmt: skip
        p.finish(extra_handles_from=twin)
        if title:
            fig.suptitle(title, fontsize=13)
        return fig

    clip_lines = [("actor/pg_clipfrac", "pg_clipfrac", "C5"),
                  ("actor/pg_clipfrac_lower", "pg_clipfrac_lower (dual clip)", "C6")]  # fmt: skip
    clip_lines = [] if on_policy else clip_lines
    if not any(_nonzero(series, key) for key, _, _ in clip_lines) and _nonzero(
        series, "timing_s/step"
    ):
        p = _Panel(axes[1, 2], series, smooth, "Time per step", "seconds")
        for key, label, color in [("timing_s/step", "step", "C0"),
                                  ("timing_s/gen", "generation", "C1"),
                                  ("timing_s/update_actor", "actor update", "C2"),
                                  ("timing_s/wait_batch", "waiting for the batch (async)",
                                   "C3")]:  # fmt: skip
            p.line(key, label, color=color)
        p.ax.set_ylim(bottom=0)
        why = "0 by construction"
        if not on_policy:
            why = "nothing clipped" if "actor/pg_clipfrac" in series else "not logged"
        p.headroom()
        p.finish(note=f"instead of the clip fraction ({why})")
    else:
        p = _Panel(axes[1, 2], series, smooth, "Clip fraction", "fraction of tokens")
        for key, label, color in clip_lines:
            p.line(key, label, color=color)
        if p.drawn:
            p.ax.set_ylim(bottom=0)
        p.finish(empty=by_construction if on_policy else "no data")

    if title:
        fig.suptitle(title, fontsize=13)
    return fig


def _draw_image_panels(axes, series: Series, smooth: float, val: dict) -> None:
    """The five panels after the reward of a Flow-GRPO run: the reward's checks (train lines,
    validation points), time per step, KL, zero-spread groups with the gradient norm, and
    the clip fraction."""
    p = _Panel(axes[0, 1], series, smooth, "Reward checks", "fraction of images")
    checks = sorted(k.removeprefix("flow/check/") for k in series if k.startswith("flow/check/"))
    for i, name in enumerate(checks):
        p.line(f"flow/check/{name}", f"train {name}", color=f"C{i}")
        for source in val:
            p.points(f"val/{source}/check/{name}", f"val {source} {name}", color=f"C{i}")
    p.finish()

    p = _Panel(axes[0, 2], series, smooth, "Time per step", "seconds")
    for i, (key, label) in enumerate(
        [("timing_s/step", "step"), ("timing_s/sample", "sampling"),
         ("timing_s/reward", "reward"), ("timing_s/update", "update (with old log-probs)")]
    ):  # fmt: skip
        p.line(key, label, color=f"C{i}")
    twin = None
    if "perf/images_per_s" in series:
        twin = p.ax.twinx()
        twin.set_ylabel("images / s")
        p.line("perf/images_per_s", "images/s (right axis)", ax=twin, color="C5", linestyle="--")
    p.finish(extra_handles_from=twin)

    p = _Panel(axes[1, 0], series, smooth, "KL", "KL")
    p.line("actor/ppo_kl", "ppo_kl (old -> new policy)", color="C0")
    p.line("actor/kl_loss", "kl_loss (policy || ref)", color="C1")
    p.finish()

    p = _Panel(axes[1, 1], series, smooth, "Groups and gradient", "gradient norm")
    p.line("actor/grad_norm", "gradient norm", color="C4")
    twin = p.fraction("flow/zero_spread_groups", "groups scored all alike (right axis)",
                      "fraction of groups", color="C3")  # fmt: skip
    p.finish(extra_handles_from=twin)

    p = _Panel(axes[1, 2], series, smooth, "Clip fraction", "fraction of trained steps")
    p.line("actor/pg_clipfrac", "pg_clipfrac", color="C5")
    if p.drawn:
        p.ax.set_ylim(bottom=0)
    p.finish()


def plot_run(run_dir: str | Path, out: str | Path | None = None, smooth: float = 0.0) -> Path:
    """Draw ``RUN_DIR/metrics.jsonl`` into a PNG.

    Args:
        run_dir: a run directory (``trainer.default_local_dir``) holding ``metrics.jsonl``.
        out: the image to write; None = ``RUN_DIR/plot.png``. The suffix picks the format.
        smooth: EMA weight in ``[0, 1)`` for the training curves; 0 = raw.

    Returns:
        The path written.

    Raises:
        DataError: ``run_dir`` or its ``metrics.jsonl`` does not exist, the file holds no
            metrics or a malformed line.
        LmrlError: ``smooth`` is outside ``[0, 1)``.
    """
    if not 0.0 <= smooth < 1.0:
        raise LmrlError(f"smooth must be in [0, 1), got {smooth}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"run directory {run_dir} does not exist")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DataError(
            f"{path} not found: RUN_DIR must be a run directory of lmrl train "
            "(trainer.default_local_dir), which holds metrics.jsonl"
        )
    series = load_metrics(path)
    if not series:
        raise DataError(f"{path} holds no metrics yet")
    steps = sorted({int(s) for xs, _ in series.values() for s in xs})
    title = f"{run_dir.resolve().name}: steps {steps[0]}-{steps[-1]}"
    if smooth > 0:
        title += f" (smoothing {smooth:g})"
    fig = draw_run(series, title=title, smooth=smooth)
    out = Path(out) if out is not None else run_dir / "plot.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def image_grid(images, columns: int, scale: int = 4) -> np.ndarray:
    """(B, 3, H, W) tensor in [0, 1] -> one (rows*H*scale, columns*W*scale, 3) uint8 array,
    row-major, with a 1-pixel grey border around each image (an image run's validation)."""
    import torch  # `lmrl plot` itself never needs it

    b, _, h, w = images.shape
    rows = -(-b // columns)
    pad = torch.full((rows * columns, 3, h + 2, w + 2), 0.3)
    pad[:b, :, 1:-1, 1:-1] = images.detach().float().clamp(0, 1).cpu()
    grid = pad.view(rows, columns, 3, h + 2, w + 2).permute(0, 3, 1, 4, 2)
    grid = grid.reshape(rows * (h + 2), columns * (w + 2), 3)
    grid = grid.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    return (grid.numpy() * 255).round().astype(np.uint8)


__all__ = ["DPI", "FIGSIZE", "draw_run", "ema", "image_grid", "load_metrics", "plot_run"]
