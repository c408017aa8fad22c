"""Supervised fine-tuning (``lmrl sft``): the warm start before RL.

``build_sft(cfg)`` assembles the parts (``SFTParts``) and ``SFTTrainer`` is the program the run
loop (``lmrl.run.loop``) runs over them, as ``lmrl train`` runs the RL ``Trainer``: the same
signals, checkpoints with exact resume (``trainer.resume_mode=auto``), health checks, trackers
and progress. It fits a causal LM on ``lmrl.data.SFTDataset`` examples (prompt/response,
chat-message or verl RL-format rows) and writes a model directory that
``lmrl train model.path=...`` loads directly. The model is loaded (and LoRA applied) as
``build_run`` does, the data order is a ``PromptSampler``, and the loss, optimizer and schedule
live in ``lmrl.workers.sft.SFTWorker`` (a ``TrainableWorker``, like the actor and the critic).

Choices:

- A step is one optimizer step over ``data.train_batch_size`` examples, collated in
  micro-batches of ``data.micro_batch_size`` (each right-padded to its own longest row) whose
  gradients accumulate to the whole batch's (see ``lmrl.workers.sft``).
- Checkpoints ``global_step_N`` hold the weights, optimizer, schedule, data order and RNGs
  (``lmrl.run.checkpoint``); the finished model is exported to ``final/`` as a plain
  Hugging Face directory (LoRA merged), written to a temporary directory and renamed, so a
  killed run never leaves a half-written ``final/``. It holds ``lmrl_prompt_layout.json``, how
  the training prompts were rendered (``lmrl.data.layout``), which ``lmrl train`` checks its
  own rendering against before its first step.
- Validation is the loss on ``data.val_files`` (or on the training rows ``data.val_split``
  holds out, which are then not trained on) and, where those rows are RL rows a built-in
  scorer scores or ``reward.custom_reward_function`` names a score function, the task's
  score on greedy answers against the answers' prior (the commonest training answer;
  ``lmrl.trainer.sft_score``); the run ends saying whether the model beats the prior.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lmrl.config.sft import SFTConfig
from lmrl.data.layout import write_layout
from lmrl.data.sampler import PromptSampler
from lmrl.data.sft import SFTDataset, held_out_rows
from lmrl.errors import DataError
from lmrl.logging import make_trackers
from lmrl.models.loading import export_pretrained, load_causal_lm, load_tokenizer, resolve_device
from lmrl.models.lora import adapter_export, apply_lora, merged_state
from lmrl.rewards.functions import load_reward_fn
from lmrl.run.checkpoint import load_state, read_weights, rng_state, set_rng_state
from lmrl.run.health import SFTHealth
from lmrl.run.loop import RunsOnLoop, resume
from lmrl.run.resume import RunStart, open_run
from lmrl.run.timing import StageTimer
from lmrl.trainer.metrics import to_floats
from lmrl.trainer.sft_score import SFTScore, commonest_answer
from lmrl.workers.build import seed_everything
from lmrl.workers.precision import Precision
from lmrl.workers.sft import SFTWorker

log = logging.getLogger("lmrl.sft")


@dataclass(frozen=True)
class SFTParts:
    """What an SFT run is made of (`build_sft`); the program runs over them.

    Attributes:
        config: the resolved ``SFTConfig``.
        start: the run directory, resume point and config changes.
        tokenizer: the model's tokenizer.
        train_data, val_data: the examples (``val_data`` None without validation files).
        sampler: the resumable order of the training examples.
        worker: the ``SFTWorker``: the model, its optimizer and schedule, the loss.
        trackers: the loggers of ``trainer.logger``.
        total_steps: optimizer steps of the run.
        held_out: the ``(file, row)`` pairs ``data.val_split`` holds out of the training
            files for validation (None without a split).
    """

    config: SFTConfig
    start: RunStart
    tokenizer: Any
    train_data: SFTDataset
    val_data: SFTDataset | None
    sampler: PromptSampler
    worker: SFTWorker
    trackers: Any
    total_steps: int
    held_out: frozenset[tuple[str, int]] | None = None


def build_sft(cfg: SFTConfig) -> SFTParts:
    """Assemble an SFT run from a resolved config, cheapest failure first: the run directory and
    resume point, the tokenizer and data, the model, the trackers.

    Raises:
        lmrl.errors.LmrlError: the run directory, a refused resume, the data or the model, each
            in one line naming what to fix.
    """
    start = open_run(cfg, "lmrl sft")
    seed_everything(cfg.trainer.seed)
    device = resolve_device(cfg.trainer.device)
    m, d = cfg.model, cfg.data
    assert m.path is not None  # load_sft_config requires it
    tokenizer = load_tokenizer(m.path, m.trust_remote_code)
    seed = cfg.trainer.seed if d.seed is None else d.seed  # resolved configs fill it already
    assert d.train_files is not None  # load_sft_config requires it
    held_out = held_out_rows(d.train_files, d.val_split, seed) if d.val_split else None
    val_data: SFTDataset | None = None
    if held_out is not None:  # data.val_split: validation rows out of the training files
        train_data = _dataset(cfg, d.train_files, tokenizer, lambda *row: row not in held_out)
        val_data = _dataset(cfg, d.train_files, tokenizer, lambda *row: row in held_out)
    else:
        train_data = _dataset(cfg, d.train_files, tokenizer)
        if d.val_files:
            val_data = _dataset(cfg, d.val_files, tokenizer)
    if len(train_data) < d.train_batch_size:
        raise DataError(
            f"data.train_batch_size={d.train_batch_size} is larger than the training set "
            f"({len(train_data)} examples in {d.train_files}); lower it"
        )
    sampler = PromptSampler(len(train_data), d.train_batch_size, seed=seed, shuffle=d.shuffle)
    total_steps = cfg.trainer.total_training_steps or len(sampler) * cfg.trainer.total_epochs
    precision = Precision.from_config(m, device)  # fp32 masters, model.mixed_precision compute
    model = load_causal_lm(
        m.path,
        dtype=precision.master,
        device=device,
        trust_remote_code=m.trust_remote_code,
        gradient_checkpointing=m.enable_gradient_checkpointing,
    )
    model = precision.prepare(model)
    if m.lora_rank > 0:
        model = apply_lora(model, m.lora_rank, m.lora_alpha, m.target_modules)
    worker = SFTWorker(
        model, cfg.optim, total_steps=total_steps, seed=cfg.trainer.seed, precision=precision
    )
    t = cfg.trainer
    trackers = make_trackers(
        t.logger, start.run_dir, t.project_name, t.experiment_name, config_dict=asdict(cfg),
        total_steps=total_steps, start_step=start.start_step,
    )  # fmt: skip
    log.info(
        "sft: %d examples (%d trained tokens), %d steps of %d, on %s",
        len(train_data), train_data.stats["loss_tokens"], total_steps, d.train_batch_size, device,
    )  # fmt: skip
    return SFTParts(cfg, start, tokenizer, train_data, val_data, sampler, worker, trackers,
                    total_steps, held_out)  # fmt: skip


def _dataset(cfg: SFTConfig, files, tokenizer, keep=None) -> SFTDataset:
    d = cfg.data
    return SFTDataset(
        files, tokenizer, prompt_key=d.prompt_key, response_key=d.response_key,
        messages_key=d.messages_key, response_from_ground_truth=d.response_from_ground_truth,
        mask_pattern=d.mask_pattern, max_length=d.max_length, truncation=d.truncation,
        prompt_template=d.prompt_template, keep=keep,
    )  # fmt: skip


class SFTTrainer(RunsOnLoop):
    """Supervised fine-tuning as a program of the run loop (``lmrl.run.loop``).

    Args:
        parts: from `build_sft`; a checkpoint in ``parts.start.resume_from`` is loaded here.

    Attributes:
        run_dir: ``trainer.default_local_dir`` (config.yaml, metrics.jsonl, checkpoints).
        final_dir: ``run_dir / "final"``, the model path to hand to ``lmrl train``.
        worker: the ``SFTWorker``: the model, its optimizer and schedule, the loss.
        score: the greedy answers' score against the answers' prior at each validation
            (`lmrl.trainer.sft_score.SFTScore`; its ``skipped`` says why not), None without
            validation files.
        total_steps: optimizer steps of the run.
        global_step: steps done.
    """

    def __init__(self, parts: SFTParts) -> None:
        self.parts = parts
        self.cfg = parts.config
        self.settings = parts.config.trainer
        self.start = parts.start
        self.run_dir = parts.start.run_dir
        self.final_dir = self.run_dir / "final"
        self.tokenizer = parts.tokenizer
        self.train_data, self.val_data = parts.train_data, parts.val_data
        self.sampler = parts.sampler
        self.worker = parts.worker
        self.trackers = parts.trackers
        self.total_steps = parts.total_steps
        self.global_step = 0
        self.health = SFTHealth(self.total_steps)
        self.score = self._score() if self.val_data is not None else None
        resume(self)

    def _score(self) -> SFTScore:
        """The greedy-answer score of the validation rows (`lmrl.trainer.sft_score`)."""
        d = self.cfg.data
        files = [d.train_files] if isinstance(d.train_files, str) else list(d.train_files or [])
        val = [d.val_files] if isinstance(d.val_files, str) else list(d.val_files or [])
        held_out = self.parts.held_out
        trained, validation = None, None
        if held_out is not None:  # both sides read from the training files
            val = files
            trained, validation = (lambda *r: r not in held_out), (lambda *r: r in held_out)

        def prior() -> str | None:
            return commonest_answer(
                files, response_key=d.response_key, messages_key=d.messages_key,
                response_from_ground_truth=d.response_from_ground_truth, keep=trained,
            )  # fmt: skip

        fn = self.cfg.reward.custom_reward_function
        reward_fn = None
        if fn.path:
            reward_fn = load_reward_fn(fn.path, fn.name, kwargs=fn.reward_kwargs)
        longest = max(sum(mask) for _, mask in self.train_data.examples)
        score = SFTScore(
            self.worker.model, self.tokenizer, val, prior, longest,
            prompt_key=d.prompt_key, prompt_template=d.prompt_template, keep=validation,
            reward_fn=reward_fn,
        )  # fmt: skip
        if score.skipped is not None:
            log.info("sft: no validation score on greedy answers: %s", score.skipped)
        return score

    @property
    def model(self) -> torch.nn.Module:
        """The model trained (the worker's)."""
        return self.worker.model

    @property
    def has_validation(self) -> bool:
        return self.val_data is not None

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
        """Token-mean loss over the validation set, ``{"val/sft_loss": ...}`` ({} without one),
        and where the rows can be scored the greedy answers' ``val/<source>/acc`` and the
        answers' prior ``val/<source>/prior_acc`` (`lmrl.trainer.sft_score`)."""
        if self.val_data is None:
            return {}
        pieces = self._micro_batches(self.val_data, range(len(self.val_data)))
        metrics = {"val/sft_loss": float(self.worker.loss(pieces))}
        return metrics | (self.score() if self.score is not None else {})

    def generations(self) -> list[dict]:
        return []

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_weights(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"model": self.worker.model_state()}

    def state_dict(self) -> dict:
        """Optimizer, schedule, data order, RNGs and the step (the weights are saved apart)."""
        return {
            "global_step": self.global_step,
            "worker": self.worker.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
        }

    def load_checkpoint(self, path: Path) -> None:
        self.worker.load_model_state(read_weights(path / "model.safetensors"))
        state = load_state(path)
        self.worker.load_state_dict(state["worker"])
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.global_step = int(state["global_step"])

    def export(self) -> Path:
        """Write ``run_dir/final``: the model (LoRA merged), tokenizer and prompt layout record
        as a plain Hugging Face directory that ``lmrl train model.path=...`` loads; written
        whole, then renamed."""
        m = self.cfg.model
        weights, adapter = self.worker.model_state(), None
        if m.lora_rank > 0:
            adapter = adapter_export(weights, m)  # final/adapter: the adapter in PEFT's format
            weights = merged_state(weights, m.lora_alpha / m.lora_rank)

        def extra(out: Path) -> None:
            write_layout(out, self.train_data.layout)
            if adapter is not None:
                adapter(out)

        assert m.path is not None  # load_sft_config requires it
        path = export_pretrained(self.final_dir, weights, m.path, self.tokenizer,
                                 m.trust_remote_code, extra=extra)  # fmt: skip
        verdict = self.score.verdict() if self.score is not None else None
        if verdict is not None:
            log.log(*verdict)
        return path

    def close(self) -> None:
        self.trackers.close()


__all__ = ["SFTParts", "SFTTrainer", "build_sft"]
