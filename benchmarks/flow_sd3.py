"""Benchmark: one Flow-GRPO step on an SD3-shaped model on a GPU: seconds, images/s, memory.

The model is diffusers' ``SD3Transformer2DModel`` built from Stable Diffusion 3 medium's
configuration (24 joint blocks, 24 heads of 64, ~2B parameters) with random weights (speed
and memory do not depend on them), in bf16, trained with LoRA (PEFT, rank ``--lora-rank`` on
the attention projections, as Flow-GRPO trains SD3.5; the adapters in fp32) or fully
(``--lora-rank 0``: fp32 weights, AdamW's state in fp32); the forward runs under bf16 autocast. The prompts are random text embeddings of the shapes SD3's
encoders give (333 tokens x 4096, pooled 2048); the unconditional ones are zeros.

The step is lmrl's own (`lmrl.flow.FlowSampler`, `lmrl.flow.FlowGRPO`): ``--images`` images at
``--resolution`` pixels (latents 16 x res/8 x res/8), ``--num-steps`` denoising steps of SD3's
shifted schedule (shift 3) with classifier-free guidance ``--cfg`` in sampling and in the
update (as Flow-GRPO does), bypass old log-probs. Two layouts side by side: every step SDE and
trained (Flow-GRPO), and Flow-GRPO-Fast's ``--sde-steps`` SDE steps at the start (only those
trained). For each: the median over ``--repeat`` steps (after one warm-up step) of sampling and
update time, images per second of a whole step, and the peak GPU memory of the step.

With ``--train-flow`` it times ``lmrl train-flow`` itself instead: a random pipeline of SD3.5
Medium's shape (`lmrl.flow.random_sd3`: text encoders, VAE, transformer; ``--tiny``: the tests'
tiny one) is written to a temporary directory and loaded through ``model.path`` as a user's
SD3.5; each layout runs ``--repeat`` + 1 steps of ``--images`` images (prompts x 4) with LoRA,
bf16 compute and CFG, and the figures come from the run's own ``metrics.jsonl`` (the first
step is the warm-up): seconds a step, images/s, its parts, and the peak GPU memory.

    python benchmarks/flow_sd3.py                          # CUDA; ~2 min on an H100/H200
    python benchmarks/flow_sd3.py --tiny --device cpu      # a 2-block smoke run on a CPU
    python benchmarks/flow_sd3.py --train-flow             # lmrl train-flow on SD3.5-M's shape
    python benchmarks/flow_sd3.py --train-flow --tiny --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmrl.flow import FlowGRPO, FlowGRPOConfig, FlowSampler

# Stable Diffusion 3 medium's transformer (diffusers' SD3Transformer2DModel arguments)
SD3_MEDIUM = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
    attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
    caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192,
)  # fmt: skip
TINY = {**SD3_MEDIUM, "num_layers": 2, "num_attention_heads": 2, "caption_projection_dim": 128}
TEXT_TOKENS, POOLED = 333, 2048  # SD3's CLIP + T5 sequence and pooled widths
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                "to_add_out"]  # fmt: skip


class SD3Velocity(torch.nn.Module):
    """``(x, t, cond) -> velocity`` over an SD3 transformer: ``cond`` (B, 334, 4096) packs the
    text embeddings (the first 333 rows) and the pooled embedding (the first 2048 entries of
    the last row), so that a `Batch` slices one tensor; ``t`` in [0, 1] is SD3's timestep / 1000
    (both predict ``noise - data``)."""

    def __init__(self, transformer: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.transformer, self.dtype = transformer, dtype

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.dtype):
            out = self.transformer(
                hidden_states=x.to(self.dtype),
                timestep=t * 1000,
                encoder_hidden_states=cond[:, :-1].to(self.dtype),
                pooled_projections=cond[:, -1, :POOLED].to(self.dtype),
                return_dict=False,
            )[0]
        return out.float()


def build(args) -> tuple[torch.nn.Module, list[torch.nn.Parameter], int]:
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    full = args.lora_rank == 0
    with torch.device(args.device):  # initialized where it runs (2B parameters on a CPU: slow)
        net = SD3Transformer2DModel(**(TINY if args.tiny else SD3_MEDIUM))
    total = sum(p.numel() for p in net.parameters())
    if args.checkpointing:
        net.enable_gradient_checkpointing()
    net = net.to(args.device, dtype=torch.float32 if full else torch.bfloat16)
    if not full:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank,
                          target_modules=LORA_TARGETS, init_lora_weights="gaussian")  # fmt: skip
        net = get_peft_model(net, lora)
        for p in net.parameters():  # the adapters train in fp32 (PEFT keeps the base dtype)
            if p.requires_grad:
                p.data = p.data.float()
    trainable = [p for p in net.parameters() if p.requires_grad]
    return SD3Velocity(net, torch.bfloat16), trainable, total


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_layout(name: str, sampler: FlowSampler, args) -> dict:
    model, trainable, total = build(args)
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    config = FlowGRPOConfig(clip_range=1e-4, micro_batch_size=args.micro)
    grpo = FlowGRPO(model, sampler, opt, config)
    res = (args.resolution // 8) if not args.tiny else 16
    gen = torch.Generator(device=args.device).manual_seed(0)
    cond = torch.randn(args.images, TEXT_TOKENS + 1, 4096, device=args.device,
                       dtype=torch.bfloat16, generator=gen)  # fmt: skip
    uncond = torch.zeros_like(cond)
    times: dict[str, list[float]] = {"sample": [], "update": []}
    peaks = []
    for i in range(args.repeat + 1):
        noise = torch.randn(args.images, 16, res, res, device=args.device, generator=gen)
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        sync(args.device)
        t0 = time.perf_counter()
        model.eval()
        batch = sampler.sample(model, cond, noise, uncond=uncond, generator=gen)
        sync(args.device)
        t1 = time.perf_counter()
        adv = torch.randn(args.images, device=args.device, generator=gen)
        metrics = grpo.update(batch, adv, uncond=uncond)
        sync(args.device)
        t2 = time.perf_counter()
        if i == 0:  # warm-up: kernels chosen, allocator grown; on-policy, the ratio is ~1
            first = {k.removeprefix("actor/"): metrics[k] for k in ("actor/pg_clipfrac",
                     "actor/ppo_kl")}  # fmt: skip
            continue
        times["sample"].append(t1 - t0)
        times["update"].append(t2 - t1)
        if args.device.startswith("cuda"):
            peaks.append(torch.cuda.max_memory_allocated() / 2**30)
    med = {k: statistics.median(v) for k, v in times.items()}
    step = sum(med.values())
    trained = int(sampler.train_mask().sum())
    print(f"\n{name}: {args.images} images at {args.resolution}px, {sampler.num_steps} steps "
          f"(CFG {args.cfg}), {trained} trained; {total / 1e6:.0f}M parameters, "
          f"{sum(p.numel() for p in trainable) / 1e6:.1f}M trained")  # fmt: skip
    for key, value in med.items():
        print(f"  {key:<8} {value:7.2f} s  ({100 * value / step:4.1f}%)")
    print(f"  {'step':<8} {step:7.2f} s   {args.images / step:6.2f} images/s")
    print(f"  first update (on-policy, bf16): clipfrac {first['pg_clipfrac']:.3f}, "
          f"ppo_kl {first['ppo_kl']:.2e} (clip range {config.clip_range:g})")  # fmt: skip
    if peaks:
        print(f"  peak GPU memory {max(peaks):.1f} GiB")
    del model, grpo, opt, batch
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"step": step, **med}


def train_flow(args) -> dict[str, dict[str, float]]:
    """``lmrl train-flow`` on a random SD3 pipeline directory, per layout (see the docstring)."""
    import json
    import tempfile
    from pathlib import Path

    from lmrl.config.flow import load_flow_config
    from lmrl.flow.random_sd3 import build_random_sd3
    from lmrl.trainer.flow import FlowTrainer, build_flow

    root = Path(tempfile.mkdtemp(prefix="lmrl-flow-sd3-"))
    started = time.perf_counter()
    build_random_sd3(root / "pipeline", "tiny" if args.tiny else "sd35-medium")
    print(f"random pipeline written in {time.perf_counter() - started:.0f} s")
    words = ["red", "blue", "green", "cat", "dog", "cup", "tree", "car"]
    lines = [f"a {a} {b}" for a in words[:3] for b in words[3:]]
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    per_prompt = 4
    resolution = 16 if args.tiny else args.resolution  # the tiny VAE down-samples 2x
    results = {}
    for layout in args.layouts.split(","):
        window = [f"sampler.sde_steps={args.sde_steps}"] if layout == "fast" else []
        run = root / f"run_{layout}"
        overrides = [
            f"model.path={root / 'pipeline'}", f"model.resolution={resolution}",
            f"data.train_files={root / 'train.txt'}", f"trainer.default_local_dir={run}",
            f"trainer.device={args.device}", "trainer.logger=[jsonl]", "trainer.save_freq=-1",
            "trainer.test_freq=-1", "trainer.val_before_train=false",
            f"trainer.total_training_steps={args.repeat + 1}",
            f"data.train_batch_size={max(1, args.images // per_prompt)}",
            f"sampler.n={per_prompt}", f"sampler.num_steps={args.num_steps}",
            f"sampler.guidance_scale={args.cfg}", f"actor.micro_batch_size={args.micro}",
            f"model.lora_rank={args.lora_rank}", "mixed_precision=bf16", "reward.name=brightness",
            *window,
        ]  # fmt: skip
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        trainer = FlowTrainer(build_flow(load_flow_config(None, overrides)))
        trainer.fit()
        trainer.close()
        steps = [json.loads(x) for x in (run / "metrics.jsonl").open() if '"timing_s/step"' in x]
        measured = steps[1:] or steps
        med = {k: statistics.median(m[f"timing_s/{k}"] for m in measured)
               for k in ("sample", "reward", "update", "step")}  # fmt: skip
        images = len(lines[: max(1, args.images // per_prompt)]) * per_prompt
        print(f"\nlmrl train-flow, {'Flow-GRPO-Fast' if window else 'Flow-GRPO'}: {images} images "
              f"at {resolution}px, {args.num_steps} steps, CFG {args.cfg}, LoRA "
              f"{args.lora_rank}")  # fmt: skip
        for key in ("sample", "reward", "update"):
            print(f"  {key:<8} {med[key]:7.2f} s  ({100 * med[key] / med['step']:4.1f}%)")
        print(f"  {'step':<8} {med['step']:7.2f} s   {images / med['step']:6.2f} images/s")
        if args.device.startswith("cuda"):
            med["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            print(f"  peak GPU memory {med['peak_gib']:.1f} GiB")
        results[layout] = med
        del trainer
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="2 blocks, 128 px: a smoke run")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--images", type=int, default=16, help="images per step")
    p.add_argument("--num-steps", type=int, default=10, help="denoising steps")
    p.add_argument("--sde-steps", type=int, default=2, help="Flow-GRPO-Fast's SDE steps")
    p.add_argument("--cfg", type=float, default=4.5, help="classifier-free guidance")
    p.add_argument("--micro", type=int, default=4, help="images per forward in the update")
    p.add_argument("--lora-rank", type=int, default=32, help="0 = full fine-tuning")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    p.add_argument("--repeat", type=int, default=2, help="measured steps (after a warm-up)")
    p.add_argument("--layouts", default="fast,full", help="fast, full or both")
    p.add_argument("--train-flow", action="store_true", help="time lmrl train-flow itself")
    args = p.parse_args()
    if args.tiny:
        args.resolution = 128
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --device cpu --tiny for a smoke run")
        torch.backends.cuda.matmul.allow_tf32 = True
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    else:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    common = dict(num_steps=args.num_steps, noise_level=0.7, shift=3.0,
                  guidance_scale=args.cfg)  # fmt: skip
    if args.train_flow:
        results = train_flow(args)
        if len(results) == 2:
            ratio = results["fast"]["step"] / results["full"]["step"]
            print(f"\nFast / full step time: {ratio:.2f}")
        return
    results = {}
    for layout in args.layouts.split(","):
        if layout == "full":
            results[layout] = one_layout("Flow-GRPO (all steps SDE)", FlowSampler(**common), args)
        elif layout == "fast":
            results[layout] = one_layout(
                f"Flow-GRPO-Fast ({args.sde_steps} SDE steps)",
                FlowSampler(**common, sde_steps=args.sde_steps), args,
            )  # fmt: skip
        else:
            raise SystemExit(f"--layouts: fast or full, not {layout!r}")
    if len(results) == 2:
        print(f"\nFast / full step time: {results['fast']['step'] / results['full']['step']:.2f}")


if __name__ == "__main__":
    main()
