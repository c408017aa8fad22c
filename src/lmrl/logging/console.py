"""The console tracker: a rich progress bar over steps, and one compact metrics line per step.

On a terminal the bar (steps done, elapsed, ETA) stays at the bottom and each step's line is
printed above it. When stdout is not a terminal (CI, ``| tee``, a notebook's captured output)
there is no bar: each step is one plain line that carries the ETA itself, so logs stay
greppable. The ETA is the run's own wall clock per step since the tracker started (so it
counts validation and checkpoint time), not rich's short-window speed estimate.

A line shows only what is present, in this order: score (``critic/score/mean``; with 2-4 data
sources in the batch each source's after it, ``score 0.27 (digits 0.41 sort 0.12)`` from
``train/<source>/score/mean``), the reward
failures when there are any (``reward errors 16/16, timeouts 0``: ``reward/errors`` out of
``reward/scored``, ``reward/timeouts``), a multi-turn run's tool failures (``tool errors 3/16,
timeouts 0``: ``agent/tool_errors/sum`` out of ``agent/tool_calls/sum``,
``agent/tool_timeouts/sum``), acc (``reward/acc/mean``), len
(``response_length/mean``), kl (``actor/kl_loss``, else ``actor/reward_kl_penalty``), ppo_kl,
entropy, clipfrac (``actor/pg_clipfrac``), an SFT run's loss, validation loss, gradient norm
and learning rate (``sft/*``), step time, then the validation metrics grouped by data source.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lmrl.logging.trackers import Tracker

# (label, candidate keys: the first present is shown)
SUMMARY_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("score", ("critic/score/mean",)),
    ("acc", ("reward/acc/mean",)),
    ("len", ("response_length/mean",)),
    ("kl", ("actor/kl_loss", "actor/reward_kl_penalty")),
    ("ppo_kl", ("actor/ppo_kl",)),
    ("entropy", ("actor/entropy",)),
    ("clipfrac", ("actor/pg_clipfrac",)),
    ("loss", ("sft/loss",)),  # lmrl sft
    ("val_loss", ("val/sft_loss",)),
    ("grad_norm", ("sft/grad_norm",)),
    ("lr", ("sft/lr",)),
)
_VAL_KEY = re.compile(
    r"^val/(?P<source>.+?)/(?P<name>acc|prior_acc|mean@\d+|pass@\d+|reward/mean)$"
)
_VAL_LABEL = {"reward/mean": "reward", "prior_acc": "prior"}
_TRAIN_SCORE = re.compile(r"^train/(?P<source>.+)/score/mean$")
MAX_SOURCES_SHOWN = 4  # more sources than this: the line keeps the batch's score only


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def format_duration(seconds: float) -> str:
    """Seconds -> ``H:MM:SS`` (``-:--:--`` when unknown)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "-:--:--"
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def reward_failures(metrics: Mapping[str, float]) -> str:
    """``reward errors 16/16, timeouts 0`` when the step's reward failed anywhere, else ``""``."""
    errors = metrics.get("reward/errors", 0.0)
    timeouts = metrics.get("reward/timeouts", 0.0)
    if not errors and not timeouts:
        return ""
    scored = metrics.get("reward/scored")
    out_of = f"/{scored:g}" if scored else ""
    return f"reward errors {errors:g}{out_of}, timeouts {timeouts:g}"


def source_scores(metrics: Mapping[str, float]) -> str:
    """``(digits 0.41 sort 0.12)``: each data source's score (``train/<source>/score/mean``)
    when the step's batch held 2-4 sources, else ``""``."""
    scores = [(m["source"], v) for k, v in metrics.items() if (m := _TRAIN_SCORE.match(k))]
    if not 2 <= len(scores) <= MAX_SOURCES_SHOWN:
        return ""
    return "(" + " ".join(f"{source} {_fmt(value)}" for source, value in scores) + ")"


def tool_failures(metrics: Mapping[str, float]) -> str:
    """``tool errors 3/16, timeouts 0`` for a multi-turn step (one with
    ``agent/tool_calls/sum``), else ``""``."""
    if "agent/tool_calls/sum" not in metrics:
        return ""
    errors = metrics.get("agent/tool_errors/sum", 0.0)
    timeouts = metrics.get("agent/tool_timeouts/sum", 0.0)
    return f"tool errors {errors:g}/{metrics['agent/tool_calls/sum']:g}, timeouts {timeouts:g}"


