"""``lmrl demo``: a tiny model learns to reverse digits on the CPU, and RL does the learning.

The whole pipeline a user runs on real models, at toy scale, in a few minutes on 2 cores:

    1 model   a ~2M-parameter Qwen2 with the byte-level tokenizer (``lmrl.models.tiny``)
    2 data    the ``digits`` task: ``reverse 48213`` -> ``31284`` (4-6 digits)
    3 SFT     a short warm start that stops while the model is still mostly wrong
    4 GRPO    from the SFT model: 16 prompts x 8 samples per step, greedy validation
    5 plot    ``<rl run>/plot.png``, and a summary (``demo.json``) of where everything is

Choices:

- The warm start must leave the work to RL (the issue's bar: exact-match accuracy at most
  0.5 after SFT, at least 0.9 after RL). Its accuracy rises from ~0 to ~1 within a few dozen
  steps, at a step that varies with the seed, so a loss threshold alone lands anywhere in
  that rise. Once the training loss is below ``SFT_CHECK_LOSS`` the demo measures greedy
  exact-match accuracy on the validation prompts after every step (the same prompts and
  decoding the RL trainer validates with, ~0.2 s) and stops at the first step where it
  reaches ``sft_target_acc``; a step that overshoots ``SFT_MAX_ACC`` is rolled back to the
  weights of the previous check.
- RL stops early once validation accuracy reaches ``target_acc`` (checked every
  ``test_freq`` steps), since more steps only cost time; ``rl_steps`` is the cap.
- Speed on a CPU: no gradient checkpointing; one optimizer step per batch (so the old
  log-probs come from the update's own forward); no KL term (no reference forward); in-process
  reward scoring; a checkpoint only at the end. Prompts are plain strings (``"reverse
  48213="``), used verbatim without the chat template: 14 tokens instead of 32, which halves
  every forward and backward pass.
- ``out_dir`` is started fresh: a previous demo there (recognised by its ``demo.json`` or
  an unfinished one by ``model/``, ``data/``...) is deleted; any other non-empty directory is
  an error rather than something to delete.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("lmrl.demo")

TASK = "digits"
ACC_KEY = f"val/{TASK}/acc"
SUMMARY_FILE = "demo.json"
_DEMO_ENTRIES = {SUMMARY_FILE, "model", "data", "sft", "rl"}

SFT_CHECK_LOSS = 1.0  # measure accuracy after every step once the training loss is below this
SFT_MAX_ACC = 0.5  # a check above this rolls back to the previous check's weights


def _fresh_dir(out: Path) -> None:
    """Empty ``out`` if it holds a previous demo; refuse any other non-empty directory."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    if out.is_dir():
        entries = {p.name for p in out.iterdir()}
        if entries and not entries <= _DEMO_ENTRIES:
            raise ValueError(
                f"--out {out}: a non-empty directory that is not a previous lmrl demo "
                f"(it holds {sorted(entries)[:5]}); pick another --out"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True)


PROMPT_FORMAT = "{}="  # "reverse 48213" -> the plain prompt "reverse 48213="


class GreedyAccuracy:
    """Exact-match accuracy of greedy answers to the validation prompts, for any model.

    Args:
        model: the causal LM (evaluated in place, its train/eval mode restored).
        tokenizer: its tokenizer.
        val_file: the validation parquet.
        max_new_tokens: the most tokens per answer (the RL run's ``max_response_length``).
        max_prompt_length: as in the RL run.
    """

    def __init__(
        self, model, tokenizer, val_file: Path, max_new_tokens: int, max_prompt_length: int
    ) -> None:
        from lmrl.data import RLDataset
        from lmrl.rewards.scorers.digits import compute_score
        from lmrl.rollout import SamplingParams, build_engine

        self.model, self.tokenizer, self.score = model, tokenizer, compute_score
        self.data = RLDataset(val_file, tokenizer, max_prompt_length=max_prompt_length)
        self.prompts = self.data.get_batch(list(range(len(self.data))))
        self.engine = build_engine("hf", model, tokenizer)
        self.sampling = SamplingParams(do_sample=False, max_new_tokens=max_new_tokens)

    @torch.no_grad()
    def __call__(self) -> float:
        """Fraction of validation prompts answered exactly."""
        training = self.model.training
        self.model.eval()
        try:
            out = self.engine.generate(self.prompts, 1, self.sampling)
        finally:
            self.model.train(training)
        right = 0.0
        for ids, mask, truth in zip(
            out["responses"], out["response_mask"], out["ground_truth"], strict=True
        ):
            text = self.tokenizer.decode(ids[mask], skip_special_tokens=False)
            right += self.score(text, truth)["acc"]
        return right / len(out["responses"])


