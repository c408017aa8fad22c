"""Supervised fine-tuning (``lmrl sft``): the warm start before RL.

``SFTDataset`` turns rows into token sequences with a loss mask; ``SFTTrainer`` fits a causal
LM on them with the token-mean negative log-likelihood of the assistant tokens and writes a
model directory that ``lmrl train model.path=...`` loads directly.

Three row layouts, chosen per row: (a) ``prompt`` + ``response`` columns (``data.prompt_key``,
``data.response_key``); (b) a whole chat in ``data.messages_key``, every assistant turn
trained on; (c) verl RL-format rows (``data.response_from_ground_truth``), the response being
``reward_model.ground_truth`` as a string (the built-in tasks' files).

Choices:

- Tokens are laid out exactly as RL will see them. A chat prompt is rendered with the
  tokenizer's template and ``add_generation_prompt=True``, then each assistant turn is the
  text the template adds for it, tokenized on its own, as the rollout engine generates it
  after the templated prompt: ``31284<|im_end|>`` for ChatML. The loss covers the turn up to
  and including its last special token (the end-of-turn the engine stops at); what the
  template writes after it (ChatML's ``\\n``) is context, and dropped at the end of a
  sequence. A plain-string prompt is used verbatim, as ``lmrl.data.RLDataset`` does, and its
  response is followed by the tokenizer's EOS token.
- One forward path for every layout: a micro-batch is right-padded to its own longest row and
  split at ``P``, the first column where any row's loss starts; ``lmrl.models.forward_log_probs``
  scores columns ``P..`` with the chunked head (no (B, L, V) fp32 log-softmax is built) and
  the loss mask selects the assistant tokens. The loss is ``lmrl.algos.agg_loss`` token-mean
  with the whole batch's token count, so gradient accumulation over micro-batches gives the
  gradient of the whole batch.
- Exports are plain Hugging Face directories (LoRA merged), written to a temporary directory
  and renamed, so a killed run never leaves a half-written ``final/``.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lmrl.algos.agg import AggNorm, agg_loss
from lmrl.config.loader import save_config
from lmrl.config.sft import SFTConfig
from lmrl.data.dataset import check_prompt, read_records
from lmrl.data.sampler import PromptSampler
from lmrl.logging.trackers import make_trackers
from lmrl.models.forward import eval_mode, forward_log_probs
from lmrl.models.loading import load_causal_lm, load_tokenizer
from lmrl.models.lora import apply_lora, is_lora, merge_lora
from lmrl.trainer.metrics import StageTimer, to_floats
from lmrl.workers.optim import build_optimizer, build_scheduler, clip_and_step

log = logging.getLogger("lmrl.sft")

TRUNCATIONS = ("error", "left", "right")


class Segment(NamedTuple):
    """One piece of an example's text.

    Attributes:
        text: the text, tokenized on its own.
        trained: the loss is on it (an assistant turn or a response).
        special_tokens: tokenized with ``add_special_tokens=True`` (a plain-string prompt).
        eos: the tokenizer's EOS id follows it, trained on (a plain-string response).
    """

    text: str
    trained: bool
    special_tokens: bool = False
    eos: bool = False


# ---------------------------------------------------------------------------- rows -> segments
def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as err:
        raise ValueError(f"{where}: the chat template failed ({err})") from err


def chat_segments(tokenizer: Any, messages: list[dict], where: str) -> list[Segment]:
    """Split a templated chat into context text and assistant-turn text.

    For assistant message ``k``: the context is what the template renders for ``messages[:k]``
    with the generation prompt (beyond what earlier turns rendered), the turn is what it adds
    for message ``k`` itself.

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: ``[{"role", "content"}, ...]`` with at least one assistant message.
        where: ``"<file>: row <i>"`` for error messages.
    Returns:
        The segments in order: context, assistant turn, context, assistant turn...
    Raises:
        ValueError: no assistant message, no chat template, or a template that does not
            render a conversation as the concatenation of its turns.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{where}: chat messages need a tokenizer with a chat template; this one has none "
            "(give plain-string prompts instead)"
        )
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ValueError(f"{where}: no assistant message to train on")
    segments: list[Segment] = []
    done = ""
    for k in turns:
        try:
            prefix = _render(tokenizer, messages[:k], True, where)
        except ValueError:
            if k:
                raise
            prefix = ""  # a template that cannot render an empty chat: nothing comes before
        full = _render(tokenizer, messages[: k + 1], False, where)
        if not prefix.startswith(done) or not full.startswith(prefix):
            raise ValueError(
                f"{where}: the chat template does not render assistant turn {k} as an "
                "extension of the conversation before it, so its tokens cannot be told apart; "
                "use the prompt/response layout (data.prompt_key, data.response_key)"
            )
        segments += [Segment(prefix[len(done) :], False), Segment(full[len(prefix) :], True)]
        done = full
    return segments


