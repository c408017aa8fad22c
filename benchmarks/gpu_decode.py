"""Decode speed of the ``hf`` engine's three paths on one GPU: today's ``DynamicCache`` loop
(``dynamic``), the preallocated cache run eagerly (``static``), and the preallocated cache
with one CUDA graph launch per step (``graphs``; `lmrl.rollout.static`).

The model is shaped like Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocabulary 151,936, tied embeddings) with random weights, built from a
``Qwen2Config`` directly on the device in bf16 (sdpa attention). 32 prompts of 256 random
tokens x 8 samples = 256 rows decode exactly 512 new tokens each (``ignore_eos``),
temperature 1, one seed, so every path does the same work and, being counter-based, draws
the same uniforms. Each path runs once short (a warm-up) and once timed.

Two more paths take the graphs apart (``--modes``): ``graphs-nofold`` attends through the
model's own sdpa (``repeat_kv`` copies the cache to every query head) and ``graphs-full``
also reads the full-width cache every step: together, the graph path before the folded attention.
``graphs-fusednorm`` and ``static-fusednorm`` normalize through ``F.rms_norm``
(``lmrl.rollout.static.FUSED_NORM``, off by default until measured here). A last line
times the sampler alone (``pick`` on (rows, vocabulary) float32 logits) per step.

Printed and written to ``--out`` (JSON): seconds and generated tokens/s per path, whether its
tokens equal the ``graphs`` path's (and the fraction of rows that do: in bf16 the static
attention sums over a wider, masked cache than the growing one, so rounding may part a row's
samples after a while), and the fraction of the memory-bandwidth roofline: the bytes a decode
must read (the bf16 weights once per step, plus each step's KV cache of P + t columns), summed
over the 511 decode forwards, over the card's bandwidth (H200 4.8e12 B/s, H100 3.35e12),
divided by the measured time.

Usage:
    python benchmarks/gpu_decode.py --out benchmarks/results/gpu_decode.json   # CUDA, ~60 s
    python benchmarks/gpu_decode.py --device cpu --tiny                          # a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen2Config

from lmrl.batch import Batch
from lmrl.rollout import HFEngine, SamplingParams
from lmrl.rollout import sampling as sampling_mod
from lmrl.rollout import static as static_mod
from lmrl.rollout.sampling import Draws, pick

QWEN05 = dict(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
    max_position_embeddings=32768, rope_theta=1_000_000.0,
)  # fmt: skip
TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=1000, tie_word_embeddings=True, max_position_embeddings=512,
)  # fmt: skip
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}  # bytes/s of HBM
# a path: (rollout.hf.decode, fold the GQA heads, width bucket (None = the full width),
# fused RMSNorm)
PATHS = {
    "dynamic": ("dynamic", True, static_mod.BUCKET, False),
    "static": ("static", True, static_mod.BUCKET, False),
    "graphs": ("graphs", True, static_mod.BUCKET, False),
    "graphs-nofold": ("graphs", False, static_mod.BUCKET, False),
    "graphs-full": ("graphs", False, None, False),
    "static-fusednorm": ("static", True, static_mod.BUCKET, True),
    "graphs-fusednorm": ("graphs", True, static_mod.BUCKET, True),
}


def pick_ms(rows: int, vocab: int, device: torch.device, reps: int = 20, full=False) -> float:
    """Milliseconds of one sampler step (`pick` at temperature 1) on (rows, vocab) logits;
    ``full``: the draw inverts the whole cumulative sum (a block as large as the vocabulary),
    as before the two-level search."""
    saved = sampling_mod.DRAW_BLOCK
    sampling_mod.DRAW_BLOCK = vocab if full else saved
    try:
        return _pick_ms(rows, vocab, device, reps)
    finally:
        sampling_mod.DRAW_BLOCK = saved


def _pick_ms(rows: int, vocab: int, device: torch.device, reps: int) -> float:
    logits = torch.randn(rows, vocab, device=device)
    draws = Draws(1, torch.arange(rows, device=device))
    sampling = SamplingParams(max_new_tokens=1, seed=1)
    step = torch.zeros(1, dtype=torch.long, device=device)
    pick(logits, sampling, draws, step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        pick(logits, sampling, draws, step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def build(shape: dict, device: str, dtype: torch.dtype):
    config = Qwen2Config(**shape)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def roofline_s(model, rows: int, prompt: int, new: int, bandwidth: float) -> float:
    """Seconds a decode of ``new`` tokens takes at ``bandwidth`` if it only read what it must:
    the weights once per forward and the KV cache written so far (P + t columns)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    per_column = 2 * c.num_hidden_layers * rows * c.num_key_value_heads * head_dim
    per_column *= next(model.parameters()).element_size()
    forwards = range(new - 1)  # the last token is never fed
    total = sum(weights + per_column * (prompt + t + 1) for t in forwards)
    return total / bandwidth


