"""lmrl's actor update alone, in variants, alternating in one process: where the update's time
goes at gpu_step's shapes, in seconds of device time rather than minutes of whole steps.

The model, prompts and recipe are `gpu_step.py`'s (``--shape``, 32 prompts x 8, 256 + 512
tokens, bf16, micro-batches of 16, token-mean loss, clip 0.2, no KL). One real step
(``Trainer.step``: generation, reward, advantages, update) makes the batch and warms up; then
every variant runs ``ActorWorker.update_actor`` on that same batch (one optimizer step each,
old log-probs taken from the update's own forward, as the step does), in rounds that alternate
the variants, each timed between two ``torch.cuda.synchronize`` with its peak memory. A
variant is ``CKPT:SHARE[:reads]``:

- ``CKPT``: ``ckpt`` (gradient checkpointing, the default) or ``full`` (no recompute);
- ``SHARE``: ``shared`` (each group's prompt runs once, `lmrl.models.forward`) or ``unshared``
  (every row's prompt in full); without checkpointing lmrl always shares them, so ``full``
  has ``shared`` only;
- ``:reads``: the update without the host's layout of the rows (`lmrl.models.layout`), so that
  each micro-batch reads its shape back from the device as without the layout: the layout's
  gain, measured in the same process.

Each variant runs on the step's batch (``plain``: every prompt exactly prompt_len tokens, so
the full pass attends with no mask) and on a ``ragged`` copy (``--batches``), whose groups'
prompts are left-padded by a random 0 to prompt_len / 2 tokens (their first tokens masked out),
as prompts of different lengths are in real data: there the full pass attends through a mask as
the shared response pass does. ``--profile VARIANT`` profiles one more update of that variant
on the plain batch (the top operators by self device time, to ``OUT_profile_VARIANT.txt``).

MFU counts the model FLOPs of ``gpu_step.update_flops`` (no recompute, every row's prompt in
full), so a variant that does less work scores higher for the same figure.

Usage:
    python benchmarks/gpu_update.py --shape 1.5b     # 3 variants x 2 batches x 2 rounds
    python benchmarks/gpu_update.py --shape 1.5b --batches ragged --variants ckpt:shared ckpt:unshared
    python benchmarks/gpu_update.py --device cpu --shape tiny --prompts 2 --samples 4 \\
        --prompt-len 16 --response-len 8 --micro-batch 4       # CPU smoke, ~30 s
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step import (  # the sibling benchmark's recipe
    CARDS,
    REPO,
    SHAPES,
    Setting,
    git_commit,
    lmrl_overrides,
    prepare,
    profiled,
    share_prompts_under_checkpointing,
    sync,
    update_flops,
)

VARIANTS = ("ckpt:shared", "ckpt:unshared", "full:shared", "ckpt:shared:reads")


def ragged(batch, prompt_len: int, samples: int, seed: int):
    """``batch`` with each group's prompt left-padded by a random 0..prompt_len // 2 tokens:
    those columns masked out and the positions restarted after them (every row of a group
    alike)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    groups = len(batch) // samples
    cut = torch.randint(0, prompt_len // 2 + 1, (groups,), generator=g).repeat_interleave(samples)
    out = batch.index(torch.arange(len(batch)))  # a copy
    mask = out["attention_mask"].clone()
    cols = torch.arange(mask.shape[1], device=mask.device)
    mask[cols[None, :] < cut.to(mask.device)[:, None]] = False
    out["attention_mask"] = mask
    out["position_ids"] = (mask.long().cumsum(1) - 1).clamp(min=0)
    return out


def set_variant(actor, variant: str) -> None:
    """Checkpointing on or off on the actor's model, where prompts are shared under it, and
    whether the update reads its micro-batches' shapes from the host's layout."""
    import lmrl.workers.actor
    from lmrl.models.forward import unwrap
    from lmrl.models.layout import with_row_layout
    from lmrl.models.loading import enable_gradient_checkpointing

    ckpt, share, *reads = variant.split(":")
    lmrl.workers.actor.with_row_layout = (lambda batch: batch) if reads else with_row_layout
    model = unwrap(actor.model)
    if ckpt == "ckpt":
        enable_gradient_checkpointing(model)
    else:  # transformers 5 renamed it, as `enable_gradient_checkpointing` says
        off = getattr(model, "activation_checkpointing_disable", None)
        (off or model.gradient_checkpointing_disable)()
    share_prompts_under_checkpointing(share == "shared")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1.5b", choices=list(SHAPES))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    for name in ("prompts", "samples", "prompt_len", "response_len", "micro_batch"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(Setting, name))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batches", nargs="+", default=["plain", "ragged"], choices=["plain", "ragged"])
    p.add_argument("--profile", choices=VARIANTS, help="profile one more update of it")
    p.add_argument("--lmrl-args", nargs="*", default=[], help="extra key=value for lmrl")
    p.add_argument("--work", help="model and prompts (default: a temp dir)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_update.json"))
    args = p.parse_args()

    import torch

    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    s = Setting(shape=args.shape, prompts=args.prompts, samples=args.samples,
                prompt_len=args.prompt_len, response_len=args.response_len,
                micro_batch=args.micro_batch, warmup=1, steps=0, device=args.device,
                lmrl_args=["rollout.hf.decode=auto", *args.lmrl_args])  # fmt: skip
    if s.rows % s.micro_batch:
        p.error(f"--micro-batch {s.micro_batch} must divide prompts x samples = {s.rows}")
    work = Path(args.work or tempfile.mkdtemp(prefix="lmrl-gpu-update-"))
    clock = time.perf_counter()
    info = prepare(s, [s.shape], work)
    cfg = load_config(None, lmrl_overrides(s, work, 1))
    trainer = Trainer(build_run(cfg), cfg.trainer)
    trainer.step()  # the batch, and a warm-up of every path the update takes
    batches = {"plain": trainer.last_batch}
    batches["ragged"] = ragged(batches["plain"], s.prompt_len, s.samples, s.seed)
    cases = [(v, b) for b in args.batches for v in args.variants]  # (variant, batch)
    actor = trainer.parts.actor
    print(f"{info['device_name']}: model, batch and a warm-up step in "
          f"{time.perf_counter() - clock:.0f}s", flush=True)  # fmt: skip

    import lmrl.models.forward

    shared = []  # micro-batches that shared their prompts: the variants really differ
    group_hidden = lmrl.models.forward.group_hidden

    def counted(*a, **k):
        shared.append(1)
        return group_hidden(*a, **k)

    lmrl.models.forward.group_hidden = counted

    def update(variant: str, batch: str) -> tuple[float, float]:
        set_variant(actor, variant)
        sync(s.device, reset_peak=True)
        shared.clear()
        start = time.perf_counter()
        actor.update_actor(batches[batch], old_log_probs_from_update=True)
        sync(s.device)
        peak = torch.cuda.max_memory_allocated() / 2**30 if s.device == "cuda" else float("nan")
        return time.perf_counter() - start, peak

    for variant in args.variants:  # each path once untimed (the first full pass allocates)
        update(variant, args.batches[0])
    times: dict[str, list[float]] = {f"{v} {b}": [] for v, b in cases}
    peaks: dict[str, float] = {}
    for _ in range(args.rounds):
        for variant, batch in cases:
            name = f"{variant} {batch}"
            seconds, peaks[name] = update(variant, batch)
            times[name].append(seconds)
            print(f"{name:21} {seconds:.3f} s ({len(shared)} micro-batches shared)", flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    peak_flops = next((v[0] for k, v in CARDS.items() if k in info["device_name"]), None)
    flops = update_flops(s, recompute=False)
    tokens = s.rows * (s.prompt_len + s.response_len)
    rows = {}
    print(
        f"\n{info['device_name']}; {s.shape}, {s.prompts} x {s.samples} rows, "
        f"{s.prompt_len} + {s.response_len} tokens, micro-batches of {s.micro_batch}\n"
    )
    print("| variant | update s (median) | tokens/s | MFU | peak GB |\n|---|---|---|---|---|")
    for variant, seconds in times.items():
        median = statistics.median(seconds)
        mfu = flops / median / peak_flops if peak_flops else None
        rows[variant] = {"update_s": seconds, "median_s": median, "tokens_s": tokens / median,
                         "mfu": mfu, "peak_gb": peaks[variant]}  # fmt: skip
        print(
            f"| {variant} | {median:.3f} | {tokens / median:,.0f} | "
            + (f"{100 * mfu:.1f}% |" if mfu else "- |")
            + f" {peaks[variant]:.1f} |"
        )
    report = {"device": info["device_name"], "commit": git_commit(),
              "versions": {k: v for k, v in info.items() if k != "device_name"},
              "setting": vars(args) | {"rows": s.rows}, "results": rows}  # fmt: skip
    out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out}", flush=True)
    if args.profile:  # last: profiled gpu_step children have run out of time (H200, 2026-11-27)
        set_variant(actor, args.profile)
        clock = time.perf_counter()
        _, table = profiled(
            lambda: actor.update_actor(batches["plain"], old_log_probs_from_update=True), s.device
        )
        path = out.with_name(f"{out.stem}_profile_{args.profile.replace(':', '_')}.txt")
        path.write_text(table + "\n")
        print(f"profile: {path} ({time.perf_counter() - clock:.0f}s)", flush=True)
    trainer.close()


if __name__ == "__main__":
    main()
