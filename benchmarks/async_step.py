"""Async against synchronous training on the same two Ray workers (issue 34's proof on a CPU).

The demo's recipe (``lmrl demo``: the small Qwen2, digits, an SFT warm start, GRPO with 16
prompts x 8 samples) from the same warm start, on Ray with one actor rank and one rollout rank
(``async_training.enable=true``, ``resources.rollout_workers=1``), run twice per seed:

    sync    ``async_training.staleness_threshold=0``: the rollout rank waits for each update
            (the synchronous step on the same two workers)
    async   ``staleness_threshold=1``: one-step-off, rollout correction (the default)

each with a reward that answers after ``--reward-delay`` seconds per call (a remote judge: the
``batch`` manager calls it once per batch with every completion), and once per run without
the delay (``--no-delay-too``). It prints wall-clock seconds of the whole run (Ray's start
and the greedy validations every tenth of the run included) and of its steps alone, their
ratios, and the greedy validation accuracy of both (the final one, and the mean of the last
three, since one validation of this small model swings by 0.1-0.4), seed by seed, and writes
``benchmarks/results/async_step.json``. A benchmark, never a test: run it on a quiet machine.

    python benchmarks/async_step.py --seeds 0 1 2 --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

JUDGE = """
import time
from lmrl.rewards.scorers import default_compute_score

def judge(prompts, completions, data_source, ground_truth, extra_info=None, **_):
    time.sleep({delay})
    return [default_compute_score(s, c, g)  # score and acc, as the built-in scorer gives
            for s, c, g in zip(data_source, completions, ground_truth)]
"""


def warm_start(out: Path, seed: int) -> tuple[Path, dict]:
    """The demo's model, data and SFT warm start for ``seed`` (built once, reused)."""
    from lmrl.demos.digits import run_sft, write_demo_data
    from lmrl.models.tiny import build_tiny_model

    done = out / "sft_model.json"
    data = {k: out / "data" / f"{k}.parquet" for k in ("train", "test", "sft")}
    if done.exists():
        return Path(json.loads(done.read_text())["model"]), data
    model = build_tiny_model(out / "model", arch="qwen2", size="small", seed=seed)
    data = write_demo_data(out / "data", seed, 10_000, 128, None)
    sft = run_sft(model, data, out / "sft", seed=seed, target_acc=0.3, max_steps=400, lr=1e-3,
                  batch_size=64, max_new_tokens=8, console=False)  # fmt: skip
    done.write_text(json.dumps({"model": str(sft["model"]), "acc": sft["acc"]}))
    return Path(sft["model"]), data


def one_run(model: Path, data: dict, run_dir: Path, seed: int, steps: int, staleness: int,
            delay: float, extra: list[str], lr: float) -> dict:  # fmt: skip
    from lmrl.demos.digits import run_rl

    judge = run_dir.with_suffix(".judge.py")
    judge.parent.mkdir(parents=True, exist_ok=True)
    judge.write_text(JUDGE.format(delay=delay))
    overrides = [
        "rollout.temperature=0.7", "trainer.backend=ray", "resources.n_gpus_per_node=1",
        "resources.rollout_workers=1", "resources.num_cpus=2", "async_training.enable=true",
        f"async_training.staleness_threshold={staleness}", "reward.manager=batch",
        f"reward.custom_reward_function.path={judge}", "reward.custom_reward_function.name=judge",
        *extra,
    ]  # fmt: skip
    rl = run_rl(model, data, run_dir, seed=seed, steps=steps, lr=lr, prompts_per_step=16, n=8,
                max_response_length=8, test_freq=max(steps // 10, 1), target_acc=2.0,
                console=False, warmup_steps=10, overrides=overrides)  # fmt: skip
    hist = rl["history"]
    mean = lambda key: statistics.fmean(m.get(key, 0.0) for m in hist[2:])  # noqa: E731
    vals = [m["val/digits/acc"] for m in hist if "val/digits/acc" in m]
    return {
        "seconds": round(rl["seconds"], 2), "acc": rl["acc"], "acc_before": rl["acc_before"],
        "acc_last3": round(statistics.fmean(vals[-3:]), 4), "vals": vals,
        "steps_s": round(sum(m["timing_s/step"] for m in hist), 2),
        "steps": rl["steps"], "step_s": round(mean("timing_s/step"), 3),
        "trainer_idle": round(mean("async/trainer_idle_frac"), 3),
        "generator_idle": round(mean("async/generator_idle_frac"), 3),
        "ess": round(mean("rollout_corr/is_eff_sample_size"), 4),
        "clipped": round(mean("rollout_corr/is_truncated_fraction"), 4),
        "mismatch_k3": mean("rollout/mismatch_k3"),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--reward-delay", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=3e-4, help="the actor's (the demo's: 3e-4)")
    ap.add_argument("--no-delay-too", action="store_true", help="also each seed without delay")
    ap.add_argument(
        "--async-overrides",
        nargs="*",
        default=[],
        help="extra keys of the async run (e.g. rollout.log_prob_mode=bypass)",
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/lmrl-async-bench"))
    ap.add_argument(
        "--results", type=Path, default=Path(__file__).with_name("results") / "async_step.json"
    )
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    delays = [args.reward_delay] + ([0.0] if args.no_delay_too else [])
    rows: list[dict] = []
    print(f"async run's extra keys: {args.async_overrides}", flush=True)
    for seed in args.seeds:
        model, data = warm_start(args.out / f"seed{seed}", seed)
        for delay in delays:
            row = {"seed": seed, "delay_s": delay}
            for name, k in (("sync", 0), ("async", 1)):  # alternating, same warm start
                run = args.out / f"seed{seed}" / f"{name}-{delay}-{int(time.time())}"
                extra = args.async_overrides if k else []
                row[name] = one_run(model, data, run, seed, args.steps, k, delay, extra, args.lr)
            row["ratio"] = round(row["async"]["seconds"] / row["sync"]["seconds"], 3)
            row["steps_ratio"] = round(row["async"]["steps_s"] / row["sync"]["steps_s"], 3)
            row["acc_gap"] = round(row["async"]["acc"] - row["sync"]["acc"], 4)
            row["acc_last3_gap"] = round(row["async"]["acc_last3"] - row["sync"]["acc_last3"], 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'seed':>4} {'delay':>5} {'sync s':>7} {'async s':>7} {'ratio':>6} "
          f"{'steps ratio':>11} {'acc sync/async':>14} {'last-3 sync/async':>17} "
          f"{'trainer idle':>12}")  # fmt: skip
    for r in rows:
        s, a = r["sync"], r["async"]
        print(f"{r['seed']:>4} {r['delay_s']:>5} {s['seconds']:>7.1f} {a['seconds']:>7.1f} "
              f"{r['ratio']:>6.3f} {r['steps_ratio']:>11.3f} {s['acc']:>6.3f}/{a['acc']:.3f} "
              f"{s['acc_last3']:>9.3f}/{a['acc_last3']:.3f} "
              f"{s['trainer_idle']:>6.2f}/{a['trainer_idle']:.2f}")  # fmt: skip
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"steps": args.steps, "lr": args.lr, "async_overrides": args.async_overrides,
                                        "rows": rows}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
