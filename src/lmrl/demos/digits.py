"""``lmrl demo``: a tiny model learns to reverse digits on the CPU, and RL does the learning.

The pipeline a user runs on real models, at toy scale, in about a minute on 2 CPU cores
(``docs/demo.md`` has the times and accuracies measured per seed):

    1 model   a ~2M-parameter Qwen2 with the byte-level tokenizer (``lmrl.models.tiny``)
    2 data    the ``digits`` task: ``reverse 48213`` -> ``31284`` (4-6 digits), 128
              validation prompts
    3 SFT     a short warm start that stops while the model is still mostly wrong
    4 GRPO    from the SFT model: 16 prompts x 8 samples per step, greedy validation
    5 plot    ``rl/plot.png``, the final checkpoint, and a summary (``demo.json``)

Choices (``docs/demo.md`` has the runs behind them):

- The warm start must leave the work to RL (the bar: exact-match accuracy at most 0.5 after
  SFT, at least 0.95 after RL). SFT accuracy rises from ~0 to ~1 within a few dozen steps, at
  a step that varies with the seed, so a loss threshold alone lands anywhere in that rise.
  Once the training loss is below ``SFT_CHECK_LOSS`` the demo measures greedy exact-match
  accuracy on the validation prompts after every step (the prompts and decoding RL validates
  with) and stops at the first step that reaches ``sft_target_acc`` (0.4); a step that
  overshoots ``SFT_MAX_ACC`` is undone (the previous check's weights are exported). A warm
  start stopped at 0.3 was too near the margin: on seed 2 GRPO learned the 4- and 5-digit
  numbers and stayed at ~0.7 for 250 steps, the last digit of most 6-digit answers wrong in
  every sample.
- The warm start is trained on 2-8 digit numbers (``SFT_LENGTHS``; none of them a
  validation prompt), RL on the task's 4-6. Numbers of more lengths make SFT learn to copy
  by relative position; a warm start on 4-6 digits alone can leave per-length shortcuts
  (right for some lengths, wrong for one digit of another) that GRPO's partial credit does
  not repair, since it cannot build a circuit the warm start lacks.
- GRPO: learning rate 3e-4 after a 10-step linear warmup (the fragile warm-started model
  does not survive higher rates, or no warmup); sampling temperature 0.7 (at 1.0 the warm
  start's samples score far below its greedy answers; see ``docs/results/learning.md``);
  partial-credit reward (the ``digits`` scorer); no KL term (no reference forward); one
  optimizer step per batch (the old log-probs are the update's own forward); no gradient
  checkpointing; in-process scoring; one checkpoint at the end. It stops once validation
  accuracy (every ``test_freq`` steps) reaches ``target_acc``, since more steps only cost
  time; ``rl_steps`` is the cap.
- Prompts are chat messages, templated (ChatML, ~32 tokens). Plain-string prompts
  (``prompt_format="{}="``) are rendered by the same rule as every run's
  (``data.prompt_template``, the chat template by default: the same tokens); kept verbatim
  (15 tokens) they halved the cost of a step, but both SFT and GRPO learned from them more
  slowly.
- ``out_dir`` starts fresh (`demo_dir`): a previous demo there, recognised by its
  ``demo.json`` (written first, so an interrupted demo is recognised too), is replaced; any
  other non-empty directory is refused before any work, and nothing in it is touched.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lmrl.demos.folder import DEMO_KEY, SUMMARY_FILE, DemoStopped, demo_dir

log = logging.getLogger("lmrl.demo")

TASK = "digits"
ACC_KEY = f"val/{TASK}/acc"

SFT_CHECK_LOSS = 1.0  # measure accuracy after every step once the training loss is below this
SFT_MAX_ACC = 0.5  # a check above this rolls back to the previous check's weights
SFT_LENGTHS = (2, 8)  # digits of the warm start's numbers (the task's are 4-6)


def _yaml_str(value: Any) -> str:
    """A path as a ``key=value`` override value: JSON-quoted, so any character survives."""
    return json.dumps(str(value))


def write_demo_data(
    out_dir: Path, seed: int, num_train: int, num_val: int, prompt_format: str | None
) -> dict[str, Path]:
    """The ``digits`` task (4-6 digits) and the warm start's examples (2-8 digits).

    Returns:
        ``{"train", "test", "sft"}``: RL's training split, the validation split, and
        ``num_train`` SFT examples of ``SFT_LENGTHS`` digits, none of them a validation prompt
        (see the module docstring).
    """
    return write_task_data(
        TASK, out_dir, seed, num_train, num_val, prompt_format, warm_start_options(TASK)
    )


def warm_start_options(task: str) -> dict[str, Any]:
    """The generator options of a task's SFT examples: ``digits`` gets numbers of
    ``SFT_LENGTHS`` digits (see the module docstring), other tasks their own defaults."""
    if task == "digits":
        return {"min_len": SFT_LENGTHS[0], "max_len": SFT_LENGTHS[1]}
    return {}


def write_task_data(
    task: str,
    out_dir: Path,
    seed: int,
    num_train: int,
    num_val: int,
    prompt_format: str | None = None,
    sft_options: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """A built-in task's RL splits and a warm-start set for SFT.

    Args:
        task: a key of ``lmrl.data.TASKS``.
        out_dir: where ``train.parquet``, ``test.parquet`` and ``sft.parquet`` go.
        seed: the RL splits' seed; the warm start's examples use ``seed + 1``.
        num_train, num_val: RL's training and validation sizes; SFT gets ``num_train`` too.
        prompt_format: see ``lmrl.data.tasks.generate_rows``.
        sft_options: the generator's options for the warm start only (e.g. more lengths).

    Returns:
        ``{"train", "test", "sft"}``; no SFT example is a validation prompt.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmrl.data.tasks import generate_rows, write_task

    paths = write_task(
        task, out_dir, seed=seed, num_train=num_train, num_test=num_val,
        prompt_format=prompt_format,
    )  # fmt: skip
    held_out = {_key(row) for row in pq.read_table(paths["test"]).to_pylist()}
    rows = generate_rows(
        task, num_train=num_train + num_val, num_test=0, seed=seed + 1,
        prompt_format=prompt_format, **(sft_options or {}),
    )["train"]  # fmt: skip
    rows = [row for row in rows if _key(row) not in held_out][:num_train]
    paths["sft"] = Path(out_dir) / "sft.parquet"
    pq.write_table(pa.Table.from_pylist(rows), paths["sft"])
    return paths


