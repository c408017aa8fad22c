"""The small model's GRPO step in fp32 against mixed precision (bf16 compute over fp32
masters), side by side in one run: seconds per step and peak memory (issue 32).

Both variants are lmrl's trainer on `benchmarks/vs_trl.py`'s ``small`` model (a Qwen2 of
hidden 512, 8 layers, a 32k vocabulary, 38.9M parameters, random init) and ``digits`` data,
with vs_trl's settings (4 prompts x 8 samples, 16 new tokens, one update per batch, no
gradient checkpointing), float32 masters, and ``model.mixed_precision.param_dtype`` float32
or bfloat16. Each measurement is a fresh child process; the variants alternate for ``--reps``
repetitions. Peak memory is the process's peak RSS on a CPU (it includes the interpreter and
libraries, the same for both) and ``torch.cuda.max_memory_allocated`` on a GPU.

Usage:
    python benchmarks/precision_step.py                  # this CPU, ~3 min on 2 cores
    python benchmarks/precision_step.py --device cuda    # a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import vs_trl  # its model, data and trainer settings

VARIANTS = {
    "fp32": ("model.mixed_precision.param_dtype=float32",),
    "bf16 mixed": ("model.mixed_precision.param_dtype=bfloat16",),
}


def child(args) -> None:
    import torch

    torch.set_num_threads(vs_trl.THREADS)
    s = vs_trl.settings_for("small", 0, quick=False, steps=args.steps)
    s.warmup = args.warmup
    extra = (*VARIANTS[args.variant], f"trainer.device={args.device}")
    trainer = vs_trl.lmrl_trainer(s, Path(args.work), extra)
    times = []
    for i in range(s.warmup + s.steps):
        if i == s.warmup and args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trainer.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    trainer.close()
    peak = (torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda"
            else vs_trl.peak_rss_mb())  # fmt: skip
    Path(args.json).write_text(json.dumps({"step_s": times[s.warmup :], "peak_mb": peak}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--work", default=None)
    p.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        return child(args)
    work = Path(args.work or tempfile.mkdtemp(prefix="lmrl-precision-"))
    vs_trl.prepare(work, ["small"])
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    env = dict(os.environ, OMP_NUM_THREADS=str(vs_trl.THREADS))
    for rep in range(args.reps):
        for variant in VARIANTS:
            out = work / f"{variant.replace(' ', '_')}-{rep}.json"
            cmd = [sys.executable, __file__, "--variant", variant, "--json", str(out),
                   "--work", str(work), "--device", args.device, "--steps", str(args.steps),
                   "--warmup", str(args.warmup)]  # fmt: skip
            subprocess.run(cmd, env=env, check=True, capture_output=True)
            runs[variant].append(json.loads(out.read_text()))
    print(f"small model, {args.device}, {args.reps} reps x {args.steps} timed steps")
    print("| variant | s/step (median) | peak MiB |")
    print("|---|---|---|")
    summary = {}
    for variant, rs in runs.items():
        step = statistics.median(t for r in rs for t in r["step_s"])
        peak = max(r["peak_mb"] for r in rs)
        summary[variant] = {"step_s": step, "peak_mb": peak}
        print(f"| {variant} | {step:.3f} | {peak:.0f} |")
    fp32, mixed = summary["fp32"], summary["bf16 mixed"]
    print(f"mixed / fp32: time {mixed['step_s'] / fp32['step_s']:.2f}x, "
          f"peak {mixed['peak_mb'] / fp32['peak_mb']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
