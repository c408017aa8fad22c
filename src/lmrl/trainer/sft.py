"""Supervised fine-tuning (``lmrl sft``): the warm start before RL.

``SFTTrainer`` fits a causal LM on ``lmrl.data.SFTDataset`` examples (prompt/response,
chat-message or verl RL-format rows) and writes a model directory that
``lmrl train model.path=...`` loads directly. It is assembled from the RL run's parts: the
model is loaded (and LoRA applied) as ``build_run`` does, the data order is a
``PromptSampler``, and the loss, optimizer and schedule live in ``lmrl.workers.sft.SFTWorker``
(a ``TrainableWorker``, like the actor and the critic).

Choices:

- A step is one optimizer step over ``data.train_batch_size`` examples, collated in
  micro-batches of ``data.micro_batch_size`` (each right-padded to its own longest row) whose
  gradients accumulate to the whole batch's (see ``lmrl.workers.sft``).
- Exports are plain Hugging Face directories (LoRA merged), written to a temporary directory
  and renamed, so a killed run never leaves a half-written ``final/``.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from lmrl.config.loader import save_config
from lmrl.config.sft import SFTConfig
from lmrl.data.sampler import PromptSampler
from lmrl.data.sft import SFTDataset
from lmrl.errors import DataError
from lmrl.logging import make_trackers
from lmrl.models.loading import load_causal_lm, load_tokenizer, resolve_device
from lmrl.models.lora import apply_lora, is_lora, merge_lora
from lmrl.trainer.health import SFTHealth
from lmrl.trainer.metrics import StageTimer, to_floats
from lmrl.trainer.resume import check_run_dir
from lmrl.trainer.run import seed_everything
from lmrl.workers.sft import SFTWorker

log = logging.getLogger("lmrl.sft")


class SFTTrainer:
    """Supervised fine-tuning from a resolved ``SFTConfig``: ``fit()`` runs it all.

    Args:
        cfg: from ``lmrl.config.sft.load_sft_config`` (resolved and validated).

    Attributes:
        run_dir: ``trainer.default_local_dir`` (config.yaml, metrics.jsonl, the exports).
        final_dir: ``run_dir / "final"``, the model path to hand to ``lmrl train``.
        worker: the ``SFTWorker``: the model, its optimizer and schedule, the loss.
        total_steps: optimizer steps of the run.
        global_step: steps done.
    """

    def __init__(self, cfg: SFTConfig) -> None:
        self.cfg = cfg
        seed_everything(cfg.trainer.seed)
        self.device = resolve_device(cfg.trainer.device)
        self.run_dir = Path(cfg.trainer.default_local_dir)
        check_run_dir(self.run_dir)  # writable, or one line now; written once all loads
        self.final_dir = self.run_dir / "final"

        m, d = cfg.model, cfg.data
        self.tokenizer = load_tokenizer(m.path, m.trust_remote_code)
        self.train_data = self._dataset(d.train_files)
        self.val_data = self._dataset(d.val_files) if d.val_files else None
        if len(self.train_data) < d.train_batch_size:
            raise DataError(
                f"data.train_batch_size={d.train_batch_size} is larger than the training set "
                f"({len(self.train_data)} examples in {d.train_files}); lower it"
            )
        self.sampler = PromptSampler(
            len(self.train_data), d.train_batch_size, seed=d.seed, shuffle=d.shuffle
        )
        self.total_steps = cfg.trainer.total_training_steps or len(self.sampler) * (
            cfg.trainer.total_epochs
        )

        model = load_causal_lm(
            m.path,
            dtype=None if m.dtype == "auto" else m.dtype,
            device=self.device,
            trust_remote_code=m.trust_remote_code,
            gradient_checkpointing=m.enable_gradient_checkpointing,
        )
        if m.lora_rank > 0:
            model = apply_lora(model, m.lora_rank, m.lora_alpha, m.target_modules)
        self.worker = SFTWorker(
            model, cfg.optim, total_steps=self.total_steps, seed=cfg.trainer.seed
        )
        self.global_step = 0
        self.health = SFTHealth(self.total_steps)
        # the console line is printed here (the console tracker summarizes RL metrics)
        self.console = "console" in cfg.trainer.logger
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml", command="lmrl sft")
        self.tracker = make_trackers(
            [n for n in cfg.trainer.logger if n != "console"],
            self.run_dir,
            cfg.trainer.project_name,
            cfg.trainer.experiment_name,
            config_dict=asdict(cfg),
            total_steps=self.total_steps,
        )
        log.info(
            "sft: %d examples (%d trained tokens), %d steps of %d, on %s",
            len(self.train_data), self.train_data.stats["loss_tokens"], self.total_steps,
            d.train_batch_size, self.device,
        )  # fmt: skip

    @property
    def model(self) -> torch.nn.Module:
        """The model trained (the worker's)."""
        return self.worker.model

    def _dataset(self, files) -> SFTDataset:
        d = self.cfg.data
        return SFTDataset(
            files,
            self.tokenizer,
            prompt_key=d.prompt_key,
            response_key=d.response_key,
            messages_key=d.messages_key,
            response_from_ground_truth=d.response_from_ground_truth,
            mask_pattern=d.mask_pattern,
            max_length=d.max_length,
            truncation=d.truncation,
        )

    def _micro_batches(self, data: SFTDataset, indices: Sequence[int]) -> Iterator[dict]:
        size = self.cfg.data.micro_batch_size or len(indices)
        for i in range(0, len(indices), size):
            yield data.collate(indices[i : i + size])

    # ---------------------------------------------------------------------- step
    def step(self) -> dict[str, float]:
        """One optimizer step on the next batch; returns its metrics as floats."""
        timer = StageTimer()
        with timer("step"):
            indices = self.sampler.next_batch()
            metrics = self.worker.update(list(self._micro_batches(self.train_data, indices)))
        self.global_step += 1
        metrics = to_floats(metrics) | {"training/epoch": float(self.sampler.epoch)}
        return metrics | timer.metrics()

    def validate(self) -> dict[str, float]:
        """Token-mean loss over the validation set: ``{"val/sft_loss": ...}`` ({} without one)."""
        if self.val_data is None:
            return {}
        pieces = self._micro_batches(self.val_data, range(len(self.val_data)))
        return {"val/sft_loss": float(self.worker.loss(pieces))}

    # ---------------------------------------------------------------------- export
    def save(self, name: str) -> Path:
        """Write the model (LoRA merged) and tokenizer to ``run_dir/name``, atomically.

        Returns:
            The directory, loadable by ``load_causal_lm`` / ``load_tokenizer``.
        """
        out = self.run_dir / name
        tmp = self.run_dir / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model = merge_lora(self.model) if is_lora(self.model) else self.model
        use_cache = model.config.use_cache
        model.config.use_cache = True  # training turned it off for checkpointing
        try:
            model.save_pretrained(tmp)
        finally:
            model.config.use_cache = use_cache
        self.tokenizer.save_pretrained(tmp)
        save_config(self.cfg, tmp / "sft_config.yaml", command="lmrl sft")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        return out

    # ---------------------------------------------------------------------- fit
    def fit(
        self, stop: Callable[[int, dict[str, float]], bool] | None = None
    ) -> list[dict[str, float]]:
        """Run ``total_steps`` steps with validation and exports; returns every step's metrics.

        Writes ``metrics.jsonl`` (and the other trackers of ``trainer.logger``), a
        ``global_step_N`` export every ``trainer.save_freq`` steps before the last, and
        ``final`` at the end.

        Args:
            stop: ``stop(step, metrics) -> bool``, asked after each logged step; True ends the
                run there (validated and exported to ``final`` like a last step). For a warm
                start that must stop part-way, e.g. at a validation loss.
        """
        t = self.cfg.trainer
        history = []
        start = time.perf_counter()
        try:
            while self.global_step < self.total_steps:
                metrics = self.step()
                last = self.global_step == self.total_steps
                if last or (t.test_freq > 0 and self.global_step % t.test_freq == 0):
                    metrics |= self.validate()
                if not last and stop is not None and stop(self.global_step, metrics):
                    last = True
                    if "val/sft_loss" not in metrics:
                        metrics |= self.validate()
                if not last and t.save_freq > 0 and self.global_step % t.save_freq == 0:
                    self.save(f"global_step_{self.global_step}")
                history.append(metrics)
                self.tracker.log(metrics, self.global_step)
                for warning in self.health.check(metrics.get("sft/loss"), metrics.get("sft/lr")):
                    log.warning("%s", warning)
                if self.console:
                    print(self._line(metrics), flush=True)
                if last:
                    break
            self.save("final")
        finally:
            self.tracker.close()
        log.info("sft: %d steps in %.1fs", self.global_step, time.perf_counter() - start)
        return history

    def _line(self, metrics: dict[str, float]) -> str:
        parts = [f"step {self.global_step}/{self.total_steps}"]
        for key, label in (("sft/loss", "loss"), ("val/sft_loss", "val_loss"),
                           ("sft/grad_norm", "grad_norm"), ("sft/lr", "lr")):  # fmt: skip
            if key in metrics and math.isfinite(metrics[key]):
                parts.append(f"{label} {metrics[key]:.4g}")
        parts.append(f"{metrics['timing_s/step']:.2f}s")
        return "  ".join(parts)


__all__ = ["SFTTrainer"]
