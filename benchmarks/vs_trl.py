"""lmrl against TRL's ``GRPOTrainer``, side by side: seconds per GRPO step, tokens/s, peak RSS,
and the reward curves, on the same model, prompts, reward function and hyperparameters.

Both sides train the same locally built Qwen2 model (``MODELS``: ``tiny`` ~1M parameters with
the byte-level tokenizer, where per-step overhead dominates; ``small``, hidden 512, 8 layers, a
32k vocabulary, where compute dominates) on the built-in ``digits`` task, scored by the same
function (``lmrl.rewards.scorers.digits.compute_score``), with:

    G = 8 samples per prompt, ``prompts`` prompts per step (one generation batch = one
    optimizer step), ``max_new_tokens``, temperature 1 (no top-k / top-p), AdamW with a
    constant learning rate, no weight decay, grad-norm clip 1, clip epsilon 0.2, one update
    per batch (TRL ``num_iterations=1``, lmrl ``ppo_epochs=1`` with one mini-batch), token-mean
    aggregation (TRL ``loss_type="dapo"``, lmrl ``loss_agg_mode=token-mean``), group-std
    scaled advantages, no entropy bonus, no gradient checkpointing, float32, 2 threads;
    ``--kl 1`` adds the k3 KL in the loss with coefficient ``BETA`` (TRL ``beta``, lmrl
    ``actor.kl_loss_coef`` with ``kl_loss_type=low_var_kl``), which loads a reference model on
    both sides.

Each measurement is a fresh child process (``--side lmrl|trl``) that builds its trainer, runs
``warmup + steps`` steps, and writes a JSON of per-step wall times (the warm-up steps are
excluded from the statistics), generated tokens, mean rewards and its peak RSS
(``ru_maxrss``). Steps are timed end to end, from the end of one step to the end of the next,
so both sides pay for their data loading, generation, reward, forward/backward and optimizer
step. The parent runs the sides alternately (lmrl, TRL, lmrl, TRL, ...) for ``--reps``
repetitions per size and setting, prints the table, and writes ``vs_trl.json`` and the reward
curves (``vs_trl_rewards.png``) to ``--out``.

Usage:
    python benchmarks/vs_trl.py --quick                   # smoke run, ~2 minutes
    python benchmarks/vs_trl.py [--sizes tiny,small] [--kl 0,1] [--reps 3] [--out DIR]
    python benchmarks/vs_trl.py --side lmrl --size tiny --kl 0 --json out.json  # one child

Needs the ``bench`` extra (``pip install -e .[bench]``: trl).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

THREADS = 2
BETA = 0.04  # the KL coefficient of the --kl 1 setting (TRL's former default)
G = 8
FINAL_STEPS = 5  # "final reward": the mean reward of the last steps of a run
SFT_TARGET_ACC = 0.2  # the tiny model's warm start (greedy exact match)
# name -> (hidden, layers, heads, kv_heads, intermediate, vocab; None = the byte tokenizer's)
MODELS: dict[str, tuple[int, int, int, int, int, int | None]] = {
    "tiny": (128, 5, 4, 2, 384, None),  # ~1.0M parameters
    "small": (512, 8, 8, 2, 1408, 32_000),  # ~40M parameters, 16M of them the tied embedding
}


@dataclass
class Setting:
    """What one child runs; the same on both sides."""

    size: str
    kl: int
    prompts: int  # prompts per step (x G samples)
    max_new_tokens: int
    steps: int  # timed steps
    warmup: int  # untimed steps before them
    lr: float
    seed: int = 0
    k3_clamp: bool = True  # lmrl's k3 clamped at 10, as verl's; False: unclamped, as TRL's


def settings_for(size: str, kl: int, quick: bool, steps: int | None) -> Setting:
    if size == "tiny":
        s = Setting(size, kl, prompts=8, max_new_tokens=16, steps=12, warmup=2, lr=3e-4)
    else:
        s = Setting(size, kl, prompts=4, max_new_tokens=16, steps=3, warmup=1, lr=1e-5)
    if quick:
        s.steps, s.warmup = 2, 1
    if steps is not None:
        s.steps = steps
    return s


# ---------------------------------------------------------------------------- shared setup
def build_model(out_dir: Path, size: str, seed: int = 0) -> Path:
    """A Qwen2 of ``MODELS[size]`` with lmrl's byte tokenizer, saved with ``save_pretrained``.

    With a vocabulary larger than the tokenizer's (``small``), the extra ids decode to nothing:
    the model pays for the full-size embedding and output head, which is the point.
    """
    from transformers import Qwen2Config

    from lmrl.models.tiny import save_model, tiny_config

    hidden, layers, heads, kv_heads, inter, vocab = MODELS[size]
    base = tiny_config("qwen2", "tiny", vocab_size=vocab).to_dict()
    base |= dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
    )
    base.pop("layer_types", None)  # rebuilt for the new depth
    return save_model(Qwen2Config(**base), out_dir, seed)


def prepare(work: Path, sizes: list[str], seed: int = 0) -> None:
    """Models and the ``digits`` data, written once for every child to load.

    The ``tiny`` model is warm-started with lmrl's SFT (as ``lmrl demo`` does) until its greedy
    validation accuracy reaches ``SFT_TARGET_ACC``, so that its rewards are neither all 0 nor
    all 1 and the reward curves show learning; ``small`` starts from its random initialization
    (its rewards stay ~0: it is there for speed, not learning).
    """
    import shutil

    from lmrl.demos.digits import run_sft, write_demo_data

    data = {"train": work / "data" / "train.parquet", "test": work / "data" / "test.parquet",
            "sft": work / "data" / "sft.parquet"}  # fmt: skip
    if not data["sft"].exists():
        write_demo_data(work / "data", seed, num_train=4096, num_val=64, prompt_format=None)
    for size in sizes:
        if (work / size / "config.json").exists():
            continue
        build_model(work / f"{size}-init", size, seed)
        if size != "tiny":
            (work / f"{size}-init").rename(work / size)
            continue
        sft = run_sft(
            work / f"{size}-init", data, work / "sft", seed=seed, target_acc=SFT_TARGET_ACC,
            max_steps=300, lr=1e-3, batch_size=64, max_new_tokens=8, console=False,
        )  # fmt: skip
        print(f"{size}: SFT warm start {sft['steps']} steps, greedy acc {sft['acc']:.2f}")
        shutil.copytree(sft["model"], work / size)


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ------------------------------------------------------------------------------ lmrl side
def lmrl_trainer(s: Setting, work: Path, extra: tuple[str, ...] = ()):
    """lmrl's ``Trainer`` for setting ``s`` (the public API, as ``lmrl train`` builds it);
    ``extra`` overrides come last (benchmarks/precision_step.py's dtypes and device)."""
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    total = s.warmup + s.steps
    overrides = [
        f"model.path={work / s.size}",
        f"data.train_files={work / 'data' / 'train.parquet'}",
        "data.max_prompt_length=64",
        f"data.max_response_length={s.max_new_tokens}",
        f"data.train_batch_size={s.prompts}",
        f"data.seed={s.seed}",
        f"rollout.n={G}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.top_k=-1",
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=true",
        f"actor.ppo_mini_batch_size={s.prompts}",
        "actor.ppo_epochs=1",
        "actor.clip_ratio=0.2",
        "actor.loss_agg_mode=token-mean",
        "actor.entropy_coeff=0",
        "actor.grad_clip=1.0",
        f"actor.optim.lr={s.lr}",
        "actor.optim.weight_decay=0",
        "actor.optim.lr_warmup_steps=0",
        "actor.optim.lr_scheduler=constant",
        f"actor.use_kl_loss={'true' if s.kl else 'false'}",
        f"actor.kl_loss_coef={BETA}",
        "actor.kl_loss_type=low_var_kl",
        "model.dtype=float32",
        "model.enable_gradient_checkpointing=false",
        "reward.num_workers=0",
        f"trainer.total_training_steps={total}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[]",
        f"trainer.default_local_dir={work / 'runs' / f'lmrl-{s.size}-{s.kl}-{os.getpid()}'}",
        "trainer.device=cpu",
        f"trainer.seed={s.seed}",
        *extra,
    ]
    cfg = load_config(None, overrides)
    return Trainer(build_run(cfg), cfg.trainer)


def unclamp_k3() -> None:
    """Diagnostic: lmrl's k3 without its clamps (log-ratio to [-20, 20], estimate to at most
    10, as verl's), as TRL computes it. Patches ``lmrl.algos.kl``'s constants in this process
    only."""
    import math

    import lmrl.algos.kl as kl_mod

    kl_mod._K3_LOG_RATIO_CLAMP = kl_mod._K3_OUTPUT_CLAMP = math.inf


def run_lmrl(s: Setting, work: Path) -> dict:
    total = s.warmup + s.steps
    if not s.k3_clamp:
        unclamp_k3()
    trainer = lmrl_trainer(s, work)
    ends, cpu, tokens, rewards, stages = [time.perf_counter()], [time.process_time()], [], [], []
    for _ in range(total):
        metrics = trainer.step()
        ends.append(time.perf_counter())
        cpu.append(time.process_time())
        batch = trainer.last_batch
        tokens.append(int(batch["response_mask"].sum()))
        rewards.append(float(batch["token_level_scores"].sum(-1).mean()))
        stages.append({k: v for k, v in metrics.items() if k.startswith("timing_s/")})
    trainer.close()
    params = sum(p.numel() for p in trainer.parts.actor.model.parameters())
    return _result(ends, cpu, tokens, rewards, params, stages=stages)


# ------------------------------------------------------------------------------- TRL side
def trl_trainer(s: Setting, work: Path, on_reward=None, callbacks=None):
    """TRL's ``GRPOTrainer`` for setting ``s``; ``on_reward(completion_ids, scores)`` is called
    with every batch the reward function scores."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from lmrl.rewards.scorers.digits import compute_score

    rows = datasets.load_dataset(
        "parquet", data_files=str(work / "data" / "train.parquet"), split="train"
    )
    rows = rows.map(
        lambda r: {"ground_truth": r["reward_model"]["ground_truth"]},
        remove_columns=["reward_model", "extra_info", "ability"],
    )

    def digits_reward(completions, completion_ids, ground_truth, **_) -> list[float]:
        scores = [
            compute_score(c[0]["content"], gt)["score"]
            for c, gt in zip(completions, ground_truth, strict=True)
        ]
        if on_reward is not None:
            on_reward(completion_ids, scores)
        return scores

    total = s.warmup + s.steps
    config = GRPOConfig(
        output_dir=str(work / "runs" / f"trl-{s.size}-{s.kl}-{os.getpid()}"),
        per_device_train_batch_size=s.prompts * G,  # completions, i.e. prompts x G
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=s.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        beta=BETA if s.kl else 0.0,
        # TRL 1.16 multiplies the k3 term by the importance ratio by default (1 in value,
        # but its gradient gains beta * k3 * grad log pi); lmrl, like verl's low_var_kl,
        # differentiates k3 itself. Off, both sides take the same KL gradient (but for
        # lmrl's clamp of k3 at 10, verl's, which zeroes the gradient of rare outliers).
        use_bias_correction_kl=False,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        use_vllm=False,
        max_steps=total,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=s.seed,
        data_seed=s.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_completions=False,
    )
    model = AutoModelForCausalLM.from_pretrained(work / s.size, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(work / s.size)
    return GRPOTrainer(
        model=model,
        reward_funcs=digits_reward,
        args=config,
        train_dataset=rows,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def run_trl(s: Setting, work: Path) -> dict:
    from transformers import TrainerCallback

    tokens, rewards = [], []

    def on_reward(completion_ids, scores) -> None:
        tokens.append(sum(len(ids) for ids in completion_ids))
        rewards.append(sum(scores) / len(scores))

    ends, cpu = [time.perf_counter()], [time.process_time()]

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            cpu.append(time.process_time())

    trainer = trl_trainer(s, work, on_reward, callbacks=[StepClock()])
    ends[0], cpu[0] = time.perf_counter(), time.process_time()
    trainer.train()
    params = sum(p.numel() for p in trainer.model.parameters())
    return _result(ends, cpu, tokens, rewards, params)


def _result(ends, cpu, tokens, rewards, params, **extra) -> dict:
    return {
        "step_s": [b - a for a, b in itertools.pairwise(ends)],
        "step_cpu_s": [b - a for a, b in itertools.pairwise(cpu)],
        "tokens": tokens,
        "rewards": rewards,
        "params": params,
        "peak_rss_mb": peak_rss_mb(),
        **extra,
    }


def child(args) -> None:
    """One measurement: ``--side`` with ``--size``/``--kl`` settings, JSON to ``--json``."""
    import torch

    torch.set_num_threads(args.threads)
    s = Setting(**json.loads(args.setting))
    work = Path(args.work)
    load_before = os.getloadavg()[0]
    result = (run_lmrl if args.side == "lmrl" else run_trl)(s, work)
    result |= {"side": args.side, "setting": asdict(s), "threads": torch.get_num_threads(),
               "loadavg_1m": [load_before, os.getloadavg()[0]]}  # fmt: skip
    Path(args.json).write_text(json.dumps(result))


# -------------------------------------------------------------------------------- parent
def spawn(side: str, s: Setting, work: Path, out: Path, threads: int = THREADS) -> dict:
    env = os.environ | {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(work / "hf_home"),
        "WANDB_DISABLED": "true",
        "WANDB_MODE": "disabled",
        "PYTHONWARNINGS": "ignore",
    }
    cmd = [sys.executable, __file__, "--side", side, "--setting", json.dumps(asdict(s)),
           "--work", str(work), "--json", str(out), "--threads", str(threads)]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"{side} {s.size} kl={s.kl} failed (exit {proc.returncode})")
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


def summarize(runs: list[dict], warmup: int) -> dict:
    """Median step time over every timed step of every repetition, and the rest.

    ``tokens_per_s`` is the median generated tokens of a step over the median step time;
    ``final_reward`` the mean over repetitions (seeds) of the mean reward of a run's last
    ``FINAL_STEPS`` steps, ``final_reward_std`` its standard deviation over the seeds;
    ``median_cpu_s`` the median process CPU seconds of a step (user + system, all threads),
    which another job's load on the machine disturbs less than wall time.
    """
    times = [t for r in runs for t in r["step_s"][warmup:]]
    tokens = [n for r in runs for n in r["tokens"][warmup:]]
    median = statistics.median(times)
    rep_medians = [statistics.median(r["step_s"][warmup:]) for r in runs]
    cpu = [t for r in runs for t in r.get("step_cpu_s", [])[warmup:]]
    finals = [statistics.mean(r["rewards"][-FINAL_STEPS:]) for r in runs]
    return {
        "median_s": median,
        "rep_medians_s": rep_medians,
        "median_cpu_s": statistics.median(cpu) if cpu else None,
        "tokens_per_s": statistics.median(tokens) / median,
        "tokens_per_step": sum(tokens) / len(tokens),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "final_reward": statistics.mean(finals),
        "final_reward_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "mean_reward": statistics.mean(statistics.mean(r["rewards"]) for r in runs),
        "rewards": [r["rewards"] for r in runs],
        "params": runs[0]["params"],
        "stages_s": stage_medians(runs, warmup),
    }


def stage_medians(runs: list[dict], warmup: int) -> dict[str, float]:
    """lmrl's ``timing_s/<stage>`` metrics: the median over every timed step (empty for TRL)."""
    stages: dict[str, list[float]] = {}
    for r in runs:
        for step in r.get("stages", [])[warmup:]:
            for key, value in step.items():
                stages.setdefault(key.removeprefix("timing_s/"), []).append(value)
    return {k: statistics.median(v) for k, v in stages.items()}


def stage_table(results: list[dict]) -> str:
    """Where lmrl's step goes: median seconds per stage."""
    names = sorted({k for r in results for k in r["lmrl"]["stages_s"]} - {"step"})
    order = ["gen", "reward", "old_log_prob", "ref", "adv", "update_actor"]
    names = [n for n in order if n in names] + [n for n in names if n not in order]
    lines = ["| size | KL | " + " | ".join(names) + " | step |", "|" + "---|" * (len(names) + 3)]
    for r in results:
        st = r["lmrl"]["stages_s"]
        cells = " | ".join(f"{st[n]:.3f}" if n in st else "-" for n in names)
        lines.append(
            f"| {r['size']} | {'k3' if r['kl'] else 'off'} | {cells} | {st.get('step', 0):.3f} |"
        )
    return "\n".join(lines)


def machine(threads: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    import transformers
    import trl

    return (
        f"{cpu}, {os.cpu_count()} cores visible, {threads} threads; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, trl {trl.__version__}, "
        f"python {platform.python_version()}"
    )


def table(results: list[dict]) -> str:
    head = (
        "| size | KL | lmrl s/step | TRL s/step | TRL/lmrl | CPU s/step lmrl / TRL (ratio) "
        "| lmrl tok/s | TRL tok/s | lmrl peak RSS MB | TRL peak RSS MB "
        "| lmrl final reward | TRL final reward |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in results:
        a, b = r["lmrl"], r["trl"]
        lines.append(
            f"| {r['size']} ({a['params'] / 1e6:.1f}M) | {'k3' if r['kl'] else 'off'} "
            f"| {a['median_s']:.3f} | {b['median_s']:.3f} | **{b['median_s'] / a['median_s']:.2f}x** "
            f"| {_cpu(a, b)} | {a['tokens_per_s']:.0f} | {b['tokens_per_s']:.0f} "
            f"| {a['peak_rss_mb']:.0f} | {b['peak_rss_mb']:.0f} "
            f"| {_reward(a)} | {_reward(b)} |"
        )
    return "\n".join(lines)


def _reward(side: dict) -> str:
    if "final_reward_std" not in side:
        return f"{side['final_reward']:.3f}"
    return f"{side['final_reward']:.3f} ± {side['final_reward_std']:.3f}"


def _cpu(a: dict, b: dict) -> str:
    if not a.get("median_cpu_s") or not b.get("median_cpu_s"):
        return "-"
    ratio = b["median_cpu_s"] / a["median_cpu_s"]
    return f"{a['median_cpu_s']:.3f} / {b['median_cpu_s']:.3f} ({ratio:.2f}x)"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.4), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        for side, color in (("lmrl", "tab:blue"), ("trl", "tab:orange")):
            curves = np.array([c[: min(map(len, r[side]["rewards"]))] for c in r[side]["rewards"]])
            steps = np.arange(1, curves.shape[1] + 1)
            # each seed faint; the mean over seeds, smoothed over 5 steps, +-1 standard error
            mean = curves.mean(0)
            kernel = np.ones(5) / 5
            smooth = np.convolve(np.pad(mean, 2, mode="edge"), kernel, mode="valid")
            spread = curves.std(0) / np.sqrt(len(curves))
            for curve in curves:
                ax.plot(steps, curve, color=color, alpha=0.12, linewidth=0.8)
            label = f"{side} (mean of {len(curves)} seeds, 5-step average)"
            ax.plot(steps, smooth, color=color, linewidth=2.2, label=label)
            ax.fill_between(steps, smooth - spread, smooth + spread, color=color, alpha=0.25)
        ax.set_title(f"{r['size']}, KL {'k3' if r['kl'] else 'off'}")
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward of the batch")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--kl", default="0,1", help="settings: 0 (beta=0), 1 (k3 KL loss)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--sides", default="lmrl,trl", help="lmrl,trl; one side alone gives no table"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per child")
    parser.add_argument(
        "--first-seed", type=int, default=0, help="repetition i runs seed first_seed + i"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=THREADS,
        help="torch threads per child (timings in the README use 2; learning runs may use 1 "
        "and run two harnesses side by side)",
    )
    parser.add_argument(
        "--lmrl-no-k3-clamp",
        action="store_true",
        help="diagnostic: lmrl's k3 unclamped, as TRL's (lmrl clamps it at 10, as verl does)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 rep, 1+2 steps")
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--work", default=None, help="models and data (default: a temp dir)")
    parser.add_argument(
        "--from-json",
        action="store_true",
        help="re-summarize the child JSONs in --out, run nothing",
    )
    # child mode
    parser.add_argument("--side", choices=["lmrl", "trl"])
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        child(args)
        return

    sizes = args.sizes.split(",")
    sides = args.sides.split(",")
    kls = [int(k) for k in args.kl.split(",")]
    reps = 1 if args.quick else args.reps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="lmrl-vs-trl-"))
    if not args.from_json:
        prepare(work, sizes)
    results, threads = [], set()  # the torch threads the children ran with
    for size in sizes:
        for kl in kls:
            s = settings_for(size, kl, args.quick, args.steps)
            s.k3_clamp = not args.lmrl_no_k3_clamp
            runs: dict[str, list[dict]] = {"lmrl": [], "trl": []}
            if args.from_json:
                for side in runs:
                    for path in sorted(out.glob(f"{side}-{size}-kl{kl}-*.json")):
                        runs[side].append(json.loads(path.read_text()))
                s = Setting(**runs["lmrl"][0]["setting"])
                reps = 0
            for rep in range(args.first_seed, args.first_seed + reps):
                s.seed = rep  # independent reward curves; timing is seed-independent
                for side in sides:  # alternating: lmrl, TRL, lmrl, TRL, ...
                    json_out = out / f"{side}-{size}-kl{kl}-{rep}.json"
                    r = spawn(side, s, work, json_out, args.threads)
                    runs[side].append(r)
                    med = statistics.median(r["step_s"][s.warmup :])
                    print(f"{size} kl={kl} rep {rep} {side:4}: median {med:.3f} s/step, "
                          f"peak RSS {r['peak_rss_mb']:.0f} MB, wall {r['wall_s']:.0f}s, "
                          f"load {r['loadavg_1m'][0]:.1f}->{r['loadavg_1m'][1]:.1f}",
                          flush=True)  # fmt: skip
            if not all(runs.values()):
                continue
            threads.update(r.get("threads", THREADS) for rs in runs.values() for r in rs)
            results.append(
                {"size": size, "kl": kl, "setting": asdict(s)}
                | {side: summarize(rs, s.warmup) for side, rs in runs.items()}
            )
    if not results:
        print(f"one side only: its child JSONs are in {out}")
        return
    report = {"machine": machine("/".join(map(str, sorted(threads)))), "results": results}
    (out / "vs_trl.json").write_text(json.dumps(report, indent=1))
    plot(results, out / "vs_trl_rewards.png")
    print(f"\n{report['machine']}\n")
    print(table(results))
    print("\nlmrl stages (median s):\n")
    print(stage_table(results))
    print(f"\nwrote {out / 'vs_trl.json'} and {out / 'vs_trl_rewards.png'}")


if __name__ == "__main__":
    main()
