"""Fixtures for the logging tests: a synthetic but realistic run directory."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest


def write_synthetic_run(run_dir: Path, steps: int = 60, val_every: int = 10, seed: int = 0) -> Path:
    """Write a ``metrics.jsonl`` shaped like a GRPO run with a KL loss and validation.

    Score rises from ~0.2 to ~0.9, entropy and length fall, validation at step 0 and every
    ``val_every`` steps (logged as a separate line at the same step, as the trainer does).
    """
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(steps + 1):
        t = step / steps
        if step % val_every == 0:
            acc = 0.1 + 0.8 * (1 - math.exp(-4 * t))
            lines.append({
                "step": step,
                "val/digits/acc": round(acc, 4),
                "val/digits/mean@4": round(acc + 0.05, 4),
                "val/digits/pass@4": round(min(1.0, acc + 0.25), 4),
                "val/digits/reward/mean": round(acc + 0.05, 4),
            })  # fmt: skip
        if step == 0:
            continue
        score = 0.2 + 0.7 * (1 - math.exp(-3 * t)) + rng.gauss(0, 0.04)
        length = 9 - 4 * t + rng.gauss(0, 0.3)
        lines.append({
            "step": step,
            "critic/score/mean": score,
            "critic/score/min": 0.0,
            "critic/score/max": 1.0,
            "reward/acc/mean": max(0.0, score - 0.1),
            "response_length/mean": length,
            "response_length/min": length - 3,
            "response_length/max": min(12.0, length + 3),
            "response_length/clip_ratio": max(0.0, 0.3 - 0.4 * t + rng.gauss(0, 0.02)),
            "actor/ppo_kl": abs(rng.gauss(0.002, 0.001)),
            "actor/kl_loss": 0.02 * t + abs(rng.gauss(0, 0.002)),
            "actor/entropy": 2.2 * math.exp(-1.5 * t) + 0.2 + rng.gauss(0, 0.03),
            "actor/pg_clipfrac": abs(rng.gauss(0.03, 0.01)),
            "actor/pg_loss": rng.gauss(0, 0.05),
            "timing_s/step": 1.5 + rng.gauss(0, 0.1),
        })  # fmt: skip
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture
def synthetic_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    write_synthetic_run(run_dir)
    return run_dir
