"""Where an lmrl GRPO step's time goes, on ``vs_trl.py``'s models and settings.

Runs the trainer of one ``vs_trl.py`` setting (same model, data and hyperparameters), skips
``--warmup`` steps, then profiles ``--steps`` steps with ``torch.profiler`` and prints:

- the trainer's own stage timers (``timing_s/gen``, ``reward``, ``ref``, ``adv``,
  ``update_actor``), mean over the profiled steps;
- the time inside torch operators (the profiler's self CPU time summed over every op) against
  the wall time: the rest is Python and framework overhead;
- the top operators by self CPU time.

Usage:
    python benchmarks/profile_step.py --size tiny --kl 0 [--steps 3] [--work DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from vs_trl import THREADS, lmrl_trainer, prepare, settings_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--kl", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    work = Path(args.work or tempfile.mkdtemp(prefix="lmrl-profile-"))
    prepare(work, [args.size])
    s = settings_for(args.size, args.kl, quick=False, steps=args.steps)
    s.warmup = args.warmup
    trainer = lmrl_trainer(s, work)
    for _ in range(args.warmup):
        trainer.step()

    stages: dict[str, list[float]] = {}
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            for key, value in trainer.step().items():
                if key.startswith("timing_s/"):
                    stages.setdefault(key[len("timing_s/") :], []).append(value)
    wall = time.perf_counter() - start
    trainer.close()

    events = prof.key_averages()
    in_ops = sum(e.self_cpu_time_total for e in events) / 1e6
    print(f"{args.size}, KL {'k3' if args.kl else 'off'}: {args.steps} profiled steps, "
          f"{s.prompts} prompts x 8, max_new_tokens {s.max_new_tokens}")  # fmt: skip
    print("stage timers (mean s/step, profiler on):")
    step = statistics.mean(stages.pop("step"))
    for name, values in stages.items():
        mean = statistics.mean(values)
        print(f"  {name:14} {mean:8.3f}  {100 * mean / step:5.1f}%")
    print(f"  {'step':14} {step:8.3f}")
    print(f"time in torch ops: {in_ops / args.steps:.3f} s/step of {wall / args.steps:.3f} wall "
          f"({100 * in_ops / wall:.0f}%); the rest is Python / framework overhead")  # fmt: skip
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