def _key(row: dict[str, Any]) -> str:
    return json.dumps(row["prompt"], sort_keys=True)


class GreedyAccuracy:
    """Exact-match accuracy of greedy answers to the validation prompts, for any model.

    Each answer is scored by the built-in scorer of its row's ``data_source`` (its ``acc``).

    Args:
        model: the causal LM (evaluated in place, its train/eval mode restored).
        tokenizer: its tokenizer.
        val_file: the validation parquet.
        max_new_tokens: the most tokens per answer (the RL run's ``max_response_length``).
        max_prompt_length: as in the RL run.
        agent: keyword arguments of `lmrl.rollout.agent.AgentLoop` (``tools``, ``max_turns``...)
            to answer with tools, in turns; None = one plain generation.
    """

    def __init__(
        self,
        model,
        tokenizer,
        val_file: Path,
        max_new_tokens: int,
        max_prompt_length: int,
        agent: dict[str, Any] | None = None,
    ) -> None:
        from lmrl.data import RLDataset
        from lmrl.rewards.scorers import default_compute_score
        from lmrl.rollout import build_engine
        from lmrl.rollout.agent import AgentLoop

        self.model, self.tokenizer, self.score = model, tokenizer, default_compute_score
        self.data = RLDataset(val_file, tokenizer, max_prompt_length=max_prompt_length)
        self.prompts = self.data.get_batch(list(range(len(self.data))))
        self.engine = build_engine("hf", model, tokenizer)
        if agent is not None:
            self.engine = AgentLoop(self.engine, tokenizer=tokenizer, **agent)
        self.max_new_tokens = max_new_tokens

    @torch.no_grad()
    def __call__(self) -> float:
        """Fraction of validation prompts answered exactly."""
        from lmrl.trainer.sft_score import greedy_texts

        texts, out = greedy_texts(
            self.model, self.engine, self.tokenizer, self.prompts, self.max_new_tokens
        )
        right = 0.0
        for text, source, truth, extra in zip(
            texts, out["data_source"], out["ground_truth"], out["extra_info"], strict=True
        ):
            right += self.score(source, text, truth, extra)["acc"]
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
    check_loss: float = SFT_CHECK_LOSS,
    max_length: int = 64,
    agent: dict[str, Any] | None = None,
    check_every: int = 1,
    max_acc: float = SFT_MAX_ACC,
    mask_pattern: str | None = None,
    stop_below: float | None = None,
) -> dict[str, Any]:
    """The warm start: SFT on ``data["sft"]`` until greedy accuracy on ``data["test"]``
    reaches ``target_acc`` (or ``max_steps``).

    Accuracy is measured after every ``check_every``-th step once the training loss is below
    ``check_loss``; a check whose accuracy exceeds ``max_acc`` is undone (the weights of the
    previous check are exported instead). ``data["sft"]`` holds verl RL rows (the response is the ground
    truth) or ``prompt``/``response`` rows; ``agent`` makes the accuracy check answer in turns
    with tools (see `GreedyAccuracy`); ``max_length`` bounds an example's tokens;
    ``mask_pattern`` leaves what it matches untrained (``data.mask_pattern``). With
    ``stop_below`` the run goes the other way: it stops at the first check whose accuracy is
    at most ``stop_below`` (``target_acc`` and ``max_acc`` unused).

    Returns:
        ``{"dir", "model", "steps", "acc", "seconds", "rolled_back"}``; ``model`` is the
        directory RL starts from.
    """
    from lmrl.config.sft import load_sft_config
    from lmrl.trainer.sft import SFTTrainer, build_sft

    from_truth = _has_ground_truth_only(data["sft"])
    # a validation loss needs the validation rows in the SFT file's layout
    val = [f"data.val_files={_yaml_str(data['test'])}"] if from_truth else []
    cfg = load_sft_config(
        None,
        [
            f"model.path={_yaml_str(model_dir)}",
            f"data.train_files={_yaml_str(data['sft'])}",
            *val,
            f"data.response_from_ground_truth={str(from_truth).lower()}",
            f"data.max_length={max_length}",
            *([f"data.mask_pattern={_yaml_str(mask_pattern)}"] if mask_pattern else []),
            f"data.train_batch_size={batch_size}",
            f"optim.lr={lr}",
            "optim.lr_warmup_steps_ratio=0",
            "optim.lr_scheduler=constant",
            "model.enable_gradient_checkpointing=false",
            f"trainer.total_training_steps={max_steps}",
            f"trainer.default_local_dir={_yaml_str(run_dir)}",
            f"trainer.logger={'[console]' if console else '[]'}",
            "trainer.device=cpu",
            f"trainer.seed={seed}",
        ],
    )
    start = time.perf_counter()
    trainer = SFTTrainer(build_sft(cfg))
    accuracy = GreedyAccuracy(
        trainer.model, trainer.tokenizer, data["test"], max_new_tokens, 64, agent=agent
    )
    state: dict[str, Any] = {"stopped": False, "acc": None, "previous": None, "rolled_back": False,
                             "checked": None}  # fmt: skip

    def stop(step: int, metrics: dict[str, float]) -> bool:
        if metrics["sft/loss"] >= check_loss or step % check_every:
            return False
        acc = metrics["sft/val_acc"] = accuracy()
        state["checked"] = step
        if stop_below is not None:
            state["acc"], state["stopped"] = acc, acc <= stop_below
            if console:
                print(f"step {step}: greedy validation accuracy {acc:.3f}", flush=True)
            return state["stopped"]
        if acc > max_acc and state["previous"] is not None:
            trainer.model.load_state_dict(state["previous"])  # the last check's weights
            state["rolled_back"] = True
            log.warning("sft: accuracy %.3f is over %.2f; rolled back to the last check", acc,
                        max_acc)  # fmt: skip
            acc = state["acc"]
        else:
            state["acc"] = acc
            state["previous"] = {
                k: v.detach().clone() for k, v in trainer.model.state_dict().items()
            }
        state["stopped"] = state["rolled_back"] or acc >= target_acc
        if console:
            print(f"step {step}: greedy validation accuracy {acc:.3f}", flush=True)
        return state["stopped"]

    trainer.fit(on_step_end=stop)
    DemoStopped.check(trainer, "SFT")
    if state["checked"] != trainer.global_step:  # the exported model was not measured yet
        state["acc"] = accuracy()
    return {
        "dir": trainer.run_dir,
        "model": trainer.final_dir,
        "steps": trainer.global_step,
        "acc": state["acc"],
        "seconds": time.perf_counter() - start,
        "rolled_back": state["rolled_back"],
    }


