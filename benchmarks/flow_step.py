"""Benchmark: seconds per Flow-GRPO step on this machine, and where the time goes.

The demo's image model (`lmrl.flow.ImageFlow`, a 0.7M-parameter U-Net at 16x16, random
weights: speed does not depend on them) and the demo's step: 16 prompts x 16 images, 10
denoising steps. Two layouts side by side: every step stochastic and trained (Flow-GRPO), and
Flow-GRPO-Fast's two SDE steps (ODE elsewhere, only those two trained). For each, the median
over ``--steps`` steps of: sampling (the rollout), the recomputed old log-probs (one forward
per trained step; skipped when the rollout's are used), and the update (forward and backward
per trained step), and images per second of a whole step.

    python benchmarks/flow_step.py              # 3 steps of each layout (~2 min on 2 cores)
    python benchmarks/flow_step.py --steps 1    # a smoke run

Run it on a quiet machine (a second 2-thread job halves every number).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmrl.flow import FlowGRPO, FlowGRPOConfig, FlowSampler
from lmrl.flow.image_model import ImageFlow


def one_layout(name: str, sampler: FlowSampler, steps: int, prompts: int, n: int) -> dict:
    torch.manual_seed(0)
    model = ImageFlow(12)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    config = FlowGRPOConfig(clip_range=1e-2, mini_batch_size=64, micro_batch_size=32)
    grpo = FlowGRPO(model, sampler, opt, config)
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"sample": [], "old log-probs": [], "update": []}
    images = prompts * n
    for _ in range(steps):
        cond = (torch.rand(images, 12, generator=gen) > 0.7).float()
        noise = torch.randn(images, 3, 16, 16, generator=gen)
        t0 = time.perf_counter()
        model.eval()
        batch = sampler.sample(model, cond, noise, generator=gen)
        t1 = time.perf_counter()
        old = grpo.old_log_probs(batch)
        t2 = time.perf_counter()
        adv = torch.randn(images, generator=gen)
        grpo.update(batch, adv, old_log_probs=old, generator=gen)
        t3 = time.perf_counter()
        times["sample"].append(t1 - t0)
        times["old log-probs"].append(t2 - t1)
        times["update"].append(t3 - t2)
    med = {k: statistics.median(v) for k, v in times.items()}
    total = sum(med.values())
    trained = int(sampler.train_mask().sum())
    print(f"\n{name}: {images} images x {sampler.num_steps} denoising steps, {trained} trained")
    for key, value in med.items():
        print(f"  {key:<14} {value:7.2f} s  ({100 * value / total:4.1f}%)")
    print(f"  {'step':<14} {total:7.2f} s   {images / total:6.1f} images/s")
    return {"total": total, **med}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    full = one_layout("Flow-GRPO (all steps SDE)", FlowSampler(num_steps=10), args.steps,
                      args.prompts, args.n)  # fmt: skip
    fast = one_layout(
        "Flow-GRPO-Fast (2 SDE steps)", FlowSampler(num_steps=10, sde_steps=2), args.steps,
        args.prompts, args.n,
    )  # fmt: skip
    print(f"\nFast / full step time: {fast['total'] / full['total']:.2f}")


if __name__ == "__main__":
    main()
