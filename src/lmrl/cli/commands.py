"""The ``lmrl`` subcommands: one function per command, ``f(args) -> exit code``, each importing
its package only when it runs (`lmrl.cli.build_parser` wires them to their arguments)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmrl.errors import DataError, LmrlError, ModelError


def _refuse_non_empty(out: Path, force: bool, what: str, error: type[LmrlError]) -> None:
    """Raise ``error`` (one line) when ``out`` is a directory that holds something and
    ``force`` is off: a command's ``--out`` never writes over a model or data unasked."""
    if not force and out.is_dir() and any(out.iterdir()):
        held = sorted(p.name for p in out.iterdir())
        more = ", ..." if len(held) > 3 else ""
        raise error(
            f"{out} is not empty (it holds {', '.join(held[:3])}{more}); nothing was written: "
            f"give a new directory, or --force to write the {what} over what is there"
        )


def _tiny_model(args: argparse.Namespace) -> int:
    from lmrl.models.tiny import build_tiny_model
    from lmrl.models.tiny_vl import VL_ARCHS, build_tiny_vl_model

    out = args.out_dir
    if args.arch in VL_ARCHS and args.size != "tiny":
        raise ModelError(f"--size {args.size}: a {args.arch} model is built in one size (tiny)")
    _refuse_non_empty(out, args.force, "model", ModelError)
    if args.arch in VL_ARCHS:
        path = build_tiny_vl_model(out, arch=args.arch, seed=args.seed)
        print(f"tiny {args.arch} model and its processor written to {path}")
        print("training on image prompts is not wired yet: docs/vision.md says what is")
        return 0
    path = build_tiny_model(out, arch=args.arch, size=args.size, seed=args.seed)
    print(f"tiny {args.arch} model ({args.size}) written to {path}")
    print(TINY_NEXT.format(model=path))
    return 0


# what a from-scratch model needs next: its weights are random, so RL alone has nothing to
# reinforce (entropy ~ log V); a warm start at a from-scratch learning rate comes first, then
# the recipe of docs/learning.md (GRPO at temperature 0.7 and lr 1e-4 after a short warmup,
# Clip-Cov on up to 10% of the tokens)
TINY_NEXT = """\
next: its weights are random, so warm it up with SFT before RL (at a from-scratch learning
rate: a pretrained model's 1e-5..1e-4 leaves it near uniform). With a task of lmrl tasks:
  lmrl tasks sort --out data
  lmrl sft model.path={model} data.train_files=data/train.parquet \\
      data.response_from_ground_truth=true optim.lr=1e-3 optim.lr_scheduler=constant \\
      trainer.total_training_steps=100 trainer.default_local_dir=runs/sft
  lmrl train model.path=runs/sft/final data.train_files=data/train.parquet \\
      data.val_files=data/test.parquet data.max_response_length=8 \\
      data.train_batch_size=16 actor.ppo_mini_batch_size=16 rollout.n=8 \\
      rollout.temperature=0.7 algorithm.adv_estimator=grpo actor.optim.lr=1e-4 \\
      actor.optim.lr_warmup_steps=10 actor.policy_loss.loss_mode=clip_cov \\
      actor.policy_loss.clip_cov_ratio=0.1 model.enable_gradient_checkpointing=false \\
      trainer.total_training_steps=150 trainer.test_freq=10 trainer.default_local_dir=runs/grpo
Stop SFT while greedy validation is well above chance but far from perfect, or RL has nothing
left to learn; docs/learning.md has the study behind these settings.
(lmrl demo runs the same pipeline on the digits task.)"""


def _tasks(args: argparse.Namespace) -> int:
    from lmrl.data.tasks import TASKS, get_task, write_task

    if args.name is None:
        for name in sorted(TASKS):
            print(name)
        return 0
    get_task(args.name)  # an unknown name first
    for flag, value in (("--num-train", args.num_train), ("--num-test", args.num_test)):
        if value is not None and value < 1:
            raise DataError(f"{flag} must be >= 1, got {value} (it is a number of examples)")
    _refuse_non_empty(args.out, args.force, "task", DataError)
    paths = write_task(
        args.name, args.out, seed=args.seed, num_train=args.num_train, num_test=args.num_test
    )
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from lmrl.config import format_help, load_config

    def build(cfg):
        from lmrl.trainer import Trainer, build_run

        return Trainer(build_run(cfg), cfg.trainer)

    return _config_command(args, TRAIN_USAGE, format_help, load_config, build, _oom_plan)


