"""Tokens per second of the ``hf`` rollout engine against a plain ``model.generate`` call.

Both sample from the same tiny model (built locally with `lmrl.models.tiny.build_tiny_model`)
with the same settings: a batch of left-padded prompts, temperature 1, no top-p / top-k
truncation, and EOS disabled so that both generate exactly ``max_new_tokens`` tokens per
row (the engine gets an EOS id outside the vocabulary, ``model.generate`` a generation config
without ``eos_token_id``). Each is run ``--reps`` times after one warm-up; the table shows the
median wall time and tokens per second (``batch * max_new_tokens / time``) and the ratio.

Usage:
    python benchmarks/generate.py [--size tiny] [--batch 64] [--max-new-tokens 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

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
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
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


if __name__ == "__main__":
    main()
