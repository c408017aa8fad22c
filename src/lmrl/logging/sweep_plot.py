"""``DIR/sweep.png`` of ``lmrl sweep``: one curve per trial of its validation score over steps.

Drawn like ``lmrl plot`` (``matplotlib.figure.Figure`` and the Agg canvas, never pyplot). A
trial stopped early ends in a cross at the step it stopped; the best trial is drawn thickest.
The right panel holds the train score per step (the ranking's fallback when validation is
flat), so both signals the ranking reads are on one page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

FIGSIZE = (12.0, 5.0)  # inches
DPI = 110


@dataclass(frozen=True)
class Curve:
    """One trial's curves.

    Attributes:
        label: the trial's keys (``lr=1e-3``).
        val: ``(step, validation score)`` pairs, step 0 = before the first step.
        train: ``(step, train score)`` pairs.
        stopped: the trial was stopped early (its last point gets a cross).
        best: the sweep's best trial.
    """

    label: str
    val: Sequence[tuple[int, float]]
    train: Sequence[tuple[int, float]]
    stopped: bool = False
    best: bool = False


def draw_sweep(
    curves: Sequence[Curve], out: str | Path, title: str = "", val_label: str = "validation"
) -> Path:
    """Write the sweep's figure to ``out`` (a PNG); returns its path."""
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    val_ax, train_ax = fig.subplots(1, 2)
    for i, curve in enumerate(curves):
        color = f"C{i % 10}"
        width = 2.6 if curve.best else 1.3
        label = (
            curve.label
            + (" (best)" if curve.best else "")
            + (" (stopped)" if curve.stopped else "")
        )
        for ax, points, marker in ((val_ax, curve.val, "o"), (train_ax, curve.train, None)):
            if not points:
                continue
            steps, values = zip(*sorted(points), strict=True)
            ax.plot(steps, values, color=color, lw=width, marker=marker, ms=3, label=label)
            if curve.stopped:
                ax.plot(steps[-1], values[-1], "x", color=color, ms=9, mew=2)
    val_ax.set(title=f"{val_label} (greedy unless configured)", xlabel="step", ylabel=val_label)
    train_ax.set(title="train score (critic/score/mean)", xlabel="step", ylabel="score")
    for ax in (val_ax, train_ax):
        ax.grid(alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    if any(c.val for c in curves):
        val_ax.legend(fontsize=8, loc="best")
    elif curves:
        train_ax.legend(fontsize=8, loc="best")
    if title:
        fig.suptitle(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


__all__ = ["Curve", "draw_sweep"]