def _oom_plan(cfg) -> str:
    """What `lmrl plan` says of ``cfg`` on this device, for an out-of-memory error."""
    import torch

    from lmrl.models import resolve_device
    from lmrl.trainer.memory_plan import plan_memory
    from lmrl.trainer.plan import RunPlan

    total = None
    if cfg.trainer.device != "cpu" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    try:
        run_plan = RunPlan.from_config(cfg, resolve_device(cfg.trainer.device).type)
        return plan_memory(run_plan, total).summary()
    except Exception as err:  # the plan must never hide the error it explains
        return f"(no memory plan: {err})"


def _plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, help="a YAML config (or give it first)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="memory of one device with its unit (80GiB, 80GB, 512MiB; a bare "
                   "number is refused): does it fit, and the largest micro-batch that does")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _plan(args: argparse.Namespace) -> int:
    """``lmrl plan [CONFIG] key=value ... [--device-memory SIZE] [--json]``: the run's plan
    (`lmrl.trainer.plan.RunPlan`: the stages a step runs and the choices behind them) and its
    memory plan (`lmrl.trainer.memory_plan`), from the config and the models' config.json
    alone."""
    import json

    from lmrl.models.memory import parse_size

    rest = argparse.ArgumentParser(prog="lmrl plan")
    _plan_options(rest)
    rest.add_argument("overrides", nargs="*")
    more = rest.parse_intermixed_args(args.overrides)
    for name in ("config", "device_memory"):
        if getattr(more, name) is not None:
            setattr(args, name, getattr(more, name))
    args.json = args.json or more.json
    config, overrides = args.config, list(more.overrides)
    if config is None and overrides and "=" not in overrides[0]:  # lmrl plan run.yaml k=v
        config, overrides = Path(overrides[0]), overrides[1:]
    device_memory = None
    if args.device_memory is not None:
        try:
            device_memory = parse_size(args.device_memory)
        except ValueError as err:
            raise LmrlError(f"--device-memory: {err}") from None
    from lmrl.trainer.memory_plan import load_plan_config, plan_memory
    from lmrl.trainer.plan import RunPlan

    run_plan = RunPlan.from_config(load_plan_config(config, overrides))
    plan = plan_memory(run_plan, device_memory)
    if args.json:
        print(json.dumps({**plan.to_dict(), "run": run_plan.summary().splitlines()}, indent=1))
        return 0
    from rich.console import Console

    print(run_plan.summary())
    Console(width=max(Console().width, 100)).print(plan.table())
    print(plan.summary())
    return 0


def _config_command(
    args: argparse.Namespace, usage: str, format_help, load, build, oom_plan=None
) -> int:
    """A command that runs one program on the run loop (``lmrl train``, ``lmrl sft``,
    ``lmrl train-flow``): ``--help`` prints ``usage`` and the keys; otherwise every config
    error comes before any model loads, then ``build(cfg)`` makes the program, which runs to
    its end; the exit code is 130/143 when a signal stopped it (saved, resumable). The run
    directory is locked from before the build to the command's end (`lmrl.run.lock`): a
    second command into it, or one into a sweep's folder, is refused in one line. An
    out-of-memory error is one line that quotes ``oom_plan(cfg)`` (`lmrl plan`'s summary)."""
    import logging

    import torch

    from lmrl.logging.configure import configure_logging
    from lmrl.run.lock import RunDirLock, refuse_sweep_folder
    from lmrl.run.resume import check_run_dir

    if args.help:
        print(usage)
        print(format_help())
        return 0
    configure_logging(logging.INFO)
    cfg = load(args.config, args.overrides)
    run_dir = Path(cfg.trainer.default_local_dir)
    check_run_dir(run_dir)  # a file or an unwritable place: named before it is locked
    refuse_sweep_folder(run_dir, f"lmrl {args.command}")
    try:
        with RunDirLock(run_dir):
            program = build(cfg)
            program.fit()
    except torch.OutOfMemoryError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "out of memory"
        plan = f"; {oom_plan(cfg)}; `lmrl plan` with the same keys shows every phase" if (
            oom_plan is not None) else ""  # fmt: skip
        raise LmrlError(f"out of memory: {first}{plan}") from err
    for line in program.summary() if program.exit_code == 0 else []:
        print(line)
    print(f"run directory: {program.run_dir}")
    if program.exit_code == 0 and (program.run_dir / "final").is_dir():
        print(f"model: {program.run_dir / 'final'}")
    return program.exit_code