def _has_ground_truth_only(path: Path) -> bool:
    """The SFT file is verl RL rows without a ``response`` column (train on the ground truth)."""
    import pyarrow.parquet as pq

    return "response" not in pq.read_schema(path).names


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
    warmup_steps: int = 0,
    overrides: Sequence[str] = (),
    task: str = TASK,
) -> dict[str, Any]:
    """GRPO from ``model_dir`` until validation accuracy reaches ``target_acc`` or ``steps``:
    the ``fit`` that ``lmrl train`` runs, stopped early by its ``on_step_end``.

    Validation runs before the first step, every ``test_freq`` steps and after the last; the
    checkpoint is written once, at the end, with ``final/``. ``overrides`` are extra
    ``lmrl train`` keys (another estimator, a KL, ...); ``task`` names the data source whose
    ``val/<task>/acc`` is the accuracy.

    Returns:
        ``{"dir", "checkpoint", "steps", "acc_before", "acc", "seconds", "history"}``.
    """
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    cfg = load_config(
        None,
        [
            f"model.path={_yaml_str(model_dir)}",
            f"data.train_files={_yaml_str(data['train'])}",
            f"data.val_files={_yaml_str(data['test'])}",
            "data.max_prompt_length=64",
            f"data.max_response_length={max_response_length}",
            f"data.train_batch_size={prompts_per_step}",
            f"rollout.n={n}",
            "algorithm.adv_estimator=grpo",
            f"actor.ppo_mini_batch_size={prompts_per_step}",
            f"actor.optim.lr={lr}",
            f"actor.optim.lr_warmup_steps={warmup_steps}",
            "actor.use_kl_loss=false",
            "model.enable_gradient_checkpointing=false",
            "reward.num_workers=0",
            f"trainer.total_training_steps={steps}",
            f"trainer.test_freq={test_freq}",
            "trainer.save_freq=-1",
            "trainer.val_before_train=true",
            "trainer.resume_mode=disable",
            f"trainer.logger={'[console]' if console else '[]'}",
            f"trainer.default_local_dir={_yaml_str(run_dir)}",
            "trainer.device=cpu",
            f"trainer.seed={seed}",
            "trainer.project_name=lmrl-demo",
            f"trainer.experiment_name={task}-grpo",
            *overrides,
        ],
    )
    start = time.perf_counter()
    trainer = Trainer(build_run(cfg), cfg.trainer)
    acc_key = f"val/{task}/acc"

    def reached(step: int, metrics: dict[str, float]) -> bool:
        return metrics.get(acc_key, -math.inf) >= target_acc

    history = trainer.fit(on_step_end=reached)
    DemoStopped.check(trainer, "GRPO")
    validations = trainer.validations
    return {
        "dir": trainer.run_dir,
        "checkpoint": trainer.run_dir / f"global_step_{trainer.global_step}",
        "steps": trainer.global_step,
        "acc_before": validations[0][acc_key],
        "acc": validations[max(validations)][acc_key],
        "seconds": time.perf_counter() - start,
        "history": history,
    }


