"""Does difficulty-aware sampling (``data.curriculum``) reach a score in fewer steps?

Three built-in small tasks are mixed into one training set (``--train`` prompts each, so that
prompts recur over the run and their pass rates matter) and drawn in equal shares
(``data.mixture``); a ~2M-parameter Qwen2 (``lmrl.models.tiny``) gets an SFT warm start on the
three tasks (the demo's procedure, stopped at ``--sft-acc`` greedy exact match), and then two
runs start from that same warm start: ``uniform`` (the mixture alone) and ``curriculum``
(the mixture plus ``data.curriculum.enable=true`` with the given options, default
``skip_solved``). Both run the recipe of docs/learning.md (GRPO, 16 prompts x 8 samples,
temperature 0.7, lr 1e-4 after 10 warmup steps, Clip-Cov 0.1, exact-match reward) for
``--steps`` steps, validating every
``--test-freq`` steps on the three tasks' validation prompts; the score is the mean of the
tasks' greedy exact match (``val/<task>/acc``).

Printed per seed and run: the score before RL and at the end, the steps each run took to
reach the uniform run's final score (the first validation at or above it; ``-`` = never),
and seconds; then the mean over the seeds. Rows also go to ``--out/curriculum.jsonl``.

Usage:
    python benchmarks/curriculum.py                       # 3 seeds, about 25 minutes on 2 cores
    python benchmarks/curriculum.py --seeds 0 --steps 20  # a quick look
    python benchmarks/curriculum.py --options mode=target,target_pass_rate=0.5
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path


def write_mixed(tasks: list[str], out: Path, seed: int, num_train: int, num_val: int) -> dict:
    """Each task's RL prompts (``num_train`` each), validation prompts and warm-start set,
    concatenated into ``train``, ``test`` and ``sft`` parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmrl.demos.digits import warm_start_options, write_task_data

    tables: dict[str, list] = {"train": [], "test": [], "sft": []}
    for task in tasks:
        paths = write_task_data(task, out / task, seed, 2000, num_val,
                                sft_options=warm_start_options(task))  # fmt: skip
        tables["train"].append(pq.read_table(paths["train"]).slice(0, num_train))
        tables["test"].append(pq.read_table(paths["test"]))
        tables["sft"].append(pq.read_table(paths["sft"]))
    files = {}
    for split, parts in tables.items():
        files[split] = out / f"{split}.parquet"
        pq.write_table(pa.concat_tables(parts, promote_options="default"), files[split])
    return files


def prepare(tasks: list[str], seed: int, work: Path, args) -> dict:
    """Model, mixed data and the SFT warm start of ``seed`` (reused when present)."""
    from lmrl.demos.digits import run_sft
    from lmrl.models.tiny import build_tiny_model

    base = work / f"s{seed}"
    summary = base / "sft.json"
    if summary.exists():
        return json.loads(summary.read_text())
    model = build_tiny_model(base / "model", arch="qwen2", size="small", seed=seed)
    data = write_mixed(tasks, base / "data", seed, args.train, args.val)
    sft = run_sft(
        model, data, base / "sft", seed=seed, target_acc=args.sft_acc, max_steps=400, lr=1e-3,
        batch_size=64, max_new_tokens=8, console=False, max_acc=args.sft_acc + 0.15,
        check_every=10,
    )  # fmt: skip
    out = {"model": str(sft["model"]), "data": {k: str(v) for k, v in data.items()},
           "sft_steps": sft["steps"], "sft_acc": sft["acc"]}  # fmt: skip
    summary.write_text(json.dumps(out))
    return out