def run_sft(
    model_dir: Path,
    data: dict[str, Path],
    run_dir: Path,
    *,
    seed: int,
    target_acc: float,
    max_steps: int,
    lr: float,
    batch_size: int,
    max_new_tokens: int,
    console: bool,
) -> dict[str, Any]:
    """The warm start: SFT until greedy validation accuracy reaches ``target_acc``.

    Returns:
        ``{"dir", "model", "steps", "acc", "seconds", "rolled_back"}``; ``model`` is the
        directory RL starts from.
    """
    from lmrl.config.sft import load_sft_config
    from lmrl.trainer.sft import SFTTrainer

    cfg = load_sft_config(
        None,
        [
            f"model.path={model_dir}",
            f"data.train_files={data['train']}",
            f"data.val_files={data['test']}",
            "data.response_from_ground_truth=true",
            "data.max_length=64",
            f"data.train_batch_size={batch_size}",
            f"optim.lr={lr}",
            "optim.lr_warmup_steps_ratio=0",
            "optim.lr_scheduler=constant",
            "model.enable_gradient_checkpointing=false",
            f"trainer.total_training_steps={max_steps}",
            f"trainer.default_local_dir={run_dir}",
            f"trainer.logger={'[console]' if console else '[]'}",
            "trainer.device=cpu",
            f"trainer.seed={seed}",
        ],
    )
    start = time.perf_counter()
    trainer = SFTTrainer(cfg)
    accuracy = GreedyAccuracy(trainer.model, trainer.tokenizer, data["test"], max_new_tokens, 64)
    state: dict[str, Any] = {"acc": None, "previous": None, "rolled_back": False}

    def stop(step: int, metrics: dict[str, float]) -> bool:
        if metrics["sft/loss"] >= SFT_CHECK_LOSS and step < max_steps - 1:
            return False
        acc = accuracy()
        metrics["sft/val_acc"] = acc
        if acc > SFT_MAX_ACC and state["previous"] is not None:
            trainer.model.load_state_dict(state["previous"][1])
            state["acc"], state["rolled_back"] = state["previous"][0], True
            log.info(
                "sft: accuracy %.3f overshot %.2f; back to the previous step", acc, SFT_MAX_ACC
            )
            return True
        state["acc"] = acc
        state["previous"] = (
            acc,
            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        )
        return acc >= target_acc

    trainer.fit(stop=stop)
    if state["acc"] is None:
        state["acc"] = accuracy()
    return {
        "dir": trainer.run_dir,
        "model": trainer.final_dir,
        "steps": trainer.global_step,
        "acc": state["acc"],
        "seconds": time.perf_counter() - start,
        "rolled_back": state["rolled_back"],
    }


def run_rl(
    model_dir: Path,
    data: dict[str, Path],
    run_dir: Path,
    *,
    seed: int,
    steps: int,
    lr: float,
    prompts_per_step: int,
    n: int,
    max_response_length: int,
    test_freq: int,
    target_acc: float,
    console: bool,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """GRPO from ``model_dir`` until validation accuracy reaches ``target_acc`` or ``steps``.

    Returns:
        ``{"dir", "checkpoint", "steps", "acc_before", "acc", "seconds", "history"}``.
    """
    from lmrl.config import load_config
    from lmrl.trainer.trainer import Trainer

    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            f"data.train_files={data['train']}",
            f"data.val_files={data['test']}",
            "data.max_prompt_length=64",
            f"data.max_response_length={max_response_length}",
            f"data.train_batch_size={prompts_per_step}",
            f"rollout.n={n}",
            "algorithm.adv_estimator=grpo",
            f"actor.ppo_mini_batch_size={prompts_per_step}",
            f"actor.optim.lr={lr}",
            "actor.use_kl_loss=false",
            "model.enable_gradient_checkpointing=false",
            "reward.num_workers=0",
            f"trainer.total_training_steps={steps}",
            f"trainer.test_freq={test_freq}",
            "trainer.save_freq=-1",
            "trainer.resume_mode=disable",
            f"trainer.logger={'[console]' if console else '[]'}",
            f"trainer.default_local_dir={run_dir}",
            "trainer.device=cpu",
            f"trainer.seed={seed}",
            "trainer.project_name=lmrl-demo",
            "trainer.experiment_name=digits-grpo",
            *overrides,
        ],
    )
    start = time.perf_counter()
    trainer = Trainer(cfg)
    history: list[dict[str, float]] = []
    try:
        before = trainer.validate()
        trainer.tracker.log(before, step=0)
        acc = before[ACC_KEY]
        while trainer.global_step < trainer.total_steps:
            metrics = trainer.step()
            step = trainer.global_step
            if step % test_freq == 0 or step == trainer.total_steps:
                metrics |= trainer.validate()
                acc = metrics[ACC_KEY]
            history.append(metrics)
            trainer.tracker.log(metrics, step=step)
            if ACC_KEY in metrics and acc >= target_acc:
                break
        if ACC_KEY not in history[-1]:
            history[-1] |= trainer.validate()
            acc = history[-1][ACC_KEY]
            trainer.tracker.log(history[-1], step=trainer.global_step)
        checkpoint = trainer.save_checkpoint()
    finally:
        trainer.close()
    return {
        "dir": trainer.run_dir,
        "checkpoint": checkpoint,
        "steps": trainer.global_step,
        "acc_before": before[ACC_KEY],
        "acc": acc,
        "seconds": time.perf_counter() - start,
        "history": history,
    }


