"""``lmrl eval`` on an image run: its checkpoint's images scored by any reward."""

from __future__ import annotations

from pathlib import Path

from lmrl.config.flow import FlowConfig

__all__ = ["evaluate_flow"]


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