def run_demo(
    out_dir: str | Path = "lmrl-demo",
    *,
    seed: int = 0,
    fast: bool = False,
    sft_target_acc: float = 0.4,
    sft_max_steps: int = 400,
    sft_lr: float = 1e-3,
    rl_steps: int = 250,
    rl_lr: float = 3e-4,
    rl_warmup_steps: int = 10,
    rl_temperature: float = 0.7,
    target_acc: float = 0.95,
    test_freq: int = 5,
    num_train: int = 10_000,
    num_val: int = 128,
    prompt_format: str | None = None,
    rl_overrides: Sequence[str] = (),
    console: bool = True,
) -> dict[str, Any]:
    """Run the demo: tiny model, digits data, SFT warm start, GRPO, plot; print a summary.

    Args:
        out_dir: where everything goes (started fresh, see the module docstring).
        seed: the seed of the model, the data and both trainers.
        fast: a smoke run in seconds (a ~0.1M-parameter model, 3 SFT and 2 GRPO steps); it
            shows the pipeline works, not that the model learns.
        sft_target_acc: SFT stops at the first step whose greedy validation accuracy
            reaches this.
        sft_max_steps: SFT's cap on optimizer steps (batches of 64).
        sft_lr: SFT's learning rate (constant, no warmup).
        rl_steps: GRPO's cap on steps.
        rl_lr: GRPO's peak learning rate (constant after the warmup).
        rl_warmup_steps: GRPO's linear learning-rate warmup.
        rl_temperature: GRPO's sampling temperature (validation is greedy).
        target_acc: GRPO stops once validation accuracy reaches this.
        test_freq: validate every this many GRPO steps.
        num_train, num_val: task sizes (every validation prompt is validated on).
        prompt_format: None for chat-message prompts (templated), or a string with one ``{}``
            for plain-string prompts (see ``lmrl.data.tasks.generate_rows``; rendered with the
            chat template too, ``data.prompt_template``'s default).
        rl_overrides: extra ``lmrl train`` ``key=value`` overrides for the GRPO stage.
        console: print the trainers' progress lines.

    Returns:
        The summary (also written to ``out_dir/demo.json``): the directories, the plot, the
        final checkpoint, steps, accuracies after SFT and after RL, and seconds.
    """
    from lmrl.models.tiny import build_tiny_model

    start = time.perf_counter()
    out = Path(out_dir)
    size, batch, prompts, n, response = "small", 64, 16, 8, 8
    check_loss = SFT_CHECK_LOSS
    if fast:
        size, batch, prompts, n = "tiny", 8, 4, 4
        sft_max_steps, rl_steps, test_freq, rl_warmup_steps = 3, 2, 1, 0
        num_train, num_val = 64, 8
        sft_target_acc = target_acc = 2.0  # never reached: run the capped steps
        check_loss = math.inf  # but exercise the accuracy checks
    with demo_dir(out, TASK):
        model_dir = build_tiny_model(out / "model", arch="qwen2", size=size, seed=seed)
        data = write_demo_data(out / "data", seed, num_train, num_val, prompt_format)
        if console:
            print(f"lmrl demo: model {model_dir}, data {out / 'data'}; SFT warm start", flush=True)
        sft = run_sft(
            model_dir, data, out / "sft", seed=seed, target_acc=sft_target_acc,
            max_steps=sft_max_steps, lr=sft_lr, batch_size=batch, max_new_tokens=response,
            console=console, check_loss=check_loss,
        )  # fmt: skip
        if console:
            print(f"lmrl demo: SFT stopped at step {sft['steps']}, greedy validation accuracy "
                  f"{sft['acc']:.3f}; GRPO", flush=True)  # fmt: skip
        rl = run_rl(
            sft["model"], data, out / "rl", seed=seed, steps=rl_steps, lr=rl_lr,
            prompts_per_step=prompts, n=n, max_response_length=response, test_freq=test_freq,
            target_acc=target_acc, console=console, warmup_steps=rl_warmup_steps,
            overrides=[f"rollout.temperature={rl_temperature}", *rl_overrides],
        )  # fmt: skip
        from lmrl.logging.plot import plot_run

        plot = plot_run(rl["dir"])
        summary = {
            DEMO_KEY: TASK,
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


__all__ = [
    "GreedyAccuracy",
    "format_summary",
    "run_demo",
    "run_rl",
    "run_sft",
    "warm_start_options",
    "write_task_data",
]
