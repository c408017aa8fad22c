"""The same GRPO run in one process and on Ray worker groups: steps/s, and where a Ray step's
time goes (the work on the ranks, the dispatch around it, the collectives inside it).

Settings, each a fresh child process (``--child NAME``) on the same model, data and recipe:

    local-2t   trainer.backend=local, 2 torch threads (what a laptop run uses)
    local-1t   trainer.backend=local, 1 thread (one worker's compute, for comparison)
    ray-1      trainer.backend=ray, 1 CPU worker (1 thread)
    ray-2      trainer.backend=ray, 2 CPU workers (1 thread each, gloo DDP)

The recipe: GRPO, G=8 samples per prompt, 8 prompts per step, one update per batch (one
mini-batch, one epoch), token-mean, float32, no gradient checkpointing, ``max_new_tokens``
16, on a locally built Qwen2 (``benchmarks/vs_trl.py``'s ``MODELS``: ``small`` = hidden 512,
8 layers, 32k vocabulary, 38.9M parameters; ``tiny`` ~1M). Each child runs ``--warmup`` steps,
then ``--steps`` timed steps, one ``Trainer.step()`` at a time.

For a Ray step the child also reads, per step:

    call_s      the driver's wall time inside worker-group calls (sending the batch, the
                remote work, gathering the results)
    work_s      the ranks' own time in those calls (per call the slowest rank, summed)
    dispatch_s  call_s - work_s: what Ray adds around the work (serialization, the object
                store, scheduling, the actor calls)
    comm_s      the slowest rank's time in its gradient and metric all-reduces (gloo), a part
                of work_s

Ray's overhead per step is ``dispatch_s`` as a share of that setting's step time (the bar of
issue 12: under 10% of a small-model step); ``ray-1`` against ``local-1t`` is the whole cost
of moving the same one-thread work into a Ray worker.

Usage:
    python benchmarks/scaling.py                       # small model, ~4 minutes on 2 cores
    python benchmarks/scaling.py --size tiny --quick   # smoke run, ~1 minute
    python benchmarks/scaling.py --only ray-2 --steps 8

Needs the ``ray`` extra. Ray runs on loopback, started and stopped by each child.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SETTINGS = {  # name -> (backend, workers, torch threads per process)
    "local-2t": ("local", 1, 2),
    "local-1t": ("local", 1, 1),
    "ray-1": ("ray", 1, 1),
    "ray-2": ("ray", 2, 1),
}
G = 8
PROMPTS = 8
MAX_NEW_TOKENS = 16


def overrides(work: Path, size: str, backend: str, workers: int) -> list[str]:
    run = work / "runs" / f"{backend}-{workers}-{os.getpid()}"
    out = [
        f"model.path={work / size}",
        f"data.train_files={work / 'data' / 'train.parquet'}",
        "data.max_prompt_length=64",
        f"data.max_response_length={MAX_NEW_TOKENS}",
        f"data.train_batch_size={PROMPTS}",
        f"rollout.n={G}",
        "algorithm.adv_estimator=grpo",
        f"actor.ppo_mini_batch_size={PROMPTS}",
        "actor.ppo_epochs=1",
        "actor.loss_agg_mode=token-mean",
        "actor.optim.lr=1e-5",
        "actor.optim.weight_decay=0",
        "model.dtype=float32",
        "model.enable_gradient_checkpointing=false",
        "reward.num_workers=0",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[]",
        "trainer.device=cpu",
        f"trainer.default_local_dir={run}",
    ]
    if backend == "ray":
        out += ["trainer.backend=ray", f"resources.n_gpus_per_node={workers}",
                f"resources.num_cpus={workers}"]  # fmt: skip
    return out


def prepare(work: Path, size: str) -> None:
    from lmrl.data.tasks import write_task
    from vs_trl import build_model

    if not (work / "data" / "train.parquet").exists():
        write_task("digits", work / "data", seed=0, num_train=512, num_test=8)
    if not (work / size / "config.json").exists():
        build_model(work / size, size, seed=0)


# ------------------------------------------------------------------------------ the child
def _ray_split(groups: list) -> dict[str, float]:
    """Driver call time, rank work, dispatch and collectives since the last read (seconds)."""
    call_s = work_s = comm_s = 0.0
    for group in groups:
        ranks = group.call("timings")
        group.wall.pop("timings", None)
        call_s += sum(group.wall.values())
        group.wall.clear()
        methods = {m for r in ranks for m in r["busy"]}
        for m in methods:
            per_rank = [r["busy"].get(m, []) for r in ranks]
            calls = max(len(p) for p in per_rank)
            work_s += sum(max(p[i] if i < len(p) else 0.0 for p in per_rank) for i in range(calls))
        comm_s += max(r["comm_s"] for r in ranks)
    return {"call_s": call_s, "work_s": work_s, "dispatch_s": call_s - work_s, "comm_s": comm_s}


def child(args) -> None:
    import torch

    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    backend, workers, threads = SETTINGS[args.child]
    torch.set_num_threads(threads)
    work = Path(args.work)
    total = f"trainer.total_training_steps={args.warmup + args.steps}"
    cfg = load_config(None, [*overrides(work, args.size, backend, workers), total])
    started = time.perf_counter()
    trainer = Trainer(build_run(cfg), cfg.trainer)
    setup_s = time.perf_counter() - started
    groups = trainer.parts.backend.groups if trainer.parts.backend is not None else []
    steps = []
    try:
        for i in range(args.warmup + args.steps):
            if groups:
                _ray_split(groups)  # drop what came before this step
            start = time.perf_counter()
            metrics = trainer.step()
            row = {"step_s": time.perf_counter() - start}
            row |= {k.removeprefix("timing_s/"): v for k, v in metrics.items()
                    if k.startswith("timing_s/")}  # fmt: skip
            if groups:
                row |= _ray_split(groups)
            if i >= args.warmup:
                steps.append(row)
    finally:
        trainer.close()
    result = {"setting": args.child, "setup_s": setup_s, "steps": steps,
              "loadavg_1m": os.getloadavg()[0]}  # fmt: skip
    Path(args.json).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- the parent
def spawn(name: str, args, work: Path) -> dict:
    threads = SETTINGS[name][2]
    env = os.environ | {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(work / "hf_home"),
        "PYTHONWARNINGS": "ignore",
        "RAY_DEDUP_LOGS": "1",
    }
    out = work / f"{name}.json"
    cmd = [sys.executable, __file__, "--child", name, "--work", str(work), "--json", str(out),
           "--size", args.size, "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"{name} failed (exit {proc.returncode})")
    return json.loads(out.read_text())


def med(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def table(results: dict[str, dict]) -> str:
    base = med(results["local-2t"]["steps"], "step_s") if "local-2t" in results else None
    lines = [
        "| setting | s/step | steps/s | vs local-2t | gen | old_log_prob | update_actor "
        "| call | work | dispatch | comm | dispatch share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    for name, res in results.items():
        rows = res["steps"]
        step = med(rows, "step_s")
        share = med(rows, "dispatch_s")
        lines.append(
            f"| {name} | {step:.3f} | {1 / step:.2f} | "
            f"{cell(base / step if base else None, '{:.2f}x')} | {cell(med(rows, 'gen'))} | "
            f"{cell(med(rows, 'old_log_prob'))} | {cell(med(rows, 'update_actor'))} | "
            f"{cell(med(rows, 'call_s'))} | {cell(med(rows, 'work_s'))} | "
            f"{cell(share)} | {cell(med(rows, 'comm_s'))} | "
            f"{cell(100 * share / step if share is not None else None, '{:.1f}%')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setting")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 timed steps")
    parser.add_argument("--only", default=",".join(SETTINGS), help="comma-separated settings")
    parser.add_argument("--work", default=None, help="models, data and runs (default: a temp dir)")
    parser.add_argument("--out", default=None, help="write scaling.json here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.steps = 2
    work = Path(args.work or tempfile.mkdtemp(prefix="lmrl-scaling-"))
    prepare(work, args.size)
    results = {}
    for name in args.only.split(","):
        started = time.perf_counter()
        results[name] = spawn(name, args, work)
        print(f"{name}: done in {time.perf_counter() - started:.0f} s "
              f"(set-up {results[name]['setup_s']:.1f} s)", flush=True)  # fmt: skip
    print(f"\n{args.size} model, G={G} x {PROMPTS} prompts, {MAX_NEW_TOKENS} new tokens, "
          f"median of {args.steps} steps after {args.warmup} warm-up; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}\n")  # fmt: skip
    print(table(results))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "scaling.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
