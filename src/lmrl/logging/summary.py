"""The before/after of a finished run, read from its ``metrics.jsonl``: what ``lmrl
train-flow`` prints at its end."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["flow_summary"]


def flow_summary(run_dir: Path) -> list[str]:
    """Lines comparing the run's first and last validation (``val/<source>/reward/mean``, each
    check, the prompt fidelity beside another reward) and its train reward (the mean of the
    first and last three steps), with the grids of both validations, read from the run's
    ``metrics.jsonl`` (a resumed run's whole history). [] when the run logged nothing."""
    from lmrl.logging.plot import load_metrics

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    series = load_metrics(path)
    lines = []
    val = sorted(k for k in series if k.startswith("val/") and "/reward/mean" not in k)
    for key in [k for k in series if k.startswith("val/") and k.endswith("/reward/mean")] + val:
        steps, values = series[key]
        if len(values) >= 2:
            lines.append(
                f"  {key}: {values[0]:.3f} (step {steps[0]:.0f}) -> {values[-1]:.3f} "
                f"(step {steps[-1]:.0f})"
            )
    if "critic/score/mean" in series:
        scores = series["critic/score/mean"][1]
        lines.append(
            f"  train reward (first/last 3 steps): {np.mean(scores[:3]):.3f} -> "
            f"{np.mean(scores[-3:]):.3f}"
        )
    if not lines:
        return []
    grids = sorted(
        (Path(run_dir) / "samples").glob("step_*.png"), key=lambda p: int(p.stem.split("_")[1])
    )
    out = ["before -> after:", *lines]
    if len(grids) >= 2:
        out.append(f"  images: {grids[0]} -> {grids[-1]}")
    return out