def summarize(metrics: Mapping[str, float]) -> str:
    """The compact one-line summary of a step's metrics (what is present, fixed order).

    Args:
        metrics: metric name -> value.

    Returns:
        For example ``score 0.406  acc 0.5  len 7.25  entropy 2.31  1.31s/step  val/digits
        acc 0.2 pass@4 0.4``, ``score 0  reward errors 16/16, timeouts 0  len 7.25 ...``, or
        for a batch of two data sources ``score 0.265 (digits 0.41 sort 0.12)  acc ...``.
    """
    parts = []
    for label, keys in SUMMARY_KEYS:
        key = next((k for k in keys if k in metrics), None)
        if key is not None:
            parts.append(f"{label} {_fmt(metrics[key])}")
            if label == "score" and (per_source := source_scores(metrics)):
                parts[-1] += f" {per_source}"
    failures = [f for f in (reward_failures(metrics), tool_failures(metrics)) if f]
    at = 1 if "critic/score/mean" in metrics else 0
    parts[at:at] = failures
    if "timing_s/step" in metrics:
        parts.append(f"{metrics['timing_s/step']:.2f}s/step")
    by_source: dict[str, list[str]] = {}
    for key, value in metrics.items():
        match = _VAL_KEY.match(key)
        if match:
            name = _VAL_LABEL.get(match["name"], match["name"])
            by_source.setdefault(match["source"], []).append(f"{name} {_fmt(value)}")
    parts += [f"val/{source} " + " ".join(items) for source, items in by_source.items()]
    return "  ".join(parts)


class ConsoleTracker(Tracker):
    """Progress bar with ETA on a terminal, one plain line per ``log`` call everywhere.

    Args:
        total_steps: steps of the whole run (None: no total, no ETA).
        start_step: the step a resumed run starts from.
        file: where to write; None = ``sys.stdout`` at each write (so pytest's capsys works).
        force_terminal: True/False to override the terminal detection (rich's own).
    """

    name = "console"

    def __init__(
        self,
        total_steps: int | None = None,
        start_step: int = 0,
        file: IO[str] | None = None,
        force_terminal: bool | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.start_step = start_step
        self.last_step = start_step
        self.console = Console(file=file, force_terminal=force_terminal, highlight=False)
        self.live = self.console.is_terminal and not self.console.is_dumb_terminal
        self._t0 = time.perf_counter()
        self.progress: Progress | None = None
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]training"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("steps  elapsed"),
                TimeElapsedColumn(),
                TextColumn("eta {task.fields[eta]}"),
                console=self.console,
                redirect_stdout=True,
                redirect_stderr=True,
            )
            self._task = self.progress.add_task(
                "train", total=total_steps, completed=start_step, eta=self.eta()
            )
            self.progress.start()

    def eta(self) -> str:
        """Remaining time at the mean wall-clock seconds per step since the tracker started."""
        done = self.last_step - self.start_step
        if self.total_steps is None or done <= 0:
            return format_duration(math.nan)
        per_step = (time.perf_counter() - self._t0) / done
        return format_duration(per_step * max(self.total_steps - self.last_step, 0))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.last_step = max(self.last_step, int(step))
        total = f"/{self.total_steps}" if self.total_steps is not None else ""
        line = f"step {step}{total}  {summarize(metrics)}".rstrip()
        if self.progress is not None:
            self.progress.update(self._task, completed=self.last_step, eta=self.eta())
            self.progress.console.print(line, markup=False, highlight=False)
        else:
            if self.total_steps is not None:
                line += f"  eta {self.eta()}"
            print(line, file=self.console.file, flush=True)

    def log_generations(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        """Generations go to ``generations.jsonl``; the console only says how many."""
        if rows:
            line = f"step {step}  {len(rows)} generations logged"
            if self.progress is not None:
                self.progress.console.print(line, markup=False, highlight=False)
            else:
                print(line, file=self.console.file, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


__all__ = [
    "SUMMARY_KEYS",
    "ConsoleTracker",
    "format_duration",
    "reward_failures",
    "source_scores",
    "summarize",
]
