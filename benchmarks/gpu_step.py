"""lmrl against TRL's ``GRPOTrainer`` on one GPU: a GRPO step of Qwen2.5-shaped models in bf16,
its generation and its update, against the card's bf16 peak and memory-bandwidth roofline.

Both sides train the same randomly initialized Qwen2 (``SHAPES``: ``0.5b`` and ``1.5b`` have
Qwen2.5-0.5B's and -1.5B's sizes, tied embeddings, rope_theta 1e6, the 151,936-token
vocabulary; ``tiny`` is for a CPU smoke run, ``mid`` for CPU A/Bs of the update) built from a
``Qwen2Config``, with a local byte-level BPE of 151,936 entries whose words are one token each
(``build_tokenizer``), so a prompt of 256 words is 256 tokens on both sides. Nothing is downloaded. Each step, by default:
32 prompts x G=8, prompts of exactly 256 tokens, responses of exactly 512 (EOS ignored: lmrl
``rollout.ignore_eos=true``; TRL ``generation_kwargs={"min_new_tokens": 512}``, which masks
EOS until then), temperature 1, the same reward (``token_reward``), group-std advantages, one
optimizer step per generation batch (TRL ``per_device_train_batch_size`` = ``--micro-batch``,
``gradient_accumulation_steps`` = rows / micro-batch; lmrl ``ppo_micro_batch_size`` =
``--micro-batch``), token-mean loss (TRL ``loss_type="dapo"``), clip 0.2, no KL, AdamW lr
1e-6 constant, no weight decay, grad clip 1, gradient checkpointing on both or off on both
(``--no-grad-ckpt``), bf16 weights (lmrl ``model.dtype=bfloat16``; TRL loads bf16 weights,
``bf16=True``), vLLM off.

Each side runs in a fresh child process (``sys.executable``, with the repository's ``src`` on
``PYTHONPATH``), one shape at a time, lmrl then TRL, under ``--child-timeout`` and what is
left of ``--budget`` (the whole run): a side that fails or hangs is recorded with its error,
the rest still runs, and the JSON is rewritten after every side. A first child builds every
shape's model (on the device, in bf16) and the prompts once into ``--work``; both sides load
that directory. lmrl runs its real trainer (``Trainer(build_run(load_config(None,
overrides)))``, as ``lmrl train`` builds it, stepped with ``Trainer.step``: ``fit`` would also
write a final checkpoint); ``--lmrl-args`` adds ``key=value`` overrides. TRL runs
``GRPOTrainer.train``. Under gradient checkpointing lmrl shares a group's prompt pass on a CPU
only (``lmrl.models.forward.CHECKPOINTED_SHARING_DEVICES``); for an A/B in one run, the side
``lmrl-shared`` shares it on any device and ``lmrl-unshared`` on none.

Timing (``--warmup`` untimed steps, then ``--steps`` timed; each figure is the median over
the timed steps; steps end after a ``torch.cuda.synchronize``):

- **step s**: from the end of one step to the end of the next (TRL: ``on_step_end``).
- **gen s**: lmrl's ``timing_s/gen`` from the step's metrics (what ``metrics.jsonl`` logs);
  TRL has no such log outside W&B, so its ``_generate`` (tokenize, ``model.generate``,
  decode) is wrapped with a synchronized clock.
- **update s**: lmrl's ``timing_s/update_actor`` (+ ``timing_s/old_log_prob`` when it
  recomputes old log-probs with a separate forward); TRL: step s - gen s (its reward call,
  advantages, forward/backward micro-batches and optimizer step).
- **gen tok/s** = rows x response_len / gen s; **update tok/s** = rows x (prompt_len +
  response_len) / update s.
- **MFU** = update FLOPs / update s / the card's bf16 dense peak (``CARDS``, or
  ``--peak-tflops``). Update FLOPs = 6 x N x rows x S + 6 x N_head x rows x R + 12 x layers x
  hidden x S x (rows x S) / 2, with S = prompt_len + response_len, R = response_len, N the
  non-embedding parameters and N_head the (tied) head's: forward and backward (x3 of the
  forward's 2 per parameter per token), the head only over response positions (neither side
  needs the prompt's logits), causal attention scores and values at half the S x S. Gradient
  checkpointing's recompute is not counted (model FLOPs, not hardware FLOPs). A side that
  recomputes old log-probs with a separate forward gets that forward's third added.
- **decode roofline** = ideal decode seconds / gen s, where the ideal reads, per decode step
  t = 0..R-1, every weight once in bf16 plus the KV cache, rows x (prompt_len + t) x layers x
  2 (K, V) x kv_heads x head_dim x 2 bytes, at the card's HBM bandwidth (``CARDS``, or
  ``--hbm-tbps``). Prefill is not in the ideal and is in gen s.
- **peak GB**: ``torch.cuda.max_memory_allocated``, reset after the warm-up steps.

Usage:
    python benchmarks/gpu_step.py                                  # both shapes, ~6 min on H200
    python benchmarks/gpu_step.py --shapes 1.5b --sides lmrl --lmrl-args key=value key=value
    python benchmarks/gpu_step.py --device cpu --shapes tiny --prompts 2 --samples 2 \\
        --prompt-len 8 --response-len 8                            # CPU smoke, ~1 min

Needs trl (``pip install -c constraints.txt trl==1.16.0``). Writes ``--out`` (default
``benchmarks/results/gpu_step.json``): device, versions, the config and every figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import resource
import shutil
import statistics
import string
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# name -> (hidden, layers, heads, kv_heads, intermediate, vocab)
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "0.5b": (896, 24, 14, 2, 4864, 151_936),  # Qwen2.5-0.5B
    "1.5b": (1536, 28, 12, 2, 8960, 151_936),  # Qwen2.5-1.5B
    "tiny": (64, 2, 4, 2, 128, 151_936),  # CPU smoke
    "mid": (512, 8, 8, 2, 1408, 151_936),  # CPU: a backbone heavier than the head (gpu_update)
}
LMRL_SIDES = ("lmrl", "lmrl-shared", "lmrl-unshared")  # lmrl as is, prompts shared or not
# device-name fragment -> (bf16 dense peak FLOP/s, HBM bytes/s)
CARDS = {"H200": (989.4e12, 4.8e12), "H100 80GB HBM3": (989.4e12, 3.35e12),
         "H100 SXM": (989.4e12, 3.35e12)}  # fmt: skip
QWEN2_SPLIT = (  # Qwen2's pre-tokenizer pattern (transformers' tokenization_qwen2.py)
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIALS = ("<|endoftext|>", "<|pad|>", "<|im_end|>")  # eos, pad, unused: the last ids


@dataclass
class Setting:
    """What one child runs; the same on both sides."""

    shape: str
    prompts: int = 32
    samples: int = 8
    prompt_len: int = 256
    response_len: int = 512
    micro_batch: int = 16
    grad_ckpt: bool = True
    warmup: int = 1
    steps: int = 2
    lr: float = 1e-6
    seed: int = 0
    device: str = "cuda"
    lmrl_args: list[str] = field(default_factory=list)
    profile: str = ""  # lmrl: profile one more step after the timed ones, its table here

    @property
    def rows(self) -> int:
        return self.prompts * self.samples


INT_ARGS = ("prompts", "samples", "prompt_len", "response_len", "micro_batch", "warmup", "steps")


def token_reward(completions, completion_ids, **_) -> list[float]:
    """The reward on both sides (batched, TRL's convention): the fraction of the response's
    token ids divisible by 4. Cheap, and it varies between samples."""
    return [sum(t % 4 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


# ---------------------------------------------------------------------------- FLOPs, bytes
def param_counts(shape: str) -> dict[str, int]:
    """Parameters of a Qwen2 of ``SHAPES[shape]`` (q/k/v biases, tied head)."""
    h, layers, heads, kvh, inter, vocab = SHAPES[shape]
    kv = kvh * (h // heads)
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * inter + 2 * h
    embed = vocab * h
    return {"total": embed + layers * layer + h, "non_embedding": layers * layer + h,
            "head": embed}  # fmt: skip


def update_flops(s: Setting, recompute: bool) -> float:
    """Model FLOPs of one update (the module docstring states the formula)."""
    h, layers, *_ = SHAPES[s.shape]
    n = param_counts(s.shape)
    seq = s.prompt_len + s.response_len
    tokens = s.rows * seq
    flops = 6 * n["non_embedding"] * tokens + 6 * n["head"] * s.rows * s.response_len
    flops += 12 * layers * h * seq * tokens / 2
    return flops * (4 / 3 if recompute else 1)


def decode_bytes(s: Setting) -> float:
    """HBM bytes an ideal decode reads over the response: all weights per step (bf16) plus
    the KV cache of every row at its context."""
    h, layers, heads, kvh, *_ = SHAPES[s.shape]
    r, p = s.response_len, s.prompt_len
    weights = 2 * param_counts(s.shape)["total"] * r
    kv_per_token = layers * 2 * kvh * (h // heads) * 2
    return weights + s.rows * kv_per_token * (r * p + r * (r - 1) / 2)


# ---------------------------------------------------------------------------- preparation
def build_tokenizer(vocab: int):
    """A byte-level BPE of exactly ``vocab`` entries, Qwen2's pre-tokenizer, whose words are
    single tokens: a space and four letters (``" abcd"``, built by merges through ``" a"``,
    ``" ab"``, ``" abc"``), then ``SPECIALS``. ``transformers`` loads a ``qwen2`` model's
    tokenizer as ``Qwen2Tokenizer`` whatever was saved, which rebuilds exactly this."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre
    from transformers import PreTrainedTokenizerFast

    letters = string.ascii_lowercase
    tokens, merges = ["Ġ", *letters], []
    for n in range(3):
        for left in ("Ġ" + "".join(p) for p in itertools.product(letters, repeat=n)):
            tokens += [left + c for c in letters]
            merges += [(left, c) for c in letters]
    words = vocab - len(tokens) - len(SPECIALS)
    for combo in itertools.islice(itertools.product(letters, repeat=4), words):
        tokens.append("Ġ" + "".join(combo))
        merges.append(("Ġ" + "".join(combo[:3]), combo[3]))
    tokens += SPECIALS
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    split = pre.Split(Regex(QWEN2_SPLIT), behavior="isolated")
    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[1], unk_token=None
    )


