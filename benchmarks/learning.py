"""Does RL learn a small task, and what changes it? (issue 16's study; docs/learning.md)

For each task, a ~2M-parameter Qwen2 (``lmrl.models.tiny``, byte-level tokenizer, built from
the seed) gets an SFT warm start that stops once greedy exact match on the validation prompts
reaches ``--sft-acc`` (the demo's procedure, ``lmrl.demos.digits.run_sft``), and then every
variant runs RL from that same warm start for at most ``--steps`` steps (stopping early at
``--target`` greedy exact match). A variant is the demo's GRPO recipe with a few ``lmrl
train`` overrides (``VARIANTS``); ``{task}`` in an override is replaced by the task's name.

Printed per run, one row: greedy exact match before RL, at the end, and the best seen; the
steps run; the mean train score over the first and last 10 steps; the policy's entropy over
the first and last 10 steps; the mean fraction of zero-spread groups over the last 10 steps;
seconds. The rows also go to ``--out/learning.jsonl``, with every validation's score.

Usage:
    python benchmarks/learning.py --tasks count,sort --variants base,binary [--seeds 0,1]
    python benchmarks/learning.py --side trl --tasks count --variants base,t07_lr1e-4  # TRL
    python benchmarks/learning.py --tasks compare --variants t07_lr1e-4+mb4  # joined with +
    python benchmarks/learning.py --list          # the variants and their overrides
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

# name -> (overrides, what it tests); the base is the demo's GRPO recipe (run_rl's defaults).
VARIANTS: dict[str, tuple[list[str], str]] = {
    "base": ([], "the demo's GRPO: n=8, lr 3e-4 (10 warmup steps), T=1, token-mean, no KL"),
    "binary": (["reward.scorer_options.{task}.binary=true"], "exact-match reward, no credit"),
    "lr1e-4": (["actor.optim.lr=1e-4"], "a lower learning rate"),
    "lr1e-3": (["actor.optim.lr=1e-3"], "a higher learning rate"),
    "lr2e-4": (["actor.optim.lr=2e-4"], "between the recipe's 1e-4 and the demo's 3e-4"),
    "nowarmup": (["actor.optim.lr_warmup_steps=0"], "no warmup"),
    "clip_high": (["actor.clip_ratio_high=0.28"], "DAPO clip-higher"),
    "mb4": (["actor.ppo_mini_batch_size=4"], "4 updates per batch (the clip can act)"),
    "mb4_clip_high": (
        ["actor.ppo_mini_batch_size=4", "actor.clip_ratio_high=0.28"],
        "4 updates per batch with clip-higher",
    ),
    "entropy": (["actor.entropy_coeff=0.01"], "an entropy bonus"),
    "entropy0.03": (["actor.entropy_coeff=0.03"], "a larger entropy bonus"),
    "temp1.3": (["rollout.temperature=1.3"], "hotter sampling"),
    "temp0.7": (["rollout.temperature=0.7"], "cooler sampling (closer to greedy)"),
    "temp0.5": (["rollout.temperature=0.5"], "cooler still"),
    "t07_lr1e-4": (
        ["rollout.temperature=0.7", "actor.optim.lr=1e-4"],
        "cooler sampling and a lower learning rate together",
    ),
    "n16": (["rollout.n=16"], "16 samples per prompt (twice the samples per step)"),
    "n4": (["rollout.n=4"], "4 samples per prompt (half the samples per step)"),
    "t07_lr1e-4_binary": (
        [
            "rollout.temperature=0.7",
            "actor.optim.lr=1e-4",
            "reward.scorer_options.{task}.binary=true",
        ],
        "the recipe with the exact-match reward",
    ),
    "n16_t07_lr1e-4": (
        ["rollout.n=16", "rollout.temperature=0.7", "actor.optim.lr=1e-4"],
        "the recipe with 16 samples per prompt",
    ),
    "p32_n4": (
        ["data.train_batch_size=32", "actor.ppo_mini_batch_size=32", "rollout.n=4"],
        "32 prompts x 4 samples (the same 128 samples a step, twice the prompts)",
    ),
    "p64_n4": (
        ["data.train_batch_size=64", "actor.ppo_mini_batch_size=64", "rollout.n=4"],
        "64 prompts x 4 samples (twice the samples a step, four times the prompts)",
    ),
    "kl": (
        ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.01", "actor.kl_loss_type=low_var_kl"],
        "k3 KL to the warm start in the loss",
    ),
    "bf16_tis": (
        ["rollout.dtype=bfloat16", "rollout.log_prob_mode=rollout_correction"],
        "a bf16 copy generates, the fp32 anchor recomputes, token-level TIS (cap 2)",
    ),
    "bf16_decoupled": (
        ["rollout.dtype=bfloat16"],
        "a bf16 copy generates, the fp32 anchor recomputes, no importance weights",
    ),
    "bf16_bypass": (
        ["rollout.dtype=bfloat16", "rollout.log_prob_mode=bypass"],
        "a bf16 copy generates and its own log-probs are pi_old: no anchor, no correction",
    ),
    "kl0.2": (
        ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.2", "actor.kl_loss_type=low_var_kl"],
        "a strong k3 KL to the warm start in the loss",
    ),
    "drgrpo": (
        [
            "algorithm.adv_estimator=grpo",
            "algorithm.norm_adv_by_std_in_grpo=false",
            "actor.loss_agg_mode=seq-mean-token-sum-norm",
        ],
        "Dr.GRPO: no std, constant divisor",
    ),
    "clipcov0.1": (
        ["actor.policy_loss.loss_mode=clip_cov", "actor.policy_loss.clip_cov_ratio=0.1"],
        "Clip-Cov: 10% of the tokens, drawn among those of covariance in (1, 5), send no gradient",
    ),
    "clipcov0.3": (
        ["actor.policy_loss.loss_mode=clip_cov", "actor.policy_loss.clip_cov_ratio=0.3"],
        "Clip-Cov on up to 30% of the tokens",
    ),
    "clipcov0.6": (
        ["actor.policy_loss.loss_mode=clip_cov", "actor.policy_loss.clip_cov_ratio=0.6"],
        "Clip-Cov on up to 60% of the tokens",
    ),
    "covlb0": (["actor.policy_loss.clip_cov_lb=0.0"], "Clip-Cov's band from covariance 0"),
    "seqmean": (["actor.loss_agg_mode=seq-mean-token-mean"], "sequence-mean aggregation"),
    "dynamic": (["algorithm.filter_groups.enable=true"], "DAPO dynamic sampling"),
    "rloo": (["algorithm.adv_estimator=rloo"], "RLOO"),
    "passk": (["algorithm.adv_estimator=grpo_passk"], "GRPO Pass@k: only each group's best learns"),
    "reinforce_pp": (["algorithm.adv_estimator=reinforce_plus_plus"], "REINFORCE++"),
    "ppo": (
        ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "algorithm.lam=1.0"],
        "PPO with a critic (GAE, lambda 1)",
    ),
}


def variant_overrides(variant: str) -> list[str]:
    """The overrides of ``variant``: a name in ``VARIANTS``, or names joined by ``+``
    (``t07_lr1e-4+mb4``: their overrides in order, a later one winning)."""
    out = []
    for name in variant.split("+"):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r} (--list shows them)")
        out.extend(VARIANTS[name][0])
    return out


def _mean(rows: list[dict], key: str, which: slice) -> float | None:
    values = [r[key] for r in rows[which] if key in r]
    return round(statistics.fmean(values), 3) if values else None


def prepare(task: str, seed: int, work: Path, sft_acc: float, num_train: int) -> dict:
    """Model, data and the SFT warm start of ``task`` at ``seed`` (reused when present)."""
    from lmrl.demos.digits import run_sft, write_task_data
    from lmrl.models.tiny import build_tiny_model

    base = work / f"{task}-s{seed}"
    summary = base / "sft.json"
    if summary.exists():
        return json.loads(summary.read_text())
    model = build_tiny_model(base / "model", arch="qwen2", size="small", seed=seed)
    from lmrl.data import TASKS
    from lmrl.demos.digits import warm_start_options

    num_train = min(num_train, TASKS[task].num_train)  # add has fewer distinct prompts
    data = write_task_data(
        task, base / "data", seed, num_train, 128, sft_options=warm_start_options(task)
    )
    sft = run_sft(
        model, data, base / "sft", seed=seed, target_acc=sft_acc, max_steps=400, lr=1e-3,
        batch_size=64, max_new_tokens=8, console=False, max_acc=max(0.5, sft_acc + 0.1),
    )  # fmt: skip
    out = {
        "model": str(sft["model"]),
        "data": {k: str(v) for k, v in data.items()},
        "sft_steps": sft["steps"],
        "sft_acc": sft["acc"],
        "sft_seconds": round(sft["seconds"], 1),
    }
    summary.write_text(json.dumps(out))
    return out


def run_variant(task, seed, variant, prep, work: Path, steps: int, target: float) -> dict:
    from lmrl.demos.digits import run_rl

    overrides = [o.replace("{task}", task) for o in variant_overrides(variant)]
    rl = run_rl(
        Path(prep["model"]), {k: Path(v) for k, v in prep["data"].items()},
        work / f"{task}-s{seed}" / variant, seed=seed, steps=steps, lr=3e-4,
        prompts_per_step=16, n=8, max_response_length=8, test_freq=10, target_acc=target,
        console=False, warmup_steps=10, overrides=overrides, task=task,
    )  # fmt: skip
    hist = rl["history"]
    accs = [h[f"val/{task}/acc"] for h in hist if f"val/{task}/acc" in h]
    return _row(task, seed, variant, prep, rl["acc_before"], accs, hist, rl["steps"],
                rl["seconds"])  # fmt: skip


def run_trl(task, seed, variant, prep, work: Path, steps: int, target: float) -> dict:
    """The same run with TRL's ``GRPOTrainer`` (the variants that change only the
    temperature, the learning rate, the samples per prompt or the reward: `_trl_settings`).

    Matched to ``run_rl``'s recipe: G=8, 16 prompts a step, one update per batch, AdamW (lr
    3e-4 after 10 linear warmup steps, then constant; weight decay 0.01), gradient norm
    clipped at 1, clip epsilon 0.2, token-mean loss (TRL's ``loss_type="dapo"``), group-std
    advantages, no KL, temperature 1 (each changed as the variant says); greedy exact match
    measured every 10 steps by the same `GreedyAccuracy` as lmrl's runs.
    """
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lmrl.demos.digits import GreedyAccuracy
    from lmrl.rewards.scorers import BuiltinScorer

    settings = _trl_settings(task, variant)
    scorer = BuiltinScorer({task: {"binary": True}} if settings["binary"] else None)
    rows = datasets.load_dataset("parquet", data_files=prep["data"]["train"], split="train")
    rows = rows.map(
        lambda r: {"ground_truth": r["reward_model"]["ground_truth"]},
        remove_columns=["reward_model", "ability"],
    )
    log: list[dict] = []

    def reward(completions, ground_truth, data_source, extra_info, **_) -> list[float]:
        return [
            float(scorer(src, c[0]["content"], gt, info)["score"])
            for c, gt, src, info in zip(
                completions, ground_truth, data_source, extra_info, strict=True
            )
        ]

    model = AutoModelForCausalLM.from_pretrained(prep["model"], dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(prep["model"])
    accuracy = GreedyAccuracy(model, tokenizer, Path(prep["data"]["test"]), 8, 64)

    accs: list[float] = []

    class Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                log.append({
                    "critic/score/mean": logs["reward"],
                    "actor/entropy": logs.get("entropy", float("nan")),
                    "critic/score/zero_spread_frac": logs.get("frac_reward_zero_std", float("nan")),
                })  # fmt: skip

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % 10 == 0 or state.global_step == steps:
                accs.append(accuracy())
                control.should_training_stop = accs[-1] >= target

    config = GRPOConfig(
        output_dir=str(work / f"{task}-s{seed}" / f"trl-{variant}"),
        per_device_train_batch_size=16 * settings["n"], gradient_accumulation_steps=1,
        num_generations=settings["n"], max_completion_length=8,
        temperature=settings["temperature"], top_p=1.0, top_k=0, learning_rate=settings["lr"],
        lr_scheduler_type="constant_with_warmup", warmup_steps=10, weight_decay=0.01,
        max_grad_norm=1.0, epsilon=0.2, num_iterations=1, loss_type="dapo",
        scale_rewards="group", beta=0.0, gradient_checkpointing=False, bf16=False, fp16=False,
        use_cpu=True, use_vllm=False, max_steps=steps, logging_steps=1, save_strategy="no",
        report_to="none", seed=seed, data_seed=seed, dataloader_num_workers=0,
        disable_tqdm=True, log_completions=False,
    )  # fmt: skip
    before = accuracy()
    start = time.perf_counter()
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=rows,
        processing_class=tokenizer, callbacks=[Progress()],
    )  # fmt: skip
    trainer.train()
    return _row(task, seed, f"trl-{variant}", prep, before, accs, log, trainer.state.global_step,
                time.perf_counter() - start)  # fmt: skip


# lmrl override -> (TRL setting, type); a variant made only of these runs on TRL as well
_TRL_KEYS = {
    "rollout.temperature": ("temperature", float),
    "actor.optim.lr": ("lr", float),
    "rollout.n": ("n", int),
}


def _trl_settings(task: str, variant: str) -> dict:
    """The TRL side's settings of ``variant``: the demo's recipe with the variant's
    temperature, learning rate, samples per prompt or binary reward."""
    settings = {"temperature": 1.0, "lr": 3e-4, "n": 8, "binary": False}
    for override in variant_overrides(variant):
        key, value = override.split("=", 1)
        if key == "reward.scorer_options.{task}.binary":
            settings["binary"] = value == "true"
        elif key in _TRL_KEYS:
            name, kind = _TRL_KEYS[key]
            settings[name] = kind(value)
        else:
            raise SystemExit(
                f"--side trl cannot run the variant {variant!r} ({override} has no TRL setting "
                f"here; TRL runs the variants that change only {', '.join(_TRL_KEYS)} or the "
                "binary reward)"
            )
    return settings


def _row(task, seed, variant, prep, before, accs, hist, steps, seconds) -> dict:
    first, last = slice(0, 10), slice(-10, None)
    return {
        "task": task,
        "seed": seed,
        "variant": variant,
        "sft_steps": prep["sft_steps"],
        "acc_before": round(before, 3),
        "acc_end": round(accs[-1] if accs else before, 3),
        "acc_best": round(max([before, *accs]), 3),
        "steps": steps,
        "score_first": _mean(hist, "critic/score/mean", first),
        "score_last": _mean(hist, "critic/score/mean", last),
        "entropy_first": _mean(hist, "actor/entropy", first),
        "entropy_last": _mean(hist, "actor/entropy", last),
        "zero_spread_last": _mean(hist, "critic/score/zero_spread_frac", last),
        "seconds": round(seconds),
        "val": [round(a, 3) for a in accs],  # every validation after the first (jsonl only)
    }


COLUMNS = ("task", "seed", "variant", "sft_steps", "acc_before", "acc_end", "acc_best", "steps",
           "score_first", "score_last", "entropy_first", "entropy_last", "zero_spread_last",
           "seconds")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="count,sort,add,compare,digits")
    p.add_argument("--variants", default="base,binary")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=150, help="RL steps at most")
    p.add_argument("--target", type=float, default=0.95, help="stop at this greedy accuracy")
    p.add_argument("--sft-acc", type=float, default=0.3, help="SFT stops at this accuracy")
    p.add_argument("--num-train", type=int, default=10_000)
    p.add_argument("--out", default="learning-runs")
    p.add_argument(
        "--side",
        choices=("lmrl", "trl"),
        default="lmrl",
        help="trl: the same runs with TRL's GRPOTrainer (pip install -e .[bench])",
    )
    p.add_argument("--list", action="store_true", help="print the variants and exit")
    args = p.parse_args()
    if args.list:
        for name, (overrides, what) in VARIANTS.items():
            print(f"{name:13} {what}: {' '.join(overrides) or '(none)'}")
        return
    for variant in args.variants.split(","):  # a typo fails now, not after a warm start
        variant_overrides(variant)
    logging.disable(logging.WARNING)
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    print(" | ".join(COLUMNS), flush=True)
    for seed in (int(s) for s in args.seeds.split(",")):
        for task in args.tasks.split(","):
            prep = prepare(task, seed, work, args.sft_acc, args.num_train)
            for variant in args.variants.split(","):
                start = time.perf_counter()
                run = run_trl if args.side == "trl" else run_variant
                row = run(task, seed, variant, prep, work, args.steps, args.target)
                row["seconds"] = round(time.perf_counter() - start)
                with open(work / "learning.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(" | ".join(str(row[c]) for c in COLUMNS), flush=True)


if __name__ == "__main__":
    main()
