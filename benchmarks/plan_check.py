"""Benchmark: ``lmrl plan``'s prediction against the memory the step really takes, per phase.

For each model shape, random weights are built from a config (nothing is downloaded) and saved
with lmrl's byte tokenizer; ``lmrl plan``'s arithmetic (`lmrl.trainer.memory_plan.plan_memory`)
predicts each phase from the config alone; then the workers the trainer builds
(`lmrl.workers.build.build_workers`, the actor role: policy and ``hf`` engine) run, in the
order of a step after the first:

1. one actor update (unmeasured: AdamW's moments now exist, as in every later step);
2. ``rollout``: the hf engine generates ``--batch`` sequences of ``--response-length`` tokens
   (``ignore_eos``) after a ``--prompt-length``-token prompt;
3. ``old log-probs``: the actor's log-probs of a full-length batch, micro-batch ``--micro``;
4. ``actor update``: the update again, ``--batch`` rows in micro-batches of ``--micro``.

Measured: on CUDA ``torch.cuda.max_memory_allocated`` over the phase (reset before it; it
counts everything allocated, weights and optimizer included, as the plan's totals do); on a
CPU the peak of live tensor bytes (`lmrl.models.memory.LiveTensorBytes`, exact; the weights,
buffers and optimizer state registered first). The config is the trainer's on that device:
fp32 masters and AdamW moments, bf16 compute on CUDA (``model.mixed_precision.param_dtype``
auto), fp32 on a CPU; one process.

Shapes: ``qwen0.5b`` (hidden 896, 24 layers, 14 heads, 2 kv heads, intermediate 4864, vocab
151936, tied: Qwen2.5-0.5B) and ``qwen1.5b`` (1536, 28, 12, 2, 8960, tied: Qwen2.5-1.5B);
``tiny``/``small``/``base`` are lmrl's tiny models for a CPU smoke run.

    python benchmarks/plan_check.py --out plan_check.json            # CUDA: ~1 min on an H200
    python benchmarks/plan_check.py --device cpu --shapes tiny --out /tmp/plan_check.json

Each shape runs with gradient checkpointing on (the default); ``--no-checkpointing-too`` adds
the 0.5B case without it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN = {
    "qwen0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                     tie_word_embeddings=True),
    "qwen1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                     tie_word_embeddings=True),
}  # fmt: skip
PHASES = ("rollout", "old log-probs", "actor update")


def model_config(shape: str):
    from transformers import Qwen2Config

    from lmrl.models.tiny import tiny_config

    if shape in QWEN:
        return Qwen2Config(**QWEN[shape], max_position_embeddings=4096, rope_theta=1e6)
    return tiny_config("qwen2", shape)


def write_model(shape: str, out: Path, device: torch.device) -> Path:
    """Random weights of ``shape`` (built on ``device``, saved in bf16 on CUDA to save disk
    time; the run loads them as fp32 masters) and lmrl's tokenizer."""
    from transformers import AutoModelForCausalLM

    from lmrl.models.tiny import build_tokenizer

    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(model_config(shape))
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    del model
    return out


class Meter:
    """Peak bytes of a phase: CUDA's allocator statistics, or live tensor bytes on a CPU."""

    def __init__(self, device: torch.device, tensors) -> None:
        self.device, self.tensors = device, tensors

    def __call__(self, fn):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        from lmrl.models.memory import LiveTensorBytes

        with LiveTensorBytes() as live:
            live.track(*self.tensors())
            fn()
        return live.peak