def prepare(s: Setting, shapes: list[str], work: Path) -> dict:
    """Child: each shape's model (random init on the device, bf16) and tokenizer in
    ``work/<shape>``, and the prompts in ``work/prompts.jsonl``; returns the device's name."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config

    tokenizer = build_tokenizer(SHAPES[shapes[0]][5])  # every shape has Qwen2.5's vocabulary
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    for shape in shapes:
        h, layers, heads, kvh, inter, vocab = SHAPES[shape]
        config = Qwen2Config(
            vocab_size=vocab, hidden_size=h, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kvh, intermediate_size=inter,
            max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
            rms_norm_eps=1e-6, bos_token_id=None, use_sliding_window=False, **ids,
        )  # fmt: skip
        torch.manual_seed(s.seed)
        with torch.device(s.device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.generation_config = GenerationConfig(**ids)
        model.save_pretrained(work / shape)
        tokenizer.save_pretrained(work / shape)
    rng = random.Random(s.seed)
    # " abcd efgh ...": every word, with its space, is one token
    texts = ["".join(" " + "".join(rng.choices("abcdefgh", k=4)) for _ in range(s.prompt_len))
             for _ in range(s.prompts * (s.warmup + s.steps))]  # fmt: skip
    with open(work / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": t, "data_source": "gpu_step"}) + "\n" for t in texts)
    loaded = AutoTokenizer.from_pretrained(work / shapes[0])  # as both sides load it
    lengths = {len(row) for row in loaded(texts)["input_ids"]}
    if len(loaded) != SHAPES[shapes[0]][5] or lengths != {s.prompt_len}:
        raise RuntimeError(f"{type(loaded).__name__}: {len(loaded)} entries, prompts of "
                           f"{lengths} tokens, not {s.prompt_len}")  # fmt: skip
    return machine(s.device)


def machine(device: str) -> dict[str, str]:
    """The device's name and the versions of what runs on it."""
    import platform

    import torch
    import transformers

    name = torch.cuda.get_device_name() if device == "cuda" else platform.machine()
    out = {"device_name": name, "python": platform.python_version(),
           "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip
    for name in ("trl", "accelerate", "lmrl"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "missing"
    return out


# ---------------------------------------------------------------------------- the sides
def sync(device: str, reset_peak: bool = False) -> None:
    """Wait for the device's queued work; ``reset_peak``: restart its peak-memory count."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()


def lmrl_overrides(s: Setting, work: Path, steps: int) -> list[str]:
    """lmrl's config for setting ``s`` on the models and prompts in ``work``: the recipe of the
    module docstring, ``steps`` training steps, then ``s.lmrl_args``."""
    return [
        f"model.path={work / s.shape}", "model.dtype=bfloat16",
        f"model.enable_gradient_checkpointing={str(s.grad_ckpt).lower()}",
        f"data.train_files={work / 'prompts.jsonl'}", f"data.max_prompt_length={s.prompt_len}",
        f"data.max_response_length={s.response_len}", f"data.train_batch_size={s.prompts}",
        f"data.seed={s.seed}",
        f"rollout.n={s.samples}", "rollout.ignore_eos=true", "rollout.temperature=1.0",
        "rollout.top_p=1.0", "rollout.top_k=-1",
        f"rollout.log_prob_micro_batch_size={s.micro_batch}",
        "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=true",
        f"actor.ppo_mini_batch_size={s.prompts}", f"actor.ppo_micro_batch_size={s.micro_batch}",
        "actor.ppo_epochs=1", "actor.clip_ratio=0.2", "actor.loss_agg_mode=token-mean",
        "actor.entropy_coeff=0", "actor.use_kl_loss=false", "actor.grad_clip=1.0",
        f"actor.optim.lr={s.lr}", "actor.optim.weight_decay=0", "actor.optim.lr_warmup_steps=0",
        "actor.optim.lr_scheduler=constant",
        f"reward.custom_reward_function.path={Path(__file__).resolve()}",
        "reward.custom_reward_function.name=token_reward", "reward.num_workers=0",
        f"trainer.total_training_steps={steps}", "trainer.save_freq=-1",
        "trainer.test_freq=-1", "trainer.resume_mode=disable", "trainer.logger=[]",
        f"trainer.default_local_dir={work / 'runs' / f'lmrl-{s.shape}-{os.getpid()}'}",
        f"trainer.device={s.device}", f"trainer.seed={s.seed}",
        *s.lmrl_args,
    ]  # fmt: skip


def share_prompts_under_checkpointing(on: bool) -> None:
    """In this process, lmrl shares a group's prompt pass under gradient checkpointing on every
    device (``on``) or on none (`lmrl.models.forward.CHECKPOINTED_SHARING_DEVICES`)."""
    import lmrl.models.forward

    lmrl.models.forward.CHECKPOINTED_SHARING_DEVICES = ("cpu", "cuda") if on else ()


def profiled(fn, device: str, rows: int = 40):
    """``fn()`` under the torch profiler (CUDA kernels too on ``cuda``), synchronized: its
    result, and the table of the top ``rows`` operators by self device (or CPU) time."""
    import torch

    kinds = [torch.profiler.ProfilerActivity.CPU]
    kinds += [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else []
    with torch.profiler.profile(activities=kinds) as prof:
        out = fn()
        sync(device)
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    return out, prof.key_averages().table(sort_by=key, row_limit=rows)


def run_lmrl(s: Setting, work: Path, side: str = "lmrl") -> dict:
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    if side != "lmrl":  # where prompts are shared under checkpointing: everywhere, or nowhere
        share_prompts_under_checkpointing(side == "lmrl-shared")

    total = s.warmup + s.steps
    overrides = lmrl_overrides(s, work, total + bool(s.profile))
    cfg = load_config(None, overrides)
    trainer = Trainer(build_run(cfg), cfg.trainer)
    sync(s.device)
    ends, gen, update, stages, tokens = [time.perf_counter()], [], [], [], []
    recomputed = False
    for i in range(total):
        if i == s.warmup:
            sync(s.device, reset_peak=True)
        m = trainer.step()
        sync(s.device)
        ends.append(time.perf_counter())
        recomputed |= m.get("actor/old_log_prob_recomputed", 0.0) > 0
        gen.append(m.get("timing_s/gen", math.nan))  # NaN: the stage was renamed
        update.append(m.get("timing_s/update_actor", math.nan) + m.get("timing_s/old_log_prob", 0))
        stages.append({k.removeprefix("timing_s/"): v for k, v in m.items() if "timing_s/" in k})
        batch = trainer.last_batch
        resp = int(batch["response_mask"].sum())
        tokens.append([int(batch["attention_mask"].sum()) - resp, resp])  # (prompt, response)
    params = sum(p.numel() for p in trainer.parts.actor.model.parameters())
    if s.profile:  # one untimed step more, its actor update under the profiler
        actor, tables = trainer.parts.actor, []
        update_actor = actor.update_actor

        def update_profiled(*args, **kwargs):  # the generation's graph replays stay out of it
            out, table = profiled(lambda: update_actor(*args, **kwargs), s.device)
            tables.append(table)
            return out

        actor.update_actor = update_profiled
        clock = time.perf_counter()
        stage = trainer.step()
        sync(s.device)
        # Two H200 runs (2026-11-27) timed out inside this block: say where the time goes.
        print(f"profiled step and table: {time.perf_counter() - clock:.0f}s", file=sys.stderr,
              flush=True)  # fmt: skip
        stages_line = {k: round(v, 3) for k, v in stage.items() if "timing_s/" in k}
        Path(s.profile).write_text(f"{stages_line}\n{tables[0]}\n")
    trainer.close()
    steps = [b - a for a, b in itertools.pairwise(ends)]
    return dict(step_s=steps, gen_s=gen, update_s=update, stages=stages, tokens=tokens,
                params=params, old_log_prob_recomputed=recomputed)  # fmt: skip


def run_trl(s: Setting, work: Path) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    total = s.warmup + s.steps
    rows = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines()]
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    prompt_tokens: list[int] = []
    response_tokens: list[int] = []

    def reward(completions, completion_ids, **_) -> list[float]:
        response_tokens.append(sum(map(len, completion_ids)))
        return token_reward(completions, completion_ids)

    cuda = s.device == "cuda"
    config = GRPOConfig(
        output_dir=str(work / "runs" / f"trl-{s.shape}-{os.getpid()}"),
        per_device_train_batch_size=s.micro_batch,
        gradient_accumulation_steps=s.rows // s.micro_batch,
        num_generations=s.samples, max_completion_length=s.response_len,
        generation_kwargs={"min_new_tokens": s.response_len},  # EOS masked: always R tokens
        temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, epsilon=0.2, num_iterations=1, loss_type="dapo",
        scale_rewards="group", beta=0.0,
        gradient_checkpointing=s.grad_ckpt, bf16=cuda, fp16=False, use_cpu=not cuda,
        use_vllm=False, max_steps=total, logging_steps=1, save_strategy="no",
        report_to="none", seed=s.seed, data_seed=s.seed, dataloader_num_workers=0,
        disable_tqdm=True, log_completions=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(
        work / s.shape, dtype=torch.bfloat16, device_map=s.device if cuda else None
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(work / s.shape),
    )  # fmt: skip
    gen: list[float] = []

    def wrap(name: str, record) -> None:  # trainer.<name>, timed: record(seconds, its output)
        fn = getattr(trainer, name)

        def timed(*a, **kw):
            sync(s.device)
            start = time.perf_counter()
            out = fn(*a, **kw)
            sync(s.device)
            record(time.perf_counter() - start, out)
            return out

        setattr(trainer, name, timed)

    wrap("_generate", lambda t, _: gen.append(t))  # tokenize, model.generate, decode
    wrap("_tokenize_prompts", lambda _, out: prompt_tokens.append(sum(map(len, out[0]))))
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            sync(s.device)
            ends.append(time.perf_counter())
            if state.global_step == s.warmup:
                sync(s.device, reset_peak=True)

    trainer.add_callback(Clock())
    ends.append(time.perf_counter())  # the first (warm-up) step includes train()'s setup
    trainer.train()
    steps = [b - a for a, b in itertools.pairwise(ends)]
    a = trainer.args
    recomputed = a.gradient_accumulation_steps % (a.steps_per_generation * trainer.num_iterations)
    return dict(
        step_s=steps, gen_s=gen, update_s=[t - g for t, g in zip(steps, gen, strict=True)],
        tokens=[list(t) for t in zip(prompt_tokens, response_tokens, strict=True)],
        params=sum(p.numel() for p in trainer.model.parameters()),
        old_log_prob_recomputed=bool(recomputed),
    )  # fmt: skip


def child(args) -> None:
    """One measurement (``--side``) or the preparation (``--prepare``); JSON to ``--json``."""
    import torch

    s = Setting(**json.loads(args.setting))
    if s.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.prepare:
        result = prepare(s, args.prepare.split(","), Path(args.work))
    else:
        if args.side == "trl":
            result = run_trl(s, Path(args.work))
        else:
            result = run_lmrl(s, Path(args.work), args.side)
    if s.device == "cuda":
        result["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.json).write_text(json.dumps(result))


# ---------------------------------------------------------------------------- the parent
def spawn(cmd_args: list[str], s: Setting, work: Path, out: Path, timeout: float, threads: int):
    """Run a child; returns its JSON, or ``{"error": ...}`` when it failed or timed out."""
    path = [str(REPO / "src"), os.environ.get("PYTHONPATH")]  # lmrl from src, not installed
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, path)),
        "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(work / "hf_home"),
        "WANDB_DISABLED": "true", "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore",
    } | ({"OMP_NUM_THREADS": str(threads)} if s.device == "cpu" else {})  # fmt: skip
    cmd = [sys.executable, str(Path(__file__).resolve()), *cmd_args, "--setting",
           json.dumps(asdict(s)), "--work", str(work), "--json", str(out),
           "--threads", str(threads)]  # fmt: skip
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or b"")[-3000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"error": f"timed out after {timeout:.0f}s", "stderr_tail": tail,
                "wall_s": time.perf_counter() - start}  # fmt: skip
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-6000:])
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:],
                "wall_s": time.perf_counter() - start}  # fmt: skip
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - start
    notes = [line for line in proc.stderr.splitlines() if "engine" in line or "WARN" in line]
    result["notes"] = notes[-10:]  # e.g. the hf engine's decode falling back, said once
    print(*result["notes"], sep="\n", flush=True)
    return result


def figures(r: dict, s: Setting, card: tuple[float | None, float | None]) -> dict:
    """The per-side figures of one child's raw result (medians over the timed steps)."""
    peak, bandwidth = card
    med = {k: statistics.median(r[k][s.warmup :]) for k in ("step_s", "gen_s", "update_s")}
    flops = update_flops(s, r["old_log_prob_recomputed"])
    ideal = decode_bytes(s) / bandwidth if bandwidth else None
    want = [s.rows * s.prompt_len, s.rows * s.response_len]
    return med | {
        "gen_tok_s": s.rows * s.response_len / med["gen_s"],
        "update_tok_s": s.rows * (s.prompt_len + s.response_len) / med["update_s"],
        "update_flops": flops, "update_tflops_s": flops / med["update_s"] / 1e12,
        "mfu": flops / med["update_s"] / peak if peak else None, "decode_ideal_s": ideal,
        "decode_roofline": ideal / med["gen_s"] if ideal else None,
        "tokens_as_set": all(t == want for t in r["tokens"]),  # (prompt, response) per step
    } | {k: r.get(k) for k in ("peak_mem_gb", "peak_rss_mb", "params", "wall_s",
                              "old_log_prob_recomputed")}  # fmt: skip


# figure -> (label, format, True = lower is better)
ROWS = {
    "step_s": ("s/step", "{:.2f}", True), "gen_s": ("gen s", "{:.2f}", True),
    "update_s": ("update s", "{:.2f}", True), "gen_tok_s": ("gen tok/s", "{:.0f}", False),
    "update_tok_s": ("update tok/s", "{:.0f}", False), "mfu": ("update MFU", "{:.1%}", False),
    "update_tflops_s": ("update TFLOP/s", "{:.1f}", False),
    "decode_roofline": ("decode / roofline", "{:.1%}", False),
    "peak_mem_gb": ("peak GB", "{:.1f}", True),
}  # fmt: skip


def table(results: dict) -> str:
    head = "| shape | figure | lmrl | TRL | lmrl advantage (TRL/lmrl time, lmrl/TRL rate) |"
    lines = [head, "|---|---|---|---|---|"]
    for shape, sides in results.items():
        a, b = sides.get("lmrl", {}), sides.get("trl", {})
        for side, r in (("lmrl", a), ("TRL", b)):
            if "error" in r:
                lines.append(f"| {shape} | {side} failed | {r['error']} | | |")
            elif r and not r["tokens_as_set"]:
                lines.append(f"| {shape} | {side}: prompt/response tokens not as set | | | |")
        for key, (label, fmt, lower) in ROWS.items():
            x, y = a.get(key), b.get(key)
            if x is None and y is None:
                continue
            cell = [fmt.format(v) if v is not None else "-" for v in (x, y)]
            ratio = (y / x if lower else x / y) if x and y else None
            lines.append(f"| {shape} | {label} | {cell[0]} | {cell[1]} | "
                         + (f"**{ratio:.2f}x** |" if ratio else "- |"))  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="0.5b,1.5b", help=f"any of {','.join(SHAPES)}")
    p.add_argument("--sides", default="lmrl,trl")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    for name in INT_ARGS:  # --samples: G; --micro-batch: rows per forward/backward
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(Setting, name))
    p.add_argument("--no-grad-ckpt", action="store_true", help="gradient checkpointing off")
    p.add_argument("--lr", type=float, default=Setting.lr)
    p.add_argument("--lmrl-args", nargs="*", default=[], help="extra key=value for lmrl")
    p.add_argument("--profile", action="store_true",
                   help="lmrl: profile the update of one untimed step more, OUT_profile_SHAPE_SIDE.txt")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, help="bf16 dense peak, if not in CARDS")
    p.add_argument("--hbm-tbps", type=float, help="HBM bandwidth in TB/s, if not in CARDS")
    p.add_argument("--child-timeout", type=float, default=300, help="seconds per side")
    p.add_argument("--budget", type=float, default=570, help="seconds for the whole run")
    p.add_argument("--threads", type=int, default=2, help="torch threads (--device cpu)")
    p.add_argument("--work", help="models and prompts (default: a temp dir)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_step.json"))
    p.add_argument("--side", choices=[*LMRL_SIDES, "trl"], help=argparse.SUPPRESS)
    p.add_argument("--prepare", help=argparse.SUPPRESS)
    p.add_argument("--setting", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side or args.prepare:
        try:
            child(args)
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        return

    shapes, sides = args.shapes.split(","), args.sides.split(",")
    if unknown := set(shapes) - set(SHAPES) or set(sides) - {*LMRL_SIDES, "trl"}:
        p.error(f"unknown shapes or sides {sorted(unknown)}; shapes: {list(SHAPES)}")
    base = Setting(shape=shapes[0], **{k: getattr(args, k) for k in INT_ARGS},
                   grad_ckpt=not args.no_grad_ckpt, lr=args.lr, device=args.device,
                   lmrl_args=args.lmrl_args)  # fmt: skip
    base.micro_batch = min(base.micro_batch, base.rows)
    if base.rows % base.micro_batch:
        p.error(f"--micro-batch {base.micro_batch} must divide prompts x samples = {base.rows}")
    work = Path(args.work or tempfile.mkdtemp(prefix="lmrl-gpu-step-"))
    (work / "json").mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def timeout() -> float:  # a child's limit: its own, and what is left of --budget
        return min(args.child_timeout, args.budget - (time.perf_counter() - start))

    info = spawn(["--prepare", ",".join(shapes)], base, work, work / "json" / "prepare.json",
                 args.budget, args.threads)  # fmt: skip
    if "error" in info:
        sys.exit(f"preparing the models failed: {info['error']}\n{info['stderr_tail']}")
    print(f"{info['device_name']}: models and prompts ready in {info['wall_s']:.0f}s", flush=True)
    card = next((v for k, v in CARDS.items() if k in info["device_name"]), (None, None))
    card = (args.peak_tflops * 1e12 if args.peak_tflops else card[0],
            args.hbm_tbps * 1e12 if args.hbm_tbps else card[1])  # fmt: skip
    config = asdict(base) | {"shapes": {k: SHAPES[k] for k in shapes},
                             "params": {k: param_counts(k) for k in shapes},
                             "peak_flops": card[0], "hbm_bytes_s": card[1]}  # fmt: skip
    config.pop("shape")
    report = {"device": info["device_name"], "commit": git_commit(),
              "versions": {k: v for k, v in info.items() if k not in ("device_name", "wall_s")},
              "config": config, "results": {}}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        s = Setting(**(asdict(base) | {"shape": shape}))
        results = report["results"].setdefault(shape, {})
        for side in sides:  # lmrl, then TRL, each a fresh process
            if args.profile and side != "trl":
                s.profile = str(out.with_name(f"{out.stem}_profile_{shape}_{side}.txt"))
            if args.budget - (time.perf_counter() - start) < 30:
                r = {"error": f"not run: --budget {args.budget:.0f}s spent"}
            else:
                r = spawn(["--side", side], s, work, work / "json" / f"{side}-{shape}.json",
                          timeout(), args.threads)  # fmt: skip
            if "error" not in r:
                try:
                    r = figures(r, s, card) | {"raw": r}
                    print(
                        f"{shape} {side:4}: {r['step_s']:.2f} s/step (gen {r['gen_s']:.2f}, "
                        f"update {r['update_s']:.2f}), wall {r['wall_s']:.0f}s",
                        flush=True,
                    )
                except (KeyError, ValueError, statistics.StatisticsError) as err:
                    r = {"error": f"unreadable result ({err!r})", "raw": r}
            if "error" in r:
                print(f"{shape} {side:4}: FAILED ({r['error']})\n"
                      f"{r.get('stderr_tail', '')[-1500:]}", flush=True)  # fmt: skip
            results[side] = r
            report["total_wall_s"] = time.perf_counter() - start
            out.write_text(json.dumps(report, indent=1))  # after every side: a cut run keeps it
    v = report["versions"]
    print(f"\n{report['device']}; torch {v['torch']}, transformers {v['transformers']}, "
          f"trl {v['trl']}, lmrl {v['lmrl']}; total {report['total_wall_s']:.0f}s\n")  # fmt: skip
    print(table(report["results"]))
    print(f"\nwrote {out}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


def git_commit() -> str | None:
    try:
        git = ["git", "-C", str(REPO), "rev-parse", "HEAD"]
        return subprocess.run(git, capture_output=True, text=True).stdout.strip() or None
    except OSError:  # no git
        return None


if __name__ == "__main__":
    main()
