"""Wall time of the demos: ``lmrl demo`` (digits), ``--task search`` and ``--task flow``.

The demos' learning bars are tests (``make test-demos``); their times are measured here, never
asserted. Each demo runs once, in this process, into ``--out`` (a temp directory unless
given), and one row per demo is printed: its stages' seconds, its total, its steps and its
headline score, with the budget of the demos that have one (issues 14 and 15: search under
10 minutes, flow under 6, on a 2-core CPU). ``--fast`` runs the smoke versions (seconds each; they learn
nothing), which times the pipeline alone. The rows also go to ``--out/demos.json``.

Usage:
    python benchmarks/demos.py                          # all three, full size (~20 min)
    python benchmarks/demos.py --demos search,flow
    python benchmarks/demos.py --fast                   # smoke runs
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

# demo -> the minutes its issue gives it on a 2-core CPU (printed next to the time, not checked)
BUDGET_MIN: dict[str, int | None] = {"digits": None, "search": 10, "flow": 6}


def run_one(name: str, out: Path, *, fast: bool, seed: int) -> dict:
    """Run one demo; returns its row: stage seconds, total seconds, steps and score."""
    start = time.perf_counter()
    if name == "digits":
        from lmrl.demos.digits import run_demo

        s = run_demo(out, fast=fast, seed=seed, console=False)
        stages = {"sft_s": s["sft_seconds"], "rl_s": s["rl_seconds"]}
        total, steps = s["seconds"], s["rl_steps"]
        score = f"acc {s['acc_before_rl']:.3f} -> {s['acc_after_rl']:.3f}"
    elif name == "search":
        from lmrl.demos.search import run_search_demo

        s = run_search_demo(out, fast=fast, seed=seed, console=False)
        stages = {"sft_s": s["sft_seconds"], "rl_s": s["rl_seconds"]}
        total, steps = s["seconds"], s["rl_steps"]
        score = f"acc {s['acc_before_rl']:.3f} -> {s['acc_after_rl']:.3f}"
    elif name == "flow":
        from lmrl.demos.flow import run_flow_demo

        s = run_flow_demo(out, fast=fast, seed=seed, console=False)
        stages = {"sft_s": s["pretrain_s"], "rl_s": s["rl_s"]}  # pre-training in the SFT column
        total, steps = s["total_s"], max(s["val_steps"])  # it validates at its last step
        score = f"val reward {s['val_reward_before']:.3f} -> {s['val_reward_after']:.3f}"
    else:
        raise ValueError(f"unknown demo {name!r}; valid: {', '.join(BUDGET_MIN)}")
    return {
        "demo": name,
        **{k: round(float(v), 1) for k, v in stages.items()},
        "total_s": round(float(total), 1),
        "wall_s": round(time.perf_counter() - start, 1),  # including imports and data writing
        "rl_steps": steps,
        "score": score,
        "budget_min": BUDGET_MIN[name],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demos", default=",".join(BUDGET_MIN), help="comma-separated")
    parser.add_argument("--fast", action="store_true", help="the smoke versions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="lmrl-demos-"))
    rows = []
    for name in args.demos.split(","):
        rows.append(run_one(name, out / name, fast=args.fast, seed=args.seed))
        print(json.dumps(rows[-1]), flush=True)
    (out / "demos.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\n{'fast' if args.fast else 'full'} demos, seed {args.seed} ({out}):")
    print("| demo | SFT / pre-train s | RL s | total s | wall s | RL steps | score | budget |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        budget = f"< {r['budget_min']} min" if r["budget_min"] else "-"
        print(
            f"| {r['demo']} | {r['sft_s']:.1f} | {r['rl_s']:.1f} | {r['total_s']:.1f} | "
            f"{r['wall_s']:.1f} | {r['rl_steps']} | {r['score']} | {budget} |"
        )


if __name__ == "__main__":
    main()
