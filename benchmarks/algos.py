"""Benchmark: lmrl's vectorized estimators and losses against the loops people run today.

The loop baselines are the ones verl ships (seed 000/004): GRPO/RLOO/Pass@k with a Python
loop over samples, GAE and REINFORCE++ with a Python loop over tokens. Each row prints the
median time of both, the speed-up, and the largest deviation of lmrl's float32 result from a
float64 run of the loop.

    python benchmarks/algos.py            # full sizes (a few minutes on 2 cores)
    python benchmarks/algos.py --quick    # smaller sizes, a smoke run

The process uses the allocator setting of the ``lmrl`` command (``lmrl.cli.tune_allocator``)
for both sides; ``--no-tune-allocator`` measures glibc's default behaviour instead. Run it on
a quiet machine: with another process busy, a 2-thread op can stall a whole scheduler tick.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

from lmrl.algos import advantage_estimators, policy_losses
from lmrl.algos.masked import masked_whiten
from lmrl.cli import tune_allocator

# ------------------------------------------------------------------- loop baselines


def loop_gae(rewards, values, mask, gamma, lam):
    """verl's per-token GAE loop (seed 000), masks as 0/1 floats."""
    mask = mask.to(rewards.dtype)
    next_values, last = 0.0, 0.0
    out = []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        new_last = delta + gamma * lam * last
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last = new_last * mask[:, t] + (1 - mask[:, t]) * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    returns = (adv + values) * mask
    return masked_whiten(adv, mask.bool()), returns


def loop_reinforce_pp(rewards, mask, gamma, skip_spans=False):
    """verl's per-token REINFORCE++ loop (seed 004 §5), which resets the running return at a
    masked token; with ``skip_spans`` it carries it through masked spans instead, as lmrl does
    (the same three ops per token), so that masks with gaps compare."""
    keep = mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        if skip_spans:
            running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        else:
            running = rewards[:, t] + gamma * running
        returns[:, t] = running
        if not skip_spans:
            running = running * keep[:, t]
    returns = returns * keep
    return masked_whiten(returns, mask), returns


def loop_grpo(rewards, mask, index, epsilon=1e-6, norm=True):
    """verl's per-sample GRPO loop (seed 004 §2.1)."""
    scores = (rewards * mask).sum(-1)
    groups = defaultdict(list)
    for i in range(scores.shape[0]):
        groups[index[i]].append(scores[i])
    mean, std = {}, {}
    for g, vals in groups.items():
        if len(vals) == 1:
            mean[g], std[g] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            stacked = torch.stack(vals)
            mean[g], std[g] = stacked.mean(), stacked.std()
    for i in range(scores.shape[0]):
        g = index[i]
        scores[i] = (scores[i] - mean[g]) / (std[g] + epsilon) if norm else scores[i] - mean[g]
    return scores.unsqueeze(-1) * mask


def loop_rloo(rewards, mask, index):
    """verl's per-sample RLOO loop (seed 004 §4)."""
    scores = (rewards * mask).sum(-1)
    groups = defaultdict(list)
    for i in range(scores.shape[0]):
        groups[index[i]].append(scores[i])
    mean = {g: torch.stack(v).mean() for g, v in groups.items()}
    for i in range(scores.shape[0]):
        n = len(groups[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - mean[index[i]] * n / (n - 1)
    return scores.unsqueeze(-1) * mask


def loop_passk(rewards, mask, index, epsilon=1e-6):
    """verl's per-group Pass@k loop (seed 004 §3.1)."""
    scores = (rewards * mask).sum(-1)
    adv = torch.zeros_like(scores)
    groups, members = defaultdict(list), defaultdict(list)
    for i in range(scores.shape[0]):
        groups[index[i]].append(scores[i])
        members[index[i]].append(i)
    for g, vals in groups.items():
        stacked = torch.stack(vals)
        top, top_idx = torch.topk(stacked, 2)
        adv[members[g][int(top_idx[0])]] = (top[0] - top[1]) / (stacked.std() + epsilon)
    return adv.unsqueeze(-1) * mask


def loop_vanilla(old_log_prob, log_prob, advantages, mask, clip=0.2, clip_c=3.0):
    """A per-sequence loop of the dual-clip PPO loss, token-mean."""
    total, count = 0.0, mask.sum()
    for i in range(log_prob.shape[0]):
        m = mask[i]
        ratio = torch.exp((log_prob[i] - old_log_prob[i]).clamp(-20, 20))
        a = advantages[i]
        loss1 = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip))
        loss = torch.where(a < 0, torch.minimum(-a * clip_c, loss1), loss1)
        total = total + (loss * m).sum()
    return total / count


# ------------------------------------------------------------------------ harness


def timed(fn, repeats, warmup=0):
    """Median wall time of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones, and the
    last result."""
    for _ in range(warmup):
        fn()
    times = []
    result = None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def max_err(ours, reference):
    return float((ours.double() - reference.double()).abs().max())


