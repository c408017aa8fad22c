"""lmrl's GRPO update against TRL's on one fixed batch, through each library's real step.

The reward curves of ``vs_trl.py`` are chaotic: a perturbation of the weights grows ~10x every
10 steps, so a run's final reward varies widely between seeds, and comparing the curves
cannot show whether the two libraries compute the same update. This script checks the update
itself. It takes the ``tiny`` setting of ``vs_trl.py`` (8 prompts x G=8 completions, the same
hyperparameters), samples one batch of completions with lmrl's engine, and feeds that same
batch to one real training step on each side: lmrl's ``Trainer.step`` with
``engine.generate`` replaced, and TRL's ``GRPOTrainer.train`` (``max_steps=1``) with
``_generate_single_turn`` replaced. Everything else (chat template, rewards, advantages,
log-probs, loss, backward, clipping, AdamW) is each library's own code. The gradients are
taken just before clipping (lmrl's ``clip_and_step``, TRL's ``_clip_grad_norm``).

It prints, side by side: the prompts (their token ids must be identical), completion tokens,
mean reward, the largest per-row advantage and per-token log-prob differences, the loss, the
pre-clip gradient norm, the cosine and relative L2 distance of the gradients and of the
parameter updates, and the learning rate. It exits non-zero when the prompts, the completions
or the initial weights differ, or when the gradient cosine is below ``MIN_GRAD_COSINE``.

With ``--kl 1`` both sides build a reference model, but from the initial model the policy is
the reference, so the k3 term and its gradient are 0. ``--policy-steps N`` first moves the
policy: N lmrl GRPO steps of the same setting (``--kl`` included) on the full training data,
saved to a temporary model; both sides then start from it while their reference stays the
initial model (lmrl's ``Trainer.ref`` rebuilt with ``build_reference(path=...)``, TRL's
``ref_model`` rebuilt as ``GRPOTrainer.__init__`` builds it). The table then adds the KL loss
(the token mean of k3) on each side, the number of completion tokens whose k3 exceeds 10 and
the largest k3.

Known differences: the advantage's std epsilon (TRL 1e-4, lmrl 1e-6) moves the gradient by
~5e-4 relative; ``--adv-eps 1e-4`` sets lmrl's to TRL's. lmrl clamps k3 to at most 10 (as
verl does), TRL does not: a token above 10 contributes no KL gradient on lmrl's side and
``exp(ref - logp) - 1`` times the log-prob's gradient on TRL's, so one such token moves the
whole gradient. ``--no-k3-clamp`` (a diagnostic, patched in this process only, after the
policy is moved) removes lmrl's clamp. On the tiny setting, 30 policy steps, ``--adv-eps
1e-4``: seed 0 has 3 such tokens of 389 (largest k3 22), gradient cosine 0.99966 and relative
L2 2.6e-2, which ``--no-k3-clamp`` brings to 1.0000000000 and 9e-6; seed 1 has one token
with k3 148: cosine 0.947, relative L2 0.32 (9e-6 unclamped); batches without such a token
agree to ~1e-5 either way. So with the clamp, a batch with such a token fails the
``MIN_GRAD_COSINE`` check.

Usage:
    python benchmarks/vs_trl_update.py [--kl 0|1] [--adv-eps 1e-4] [--seed 0] [--json OUT]
    python benchmarks/vs_trl_update.py --work DIR   # reuse vs_trl.py's models and data
    python benchmarks/vs_trl_update.py --work DIR --kl 1 --adv-eps 1e-4 --policy-steps 30
    python benchmarks/vs_trl_update.py ... --policy-steps 30 --no-k3-clamp   # lmrl unclamped

Without ``--work`` the tiny model is built and SFT-warm-started first (1-2 minutes).
Needs the ``bench`` extra (``pip install -e .[bench]``: trl).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import tempfile
import warnings
from collections import Counter, defaultdict
from pathlib import Path

from vs_trl import (
    BETA,
    G,
    Setting,
    lmrl_trainer,
    prepare,
    settings_for,
    trl_trainer,
    unclamp_k3,
)

MIN_GRAD_COSINE = 0.9999


class Mismatch(Exception):
    """The two sides were not given the same inputs."""


def subset_work(work: Path, out: Path, prompts: int, seed: int, policy: Path | None = None) -> Path:
    """A work dir holding ``prompts`` random rows of ``work``'s training data and a link to its
    tiny model (or to ``policy``): with exactly one batch of data, both samplers pick the same
    prompts."""
    import numpy as np
    import pandas as pd

    df = pd.read_parquet(work / "data" / "train.parquet")
    rows = np.random.default_rng(seed).choice(len(df), prompts, replace=False)
    (out / "data").mkdir(parents=True)
    df.iloc[sorted(rows)].reset_index(drop=True).to_parquet(out / "data" / "train.parquet")
    (out / "tiny").symlink_to((policy or work / "tiny").resolve())
    return out


def move_policy(s: Setting, work: Path, out: Path, steps: int) -> tuple[Path, dict]:
    """``steps`` lmrl GRPO steps of setting ``s`` (its ``kl`` included) from ``work``'s tiny
    model on ``work``'s full training data; the moved policy is saved to ``out / "policy"``:
    the tiny model's files (tokenizer, chat template) with the new weights."""
    import shutil

    run = out / "move"
    (run / "data").mkdir(parents=True)
    (run / "data" / "train.parquet").symlink_to((work / "data" / "train.parquet").resolve())
    (run / "tiny").symlink_to((work / "tiny").resolve())
    trainer = lmrl_trainer(dataclasses.replace(s, steps=steps), run)
    model = trainer.parts.actor.model
    before = flat(model.parameters())
    rewards = []
    for _ in range(steps):
        trainer.step()
        rewards.append(float(trainer.last_batch["token_level_scores"].sum(-1).mean()))
    trainer.close()
    policy = out / "policy"
    shutil.copytree((work / "tiny").resolve(), policy)
    model.save_pretrained(policy)
    first, last = rewards[: min(5, steps)], rewards[-min(5, steps) :]
    return policy, {
        "steps": steps,
        "reward_first5": sum(first) / len(first),
        "reward_last5": sum(last) / len(last),
        "param_distance": float((flat(model.parameters()) - before).norm()),
        "param_norm": float(before.norm()),
    }


