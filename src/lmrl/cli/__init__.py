"""The ``lmrl`` command line.

Each subcommand is a small function that imports its package only when it runs, so
``lmrl --help`` stays instant and a missing optional extra only affects its own command.

Exit codes: 0 done; 2 an input the user can fix (an ``lmrl.errors.LmrlError``: a config key,
a data file, a model path...), printed as one line ``lmrl <command>: error: <message>``; 130
interrupted by Ctrl-C before the command could handle it (one line, no traceback); anything
else is a bug and keeps its traceback (exit 1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmrl.cli import commands
from lmrl.errors import LmrlError


def _add_config_command(
    sub, name: str, help: str, func, keys: str = "", config: str = "a YAML config (ours or verl's)"
) -> None:
    """A command run from a config and ``key=value`` overrides; its ``--help`` lists every
    ``keys`` config key (`commands._config_command`)."""
    p = sub.add_parser(name, help=help, add_help=False)
    p.add_argument("--config", type=Path, default=None, help=config)
    p.add_argument("-h", "--help", action="store_true", help=f"list every {keys}config key")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=func)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmrl", description="Reinforcement-learning post-training of language models."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    _add_config_command(sub, "train", "train a policy with RL", commands._train)

    p = sub.add_parser(
        "plan", help="peak device memory of each phase of a run, before any weights load"
    )
    commands._plan_options(p)
    # options may follow the config and the keys: the rest is parsed again by `commands._plan`
    p.add_argument("overrides", nargs=argparse.REMAINDER, metavar="[CONFIG] key=value ...")
    p.set_defaults(func=commands._plan)

    p = sub.add_parser("eval", help="validation alone on a checkpoint")
    p.add_argument(
        "path", type=Path, help="a run directory (its latest checkpoint) or a checkpoint"
    )
    p.add_argument(
        "overrides", nargs="*", metavar="key=value",
        help="e.g. rollout.val_kwargs.n=4; an image run: reward.name=brightness",
    )  # fmt: skip
    p.set_defaults(func=commands._eval)

    p = sub.add_parser(
        "serve", help="an OpenAI-compatible endpoint over a model, a run or a checkpoint",
        description="Serve POST /v1/chat/completions, /v1/completions and GET /v1/models over "
        "a model directory, a run directory (its final model, else its latest checkpoint) or a "
        "checkpoint, until Ctrl-C or SIGTERM; prints OPENAI_BASE_URL and OPENAI_API_KEY. "
        "docs/agents.md.",
    )  # fmt: skip
    p.add_argument("path", type=Path, metavar="RUN_DIR_OR_MODEL")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000,
                   help="port (default: %(default)s; 0 = one the system picks)")  # fmt: skip
    p.add_argument("--api-key", default=None,
                   help="the key clients send (default: $LMRL_API_KEY, else a new one)")  # fmt: skip
    p.add_argument("--model-name", default=None,
                   help="the model name requests give (default: the directory's name)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens of a prompt and its completion (default: the model's)")  # fmt: skip
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1... (default: auto)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16... (default: the device's)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed of unseeded requests")
    p.set_defaults(func=commands._serve)

    _add_config_command(sub, "sft", "supervised fine-tuning (warm start)", commands._sft, "SFT ")

    _add_config_command(
        sub, "train-flow", "Flow-GRPO: RL of a flow-matching image model", commands._train_flow,
        config="a YAML config",
    )  # fmt: skip

    p = sub.add_parser(
        "pretrain-flow",
        help="pre-train an image model by flow matching (before train-flow)",
    )
    p.add_argument("images", type=Path, help="images.parquet of `lmrl tasks shapes`")
    p.add_argument("--out", type=Path, required=True, help="the model directory to write")
    p.add_argument(
        "--steps", type=int, default=400,
        help="optimizer steps (default: %(default)s, as `lmrl demo --task flow` pre-trains)",
    )  # fmt: skip
    p.add_argument(
        "--batch-size", type=int, default=64, help="images per step (default: %(default)s)"
    )
    p.add_argument(
        "--lr", type=float, default=2e-3, help="AdamW's learning rate (default: %(default)s)"
    )
    p.add_argument(
        "--seed", type=int, default=0,
        help="initialisation, batch order and caption noise (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--caption-noise", type=float, default=0.0,
        help="probability that each attribute of an image's caption is redrawn at random, as "
        "web captions are loose: a model that draws well but follows its prompts in part "
        "(default: %(default)s; `lmrl demo --task flow` uses 0.25)",
    )  # fmt: skip
    p.add_argument("--force", action="store_true", help="write into --out even if it is not empty")
    p.set_defaults(func=commands._pretrain_flow)

    p = sub.add_parser("tiny-model", help="build a small model and tokenizer locally")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--arch", default="qwen2",
                   choices=["qwen2", "llama", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"],
                   help="qwen2_vl, qwen2_5_vl, qwen3_vl: a vision-language model with its "
                   "processor")  # fmt: skip
    p.add_argument("--size", default="tiny", help="tiny (~100k), small (~2M), base (~20M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--force", action="store_true", help="write into OUT_DIR even if it is not empty"
    )
    p.set_defaults(func=commands._tiny_model)

    p = sub.add_parser("tasks", help="list the built-in tasks, or write one as parquet")
    p.add_argument("name", nargs="?", help="task name; omit to list them")
    p.add_argument("--out", type=Path, default=Path("data"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-train", type=int, default=None)
    p.add_argument("--num-test", type=int, default=None)
    p.add_argument("--force", action="store_true", help="write into --out even if it is not empty")
    p.set_defaults(func=commands._tasks)

    p = sub.add_parser(
        "sweep", help="short trials of a grid or random search over config keys, ranked",
        description="Short RL trials (lmrl train with the base keys and each trial's) ranked "
        "by validation gain per step (train-score slope where validation is flat), hopeless "
        "ones stopped early (ASHA); writes DIR/trials.csv, trials.md, sweep.png and prints "
        "the best lmrl train command. docs/sweep.md.",
    )  # fmt: skip
    p.add_argument("--config", type=Path, default=None, help="a YAML config (or give it first)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="the base keys, as lmrl train takes them (before --grid)")  # fmt: skip
    p.add_argument("--grid", nargs="+", action="extend", metavar="KEY=V1,V2",
                   help="a swept key and its values (several keys: the grid of all points); "
                   "KEY=log:1e-6..1e-3 draws log-uniformly with --samples")  # fmt: skip
    p.add_argument("--samples", type=int, default=None,
                   help="N random trials instead of the whole grid")  # fmt: skip
    p.add_argument("--steps", type=int, default=20, help="steps of each trial (default 20)")
    p.add_argument("--test-freq", type=int, default=None,
                   help="validate every this many steps (default steps // 4)")  # fmt: skip
    p.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="local: trials one after another here; ray: in parallel on Ray Tune")  # fmt: skip
    p.add_argument("--cpus-per-trial", type=int, default=1, help="Ray resources of a trial")
    p.add_argument("--gpus-per-trial", type=float, default=0.0, help="Ray resources of a trial")
    p.add_argument("--eta", type=int, default=2,
                   help="early stopping keeps the best 1/eta at each rung (default 2)")  # fmt: skip
    p.add_argument("--metric", default=None,
                   help="validation key to rank on (default: mean val/<source>/acc)")  # fmt: skip
    p.add_argument("--flat", type=float, default=0.01,
                   help="a validation change at most this large is flat: the train score's "
                   "slope then orders the trial (default 0.01)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the --samples draws")
    p.add_argument("--out", type=Path, default=None,
                   help="the sweep's folder, new or empty, or a stopped sweep's to resume it "
                   "(default sweeps/sweep-<time>)")  # fmt: skip
    p.set_defaults(func=commands._sweep)

    p = sub.add_parser("plot", help="draw a run's metrics.jsonl as a PNG (RUN_DIR/plot.png)")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory of lmrl train")
    p.add_argument("--out", type=Path, default=None, help="image path (default RUN_DIR/plot.png)")
    p.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1); 0 = raw")
    p.set_defaults(func=commands._plot)

    p = sub.add_parser(
        "demo",
        help="tiny model, SFT warm start, then GRPO on the CPU: digits (~1 min), "
        "--task search (~5 min) or --task flow (images, ~3 min)",
    )
    p.add_argument("--task", choices=["digits", "search", "flow"], default="digits",
                   help="digits (reverse digits), search (answer by searching a corpus, "
                   "multi-turn with the search tool) or flow (Flow-GRPO on a tiny image "
                   "model: shapes that match their prompt)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None,
                   help="directory of the whole demo, started fresh (default lmrl-demo, "
                   "lmrl-demo-search / lmrl-demo-flow for --task search / flow)")  # fmt: skip
    p.add_argument("--no-tool", action="store_true",
                   help="--task search with the search tool off (the ablation: stays near "
                   "chance)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the model, data and training")
    p.add_argument("--fast", action="store_true",
                   help="a smoke run in seconds: a tinier model and a few steps (learns nothing)")  # fmt: skip
    p.set_defaults(func=commands._demo)
    return parser


def tune_allocator() -> None:
    """Keep freed tensor memory in the heap instead of returning it to the OS each time.

    glibc serves large allocations (a (B, T) tensor of a step) with mmap and unmaps them on
    free, so every new tensor pays its page faults again: a quarter or more of the time of
    the advantage and loss maths at RL sizes. A threshold of 32 MB and a trim threshold of
    256 MB keep such buffers reusable. Applied by the ``lmrl`` command (a training process),
    never on import; a no-op where glibc's ``mallopt`` is missing.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return
    if mallopt is not None:
        m_trim_threshold, m_mmap_threshold = -1, -3
        mallopt(m_mmap_threshold, 32 * 1024 * 1024)
        mallopt(m_trim_threshold, 256 * 1024 * 1024)


def main(argv: list[str] | None = None) -> int:
    tune_allocator()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except LmrlError as err:
        print(f"lmrl {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # before the run loop took the signals, or a second one
        from lmrl.run.signals import StopNow

        print(f"lmrl {args.command}: interrupted", file=sys.stderr)
        return err.exit_code if isinstance(err, StopNow) else 130