def _sft(args: argparse.Namespace) -> int:
    from lmrl.config.sft import format_sft_help, load_sft_config

    def build(cfg):
        from lmrl.trainer.sft import SFTTrainer, build_sft

        return SFTTrainer(build_sft(cfg))

    usage = (
        "usage: lmrl sft [--config FILE.yaml] key=value ...\n\n"
        "Supervised fine-tuning (the warm start before RL). Its output directory "
        "RUN_DIR/final is a\nmodel path for `lmrl train model.path=...`. The keys, their "
        "defaults and docs follow.\n"
    )
    return _config_command(args, usage, format_sft_help, load_sft_config, build)


def _train_flow(args: argparse.Namespace) -> int:
    from lmrl.config.flow import format_flow_help, load_flow_config

    def build(cfg):
        from lmrl.trainer.flow import FlowTrainer, build_flow

        return FlowTrainer(build_flow(cfg))

    usage = (
        "usage: lmrl train-flow [--config FILE.yaml] key=value ...\n\n"
        "Flow-GRPO: RL of a flow-matching image model. model.path: a diffusers\n"
        "StableDiffusion3Pipeline directory (SD3, SD3.5; text prompts from Flow-GRPO's train.txt or\n"
        "train_metadata.jsonl), or lmrl's small image model written by `lmrl pretrain-flow` or\n"
        "`lmrl demo --task flow` (data: `lmrl tasks shapes`). The keys, their defaults and docs "
        "follow.\n"
    )
    return _config_command(args, usage, format_flow_help, load_flow_config, build)