def set_trl_reference(trainer, path: Path) -> None:
    """Replace TRL's reference (built from the policy's own path) by the model at ``path``,
    built as ``GRPOTrainer.__init__`` builds its reference."""
    from trl.trainer.grpo_trainer import (
        add_fused_lm_head,
        create_model_from_path,
        disable_dropout_in_model,
    )

    args, model = trainer.args, trainer.model
    if args.cast_lm_head_to_fp32 or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise NotImplementedError("only TRL's plain reference path is rebuilt here")
    ref = create_model_from_path(
        str(path),
        dtype=model.dtype,
        attn_implementation=model.config._attn_implementation,
        trust_remote_code=args.trust_remote_code,
    )
    if args.disable_dropout:
        disable_dropout_in_model(ref)
    add_fused_lm_head(ref, temperature=trainer.temperature, cast_lm_head_to_fp32=False)
    trainer.ref_model = trainer.accelerator.prepare_model(ref, evaluation_mode=True)


def k3_stats(logp: dict, ref: dict, rows: Counter) -> dict:
    """The unclamped k3 = exp(ref - logp) - (ref - logp) - 1 over every completion token: the
    number of tokens above lmrl's clamp (10) and the largest value."""
    import torch

    k3 = []
    for key, n in rows.items():
        x = ref[key].double() - logp[key].double()
        k3 += [torch.expm1(x) - x] * n
    k3 = torch.cat(k3)
    return {"above_clamp": int((k3 > 10).sum()), "max": float(k3.max())}


def prompt_key(ids, mask) -> tuple[int, ...]:
    return tuple(ids[mask.bool()].tolist())