def run_demo(
    out_dir: str | Path = "lmrl-demo",
    *,
    seed: int = 0,
    fast: bool = False,
    sft_target_acc: float = 0.25,
    sft_max_steps: int = 300,
    sft_lr: float = 1e-3,
    rl_steps: int = 80,
    rl_lr: float = 1e-3,
    target_acc: float = 0.95,
    test_freq: int = 5,
    num_train: int = 10_000,
    num_val: int = 128,
    prompt_format: str | None = PROMPT_FORMAT,
    rl_overrides: Sequence[str] = (),
    console: bool = True,
) -> dict[str, Any]:
    """Run the demo: tiny model, digits data, SFT warm start, GRPO, plot; print a summary.

    Args:
        out_dir: where everything goes (started fresh, see the module docstring).
        seed: the seed of the model, the data and both trainers.
        fast: a smoke run in seconds (a ~0.1M-parameter model, a few steps of each stage);
            it shows the pipeline works, not that the model learns.
        sft_target_acc: SFT stops at the first step whose greedy validation accuracy
            reaches this.
        sft_max_steps: SFT's cap on optimizer steps.
        sft_lr: SFT's learning rate (constant, no warmup).
        rl_steps: GRPO's cap on steps.
        rl_lr: GRPO's learning rate.
        target_acc: GRPO stops once validation accuracy reaches this.
        test_freq: validate every this many GRPO steps.
        num_train, num_val: task sizes (the validation set is every prompt validated on).
        prompt_format: how the task writes prompts: a plain string with one ``{}`` for the
            task's text, or None for chat messages (templated: ~2x longer prompts).
        rl_overrides: extra ``lmrl train`` ``key=value`` overrides for the GRPO stage.
        console: print the trainers' progress lines.

    Returns:
        The summary (also written to ``out_dir/demo.json``): the directories, the plot, the
        final checkpoint, steps, accuracies after SFT and after RL, and seconds.
    """
    from lmrl.data.tasks import write_task
    from lmrl.logging.plot import plot_run
    from lmrl.models.tiny import build_tiny_model

    start = time.perf_counter()
    out = Path(out_dir)
    size, batch, prompts, n, response = "small", 64, 16, 8, 8
    if fast:
        size, batch, prompts, n = "tiny", 8, 4, 4
        sft_max_steps, rl_steps, test_freq = 3, 2, 1
        num_train, num_val = 64, 8
        sft_target_acc = target_acc = 2.0  # never stop early: run the capped steps
    _fresh_dir(out)
    model_dir = build_tiny_model(out / "model", arch="qwen2", size=size, seed=seed)
    data = write_task(
        TASK, out / "data", seed=seed, num_train=num_train, num_test=num_val,
        prompt_format=prompt_format,
    )  # fmt: skip
    sft = run_sft(
        model_dir, data, out / "sft", seed=seed, target_acc=sft_target_acc,
        max_steps=sft_max_steps, lr=sft_lr, batch_size=batch, max_new_tokens=response,
        console=console,
    )  # fmt: skip
    rl = run_rl(
        sft["model"], data, out / "rl", seed=seed, steps=rl_steps, lr=rl_lr,
        prompts_per_step=prompts, n=n, max_response_length=response, test_freq=test_freq,
        target_acc=target_acc, console=console, overrides=rl_overrides,
    )  # fmt: skip
    plot = plot_run(rl["dir"])
    summary = {
        "out_dir": str(out),
        "sft_dir": str(sft["dir"]),
        "sft_model": str(sft["model"]),
        "rl_dir": str(rl["dir"]),
        "metrics": str(rl["dir"] / "metrics.jsonl"),
        "plot": str(plot),
        "checkpoint": str(rl["checkpoint"]),
        "sft_steps": sft["steps"],
        "rl_steps": rl["steps"],
        "acc_after_sft": sft["acc"],
        "acc_before_rl": rl["acc_before"],
        "acc_after_rl": rl["acc"],
        "sft_seconds": round(sft["seconds"], 1),
        "rl_seconds": round(rl["seconds"], 1),
        "seconds": round(time.perf_counter() - start, 1),
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    print(format_summary(summary), flush=True)
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """The lines printed at the end of the demo."""
    return "\n".join(
        [
            "",
            f"lmrl demo finished in {summary['seconds']:.0f}s "
            f"(SFT {summary['sft_seconds']:.0f}s, RL {summary['rl_seconds']:.0f}s)",
            f"  validation exact-match ({ACC_KEY}, greedy, reverse 4-6 digits):",
            f"    after SFT ({summary['sft_steps']} steps):  {summary['acc_before_rl']:.3f}",
            f"    after GRPO ({summary['rl_steps']} steps): {summary['acc_after_rl']:.3f}",
            f"  SFT run:    {summary['sft_dir']}  (model: {summary['sft_model']})",
            f"  RL run:     {summary['rl_dir']}  (metrics: {summary['metrics']})",
            f"  plot:       {summary['plot']}",
            f"  checkpoint: {summary['checkpoint']}",
        ]
    )


__all__ = ["GreedyAccuracy", "format_summary", "run_demo", "run_rl", "run_sft"]