def _pretrain_flow(args: argparse.Namespace) -> int:
    import logging

    from lmrl.logging.configure import configure_logging

    configure_logging(logging.INFO)
    if not args.images.is_file():
        raise LmrlError(
            f"{args.images}: no such file (write one with `lmrl tasks shapes --out DIR`: "
            "DIR/images.parquet)"
        )
    import math

    if args.steps < 1:
        raise LmrlError(f"--steps must be >= 1, got {args.steps}")
    if args.batch_size < 1:
        raise LmrlError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise LmrlError(f"--lr must be a number > 0, got {args.lr}")
    if not 0 <= args.caption_noise <= 1:
        raise LmrlError(f"--caption-noise must be in [0, 1], got {args.caption_noise}")
    _refuse_non_empty(args.out, args.force, "model", ModelError)
    from lmrl.flow.matching import pretrain_image_flow

    _, losses = pretrain_image_flow(
        args.images, args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        seed=args.seed, caption_noise=args.caption_noise, log_every=max(1, args.steps // 10),
    )  # fmt: skip
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; model: {args.out}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    """``lmrl sweep [CONFIG] key=value ... --grid k=v1,v2 ...``: short trials of every grid
    point (or ``--samples N`` random ones), ranked, the best ``lmrl train`` command printed
    (`lmrl.sweep`)."""
    import logging
    import time

    from lmrl.logging.configure import configure_logging

    configure_logging(logging.INFO if args.backend == "local" else logging.WARNING)
    config, overrides = args.config, list(args.overrides)
    if config is None and overrides and "=" not in overrides[0]:  # lmrl sweep run.yaml k=v
        config, overrides = Path(overrides[0]), overrides[1:]
    out = args.out or Path("sweeps") / time.strftime("sweep-%Y%m%d-%H%M%S")
    if args.cpus_per_trial < 1 or args.gpus_per_trial < 0:
        raise LmrlError("--cpus-per-trial must be >= 1 and --gpus-per-trial >= 0")
    from lmrl.sweep import format_table, plan_sweep, records_on_disk, run_sweep, table_rows

    sweep = plan_sweep(
        config, overrides, args.grid or [], out=out, samples=args.samples, steps=args.steps,
        test_freq=args.test_freq, eta=args.eta, metric=args.metric, flat=args.flat,
        seed=args.seed,
    )  # fmt: skip
    kept = records_on_disk(sweep)
    again = f", {len(kept)} of them resumed or kept from {out}" if kept else ""
    print(f"lmrl sweep: {len(sweep.trials)} trials of {sweep.steps} steps ({args.backend}), "
          f"validated every {sweep.test_freq}{again}; results in {out}", flush=True)  # fmt: skip
    runner = None  # one after another, here
    if args.backend == "ray":
        import functools

        from lmrl.sweep.tune import run_ray

        runner = functools.partial(run_ray, cpus_per_trial=args.cpus_per_trial,
                                   gpus_per_trial=args.gpus_per_trial)  # fmt: skip
    records, paths = run_sweep(sweep, runner)
    print(format_table(table_rows(sweep, records)))
    print(f"table: {paths['csv']} ({paths['table'].name}); plot: {paths['plot']}")
    if paths["stopped_by"]:
        from lmrl.run.signals import EXIT_CODES

        same = "the same command" + (f" with --out {out}" if args.out is None else "")
        print(f"{paths['stopped_by']}: the sweep stopped (the running trials saved); run {same} "
              "to resume it")  # fmt: skip
        return EXIT_CODES.get(paths["stopped_by"], 130)
    if paths["best"] is None:
        print("no trial completed: nothing to recommend")
        return 1
    print(f"best: {paths['best']}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from lmrl.logging.plot import plot_run

    path = plot_run(args.run_dir, args.out, smooth=args.smooth)
    print(f"plot written to {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """``lmrl demo``: 0 when it finished; 130/143 when a signal stopped one of its runs (its
    checkpoint saved), said in one line, the demo's next stages not started."""
    import logging

    from lmrl.demos.folder import DemoStopped
    from lmrl.logging.configure import configure_logging

    configure_logging(logging.WARNING)
    try:
        return _run_demo(args)
    except DemoStopped as stopped:
        print(f"lmrl demo: {stopped}", file=sys.stderr, flush=True)
        return stopped.exit_code


def _run_demo(args: argparse.Namespace) -> int:
    if args.task == "flow":
        from lmrl.demos.flow import run_flow_demo

        if args.no_tool:
            raise LmrlError("--no-tool is for --task search (the flow demo uses no tool)")
        run_flow_demo(args.out if args.out is not None else Path("lmrl-demo-flow"),
                      seed=args.seed, fast=args.fast)  # fmt: skip
        return 0
    if args.task == "search":
        from lmrl.demos.search import run_search_demo

        out = args.out if args.out is not None else Path("lmrl-demo-search")
        run_search_demo(out, seed=args.seed, fast=args.fast, search=not args.no_tool)
        return 0
    from lmrl.demos.digits import run_demo

    if args.no_tool:
        raise LmrlError("--no-tool is for --task search (the digits demo uses no tool)")
    run_demo(args.out if args.out is not None else Path("lmrl-demo"), seed=args.seed,
             fast=args.fast)  # fmt: skip
    return 0


def _eval(args: argparse.Namespace) -> int:
    import json
    import logging

    from lmrl.config import load_config
    from lmrl.errors import CheckpointError
    from lmrl.logging.configure import configure_logging
    from lmrl.run.checkpoint import scan_checkpoints
    from lmrl.run.resume import run_owner, unloadable

    configure_logging(logging.INFO)
    path = args.path
    run_dir = path if (path / "config.yaml").exists() else path.parent
    owner = run_owner(run_dir) if (run_dir / "config.yaml").exists() else None
    if owner not in (None, "lmrl train", "lmrl train-flow"):
        raise CheckpointError(
            f"{run_dir} was made by `{owner}`; `lmrl eval` evaluates checkpoints of `lmrl train` "
            "and `lmrl train-flow`"
        )
    if run_dir == path:
        checkpoint, skipped = scan_checkpoints(path)
        if checkpoint is None and skipped:
            raise CheckpointError(f"{path}: no checkpoint can be read ({unloadable(skipped)})")
        for skipped_path, problem in skipped:
            logging.getLogger("lmrl.trainer").warning(
                "skipping checkpoint %s: %s", skipped_path, problem
            )
    else:
        checkpoint = path
    if checkpoint is None or not (checkpoint.parent / "config.yaml").exists():
        raise CheckpointError(
            f"{path} is neither a run directory with a checkpoint nor a checkpoint "
            "(global_step_N) inside one"
        )
    if owner == "lmrl train-flow":  # an image run: its images scored by any reward
        from lmrl.config.flow import load_flow_config
        from lmrl.run.lock import RunDirLock
        from lmrl.trainer.flow_report import evaluate_flow

        cfg = load_flow_config(
            checkpoint.parent / "config.yaml",
            [f"trainer.default_local_dir={checkpoint.parent}", *args.overrides],
        )
        with RunDirLock(checkpoint.parent):  # it writes the run's eval/: one owner at a time
            print(json.dumps(evaluate_flow(cfg, checkpoint), indent=1))
        return 0
    # a text run's eval writes nothing: it may read a run that is training
    cfg = load_config(
        checkpoint.parent / "config.yaml",
        [f"trainer.resume_mode={checkpoint}", *args.overrides],
    )
    from lmrl.trainer import evaluate

    metrics = evaluate(cfg, checkpoint)
    print(json.dumps({"checkpoint": str(checkpoint), **metrics}, indent=1))
    return 0


def _servable(path: Path):
    """(model directory, a loader of checkpoint weights over it or None, what it is): a model
    directory; a run directory's ``final`` model, else its latest checkpoint; a checkpoint."""
    from lmrl.errors import CheckpointError

    if (path / "config.json").is_file():
        return str(path), None, f"the model {path}"
    run_dir = path if (path / "config.yaml").is_file() else path.parent
    if not (run_dir / "config.yaml").is_file():
        if path.exists():
            raise CheckpointError(
                f"{path} is neither a model directory (config.json), a run directory "
                "(config.yaml) nor a checkpoint (global_step_N) inside one"
            )
        return str(path), None, f"the model {path}"  # a hub id, or the loader's own error
    if run_dir == path and (path / "final" / "config.json").is_file():
        return str(path / "final"), None, f"the final model of the run {path}"
    from lmrl.run.checkpoint import latest_checkpoint, load_model_state
    from lmrl.run.resume import run_owner

    owner = run_owner(run_dir)
    if owner not in (None, "lmrl train"):
        raise CheckpointError(
            f"{run_dir} was made by `{owner}` and has no final model yet: `lmrl serve` takes "
            "a final model (RUN_DIR/final) or a checkpoint of `lmrl train`"
        )
    checkpoint = latest_checkpoint(path) if run_dir == path else path
    weights = checkpoint / "actor.safetensors" if checkpoint is not None else None
    if weights is None or not weights.is_file():
        raise CheckpointError(
            f"{path}: no final model and no checkpoint with the actor's weights "
            "(global_step_N/actor.safetensors)"
        )
    import yaml

    model = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("model") or {}
    if (model.get("lora_rank") or 0) > 0:
        raise CheckpointError(
            f"{checkpoint} holds LoRA weights: serve the run's final model (RUN_DIR/final, "
            "the adapter merged), written when the run ends"
        )
    if not model.get("path"):
        raise CheckpointError(f"{run_dir / 'config.yaml'} names no model.path")
    load = lambda m: load_model_state(m, weights)  # noqa: E731
    return str(model["path"]), load, f"the checkpoint {checkpoint}"


def _serve(args: argparse.Namespace) -> int:
    import logging
    import os
    import signal
    import threading

    from lmrl.logging.configure import configure_logging

    configure_logging(logging.WARNING)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401

        from lmrl.serve import load_endpoint, serve_in_thread
    except ImportError as err:
        raise LmrlError(
            f"lmrl serve needs the serve extra ({err.name} is missing): pip install 'lmrl[serve]'"
        ) from None
    model_path, load_weights, what = _servable(args.path)
    endpoint = load_endpoint(
        model_path, load_weights=load_weights, device=args.device, dtype=args.dtype,
        model_name=args.model_name or args.path.resolve().name,
        context_length=args.max_model_len, seed=args.seed,
    )  # fmt: skip
    episode = endpoint.open_episode("serve", key=args.api_key or os.environ.get("LMRL_API_KEY"))
    try:
        running = serve_in_thread(endpoint, args.host, args.port)
    except OSError as err:
        raise LmrlError(f"{err}; give another --host/--port (--port 0: any free one)") from None
    stop = threading.Event()
    handlers = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    print(f"serving {what} as model {endpoint.model_name!r} (Ctrl-C stops)")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"listening on {args.host}: whoever reaches this machine with the key may use it")
    print(f"OPENAI_BASE_URL={running.base_url}")
    print(f"OPENAI_API_KEY={episode.key}", flush=True)
    try:
        while not stop.wait(0.2) and running.thread.is_alive():
            pass
    finally:
        running.close()
        for s, handler in handlers.items():
            signal.signal(s, handler)
    print("stopped", flush=True)
    return 0


TRAIN_USAGE = """usage: lmrl train [--config FILE.yaml] key=value ...

Train a policy with RL. Keys in lmrl's layout (actor.clip_ratio=0.2) or verl's
(actor_rollout_ref.actor.clip_ratio=0.2). The keys, their defaults and docs follow.
"""