def make_case(batch, length, seed=0, group=8, gaps=False):
    """Responses of random lengths padded on the right; with ``gaps``, each also has two masked
    spans of 1-64 tokens inside it (multi-turn observations)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    positions = torch.arange(length).expand(batch, length)
    mask = positions < lengths[:, None]
    if gaps:
        for _ in range(2):
            starts = (torch.rand(batch, 1, generator=gen) * lengths[:, None]).long()
            ends = starts + torch.randint(1, 65, (batch, 1), generator=gen)
            mask &= (positions < starts) | (positions >= ends)
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), lengths - 1] = torch.randint(0, 2, (batch,), generator=gen).float()
    rewards += 0.01 * torch.randn(batch, length, generator=gen) * mask  # dense shaping terms
    values = torch.randn(batch, length, generator=gen) * mask
    index = np.repeat(np.arange(batch // group), group)
    return rewards, values, mask, index


def row(name, size, loop_s, ours_s, err):
    print(
        f"{name:<26} {size:<18} {loop_s * 1e3:>10.1f} {ours_s * 1e3:>10.2f} "
        f"{loop_s / ours_s:>9.1f}x {err:>10.1e}"
    )


def bench_token_recursions(batch: int, length: int, gaps: bool = False) -> None:
    """GAE and REINFORCE++ against verl's per-token loops at (batch, length); ``gaps``: masks
    with masked spans inside the responses (lmrl's chunked scan instead of its block scan)."""
    get = advantage_estimators.get
    rewards, values, mask, _ = make_case(batch, length, gaps=gaps)
    r64, v64 = rewards.double(), values.double()
    size = f"B={batch},T={length}"
    suffix = " (gaps)" if gaps else ""
    loop_s, (ref_adv, ref_ret) = timed(lambda: loop_gae(r64, v64, mask, 1.0, 0.95), 3)
    ours_s, (adv, ret) = timed(
        lambda: get("gae")(rewards, mask, values=values, gamma=1.0, lam=0.95), 15, warmup=2
    )
    row("gae" + suffix, size, loop_s, ours_s, max(max_err(adv, ref_adv), max_err(ret, ref_ret)))
    loop_s, (ref_adv, ref_ret) = timed(lambda: loop_reinforce_pp(r64, mask, 0.99, gaps), 3)
    ours_s, (adv, ret) = timed(
        lambda: get("reinforce_plus_plus")(rewards, mask, gamma=0.99), 15, warmup=2
    )
    err = max(max_err(adv, ref_adv), max_err(ret, ref_ret))
    row("reinforce_plus_plus" + suffix, size, loop_s, ours_s, err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-tune-allocator", action="store_true")
    args = parser.parse_args()
    if not args.no_tune_allocator:
        tune_allocator()
    torch.set_num_threads(args.threads)
    get = advantage_estimators.get
    scale = 8 if args.quick else 1

    allocator = "glibc default" if args.no_tune_allocator else "lmrl's allocator setting"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, {allocator}")
    print(
        f"{'estimator/loss':<26} {'size':<18} {'loop ms':>10} {'lmrl ms':>10} {'speed-up':>10} {'max err':>10}"
    )

    # group estimators: B=8192 prompts x G=8 samples, a per-sample Python loop as baseline
    prompts, group, length = 8192 // scale, 8, 32
    rewards, _, mask, index = make_case(prompts * group, length, group=group)
    size = f"B={prompts},G={group}"
    r64, m64 = rewards.double(), mask.double()
    cases = [
        (
            "grpo",
            lambda: loop_grpo(r64.clone(), m64, index),
            lambda: get("grpo")(rewards, mask, index=index)[0],
        ),
        (
            "grpo (Dr.GRPO)",
            lambda: loop_grpo(r64.clone(), m64, index, norm=False),
            lambda: get("grpo")(rewards, mask, index=index, norm_adv_by_std_in_grpo=False)[0],
        ),
        (
            "rloo",
            lambda: loop_rloo(r64.clone(), m64, index),
            lambda: get("rloo")(rewards, mask, index=index)[0],
        ),
        (
            "grpo_passk",
            lambda: loop_passk(r64.clone(), m64, index),
            lambda: get("grpo_passk")(rewards, mask, index=index)[0],
        ),
    ]
    for name, loop_fn, ours_fn in cases:
        loop_s, ref = timed(loop_fn, 1)
        ours_s, ours = timed(ours_fn, 5)
        row(name, size, loop_s, ours_s, max_err(ours, ref))

    # token recursions: a per-token Python loop as baseline; single-turn responses (one run
    # of tokens each), then multi-turn ones (masked observation spans inside)
    for gaps in (False, True):
        for batch, length in ((256, 4096), (64, 16384)):
            bench_token_recursions(batch // scale, length, gaps)

    # policy losses, forward + backward at B=256, T=4096
    batch, length = 256 // scale, 4096
    gen = torch.Generator().manual_seed(0)
    _, _, mask, _ = make_case(batch, length)
    old = -torch.rand(batch, length, generator=gen) * 3
    new = old + 0.1 * torch.randn(batch, length, generator=gen)
    adv = torch.randn(batch, length, generator=gen)
    size = f"B={batch},T={length}"

    def fwd_bwd(fn):
        lp = new.clone().requires_grad_()
        loss = fn(lp)
        loss.backward()
        return loss.detach()

    loop_s, ref = timed(
        lambda: fwd_bwd(lambda lp: loop_vanilla(old.double(), lp.double(), adv.double(), mask)), 3
    )
    vanilla = policy_losses.get("vanilla")
    ours_s, ours = timed(lambda: fwd_bwd(lambda lp: vanilla(old, lp, adv, mask)[0]), 5)
    row("vanilla (fwd+bwd)", size, loop_s, ours_s, max_err(ours, ref))
    for name in (n for n in policy_losses.names() if n != "vanilla"):
        fn = policy_losses.get(name)
        ours_s, _ = timed(lambda fn=fn: fwd_bwd(lambda lp: fn(old, lp, adv, mask)[0]), 5)
        print(f"{name + ' (fwd+bwd)':<26} {size:<18} {'':>10} {ours_s * 1e3:>10.2f}")


if __name__ == "__main__":
    main()
