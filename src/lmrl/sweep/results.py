"""A sweep's results: its trials ranked, the table (``trials.csv``, ``trials.md``), the plot and
the best trial's command (`lmrl.sweep`)."""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from lmrl.sweep.plan import Sweep, TrialRecord
from lmrl.sweep.rank import FLAT, slope

log = logging.getLogger("lmrl.trainer")

# ------------------------------------------------------------------------------ results
_ORDER = {"completed": 0, "stopped": 1, "running": 1, "interrupted": 2, "pending": 2, "failed": 3}


def rank(records: Sequence[TrialRecord], flat: float = FLAT) -> list[TrialRecord]:
    """Best first: completed trials by score, then trials stopped early (the later they
    stopped, the higher), then interrupted and failed ones."""

    def key(r: TrialRecord):
        score, _ = r.score(flat)
        return (_ORDER.get(r.status, 3), -r.steps if r.status == "stopped" else 0,
                -score if score is not None else math.inf, r.index)  # fmt: skip

    return sorted(records, key=key)


def _status(r: TrialRecord) -> str:
    if r.status == "stopped":
        return f"stopped early at step {r.steps}"
    if r.status == "interrupted":
        return f"interrupted at step {r.steps}"
    if r.status == "failed" and r.error:
        return f"failed: {r.error}"
    return "not started" if r.status == "pending" else r.status


def table_rows(sweep: Sweep, records: Sequence[TrialRecord]) -> list[dict[str, str]]:
    """One row per trial, best first (the columns of ``trials.csv``)."""
    keys = list(sweep.trials[0]) if sweep.trials else []
    rows = []
    for place, r in enumerate(rank(records, sweep.flat), start=1):
        _, basis = r.score(sweep.flat)
        first = r.val[min(r.val)] if r.val else None
        last = r.val[max(r.val)] if r.val else None
        gain = (last - first) / (max(r.val) - min(r.val)) if len(r.val) > 1 else None
        train_slope = slope(r.train)
        rows.append({
            "rank": str(place), "trial": f"{r.index:02d}", **{k: r.keys.get(k, "") for k in keys},
            "steps": str(r.steps), "val_before": _num(first), "val_after": _num(last),
            "gain_per_step": _num(gain, "+.4f"), "train_slope": _num(train_slope, "+.4f"),
            "ranked_by": {"train": "train slope (val flat)"}.get(basis, basis),
            "status": _status(r), "seconds": f"{r.seconds:.0f}", "run_dir": r.run_dir,
        })  # fmt: skip
    return rows


def _num(value: float | None, spec: str = ".3f") -> str:
    return "" if value is None else format(value, spec)


def format_table(rows: Sequence[Mapping[str, str]]) -> str:
    """The rows as a Markdown table (``trials.md``; printed at the end)."""
    if not rows:
        return "(no trial ran)"
    cols = [c for c in rows[0] if c != "run_dir"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(row[c].replace("|", "\\|") for c in cols) + " |" for row in rows]
    return "\n".join(lines)


def write_results(
    sweep: Sweep, records: Sequence[TrialRecord], plot: bool = True
) -> dict[str, Path | str | None]:
    """``trials.csv``, ``trials.md``, ``sweep.png`` and ``best.txt`` in the sweep's folder.

    Returns:
        ``{"csv", "table", "plot", "best"}``: paths, and the best trial's ``lmrl train``
        command line (None when no trial completed); ``plot`` False: no ``sweep.png``.
    """
    from lmrl.logging.sweep_plot import Curve, draw_sweep

    sweep.out.mkdir(parents=True, exist_ok=True)
    rows = table_rows(sweep, records)
    csv_path = sweep.out / "trials.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["trial"])
        writer.writeheader()
        writer.writerows(rows)
    md = sweep.out / "trials.md"
    md.write_text(format_table(rows) + "\n")
    ranked = rank(records, sweep.flat)
    best = ranked[0] if ranked and ranked[0].status == "completed" else None
    curves = [
        Curve(" ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in r.keys.items()) or f"{r.index:02d}",
              sorted(r.val.items()), sorted(r.train.items()), stopped=r.status == "stopped",
              best=r is best)
        for r in sorted(records, key=lambda r: r.index)
    ]  # fmt: skip
    title = f"lmrl sweep: {len(records)} trials, {sweep.steps} steps each"
    drawn = draw_sweep(curves, sweep.out / "sweep.png", title=title,
                       val_label=sweep.metric or "validation score") if plot else None  # fmt: skip
    command = sweep.train_command(best.keys) if best is not None else None
    (sweep.out / "best.txt").write_text((command or "no trial completed") + "\n")
    return {"csv": csv_path, "table": md, "plot": drawn, "best": command}