def row_segments(
    row: Any,
    tokenizer: Any,
    where: str,
    *,
    prompt_key: str = "prompt",
    response_key: str = "response",
    messages_key: str = "messages",
    response_from_ground_truth: bool = False,
) -> list[Segment]:
    """The text segments of one row, in whichever layout it has (see the module docstring).

    Args:
        row: a row as read (a dict).
        tokenizer: the model's tokenizer.
        where: ``"<file>: row <i>"`` for error messages.
        prompt_key, response_key, messages_key: the column names.
        response_from_ground_truth: take the response from ``reward_model.ground_truth``.
    Returns:
        The row's segments: the templated chat split into context and assistant turns, or a
        plain-string prompt (special tokens added) and its response (EOS appended).
    Raises:
        ValueError: a missing or malformed column, naming the row and the column.
    """
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: must be an object with columns, got {type(row).__name__}")
    if response_from_ground_truth:
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
            raise ValueError(
                f"{where}: column 'reward_model.ground_truth': missing, needed by "
                f"data.response_from_ground_truth=true (columns there: {sorted(row)})"
            )
        truth = reward_model["ground_truth"]
        if isinstance(truth, bool) or not isinstance(truth, str | int | float):
            raise ValueError(
                f"{where}: column 'reward_model.ground_truth' is a {type(truth).__name__}; "
                "data.response_from_ground_truth needs a string (or a number) to train on"
            )
        response, response_col = str(truth), "reward_model.ground_truth"
    elif response_key in row:
        response, response_col = row[response_key], response_key
    elif messages_key in row:
        messages = check_prompt(row[messages_key], f"{where}: column {messages_key!r}")
        if isinstance(messages, str):
            raise ValueError(
                f"{where}: column {messages_key!r} must be a list of chat messages, got a string"
            )
        return chat_segments(tokenizer, messages, f"{where}: column {messages_key!r}")
    else:
        raise ValueError(
            f"{where}: neither a {response_key!r} column (data.response_key) nor a "
            f"{messages_key!r} column (data.messages_key) (columns there: {sorted(row)}); for "
            "verl RL-format rows set data.response_from_ground_truth=true"
        )
    if not isinstance(response, str) or not response.strip():
        raise ValueError(
            f"{where}: column {response_col!r} must be a non-empty string, got {response!r:.60}"
        )
    if prompt_key not in row:
        raise ValueError(f"{where}: column {prompt_key!r}: missing (columns there: {sorted(row)})")
    prompt = check_prompt(row[prompt_key], f"{where}: column {prompt_key!r}")
    if isinstance(prompt, str):
        return [Segment(prompt, False, special_tokens=True), Segment(response, True, eos=True)]
    messages = [*prompt, {"role": "assistant", "content": response}]
    return chat_segments(tokenizer, messages, f"{where}: column {prompt_key!r}")


