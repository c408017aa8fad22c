"""Benchmark: lmrl's response log-probs against the naive ``log_softmax().gather()``.

A Qwen2 model with Qwen's vocabulary (V = 151,936) on a tiny body (hidden 64, one layer), so
that the output head dominates as it does for small policies with large vocabularies. Inputs
are B=8 sequences of a P=32-token prompt and a T=1024-token response, no padding (trimming
has nothing to cut: only the log-prob maths is compared). Two cases:

- ``forward``: no grad, lmrl's ``compute_log_probs`` (one micro-batch of 8) against
  ``log_softmax(model(...).logits.float(), -1).gather(...)`` (how old and reference log-probs
  are computed);
- ``forward+backward``: lmrl's ``forward_log_probs`` against the same naive expression, each
  followed by ``backward()`` of ``sum(log_probs)`` (the actor update).

Each measurement runs in a fresh subprocess: the model and inputs are built, the peak RSS is
reset (``/proc/self/clear_refs``), the case runs, and the peak is read back (``VmHWM``), so
the "peak" column is the memory the computation itself added. Times are the median of
``--repeats`` runs after that first one. Results are checked against each other (log-probs
and the gradient of the output head).

    python benchmarks/logprobs.py                  # the issue's sizes; needs ~16 GB free
    python benchmarks/logprobs.py --batch 2 --response-length 256   # a quick run

The naive forward+backward is skipped, with a note, when less memory is available than it
needs (about 3 copies of the fp32 (B, T, V) logits).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HIDDEN, LAYERS, PROMPT = 64, 1, 32


def build(args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=4 * HIDDEN,
        max_position_embeddings=PROMPT + args.response_length,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, PROMPT + args.response_length), generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids, dtype=torch.bool),
        "position_ids": torch.arange(ids.shape[1]).expand_as(ids).contiguous(),
        "responses": ids[:, PROMPT:].contiguous(),
    }
    return model, batch


def naive_log_probs(model, batch):
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"].long(),
        position_ids=batch["position_ids"],
    ).logits[:, PROMPT - 1 : -1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, batch["responses"][..., None]).squeeze(-1)


def run_case(args) -> dict:
    """Runs in the subprocess: one (implementation, case) pair."""
    from lmrl.models import compute_log_probs, forward_log_probs

    torch.set_num_threads(args.threads)
    model, batch = build(args)

    def once():
        model.zero_grad(set_to_none=True)
        if args.case == "forward":
            if args.impl == "lmrl":
                return compute_log_probs(model, batch, micro_batch_size=args.batch)[0], None
            with torch.no_grad():
                return naive_log_probs(model, batch), None
        logp = (
            forward_log_probs(model, batch)[0]
            if args.impl == "lmrl"
            else naive_log_probs(model, batch)
        )
        logp.sum().backward()
        return logp.detach(), model.lm_head.weight.grad

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    base = _status_kb("VmRSS")
    start = time.perf_counter()
    logp, grad = once()
    first = time.perf_counter() - start
    peak = _status_kb("VmHWM") - base
    times = [first]
    for _ in range(args.repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return {
        "peak_mb": peak / 1024,
        "time_s": statistics.median(times[1:] or times),
        "logp_sum": logp.double().sum().item(),
        "logp_head": logp[0, :8].tolist(),
        "grad_norm": grad.double().norm().item() if grad is not None else None,
    }


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


def spawn(args, impl: str, case: str) -> dict:
    cmd = [
        sys.executable, __file__, "--impl", impl, "--case", case,
        "--batch", str(args.batch), "--response-length", str(args.response_length),
        "--vocab", str(args.vocab), "--repeats", str(args.repeats), "--threads", str(args.threads),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{impl} {case} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs after the first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--impl", choices=["lmrl", "naive"], help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=["forward", "forward+backward"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.impl:  # inside a subprocess
        print(json.dumps(run_case(args)))
        return

    logits_mb = args.batch * args.response_length * args.vocab * 4 / 2**20
    print(
        f"B={args.batch} T={args.response_length} V={args.vocab} hidden={HIDDEN} "
        f"layers={LAYERS}; one fp32 (B, T, V) tensor = {logits_mb:,.0f} MB; "
        f"{args.threads} threads; median of {args.repeats} runs"
    )
    rows = []
    # The naive side holds about 3 fp32 (B, T, V) tensors at its peak in both cases (full
    # logits, a contiguous copy of the response slice, the log-softmax; then its gradients).
    for case, copies in (("forward", 3), ("forward+backward", 3)):
        ours = spawn(args, "lmrl", case)
        need = copies * logits_mb * 1.1
        if _available_mb() < need + 1024:
            print(
                f"skipping naive {case}: needs ~{need:,.0f} MB, {_available_mb():,.0f} MB available"
            )
            rows.append((case, ours, None))
            continue
        rows.append((case, ours, spawn(args, "naive", case)))

    header = (
        f"{'case':<18}{'lmrl peak MB':>14}{'naive peak MB':>15}{'mem ratio':>11}"
        f"{'lmrl s':>9}{'naive s':>9}{'speed-up':>10}   check"
    )
    print(header)
    print("-" * len(header))
    for case, ours, naive in rows:
        if naive is None:
            print(
                f"{case:<18}{ours['peak_mb']:>14,.0f}{'skipped':>15}{'':>11}{ours['time_s']:>9.2f}"
            )
            continue
        diff = max(abs(a - b) for a, b in zip(ours["logp_head"], naive["logp_head"], strict=True))
        check = f"max |dlogp| {diff:.1e}"
        if ours["grad_norm"] is not None:
            rel = abs(ours["grad_norm"] - naive["grad_norm"]) / naive["grad_norm"]
            check += f", head grad norm rel {rel:.1e}"
        print(
            f"{case:<18}{ours['peak_mb']:>14,.0f}{naive['peak_mb']:>15,.0f}"
            f"{ours['peak_mb'] / naive['peak_mb']:>11.3f}{ours['time_s']:>9.2f}"
            f"{naive['time_s']:>9.2f}{naive['time_s'] / ours['time_s']:>9.2f}x   {check}"
        )


if __name__ == "__main__":
    main()
