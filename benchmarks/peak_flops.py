"""This machine's fp32 matmul peak, and how much of it a training forward+backward achieves.

1. Peak: the best GFLOP/s of square fp32 ``torch.mm`` (sizes 256-2048, ``2 n^3`` FLOPs each,
   median of ``--reps`` after a warm-up) with ``--threads`` threads.
2. Training: the policy forward+backward of one GRPO update of ``vs_trl.py``'s model
   (``--size small``: hidden 512, 8 layers, 32k vocabulary) on a batch shaped like the
   benchmark's: ``--prompts`` prompts x G=8 samples, ``--prompt-len`` prompt and
   ``--response-len`` response tokens, through ``lmrl.models.forward_log_probs`` (the actor's
   update path), with shared prompts (the default) and without. FLOPs are counted by
   ``torch.utils.flop_counter.FlopCounterMode`` over the same call (every matmul and attention
   of forward and backward, as executed), the time is the median of ``--reps`` calls.
   "useful" FLOPs are the unshared count (what the plain computation of the same log-probs
   and gradients costs), so the shared path's useful FLOP/s can exceed what it executes.

Usage:
    python benchmarks/peak_flops.py [--threads 2] [--size small] [--prompts 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from algos import timed


def matmul_peak(reps: int) -> tuple[float, int]:
    """Best fp32 GFLOP/s over square sizes, and the size that reached it."""
    best = (0.0, 0)
    for n in (256, 512, 1024, 1536, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        seconds = timed(lambda a=a, b=b: torch.mm(a, b), reps, warmup=1)[0]
        best = max(best, (2 * n**3 / seconds / 1e9, n))
    return best


def grpo_batch(prompts: int, g: int, prompt_len: int, response_len: int, vocab: int):
    """``prompts x g`` rows, each prompt repeated ``g`` times, distinct full-length responses."""
    from lmrl.batch import Batch

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, min(vocab, 256), (prompts, prompt_len), generator=gen)
    prompt = prompt.repeat_interleave(g, dim=0)
    responses = torch.randint(0, min(vocab, 256), (prompts * g, response_len), generator=gen)
    ids = torch.cat([prompt, responses], dim=1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": torch.arange(ids.shape[1]).expand_as(ids).contiguous(),
            "responses": responses,
            "response_mask": torch.ones_like(responses, dtype=torch.bool),
        }
    )


def train_flops(model, batch, share: bool, reps: int) -> tuple[float, float]:
    """(FLOPs, median seconds) of ``forward_log_probs`` + backward."""
    from torch.utils.flop_counter import FlopCounterMode

    from lmrl.models import forward_log_probs

    def step():
        log_probs, _ = forward_log_probs(model, batch, 1.0, with_entropy=True, share_prompts=share)
        log_probs.sum().backward()
        model.zero_grad(set_to_none=True)

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return counter.get_total_flops(), timed(step, reps, warmup=1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", default="small")
    parser.add_argument("--model", default=None, help="a saved model (default: build --size)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    peak, n = matmul_peak(args.reps)
    print(f"fp32 matmul peak, {args.threads} threads: {peak:.1f} GFLOP/s (n={n})")

    from transformers import AutoModelForCausalLM

    path = args.model
    if path is None:
        from vs_trl import build_model

        path = build_model(Path(tempfile.mkdtemp()) / args.size, args.size)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    params = sum(p.numel() for p in model.parameters())
    batch = grpo_batch(args.prompts, 8, args.prompt_len, args.response_len, model.config.vocab_size)
    rows, tokens = batch["input_ids"].shape[0], batch["input_ids"].numel()
    print(
        f"{args.size} model ({params / 1e6:.1f}M params), {rows} rows x "
        f"{args.prompt_len}+{args.response_len} tokens, forward_log_probs + backward:"
    )
    useful = None
    for share in (False, True):
        flops, seconds = train_flops(model, batch, share, args.reps)
        useful = useful or flops
        rate = flops / seconds / 1e9
        print(
            f"  share_prompts={share!s:5}: {seconds:.3f} s, {flops / 1e9:.1f} GFLOP executed "
            f"({flops / tokens / params:.2f} x params x tokens), {rate:.1f} GFLOP/s = "
            f"{100 * rate / peak:.0f}% of peak; useful {useful / seconds / 1e9:.1f} GFLOP/s = "
            f"{100 * useful / seconds / 1e9 / peak:.0f}% of peak"
        )


if __name__ == "__main__":
    main()