# ---------------------------------------------------------------------------- dataset
class SFTDataset:
    """Examples for SFT, read, checked and tokenized up front.

    Args:
        paths: one data file / saved-dataset directory, or a list of them.
        tokenizer: the model's tokenizer (a pad or EOS token to pad with; a chat template for
            message prompts).
        prompt_key, response_key, messages_key, response_from_ground_truth: the layout (see
            the module docstring).
        max_length: the most tokens per example; None = no limit.
        truncation: for longer examples: ``"error"`` (raise, naming the row), ``"right"`` (cut
            the end) or ``"left"`` (cut the start). An example left with no trained token is
            dropped (counted in ``stats["dropped"]``).

    Attributes:
        examples: ``(input_ids, loss_mask)`` per example: lists of ints and bools, the mask
            True at tokens the loss is on (never the first token, which nothing predicts).
        stats: ``{"rows", "truncated", "dropped", "examples", "loss_tokens"}``.

    Raises:
        ValueError: bad arguments, or bad input naming the file, the row and the column.
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        response_key: str = "response",
        messages_key: str = "messages",
        response_from_ground_truth: bool = False,
        max_length: int | None = None,
        truncation: str = "error",
    ) -> None:
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {list(TRUNCATIONS)}, got {truncation!r}")
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be >= 2 or None, got {max_length}")
        if isinstance(paths, str | Path):
            paths = [paths]
        if not paths:
            raise ValueError("no data files given")
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        if pad is None or tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer needs an eos token (the end of a plain-text response)")
        self.pad_token_id = int(pad)
        special = set(tokenizer.all_special_ids)

        rows: list[list[Segment]] = []
        where: list[str] = []
        for path in paths:
            for i, raw in enumerate(read_records(path)):
                at = f"{path}: row {i}"
                rows.append(
                    row_segments(
                        raw, tokenizer, at, prompt_key=prompt_key, response_key=response_key,
                        messages_key=messages_key,
                        response_from_ground_truth=response_from_ground_truth,
                    )
                )  # fmt: skip
                where.append(at)
        if not rows:
            raise ValueError(f"no rows in {[str(p) for p in paths]}")

        # one tokenizer call per add_special_tokens setting, over every segment of every row
        flat = [seg for segs in rows for seg in segs]
        ids: list[list[int]] = [[] for _ in flat]
        for add_special in (False, True):
            picked = [j for j, g in enumerate(flat) if g.special_tokens is add_special and g.text]
            if picked:
                encoded = tokenizer([flat[j].text for j in picked], add_special_tokens=add_special)
                for j, tokens in zip(picked, encoded["input_ids"], strict=True):
                    ids[j] = list(tokens)

        self.examples: list[tuple[list[int], list[bool]]] = []
        truncated = dropped = 0
        j = 0
        for segs, at in zip(rows, where, strict=True):
            input_ids: list[int] = []
            loss_mask: list[bool] = []
            for seg in segs:
                tokens = ids[j]
                j += 1
                if not seg.trained:
                    end = 0
                elif seg.eos:
                    tokens = [*tokens, tokenizer.eos_token_id]
                    end = len(tokens)
                else:  # a chat turn: trained up to its last special token (end of turn)
                    marks = [k for k, t in enumerate(tokens) if t in special]
                    end = marks[-1] + 1 if marks else len(tokens)
                input_ids += tokens
                loss_mask += [True] * end + [False] * (len(tokens) - end)
            _drop_untrained_tail(input_ids, loss_mask)
            if max_length is not None and len(input_ids) > max_length:
                if truncation == "error":
                    raise ValueError(
                        f"{at}: the example has {len(input_ids)} tokens, more than "
                        f"data.max_length={max_length}; raise it or set data.truncation="
                        "left/right"
                    )
                cut = slice(0, max_length) if truncation == "right" else slice(-max_length, None)
                input_ids, loss_mask = input_ids[cut], loss_mask[cut]
                _drop_untrained_tail(input_ids, loss_mask)
                truncated += 1
            if loss_mask:
                loss_mask[0] = False  # the first token has no prediction
            if not any(loss_mask):
                dropped += 1
                continue
            self.examples.append((input_ids, loss_mask))
        if truncated:
            log.warning(
                "truncated %d examples to %d tokens (%s)", truncated, max_length, truncation
            )
        if dropped:
            log.warning("dropped %d examples with no response token left", dropped)
        if not self.examples:
            raise ValueError(f"no example with a response token in {[str(p) for p in paths]}")
        self.stats = {
            "rows": len(rows),
            "truncated": truncated,
            "dropped": dropped,
            "examples": len(self.examples),
            "loss_tokens": sum(sum(m) for _, m in self.examples),
        }

    def __len__(self) -> int:
        return len(self.examples)

    def collate(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Right-pad the examples at ``indices`` to their longest.

        Returns:
            ``input_ids`` (B, L) long (padded with the pad id), ``attention_mask`` (B, L) bool,
            ``loss_mask`` (B, L) bool (True at trained tokens).
        """
        if len(indices) == 0:
            raise ValueError("collate needs at least one index")
        picked = [self.examples[i] for i in indices]
        width = max(len(ids) for ids, _ in picked)
        input_ids = torch.full((len(picked), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(picked), width), dtype=torch.bool)
        loss_mask = torch.zeros((len(picked), width), dtype=torch.bool)
        for r, (ids, mask) in enumerate(picked):
            input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[r, : len(ids)] = True
            loss_mask[r, : len(ids)] = torch.tensor(mask, dtype=torch.bool)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def _drop_untrained_tail(input_ids: list[int], loss_mask: list[bool]) -> None:
    """Remove trailing context tokens in place: they predict nothing trained."""
    while loss_mask and not loss_mask[-1]:
        loss_mask.pop()
        input_ids.pop()


