"""Rewards in flight against scoring after the generation (issue 34 part 1, on a CPU).

The demo's recipe (``lmrl demo``: the small Qwen2, digits, an SFT warm start, GRPO with 16
prompts x 8 samples) with verl's GRPO KL loss (so each step also runs the reference), in one
process, with a judge that answers after ``--delay-per-sample`` seconds per completion, one
completion after another (a remote judge, called by the ``naive`` manager from one worker
process). Six runs from the same warm start, same seed:

    instant       the judge answers at once (what the step costs without it)
    at once       the batch is generated, then scored (the default)
    in flight     ``reward.overlap.chunks=4``: each quarter is scored while the next one
                  generates
    rows          ``reward.overlap.rows=true``: each sample is scored the moment it stops
                  (EOS), while the other rows decode
    async only    ``reward.overlap.log_probs=true``: the batch's scoring overlaps the old and
                  reference log-probs
    rows+async    both

It prints seconds per step (the mean after the first two), ``timing_s/gen`` and
``timing_s/reward`` (the wait for the scores that the step did not hide), and each run's
ratio to the instant one, and writes ``benchmarks/results/reward_in_flight.json``. The samples
and scores of the six runs are the same; the benchmark checks the score curve. A benchmark,
never a test: run it on a quiet machine.

    python benchmarks/reward_in_flight.py --steps 20
    python benchmarks/reward_in_flight.py --steps 20 --response-length 48 \
        --results benchmarks/results/reward_in_flight_long.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from async_step import warm_start  # the demo's warm start, built once per seed

JUDGE = """
import time
from lmrl.rewards.scorers import default_compute_score

def judge(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({delay})
    return default_compute_score(data_source, solution_str, ground_truth)
"""

MODES = {
    "instant": (0.0, []),
    "at once": (None, []),
    "in flight": (None, ["reward.overlap.chunks=4"]),
    "rows": (None, ["reward.overlap.rows=true"]),
    "async only": (None, ["reward.overlap.log_probs=true"]),
    "rows+async": (None, ["reward.overlap.rows=true", "reward.overlap.log_probs=true"]),
}


def one_run(model: Path, data: dict, run_dir: Path, seed: int, steps: int, delay: float,
            extra: list[str], length: int) -> dict:  # fmt: skip
    from lmrl.demos.digits import run_rl

    judge = run_dir.with_suffix(".judge.py")
    judge.parent.mkdir(parents=True, exist_ok=True)
    judge.write_text(JUDGE.format(delay=delay))
    overrides = [
        "rollout.temperature=0.7", "reward.manager=naive", "reward.num_workers=1",
        f"reward.custom_reward_function.path={judge}", "reward.custom_reward_function.name=judge",
        "actor.use_kl_loss=true", "actor.kl_loss_coef=0.001",
        *(["rollout.ignore_eos=true"] if length > 8 else []), *extra,
    ]  # fmt: skip
    rl = run_rl(model, data, run_dir, seed=seed, steps=steps, lr=1e-4, prompts_per_step=16, n=8,
                max_response_length=length, test_freq=steps, target_acc=2.0, console=False,
                overrides=overrides)  # fmt: skip
    hist = rl["history"][2:]
    mean = lambda key: round(statistics.fmean(m.get(key, 0.0) for m in hist), 3)  # noqa: E731
    return {
        "step_s": mean("timing_s/step"), "gen_s": mean("timing_s/gen"),
        "reward_s": mean("timing_s/reward"), "ref_s": mean("timing_s/ref"),
        "scores": [round(m["critic/score/mean"], 6) for m in rl["history"]],
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--delay-per-sample", type=float, default=0.004, help="the judge's seconds")
    ap.add_argument(
        "--response-length",
        type=int,
        default=8,
        help="tokens per response (the demo's 8; longer ones ignore EOS, so every response "
        "is that long and the generation takes as long as a slow judge)",
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/lmrl-async-bench"))
    ap.add_argument(
        "--results",
        type=Path,
        default=Path(__file__).with_name("results") / "reward_in_flight.json",
    )
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, data = warm_start(args.out / f"seed{args.seed}", args.seed)
    rows: dict[str, dict] = {}
    for name, (delay, extra) in MODES.items():
        run = (
            args.out / f"seed{args.seed}" / f"inflight-{name.replace(' ', '_')}-{int(time.time())}"
        )
        delay = args.delay_per_sample if delay is None else delay
        rows[name] = one_run(
            model, data, run, args.seed, args.steps, delay, extra, args.response_length
        )
        print(name, json.dumps(rows[name]), flush=True)
    base = rows["instant"]["step_s"]
    print(f"\njudge: {args.delay_per_sample} s per completion, 128 per step; {args.steps} steps; "
          f"responses of {args.response_length} tokens")  # fmt: skip
    print(f"{'run':>10} {'s/step':>7} {'gen s':>6} {'reward s':>8} {'x instant':>9}")
    for name, r in rows.items():
        r["ratio_to_instant"] = round(r["step_s"] / base, 3)
        print(f"{name:>10} {r['step_s']:>7.3f} {r['gen_s']:>6.3f} {r['reward_s']:>8.3f} "
              f"{r['ratio_to_instant']:>9.3f}")  # fmt: skip
    same = all(r["scores"] == rows["at once"]["scores"] for r in rows.values())
    print(f"same scores in every run: {same}")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"steps": args.steps, "seed": args.seed,
                                        "response_length": args.response_length,
                                        "delay_per_sample_s": args.delay_per_sample,
                                        "same_scores": same, "runs": rows}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