def flat(tensors):
    import torch

    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def compare(a, b) -> tuple[float, float]:
    """Cosine and relative L2 distance (over the larger norm) of two tensors."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    cos = float(a @ b / (a.norm() * b.norm()))
    rel = float((a - b).norm() / max(a.norm(), b.norm()))
    return cos, rel


def fixed_batch(trainer, seed: int) -> dict[tuple[int, ...], list[list[int]]]:
    """G completions (token ids, the stopping token included) for every prompt of the data,
    sampled once with lmrl's engine; keyed by the prompt's token ids."""
    parts = trainer.parts
    prompts = parts.train_data.get_batch(range(len(parts.train_data)))
    out = parts.engine.generate(prompts, G, dataclasses.replace(parts.plan.sampling, seed=seed))
    plen = out["prompts"].shape[1]
    groups: dict[tuple[int, ...], list[list[int]]] = defaultdict(list)
    for r in range(len(out)):
        key = prompt_key(out["prompts"][r], out["attention_mask"][r, :plen])
        groups[key].append(out["responses"][r][out["response_mask"][r]].tolist())
    if len(groups) != len(prompts):
        raise Mismatch("two prompts of the batch have the same token ids")
    return dict(groups)


def run_lmrl(trainer, s: Setting, completions, adv_eps: float | None) -> dict:
    """One ``trainer.step()`` on ``completions``."""
    import torch

    import lmrl.workers.actor as actor_mod
    from lmrl.rollout.base import finish_rollout

    if adv_eps is not None:
        plan = trainer.parts.plan
        estimator = functools.partial(plan.estimator, epsilon=adv_eps)
        trainer.parts = dataclasses.replace(
            trainer.parts, plan=dataclasses.replace(plan, estimator=estimator)
        )
    model = trainer.parts.actor.model
    names = {p: n for n, p in model.named_parameters()}
    before = flat(model.parameters())
    width = max(len(c) for group in completions.values() for c in group)
    got: dict = {"logp": {}}

    def generate(prompts, n, sampling):
        rows = []
        for i in range(len(prompts)):
            rows += completions[prompt_key(prompts["input_ids"][i], prompts["attention_mask"][i])]
        responses = torch.full((len(rows), width), trainer.parts.engine.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for j, ids in enumerate(rows):
            responses[j, : len(ids)] = torch.tensor(ids)
            mask[j, : len(ids)] = True
        zeros = torch.zeros(len(rows), width)
        return finish_rollout(prompts, n, responses, mask, zeros, sampling.temperature)

    forward_log_probs = actor_mod.forward_log_probs
    clip_and_step = actor_mod.clip_and_step

    def logged_forward(model, micro, *args, **kwargs):
        log_prob, entropy = forward_log_probs(model, micro, *args, **kwargs)
        plen = micro["input_ids"].shape[1] - micro["responses"].shape[1]
        for r in range(len(micro)):
            m = micro["response_mask"][r]
            key = prompt_key(micro["input_ids"][r, :plen], micro["attention_mask"][r, :plen])
            got["logp"][(key, *micro["responses"][r][m].tolist())] = log_prob[r][m].detach()
        return log_prob, entropy

    def logged_clip(params, optimizer, grad_clip):
        got["grads"] = {names[p]: p.grad.detach().clone() for p in params if p.grad is not None}
        got["lr"] = optimizer.param_groups[0]["lr"]
        grad_norm, stepped = clip_and_step(params, optimizer, grad_clip)
        got["grad_norm"] = float(grad_norm)
        return grad_norm, stepped

    trainer.parts.engine.generate = generate
    actor_mod.forward_log_probs, actor_mod.clip_and_step = logged_forward, logged_clip
    try:
        metrics = trainer.step()
    finally:
        actor_mod.forward_log_probs, actor_mod.clip_and_step = forward_log_probs, clip_and_step
    trainer.close()

    batch = trainer.last_batch
    plen = batch["prompts"].shape[1]
    rows, adv, ref = Counter(), {}, {}
    for r in range(len(batch)):
        m = batch["response_mask"][r]
        key = prompt_key(batch["prompts"][r], batch["attention_mask"][r, :plen])
        key = (key, *batch["responses"][r][m].tolist())
        rows[key] += 1
        adv[key] = batch["advantages"][r][m][0]
        if "ref_log_probs" in batch:
            ref[key] = batch["ref_log_probs"][r][m]
    loss = metrics["actor/pg_loss"] + (BETA * metrics["actor/kl_loss"] if s.kl else 0.0)
    if s.kl:
        got["kl"] = float(metrics["actor/kl_loss"])
    return got | {
        "prompts": sorted({k[0] for k in rows}),
        "rows": rows,
        "adv": adv,
        "ref": ref,
        "tokens": int(batch["response_mask"].sum()),
        "reward": float(batch["token_level_scores"].sum(-1).mean()),
        "loss": loss,
        "before": before,
        "after": flat(model.parameters()),
    }


def run_trl(s: Setting, work: Path, completions, reference: Path | None = None) -> dict:
    """``GRPOTrainer.train`` for one step on ``completions``; ``reference``: the reference
    model's directory, when it is not the policy's."""
    from transformers import PrinterCallback

    scores: list[float] = []
    trainer = trl_trainer(s, work, on_reward=lambda ids, batch_scores: scores.extend(batch_scores))
    trainer.remove_callback(PrinterCallback)  # its log line would break up the table
    if reference is not None and s.kl:
        set_trl_reference(trainer, reference)
    model = trainer.model
    before = flat(model.parameters())
    handed: Counter = Counter()
    got: dict = {}

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for ids in prompt_ids:
            key = tuple(ids)
            if key not in completions:
                raise Mismatch(f"TRL's prompt {key} is not one of lmrl's")
            out.append(completions[key][handed[key] % G])
            handed[key] += 1
        return out, None

    compute_loss = trainer._compute_loss
    logps_and_entropies = trainer._get_per_token_logps_and_entropies
    clip_grad_norm = trainer._clip_grad_norm

    def logged_loss(model, inputs):
        loss = compute_loss(model, inputs)
        got["inputs"], got["loss"] = inputs, float(loss.detach())
        if s.kl:  # the token mean of k3 (TRL's "kl" metric), as lmrl's actor/kl_loss
            got["kl"] = trainer._metrics["train"]["kl"][-1]
        return loss

    def logged_logps(*args, **kwargs):
        out = logps_and_entropies(*args, **kwargs)
        if kwargs.get("compute_entropy"):  # the loss's forward (the reference's has none)
            got["logp_tensor"] = out[0].detach()
        return out

    def logged_clip(model):
        got["grads"] = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        got["lr"] = trainer.optimizer.param_groups[0]["lr"]
        grad_norm = clip_grad_norm(model)
        got["grad_norm"] = float(grad_norm)
        return grad_norm

    trainer._generate_single_turn = generate
    trainer._compute_loss = logged_loss
    trainer._get_per_token_logps_and_entropies = logged_logps
    trainer._clip_grad_norm = logged_clip
    trainer.train()

    inputs = got.pop("inputs")
    rows, adv, logp, ref = Counter(), {}, {}, {}
    for r in range(inputs["prompt_ids"].shape[0]):
        m = inputs["completion_mask"][r].bool()
        key = (
            prompt_key(inputs["prompt_ids"][r], inputs["prompt_mask"][r]),
            *inputs["completion_ids"][r][m].tolist(),
        )
        rows[key] += 1
        adv[key] = inputs["advantages"][r]
        logp[key] = got["logp_tensor"][r][m]
        if inputs.get("ref_per_token_logps") is not None:
            ref[key] = inputs["ref_per_token_logps"][r][m]
    return got | {
        "prompts": sorted({k[0] for k in rows}),
        "rows": rows,
        "adv": adv,
        "logp": logp,
        "ref": ref,
        "tokens": int(inputs["completion_mask"].sum()),
        "reward": sum(scores) / len(scores),
        "before": before,
        "after": flat(model.parameters()),
    }


def check(lm: dict, tr: dict) -> tuple[dict, list[str]]:
    """The comparison, and what failed."""
    failures = []
    if lm["prompts"] != tr["prompts"]:
        failures.append("the prompt token ids differ")
    if lm["rows"] != tr["rows"]:
        failures.append("the (prompt, completion) rows differ")
    if not bool((lm["before"] == tr["before"]).all()):
        failures.append("the initial weights differ")
    names = list(lm["grads"])
    if set(names) != set(tr["grads"]):
        failures.append("the parameters with a gradient differ")
        names = [n for n in names if n in tr["grads"]]
    grad_cos, grad_rel = compare(
        flat(lm["grads"][n] for n in names), flat(tr["grads"][n] for n in names)
    )
    if not grad_cos >= MIN_GRAD_COSINE:  # also catches NaN
        failures.append(f"gradient cosine {grad_cos:.10f} < {MIN_GRAD_COSINE}")
    update_cos, update_rel = compare(lm["after"] - lm["before"], tr["after"] - tr["before"])
    result = {
        "prompts": {"lmrl": len(lm["prompts"]), "trl": len(tr["prompts"]),
                    "identical": lm["prompts"] == tr["prompts"]},
        "completion_tokens": {"lmrl": lm["tokens"], "trl": tr["tokens"]},
        "mean_reward": {"lmrl": lm["reward"], "trl": tr["reward"]},
        "adv_max_abs_diff": max_abs_diff(lm["adv"], tr["adv"]),
        "logp_max_abs_diff": max_abs_diff(lm["logp"], tr["logp"]),
        "loss": {"lmrl": lm["loss"], "trl": tr["loss"]},
        "grad_norm_preclip": {"lmrl": lm["grad_norm"], "trl": tr["grad_norm"]},
        "grad": {"cos": grad_cos, "rel_l2": grad_rel},
        "update": {"cos": update_cos, "rel_l2": update_rel,
                   "lmrl_norm": float((lm["after"] - lm["before"]).norm()),
                   "trl_norm": float((tr["after"] - tr["before"]).norm())},
        "lr": {"lmrl": lm["lr"], "trl": tr["lr"]},
    }  # fmt: skip
    if lm["ref"] or tr["ref"]:
        result["ref_logp_max_abs_diff"] = max_abs_diff(lm["ref"], tr["ref"])
    if "kl" in lm and "kl" in tr:
        result["kl_loss"] = {"lmrl": lm["kl"], "trl": tr["kl"]}
        result["k3"] = {
            "lmrl": k3_stats(lm["logp"], lm["ref"], lm["rows"]),
            "trl": k3_stats(tr["logp"], tr["ref"], tr["rows"]),
        }
    return result, failures


def max_abs_diff(a: dict, b: dict) -> float:
    """The largest |a - b| over the rows (keys) both have; NaN when they share none."""
    diffs = [float((a[k] - b[k]).abs().max()) for k in a.keys() & b.keys()]
    return max(diffs, default=float("nan"))


def rel(a: float, b: float) -> str:
    return f"rel {abs(a - b) / max(abs(a), abs(b), 1e-30):.1e}"


def table(r: dict) -> str:
    p, u = r["prompts"], r["update"]
    rows = [
        ("prompt ids", f"{p['lmrl']} prompts", f"{p['trl']} prompts",
         "identical" if p["identical"] else "DIFFERENT"),
        ("completion tokens", *r["completion_tokens"].values(),
         r["completion_tokens"]["trl"] - r["completion_tokens"]["lmrl"]),
        ("mean reward", *(f"{v:.4f}" for v in r["mean_reward"].values()),
         f"{r['mean_reward']['trl'] - r['mean_reward']['lmrl']:.1e}"),
        ("advantage", "", "", f"max |diff| {r['adv_max_abs_diff']:.1e}"),
        ("log-prob", "", "", f"max |diff| {r['logp_max_abs_diff']:.1e}"),
        *([("reference log-prob", "", "", f"max |diff| {r['ref_logp_max_abs_diff']:.1e}")]
          if "ref_logp_max_abs_diff" in r else []),
        *([("KL loss (mean k3)", *(f"{v:.6f}" for v in r["kl_loss"].values()),
            rel(*r["kl_loss"].values())),
           ("tokens with k3 > 10", *(v["above_clamp"] for v in r["k3"].values()),
            "lmrl clamps them to 10" if r.get("lmrl_k3_clamped", True)
            else "lmrl unclamped (--no-k3-clamp)"),
           ("largest k3", *(f"{v['max']:.4g}" for v in r["k3"].values()), "")]
          if "kl_loss" in r else []),
        ("loss", *(f"{v:.6f}" for v in r["loss"].values()), rel(*r["loss"].values())),
        ("grad norm (pre-clip)", *(f"{v:.6f}" for v in r["grad_norm_preclip"].values()),
         rel(*r["grad_norm_preclip"].values())),
        ("gradient", "", "", f"cos {r['grad']['cos']:.10f}, rel L2 {r['grad']['rel_l2']:.1e}"),
        ("parameter update", f"norm {u['lmrl_norm']:.4f}", f"norm {u['trl_norm']:.4f}",
         f"cos {u['cos']:.10f}, rel L2 {u['rel_l2']:.1e}"),
        ("learning rate", *(f"{v:g}" for v in r["lr"].values()),
         "same" if r["lr"]["lmrl"] == r["lr"]["trl"] else "DIFFERENT"),
    ]  # fmt: skip
    cells = [("quantity", "lmrl", "TRL", "difference"), *rows]
    widths = [max(len(str(row[i])) for row in cells) for i in range(3)]
    lines = ["  ".join(f"{c!s:<{w}}" for c, w in zip(row, widths, strict=False)) + f"  {row[3]}"
             for row in cells]  # fmt: skip
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kl", type=int, choices=[0, 1], default=0, help="1: the k3 KL loss")
    parser.add_argument(
        "--adv-eps", type=float, default=None, help="lmrl's GRPO std epsilon (TRL's is 1e-4)"
    )
    parser.add_argument("--seed", type=int, default=0, help="picks the prompts and samples")
    parser.add_argument(
        "--policy-steps",
        type=int,
        default=0,
        help="first move the policy by this many lmrl steps (the reference stays the initial "
        "model): with --kl 1, the k3 term and its gradient are no longer 0",
    )
    parser.add_argument(
        "--no-k3-clamp",
        action="store_true",
        help="diagnostic: lmrl's k3 unclamped, as TRL's (in this process only)",
    )
    parser.add_argument("--work", default=None, help="vs_trl.py's models and data, reused")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", default=None, help="write the comparison here")
    args = parser.parse_args()

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_DISABLED", "true")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations
    import torch

    from lmrl.models import build_reference

    torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="lmrl-vs-trl-"))
    prepare(work, ["tiny"])
    s = dataclasses.replace(settings_for("tiny", args.kl, False, 1), warmup=0, seed=args.seed)
    moved = None
    with tempfile.TemporaryDirectory(prefix="lmrl-vs-trl-update-") as tmp:
        policy = None
        if args.policy_steps > 0:
            policy, moved = move_policy(s, work, Path(tmp), args.policy_steps)
        if args.no_k3_clamp:
            unclamp_k3()  # after moving the policy: the runs with and without share it
        reference = work / "tiny" if policy is not None else None
        one_batch = subset_work(work, Path(tmp) / "batch", s.prompts, s.seed, policy)
        try:
            trainer = lmrl_trainer(s, one_batch)
            if reference is not None and trainer.parts.reference is not None:
                trainer.parts.reference.reference = build_reference(
                    trainer.parts.actor.model, reference, dtype="float32", device="cpu"
                )
            completions = fixed_batch(trainer, s.seed)
            lm = run_lmrl(trainer, s, completions, args.adv_eps)
            tr = run_trl(s, one_batch, completions, reference)
        except Mismatch as e:
            sys.exit(f"FAIL: {e}")
    result, failures = check(lm, tr)
    if "k3" in result:
        result["lmrl_k3_clamped"] = not args.no_k3_clamp
    print(
        f"one step on one fixed batch ({s.prompts} prompts x {G}), kl={args.kl}, seed={s.seed}, "
        f"lmrl's adv epsilon {args.adv_eps if args.adv_eps is not None else '1e-6 (default)'}"
        + (", lmrl's k3 UNCLAMPED" if args.no_k3_clamp else "")
    )
    if moved:
        print(
            f"policy: {moved['steps']} lmrl steps (kl={args.kl}) from the initial model, "
            f"mean reward {moved['reward_first5']:.3f} (first 5) -> {moved['reward_last5']:.3f} "
            f"(last 5), |delta params| {moved['param_distance']:.3f} "
            f"(|params| {moved['param_norm']:.1f})"
            + ("; reference: the initial model" if args.kl else "")
        )
    print()
    print(table(result))
    if args.json:
        report = {"kl": args.kl, "seed": s.seed, "adv_eps": args.adv_eps,
                  "policy_steps": args.policy_steps, "moved_policy": moved,
                  "no_k3_clamp": args.no_k3_clamp, "failures": failures}  # fmt: skip
        Path(args.json).write_text(json.dumps(report | result, indent=1))
    if failures:
        sys.exit("\nFAIL: " + "; ".join(failures))
    print(f"\nOK: same inputs, gradient cosine >= {MIN_GRAD_COSINE}")


if __name__ == "__main__":
    main()