# ---------------------------------------------------------------------------- the loss
def sft_token_log_probs(
    model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the trained tokens of a right-padded micro-batch, differentiable.

    Columns before ``P`` (the first column where any row is trained) are only context: the
    chunked head scores columns ``P..L-1`` alone.

    Args:
        model: a causal LM (Hugging Face or PEFT-wrapped), train or eval mode as set.
        batch: ``input_ids`` (B, L), ``attention_mask`` (B, L) bool, ``loss_mask`` (B, L) bool
            (from ``SFTDataset.collate``).
    Returns:
        ``(log_probs, loss_mask)``: (B, L-P) fp32 on the model's device, and the loss mask of
        those columns (B, L-P) bool on the same device.
    """
    loss_mask = batch["loss_mask"]
    trained = loss_mask.any(0).nonzero()
    if trained.numel() == 0:
        raise ValueError("the micro-batch has no trained token (loss_mask is all False)")
    start = max(int(trained[0]), 1)
    input_ids = batch["input_ids"]
    log_probs, _ = forward_log_probs(
        model,
        {
            "input_ids": input_ids,
            "attention_mask": batch["attention_mask"],
            "responses": input_ids[:, start:],
        },
    )
    return log_probs, loss_mask[:, start:].to(log_probs.device)


# ---------------------------------------------------------------------------- the trainer
def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but CUDA is not available; use trainer.device=cpu")
    return torch.device(name)


class SFTTrainer:
    """Supervised fine-tuning from a resolved ``SFTConfig``: ``fit()`` runs it all.

    Args:
        cfg: from ``lmrl.config.sft.load_sft_config`` (resolved and validated).

    Attributes:
        run_dir: ``trainer.default_local_dir`` (config.yaml, metrics.jsonl, the exports).
        final_dir: ``run_dir / "final"``, the model path to hand to ``lmrl train``.
        total_steps: optimizer steps of the run.
        global_step: steps done.
    """

    def __init__(self, cfg: SFTConfig) -> None:
        self.cfg = cfg
        random.seed(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)
        self.device = _resolve_device(cfg.trainer.device)
        self.run_dir = Path(cfg.trainer.default_local_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.final_dir = self.run_dir / "final"
        save_config(cfg, self.run_dir / "config.yaml", command="lmrl sft")

        m = cfg.model
        self.tokenizer = load_tokenizer(m.path, m.trust_remote_code)
        self.train_data = self._dataset(cfg.data.train_files)
        self.val_data = self._dataset(cfg.data.val_files) if cfg.data.val_files else None
        d = cfg.data
        if len(self.train_data) < d.train_batch_size:
            raise ValueError(
                f"data.train_batch_size={d.train_batch_size} is larger than the training set "
                f"({len(self.train_data)} examples in {d.train_files}); lower it"
            )
        self.sampler = PromptSampler(
            len(self.train_data), d.train_batch_size, seed=d.seed, shuffle=d.shuffle
        )
        self.total_steps = cfg.trainer.total_training_steps or len(self.sampler) * (
            cfg.trainer.total_epochs
        )

        self.model = load_causal_lm(
            m.path,
            dtype=None if m.dtype == "auto" else m.dtype,
            device=self.device,
            trust_remote_code=m.trust_remote_code,
            gradient_checkpointing=m.enable_gradient_checkpointing,
        )
        if m.lora_rank > 0:
            self.model = apply_lora(self.model, m.lora_rank, m.lora_alpha, m.target_modules)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        self.global_step = 0
        # the console line is printed here (the console tracker summarizes RL metrics)
        self.console = "console" in cfg.trainer.logger
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

    def _dataset(self, files) -> SFTDataset:
        d = self.cfg.data
        return SFTDataset(
            files,
            self.tokenizer,
            prompt_key=d.prompt_key,
            response_key=d.response_key,
            messages_key=d.messages_key,
            response_from_ground_truth=d.response_from_ground_truth,
            max_length=d.max_length,
            truncation=d.truncation,
        )

    def _micro_batches(self, data: SFTDataset, indices: Sequence[int]):
        size = self.cfg.data.micro_batch_size or len(indices)
        for i in range(0, len(indices), size):
            yield data.collate(indices[i : i + size])

    # ---------------------------------------------------------------------- step
    def step(self) -> dict[str, float]:
        """One optimizer step on the next batch; returns its metrics as floats."""
        timer = StageTimer()
        with timer("step"):
            indices = self.sampler.next_batch()
            pieces = list(self._micro_batches(self.train_data, indices))
            tokens = sum(int(p["loss_mask"].sum()) for p in pieces)
            norm = AggNorm(token_count=float(tokens))
            self.model.train()
            total = torch.zeros((), device=self.device)
            for piece in pieces:
                log_probs, mask = sft_token_log_probs(self.model, piece)
                loss = agg_loss(-log_probs, mask, "token-mean", norm)
                loss.backward()
                total += loss.detach()
            lr = self.scheduler.get_last_lr()[0]
            grad_norm, stepped = clip_and_step(
                self.params, self.optimizer, self.cfg.optim.grad_clip
            )
            self.scheduler.step()
        self.global_step += 1
        metrics = to_floats({"sft/loss": total, "sft/grad_norm": grad_norm})
        metrics |= {
            "sft/lr": lr,
            "sft/tokens": float(tokens),
            "sft/skipped_steps": float(not stepped),
            "training/epoch": float(self.sampler.epoch),
        }
        return metrics | timer.metrics()

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Token-mean loss over the validation set: ``{"val/sft_loss": ...}`` ({} without one)."""
        if self.val_data is None:
            return {}
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        with eval_mode(self.model):
            for piece in self._micro_batches(self.val_data, range(len(self.val_data))):
                log_probs, mask = sft_token_log_probs(self.model, piece)
                total += agg_loss(-log_probs, mask, "token-sum").double().cpu()
                count += int(mask.sum())
        return {"val/sft_loss": float(total / max(count, 1))}

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


__all__ = [
    "SFTDataset",
    "SFTTrainer",
    "chat_segments",
    "row_segments",
    "sft_token_log_probs",
]
