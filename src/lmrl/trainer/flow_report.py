"""What an image run says about itself: the before/after summary ``lmrl train-flow`` prints at
its end, and ``lmrl eval`` on an image run (its checkpoint's images scored by any reward).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lmrl.config.flow import FlowConfig

__all__ = ["evaluate_flow", "flow_summary"]


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


def evaluate_flow(cfg: FlowConfig, checkpoint: Path) -> dict:
    """``lmrl eval`` of an image run: the validation of ``checkpoint`` (its EMA weights when
    the run kept them) under ``cfg`` (the run's config with the user's changes: another
    ``reward.name``/``reward.path``, more ``trainer.val_images_per_prompt``, other
    ``data.val_files``). Writes only the images, ``RUN_DIR/eval/global_step_<N>-<reward>.png``.

    Returns:
        The validation's metrics, the checkpoint and the grid's path.

    Raises:
        ConfigError: no ``data.val_files``; what `build_flow` raises.
    """
    from lmrl.config.errors import ConfigError
    from lmrl.trainer.flow import FlowTrainer, build_flow

    if not cfg.data.val_files:
        raise ConfigError(["no validation prompts: set data.val_files=..."])
    trainer = FlowTrainer(build_flow(cfg, evaluate=checkpoint))
    try:
        label = Path(cfg.reward.path).stem + "." + cfg.reward.name if cfg.reward.path else (
            cfg.reward.name)  # fmt: skip
        grid = trainer.run_dir / "eval" / f"{Path(checkpoint).name}-{label}.png"
        metrics = trainer.validate(grid=grid)
    finally:
        trainer.close()
    return {"checkpoint": str(checkpoint), "images": str(grid), **metrics}