def run(tasks: list[str], seed: int, variant: str, prep: dict, work: Path, args) -> dict:
    """One RL run from the warm start; its validation scores by step."""
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    extra = [f"data.mixture.{task}=1" for task in tasks]
    if variant == "curriculum":
        extra.append("data.curriculum.enable=true")
        extra += [f"data.curriculum.{o}" for o in args.options.split(",") if o]
    cfg = load_config(None, [
        f"model.path={prep['model']}", f"data.train_files={prep['data']['train']}",
        f"data.val_files={prep['data']['test']}", "data.max_prompt_length=64",
        "data.max_response_length=8", "data.train_batch_size=16", "rollout.n=8",
        "algorithm.adv_estimator=grpo", "actor.ppo_mini_batch_size=16", "actor.optim.lr=1e-4",
        "actor.optim.lr_warmup_steps=10", "actor.use_kl_loss=false", "rollout.temperature=0.7",
        "actor.policy_loss.loss_mode=clip_cov", "actor.policy_loss.clip_cov_ratio=0.1",
        *[f"reward.scorer_options.{task}.binary=true" for task in tasks],
        "model.enable_gradient_checkpointing=false", "reward.num_workers=0",
        f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.test_freq}",
        "trainer.save_freq=-1", "trainer.val_before_train=true", "trainer.resume_mode=disable",
        "trainer.logger=[]", f"trainer.default_local_dir={work / f's{seed}' / variant}",
        "trainer.device=cpu", f"trainer.seed={seed}", *extra,
    ])  # fmt: skip
    start = time.perf_counter()
    trainer = Trainer(build_run(cfg), cfg.trainer)
    trainer.fit()
    scores = {
        int(step): round(statistics.fmean(m[f"val/{t}/acc"] for t in tasks), 4)
        for step, m in sorted(trainer.validations.items())
    }
    return {"seed": seed, "variant": variant, "val": scores,
            "seconds": round(time.perf_counter() - start)}  # fmt: skip


def steps_to(scores: dict[int, float], goal: float) -> int | None:
    """The first step (after the start) whose validation is at or above ``goal``."""
    return next((s for s, v in sorted(scores.items()) if s > 0 and v >= goal), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="digits,count,compare")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=120, help="RL steps per run")
    p.add_argument("--test-freq", type=int, default=10)
    p.add_argument("--train", type=int, default=48, help="training prompts per task")
    p.add_argument("--val", type=int, default=32, help="validation prompts per task")
    p.add_argument("--sft-acc", type=float, default=0.3, help="SFT stops at this accuracy")
    p.add_argument("--options", default="", help="data.curriculum options, e.g. mode=target")
    p.add_argument("--out", default="curriculum-runs")
    args = p.parse_args()
    logging.disable(logging.WARNING)
    tasks, work = args.tasks.split(","), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    print("| seed | run | val before | val end | steps to uniform's end | seconds |")
    print("|---|---|---|---|---|---|", flush=True)
    for seed in (int(s) for s in args.seeds.split(",")):
        prep = prepare(tasks, seed, work, args)
        runs = [run(tasks, seed, v, prep, work, args) for v in ("uniform", "curriculum")]
        goal = runs[0]["val"][max(runs[0]["val"])]
        for r in runs:
            r["goal"], r["steps_to_goal"] = goal, steps_to(r["val"], goal)
            r["before"], r["end"] = r["val"][0], r["val"][max(r["val"])]
            with open(work / "curriculum.jsonl", "a") as f:
                f.write(json.dumps(r) + "\n")
            reached = "-" if r["steps_to_goal"] is None else r["steps_to_goal"]
            print(f"| {seed} | {r['variant']} | {r['before']:.3f} | {r['end']:.3f} | "
                  f"{reached} | {r['seconds']} |", flush=True)  # fmt: skip
            rows.append(r)
    for variant in ("uniform", "curriculum"):
        mine = [r for r in rows if r["variant"] == variant]
        reached = [r["steps_to_goal"] for r in mine if r["steps_to_goal"] is not None]
        mean_steps = f"{statistics.fmean(reached):.0f} ({len(reached)}/{len(mine)} reached)"
        print(f"| mean | {variant} | {statistics.fmean(r['before'] for r in mine):.3f} | "
              f"{statistics.fmean(r['end'] for r in mine):.3f} | {mean_steps} | "
              f"{statistics.fmean(r['seconds'] for r in mine):.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