def profile(model, batch, n: int, device: torch.device, steps: int) -> None:
    """Print the kernels of an eager static decode of ``steps`` tokens (prefill included) by
    their own device time (operators and their kernels both listed): what a graph replays."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    static_mod.FOLD_GQA, static_mod.BUCKET = True, PATHS["graphs"][2]
    engine = HFEngine(model, None, eos_token_ids=[0], pad_token_id=0, decode="static")
    sampling = SamplingParams(max_new_tokens=steps, seed=1, ignore_eos=True)
    engine.generate(batch, n=n, sampling=sampling)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch_profile(activities=activities) as prof:
        engine.generate(batch, n=n, sampling=sampling)
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (smoke)")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new", type=int, default=None, help="new tokens per row")
    parser.add_argument("--modes", default="dynamic,static,graphs,graphs-nofold,graphs-full")
    parser.add_argument("--out", default=None, help="write the results here (JSON)")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="STEPS",
        help="then profile an eager static decode of STEPS tokens: GPU time per kernel",
    )  # fmt: skip
    args = parser.parse_args()
    tiny = args.tiny
    prompts = args.prompts or (4 if tiny else 32)
    prompt_len = args.prompt_len or (16 if tiny else 256)
    new = args.new or (24 if tiny else 512)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(TINY if tiny else QWEN05, args.device, dtype)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (prompts, prompt_len), generator=gen)
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)})
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"
    bandwidth = next((b for k, b in BANDWIDTH.items() if k in name), None)
    rows = prompts * args.n
    modes = args.modes.split(",")
    if unknown := set(modes) - set(PATHS):
        parser.error(f"unknown --modes {sorted(unknown)}; choose from {list(PATHS)}")
    modes = [m for m in modes if cuda or not m.startswith("graphs")]

    results, tokens = {}, {}
    for mode in modes:
        decode, static_mod.FOLD_GQA, bucket, static_mod.FUSED_NORM = PATHS[mode]
        static_mod.BUCKET = bucket or 1 << 30
        engine = HFEngine(model, None, eos_token_ids=[0], pad_token_id=0, decode=decode)
        for steps in (min(new, 8), new):  # a warm-up, then the timed run
            sampling = SamplingParams(max_new_tokens=steps, seed=1, ignore_eos=True)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            out = engine.generate(batch, n=args.n, sampling=sampling)
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        assert out["responses"].shape == (rows, new) and bool(out["response_mask"].all())
        tokens[mode] = out["responses"].cpu()
        results[mode] = {
            "seconds": seconds,
            "tokens_per_s": rows * new / seconds,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        }
        if bandwidth:
            results[mode]["roofline_frac"] = roofline_s(model, rows, prompt_len, new, bandwidth)
            results[mode]["roofline_frac"] /= seconds
        print(f"{mode}: {seconds:.2f} s", flush=True)
    sampler = pick_ms(rows, model.config.vocab_size, device)
    sampler_full = pick_ms(rows, model.config.vocab_size, device, full=True)
    ref = "graphs" if "graphs" in tokens else modes[-1]
    for mode in modes:
        same = (tokens[mode] == tokens[ref]).all(dim=1)
        results[mode]["tokens_equal_" + ref] = bool(same.all())
        results[mode]["rows_equal_frac"] = float(same.float().mean())

    print(f"\n{name}: {prompts} prompts x {args.n} samples, prompt {prompt_len}, {new} new tokens")
    print(
        f"{'path':<14} {'s':>7} {'ms/step':>8} {'tok/s':>9} {'roofline':>9} {'peak GB':>8} "
        f"{'= ' + ref:>9}"
    )
    for mode, r in results.items():
        frac = f"{r['roofline_frac']:.1%}" if "roofline_frac" in r else "-"
        peak = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
        print(
            f"{mode:<14} {r['seconds']:>7.2f} {r['seconds'] / new * 1e3:>8.2f} "
            f"{r['tokens_per_s']:>9.0f} {frac:>9} {peak:>8} {r['rows_equal_frac']:>9.1%}"
        )
    print(f"the sampler alone: {sampler:.2f} ms a step ({sampler_full:.2f} with the full cdf)")
    if args.profile:
        profile(model, batch, args.n, device, args.profile)
    if "dynamic" in results and len(results) > 1:
        best = min(results, key=lambda m: results[m]["seconds"])
        speedup = results["dynamic"]["seconds"] / results[best]["seconds"]
        print(f"{best} is {speedup:.1f}x the dynamic loop")
    if args.out:
        report = {
            "device": name, "bandwidth_Bps": bandwidth, "torch": torch.__version__,
            "transformers": transformers.__version__, "prompts": prompts, "n": args.n,
            "prompt_len": prompt_len, "new_tokens": new, "dtype": str(dtype),
            "model": "tiny" if tiny else "qwen2.5-0.5b-shaped", "results": results,
            "sampler_ms_per_step": sampler, "sampler_full_cdf_ms_per_step": sampler_full,
            "bucket": PATHS["graphs"][2],
        }  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