def check(shape: str, args, work: Path, device: torch.device, checkpointing: bool) -> dict:
    from lmrl.batch import Batch
    from lmrl.config import load_config
    from lmrl.models import load_tokenizer
    from lmrl.rollout.base import SamplingParams
    from lmrl.trainer.memory_plan import plan_memory
    from lmrl.trainer.plan import RunPlan
    from lmrl.workers.build import build_workers

    path = work / shape
    if not (path / "config.json").exists():
        write_model(shape, path, device)
    b, p, t, micro = args.batch, args.prompt_length, args.response_length, args.micro
    cfg = load_config(
        None,
        [f"model.path={path}", f"trainer.device={device.type}",
         "algorithm.adv_estimator=reinforce_plus_plus", "rollout.n=1",
         f"data.max_prompt_length={p}", f"data.max_response_length={t}",
         f"data.train_batch_size={b}", f"actor.ppo_mini_batch_size={b}",
         f"actor.ppo_micro_batch_size={micro}", f"rollout.log_prob_micro_batch_size={micro}",
         f"model.enable_gradient_checkpointing={str(checkpointing).lower()}"],
        required=("model.path",),
    )  # fmt: skip
    run_plan = RunPlan.from_config(cfg, device.type)
    plan = plan_memory(run_plan)
    predicted = {ph.name: ph.total for ph in plan.phases}
    start = time.perf_counter()
    workers = build_workers(
        cfg,
        run_plan.workers,
        load_tokenizer(str(path)),
        device,
        total_steps=10,
        roles=frozenset({"actor"}),
    )
    actor, engine = workers.actor, workers.engine
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (b, p + t), generator=g)
    mask = torch.ones(b, p + t, dtype=torch.bool)
    mask[0, :5] = False  # a left-padded prompt: the attention mask exists, as in a run
    batch = Batch({
        "input_ids": ids, "attention_mask": mask,
        "position_ids": (mask.long().cumsum(1) - 1).clamp(min=0),
        "responses": ids[:, p:], "response_mask": mask[:, p:],
        "advantages": torch.randn(b, t, generator=g), "old_log_probs": torch.zeros(b, t),
    })  # fmt: skip
    prompts = Batch({"input_ids": ids[:, :p], "attention_mask": mask[:, :p]})  # on the CPU, as
    # the trainer's batches are: the engine moves them
    actor.update_actor(batch)

    def tensors():
        state = [v for s in actor.optimizer.state.values() for v in s.values()]
        return [*actor.model.parameters(), *actor.model.buffers(), *state]

    meter = Meter(device, tensors)
    sampling = SamplingParams(max_new_tokens=t, ignore_eos=True, seed=0)
    measured = {
        "rollout": meter(lambda: engine.generate(prompts, n=1, sampling=sampling)),
        "old log-probs": meter(lambda: actor.compute_log_probs(batch)),
        "actor update": meter(lambda: actor.update_actor(batch)),
    }
    seconds = time.perf_counter() - start
    return {
        "shape": shape,
        "gradient_checkpointing": checkpointing,
        "params": plan.settings["params"],
        "batch": b, "micro_batch": micro, "prompt_length": p, "response_length": t,
        "compute_bytes": plan.settings["compute_bytes"],
        "phases": {
            name: {"predicted": predicted[name], "measured": measured[name],
                   "ratio": predicted[name] / measured[name]}
            for name in PHASES
        },
        "plan": plan.to_dict(),
        "seconds": seconds,
    }  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated: qwen0.5b, qwen1.5b (CUDA default), tiny, small, "
                        "base (CPU default: tiny)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=8, help="sequences per phase")
    parser.add_argument("--micro", type=int, default=4, help="micro-batch of the update")
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--no-checkpointing-too", action="store_true",
                        help="also run the first shape without gradient checkpointing")  # fmt: skip
    parser.add_argument("--work", type=Path, default=None, help="where models are written")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda but CUDA is not available", file=sys.stderr)
        return 2
    shapes = args.shapes or ("qwen0.5b,qwen1.5b" if device.type == "cuda" else "tiny")
    shapes = [s.strip() for s in shapes.split(",") if s.strip()]
    cases = [(s, True) for s in shapes]
    if args.no_checkpointing_too:
        cases.insert(1, (shapes[0], False))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        results = []
        for shape, checkpointing in cases:
            results.append(check(shape, args, work, device, checkpointing))
            gc.collect()  # the case's workers and models, before the next one is measured
            if device.type == "cuda":
                torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    what = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "live tensor bytes"
    print(f"lmrl plan vs measured ({what}) on {name}; batch {args.batch}, micro "
          f"{args.micro}, {args.prompt_length} + {args.response_length} tokens")  # fmt: skip
    print(f"{'shape':10} {'ckpt':5} {'phase':14} {'predicted':>11} {'measured':>11} {'ratio':>6}")
    for r in results:
        for phase, v in r["phases"].items():
            print(f"{r['shape']:10} {'on' if r['gradient_checkpointing'] else 'off':5} "
                  f"{phase:14} {v['predicted'] / 2**20:9.0f}Mi {v['measured'] / 2**20:9.0f}Mi "
                  f"{v['ratio']:6.3f}")  # fmt: skip
    total = time.perf_counter() - started
    print(f"total {total:.0f} s")
    if args.out is not None:
        args.out.write_text(json.dumps(
            {"device": name, "measured_by": what, "seconds": total, "results": results},
            indent=1,
        ))  # fmt: skip
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
