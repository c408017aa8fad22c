"""``lmrl demo --task flow``: Flow-GRPO on a tiny image model, end to end on the CPU.

1. ``data/``: the ``shapes`` task (prompts like "two red circles on the left", and
   ``images.parquet``, 4096 rendered images of such prompts);
2. ``model/``: a 0.7M-parameter conditional U-Net (`lmrl.flow.ImageFlow`, with each pixel's
   coordinates as input channels) pre-trained by flow matching on those images for 400 steps,
   with loose captions (each attribute of a quarter of them redrawn at random,
   `lmrl.data.shapes.noisy_captions`), as a text-to-image model is pre-trained on loose web
   captions: it draws solid objects but follows its prompt only in part (the wrong colour,
   half or number of objects in about a third of its images), which is where GenEval's RL
   starts;
3. ``run/``: Flow-GRPO (`lmrl.trainer.flow.FlowTrainer` on the run loop: the run
   ``lmrl train-flow`` makes) with the GenEval-like rule reward: the fraction of four checks (colour, count, shape and
   position of the objects a small detector finds) that hold (``geneval``);
4. ``before_after.png``: the held-out validation prompts' images from the same noise before
   RL (left) and after (right), one prompt per row, its text on the left; ``run/plot.png``: the reward curve and
   each check's.

The recipe (every run that led to it is in ``docs/flow.md``): Flow-GRPO-Fast's window of two
SDE steps at the start of the trajectory (ODE after them, where the layout is decided), 16
prompts x 16 images a step, four optimizer steps a batch, full fine-tuning at lr 3e-5, 60
steps (held-out reward +0.18 to +0.19 on seeds 1 and 2 by then, still rising slowly).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from lmrl.demos.folder import DEMO_KEY, SUMMARY_FILE, DemoStopped, demo_dir

log = logging.getLogger("lmrl.flow")

__all__ = ["run_flow_demo"]


def _with_prompts(grid, prompts: list[str], width: int = 200):
    """``grid`` (a PIL image, one row of images per prompt) with each row's prompt written in a
    white strip on its left."""
    from PIL import Image, ImageDraw

    out = Image.new("RGB", (grid.width + width, grid.height), "white")
    out.paste(grid, (width, 0))
    draw, row = ImageDraw.Draw(out), grid.height / len(prompts)
    for i, prompt in enumerate(prompts):
        draw.text((6, int(row * (i + 0.5)) - 5), prompt, fill="black")
    return out


def run_flow_demo(
    out_dir: str | Path = "lmrl-demo-flow",
    *,
    seed: int = 0,
    fast: bool = False,
    pretrain_steps: int = 400,
    caption_noise: float = 0.25,
    rl_steps: int = 60,
    overrides: tuple[str, ...] = (),
    console: bool = True,
) -> dict[str, Any]:
    """Run the demo (see the module docstring); returns and writes ``demo.json``.

    Args:
        out_dir: the demo's directory (started fresh).
        seed: seed of the data, the model and the run.
        fast: a smoke run in seconds (a tinier model, a few steps; learns nothing).
        pretrain_steps: flow-matching steps of the pre-training (batches of 64).
        caption_noise: how loose the pre-training captions are (`noisy_captions`).
        rl_steps: Flow-GRPO steps.
        overrides: extra ``lmrl train-flow`` ``key=value`` overrides.
        console: print progress.

    Raises:
        DataError: ``out_dir`` is not new, empty or a previous demo's (refused before any
            work, untouched; `lmrl.demos.folder.demo_dir`).
    """
    out = Path(out_dir)
    with demo_dir(out, "flow"):
        return _run(out, seed, fast, pretrain_steps, caption_noise, rl_steps, overrides, console)


def _run(  # the demo, in the directory `demo_dir` made ready
    out: Path, seed: int, fast: bool, pretrain_steps: int, caption_noise: float, rl_steps: int,
    overrides: tuple[str, ...], console: bool,
) -> dict[str, Any]:  # fmt: skip
    from PIL import Image

    from lmrl.config.flow import load_flow_config
    from lmrl.data.tasks import write_task
    from lmrl.flow.matching import pretrain_image_flow
    from lmrl.logging.plot import plot_run
    from lmrl.trainer.flow import FlowTrainer, build_flow

    say = print if console else log.info
    start = time.perf_counter()
    paths = write_task("shapes", out / "data", seed=seed, num_images=256 if fast else 4096)
    widths = (8, 16) if fast else (32, 64)
    steps = 3 if fast else pretrain_steps
    say(
        f"pre-training {'a tiny' if fast else 'an'} image model by flow matching ({steps} steps)..."
    )
    _, losses = pretrain_image_flow(
        paths["images"], out / "model", steps=steps, seed=seed, block_out_channels=widths,
        caption_noise=caption_noise,
    )  # fmt: skip
    pretrained = time.perf_counter()
    say(f"  loss {np.mean(losses[:20]):.3f} -> {np.mean(losses[-20:]):.3f} "
        f"({pretrained - start:.0f} s)")  # fmt: skip
    recipe = [
        f"model.path={out / 'model'}",
        f"data.train_files={paths['train']}",
        f"data.val_files={paths['test']}",
        f"trainer.val_images_per_prompt={4 if fast else 16}",
        f"trainer.default_local_dir={out / 'run'}",
        f"trainer.seed={seed}",
        f"trainer.total_training_steps={2 if fast else rl_steps}",
        "trainer.test_freq=10",
        f"trainer.logger={'[console]' if console else '[]'}",
        "data.train_batch_size=4" if fast else "data.train_batch_size=16",
        "sampler.n=4" if fast else "sampler.n=16",
        "sampler.num_steps=10",
        "sampler.sde_start=0",
        "sampler.sde_steps=2",
        "actor.ppo_mini_batch_size=8" if fast else "actor.ppo_mini_batch_size=64",
        "actor.micro_batch_size=8" if fast else "actor.micro_batch_size=32",
        "actor.clip_range=1e-2",
        "actor.optim.lr=3e-5",
        "reward.name=geneval",
        *overrides,
    ]
    cfg = load_flow_config(None, recipe)
    trainer = FlowTrainer(build_flow(cfg))
    say(f"Flow-GRPO: {cfg.trainer.total_training_steps} steps of "
        f"{cfg.data.train_batch_size} prompts x {cfg.sampler.n} images...")  # fmt: skip
    history = trainer.fit()
    DemoStopped.check(trainer, "Flow-GRPO")
    done = time.perf_counter()
    val = trainer.validations
    source = trainer.val_prompts[0]["data_source"]
    # the reward and each check at every validation: the table printed and kept in demo.json
    keys = {"reward": f"val/{source}/reward/mean"}
    keys |= {key.split("/")[-1]: key for key in sorted(val[0]) if "/check/" in key}
    table = {name: [val[step][key] for step in sorted(val)] for name, key in keys.items()}
    first, last = table["reward"][0], table["reward"][-1]
    samples = out / "run" / "samples"
    before = np.asarray(Image.open(samples / "step_0.png"))
    after = np.asarray(Image.open(samples / f"step_{max(val)}.png"))
    gap = np.full((before.shape[0], 8, 3), 255, dtype=np.uint8)
    pair = Image.fromarray(np.concatenate([before, gap, after], 1))
    _with_prompts(pair, [r["prompt"] for r in trainer.val_prompts]).save(out / "before_after.png")
    plot = plot_run(out / "run")
    scores = [h["critic/score/mean"] for h in history]
    summary = {
        DEMO_KEY: "flow",
        "val_reward_before": first,
        "val_reward_after": last,
        "val_steps": sorted(val),
        "val": table,
        "train_reward_first_steps": float(np.mean(scores[:3])),
        "train_reward_last_steps": float(np.mean(scores[-3:])),
        "pretrain_s": pretrained - start,
        "rl_s": done - pretrained,
        "total_s": done - start,
        "seconds_per_step": float(np.mean([h["timing_s/step"] for h in history])),
        "run_dir": str(out / "run"),
        "model": str(out / "model"),
        "before_after": str(out / "before_after.png"),
        "plot": str(plot),
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    images = len(trainer.val_prompts) * cfg.trainer.val_images_per_prompt
    rows = [f"{'step':>9} " + " ".join(f"{step:>5}" for step in sorted(val))]
    rows += [
        f"{name:>9} " + " ".join(f"{v:5.3f}" for v in values) for name, values in table.items()
    ]
    say(
        f"validation on {len(trainer.val_prompts)} held-out prompts x "
        f"{cfg.trainer.val_images_per_prompt} images ({images}; reward = the fraction of the "
        "four checks that hold):\n" + "\n".join(rows) + "\n"
        f"validation reward {first:.3f} before RL -> {last:.3f} after; train reward "
        f"{summary['train_reward_first_steps']:.3f} -> {summary['train_reward_last_steps']:.3f}\n"
        f"images before/after: {out / 'before_after.png'}\nreward curve: {plot}\n"
        f"total {done - start:.0f} s (pre-training {pretrained - start:.0f} s, "
        f"Flow-GRPO {done - pretrained:.0f} s)"
    )
    return summary
