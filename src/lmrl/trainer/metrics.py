"""Step metrics: the one table of names, and the per-batch data metrics (stage timers: `lmrl.run.timing`).

Names are hierarchical and verl's where verl has one, so dashboards carry over. Workers and
``lmrl.algos`` return detached tensors; they become floats here, once per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from lmrl.algos.kl import k3
from lmrl.algos.masked import masked_count, masked_mean, masked_var, zero_outside
from lmrl.batch import Batch, response_tokens_mask
from lmrl.rollout.agent import AGENT_KEYS

# name (or name prefix ending in "/") -> what it measures. The documentation of every metric.
METRICS: dict[str, str] = {
    "actor/pg_loss": "policy-gradient loss of the update, averaged over mini-batches and epochs",
    "actor/pg_clipfrac": "fraction of tokens whose ratio was clipped (upper side for A>0)",
    "actor/pg_clipfrac_lower": "fraction of tokens hit by the dual clip (A<0, ratio > clip_ratio_c)",
    "actor/cov_clipfrac": "clip_cov: fraction of tokens whose gradient was dropped (high covariance)",
    "actor/cov_klfrac": "kl_cov: fraction of tokens given the abs(log-ratio) penalty (high covariance)",
    "actor/ppo_kl": "mean of old_log_prob - log_prob over tokens: how far the update moved",
    "actor/entropy": "mean token entropy of the policy on the rollout",
    "actor/kl_loss": "KL(pi || pi_ref) loss term (use_kl_loss)",
    "actor/kl_coef": "coefficient of the KL loss term",
    "actor/grad_norm": "gradient norm before clipping, mean over optimizer steps",
    "actor/lr": "learning rate after this step's update",
    "actor/skipped_steps": "optimizer steps skipped for a non-finite loss or gradient",
    "actor/old_log_prob_recomputed": "1 if old log-probs came from a separate forward pass, 0 if "
    "the update's own forward provided them (one mini-batch, one epoch: provably identical)",
    "actor/reward_kl_penalty": "KL(pi_old || pi_ref) subtracted from the reward (use_kl_in_reward)",
    "actor/reward_kl_penalty_coeff": "the KL controller's coefficient for that penalty",
    "critic/vf_loss": "clipped value loss",
    "critic/vf_clipfrac": "fraction of tokens whose value prediction was clipped",
    "critic/vf_explained_var": "1 - Var(returns - values) / Var(returns) over response tokens",
    "critic/grad_norm": "critic gradient norm before clipping",
    "critic/lr": "critic learning rate after this step's update",
    "critic/score/zero_spread_frac": "fraction of prompt groups (n > 1 samples) whose samples "
    "all scored the same: their group-relative advantages are 0, they teach nothing",
    "critic/score/": "sequence score from the reward function (mean, max, min)",
    "critic/rewards/": "sequence reward after the KL penalty (mean, max, min)",
    "critic/advantages/": "advantages over response tokens (mean, max, min)",
    "critic/returns/": "returns over response tokens (mean, max, min)",
    "critic/values/": "critic values over response tokens (mean, max, min)",
    "response_length/": "response tokens per sample, tool observations included (mean, max, min)",
    "agent/turns/mean": "multi-turn: generation turns per sample",
    "agent/tool_calls/mean": "multi-turn: tool calls per sample",
    "agent/valid_call_ratio": "multi-turn: calls the format parsed and a tool answered",
    "agent/tool_errors/mean": "multi-turn: tool calls per sample that raised an error",
    "agent/tool_timeouts/mean": "multi-turn: tool calls per sample that ran past their limit",
    "agent/tool_calls/sum": "multi-turn: tool calls in the step (the denominator of the "
    "console's 'tool errors N/M')",
    "agent/tool_errors/sum": "multi-turn: tool calls in the step that raised an error",
    "agent/tool_timeouts/sum": "multi-turn: tool calls in the step that ran past their limit",
    "agent/obs_token_frac": "multi-turn: fraction of response tokens that are tool observations",
    "agent/finish_ratio": "multi-turn: fraction of samples that ended with an answer",
    "response_length/clip_ratio": "fraction of samples that hit max_response_length",
    "prompt_length/": "prompt tokens per sample (mean, max, min)",
    "rollout/actor_logprob_abs_diff": "mean |rollout log-prob - actor log-prob| over response "
    "tokens when old log-probs are recomputed: the engine's gap from the trainer (a broken "
    "weight sync shows here at once)",
    "rollout/actor_logprob_abs_diff_max": "largest |rollout log-prob - actor log-prob|",
    "rollout/mismatch_k3": "the training-inference KL(rollout || actor) by k3 over response "
    "tokens, when old log-probs are recomputed (rollout.dtype or vLLM against the fp32 anchor)",
    "rollout/ratio_outside_frac": "fraction of response tokens whose actor/rollout probability "
    "ratio leaves [0.9, 1.1] (verl issue 6280's measure of the engine gap)",
    "parity/cause": "the parity probe's verdict, at the one step it ran (trainer.parity_threshold;"
    " see 'The parity probe' below): 0 unknown, 1 stale weights, 2 tokenization, 3 padding or "
    "micro-batch shape, 4 dtype",
    "parity/": "the parity probe's figures at that step, mean |log-prob difference| per response "
    "token: gap, tokenization_bad_frac (responses that do not survive decode -> encode), "
    "tokenization_gap_clean, stale_gap_before_sync, stale_gap_after_sync, dtype_shift, "
    "micro_batch_shift",
    "rollout_corr/": "rollout importance weights (mean, max, ESS, masked fraction, mismatch KL)",
    "async/staleness": "async_training: updates between the weights that generated this step's "
    "batch and the trainer's (every row of a batch shares one version, so the run's staleness "
    "histogram is this metric over the steps; at most ceil(staleness_threshold) + "
    "trigger_parameter_sync_step - 1)",
    "async/weights_version": "async_training: the weights version (updates done) that "
    "generated the batch; each row carries it too (the batch's weights_version column)",
    "async/ready_batches": "async_training: batches finished ahead and waiting when this step "
    "took its own",
    "async/trainer_idle_frac": "async_training: fraction of the step the trainer waited for "
    "its batch (timing_s/wait_batch / timing_s/step)",
    "async/generator_idle_frac": "async_training: fraction of the time of this batch that the "
    "generator waited for the weights version it needs (the rest it generated and scored)",
    "reward/scored": "scorings attempted in the step: samples times reward functions (the "
    "denominator of reward/errors, reward/timeouts and reward/no_score)",
    "reward/errors": "scorings that failed and scored 0: the function raised, returned None, NaN, "
    "a non-number, a dict without 'score' or a batch of the wrong length, or its worker died",
    "reward/timeouts": "scorings that ran past reward.timeout_s (or the batch time limit), scored 0",
    "reward/no_score": "sample scorings a reward function declined (returned None, or a score "
    "of None): they add nothing to the sample's sum",
    "reward/unscored": "samples no reward function scored (each declined): left out of the "
    "advantages' groups, the loss and the score means",
    "reward/unscored_frac": "reward/unscored as a share of the batch",
    "curriculum/": "data.curriculum: curriculum/skipped (prompts that sat out in the step's "
    "draw) and curriculum/settled_frac (the share of the prompts seen whose last groups all "
    "passed or all failed)",
    "reward/worker_restarts": "reward worker processes replaced after a timeout or a crash",
    "reward/": (
        "numeric (and bool) reward extras per sample, as reward/<key>/mean (acc, "
        "overlong_penalty...); text extras (verl's pred) go to generations.jsonl instead"
    ),
    "filter_groups/": "DAPO dynamic sampling: kept groups and generation batches used",
    "timing_s/": "seconds spent in each stage of the step (gen, reward, old_log_prob, ref, "
    "values, adv, update_critic, update_actor, step; with async_training, gen and reward "
    "ran ahead in the generator and wait_batch is the trainer's wait for them)",
    "perf/throughput": "tokens (prompt + response) processed per second over the whole step",
    "perf/memory_probe_s": "seconds of the memory probe before the first step (logged with "
    "the first step; trainer.memory_probe)",
    "perf/memory_probe_peak_gib": "the memory probe's torch.cuda.max_memory_allocated (GiB)",
    "doctor/rollback": "the run doctor rolled back here (trainer.max_rollbacks): its number",
    "doctor/rolled_back_from": "the step the rollback left (its checkpoints are in "
    "RUN_DIR/rolled_back/<n>/)",
    "doctor/lr_scale": "the actor's lr as a multiple of actor.optim.lr after the rollback",
    "training/step": "the global step",
    "training/epoch": "the data epoch",
    "val/": "validation: val/<source>/mean@k, pass@k, acc, reward/mean; and prior_acc, the "
    "score of the answers' prior (always giving the commonest training answer), which a model "
    "that learned the task beats; answers/distinct and answers/truths (distinct greedy answers "
    "and distinct ground truths), answers/top_share and answers/truth_top_share (the commonest "
    "one's share of each): answers collapsed onto a few strings",
    "train/": "per data source, when the step's batch mixes 2+ of them (nothing with one): "
    "train/<source>/score/mean, response_length/mean, response_length/clip_ratio, "
    "score/zero_spread_frac (as the batch's critic/score/..., response_length/...), acc (as "
    "reward/acc/mean), reward_errors (its share of reward/errors) and unscored (its samples "
    "no reward function scored)",
    "sft/loss": "lmrl sft: token-mean cross-entropy on the assistant tokens",
    "sft/lr": "lmrl sft: learning rate",
    "sft/grad_norm": "lmrl sft: gradient norm before clipping",
    "sft/tokens": "lmrl sft: assistant tokens in the step's batch",
    "val/sft_loss": "lmrl sft: the same loss on data.val_files (or the rows data.val_split "
    "holds out); with RL rows or reward.custom_reward_function, also val/<source>/acc on "
    "greedy answers and val/<source>/prior_acc",
}


PARITY_DOC = """
## The parity probe

Every step that recomputes the old log-probs logs the engine's gap from the trainer
(`rollout/actor_logprob_abs_diff`, the mean |old - rollout| log-prob over response tokens, in
nats). The first time it exceeds `trainer.parity_threshold` (default 0.05; 0 or null turns it
off; a negative or NaN threshold is refused) the trainer probes that step's batch once (`lmrl.trainer.parity`), logs one warning naming
the cause and what to do, and logs `parity/cause` with the probes' figures at that step. The
probes run cheapest first and stop at the first that accounts for at least half the gap:

| cause | probe | names it when |
|---|---|---|
| tokenization | decode each response and encode the text again (no forward pass) | the responses whose ids change carry the gap and the others are clean (their gap at most the threshold and a quarter of the others') |
| stale weights | score the same tokens with the engine's model, force its weight sync, score again | the sync removes half the gap; skipped for an engine that generates with the actor's own module (`hf`) or cannot score given tokens (vLLM) |
| dtype | the engine's scores (or, under `model.mixed_precision`, the actor's) against an fp32 recompute | the engine or the trainer computes below fp32 and the fp32 recompute moves its log-probs by half the gap |
| padding or micro-batch shape | recompute the actor's log-probs with 1 row per micro-batch (no padding) and with all rows in one | either moves them by half the gap |

None of them: `unknown`, with every figure in the message. Under `trainer.backend=ray` only the
tokenization probe runs (the actor and the engine live in worker processes). The trigger is the
mean absolute difference rather than `rollout/mismatch_k3`: it reads in nats per token and the
probes' figures compare with it in the same unit, where k3 (about d^2/2) hides small per-token
errors. The default is meant to sit above a healthy bf16 engine's precision gap (about 1e-3 on the
tiny test model) and below what a missed weight sync or re-tokenized text gives (tenths of a nat).
Whether the probe ran is part of the checkpoint: a resumed run that had probed does not probe
again (a rollback returns it to the best checkpoint's).
"""


def metrics_markdown() -> str:
    """The table of ``METRICS`` as Markdown (``docs/metrics.md`` is this, generated)."""
    lines = [
        "# Metrics",
        "",
        "Every step's metrics, as written to `metrics.jsonl` and the trackers. Generated from",
        "`lmrl.trainer.metrics.METRICS` by `python -m lmrl.trainer.metrics`; a name ending in",
        "`/` is a prefix.",
        "",
        "| name | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {text} |" for name, text in METRICS.items()]
    return "\n".join(lines) + "\n" + PARITY_DOC


def to_floats(metrics: Mapping[str, torch.Tensor | float | int]) -> dict[str, float]:
    """Detached tensors and numbers -> floats, in one pass (one device sync per tensor)."""
    return {
        k: float(v.detach().float().mean()) if isinstance(v, torch.Tensor) else float(v)
        for k, v in metrics.items()
    }


def mean_metrics(records: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Average each key over the records that have it."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for record in records:
        for k, v in record.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1
    return {k: sums[k] / counts[k] for k in sums}


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.float()
    if x.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": float(x.mean()),
        f"{prefix}/max": float(x.max()),
        f"{prefix}/min": float(x.min()),
    }


def _scored_rows(batch: Batch) -> torch.Tensor | None:
    """``scored_mask`` (B,) when some row of ``batch`` no reward function scored, else None."""
    if "scored_mask" not in batch or bool(batch["scored_mask"].all()):
        return None
    return batch["scored_mask"]


def data_metrics(batch: Batch, max_response_length: int) -> dict[str, float]:
    """Score, reward, advantage, return, value and length statistics of a finished batch; the
    score statistics over the rows a reward function scored (``scored_mask``)."""
    mask = batch["response_mask"]
    out: dict[str, float] = {}
    if "token_level_scores" in batch:  # the scores of the rows a reward function scored
        scores = batch["token_level_scores"].sum(-1)
        scored = _scored_rows(batch)
        out |= _stats("critic/score", scores if scored is None else scores[scored])
        if "uid" in batch:
            uid = batch["uid"] if scored is None else np.asarray(batch["uid"])[scored.cpu()]
            spread = zero_spread_fraction(scores if scored is None else scores[scored], uid)
            if spread is not None:
                out["critic/score/zero_spread_frac"] = spread
    if "token_level_rewards" in batch:
        out |= _stats("critic/rewards", batch["token_level_rewards"].sum(-1))
    for key, name in (("advantages", "advantages"), ("returns", "returns"), ("values", "values")):
        if key in batch:
            out |= _stats(f"critic/{name}", batch[key][mask])
    if "values" in batch and "returns" in batch:
        ret, val = batch["returns"].float(), batch["values"].float()
        var_ret = masked_var(ret, mask)
        out["critic/vf_explained_var"] = float(1 - masked_var(ret - val, mask) / (var_ret + 1e-8))
    lengths = response_tokens_mask(batch).sum(-1)  # every token, observations included
    out |= _stats("response_length", lengths)
    out["response_length/clip_ratio"] = float((lengths >= max_response_length).float().mean())
    out |= agent_metrics(batch)
    if "prompts" in batch and "attention_mask" in batch:
        prompt_len = batch["prompts"].shape[1]
        out |= _stats("prompt_length", batch["attention_mask"][:, :prompt_len].sum(-1))
    return out


def agent_metrics(batch: Batch) -> dict[str, float]:
    """A multi-turn rollout's tool use (empty for a one-turn batch): turns and tool calls per
    sample, the valid-call ratio, tool errors and timeouts per sample (and the step's counts
    of calls, errors and timeouts, for the console), the fraction of
    response tokens that are observations, and the fraction that ended with an answer
    (Search-R1's ``env/number_of_actions``, ``env/ratio_of_valid_action``,
    ``env/finish_ratio``)."""
    if "agent_turns" not in batch or len(batch) == 0:
        return {}
    col = {k: batch.tensors[k].double() for k in AGENT_KEYS}  # all tensors (the schema's)
    calls = col["agent_tool_calls"].sum()
    tokens = response_tokens_mask(batch).sum()
    return {
        "agent/turns/mean": float(col["agent_turns"].mean()),
        "agent/tool_calls/mean": float(col["agent_tool_calls"].mean()),
        "agent/valid_call_ratio": float(col["agent_valid_calls"].sum() / calls) if calls else 1.0,
        "agent/tool_errors/mean": float(col["agent_tool_errors"].mean()),
        "agent/tool_timeouts/mean": float(col["agent_tool_timeouts"].mean()),
        "agent/tool_calls/sum": float(calls),
        "agent/tool_errors/sum": float(col["agent_tool_errors"].sum()),
        "agent/tool_timeouts/sum": float(col["agent_tool_timeouts"].sum()),
        "agent/obs_token_frac": float(col["agent_obs_tokens"].sum() / max(float(tokens), 1.0)),
        "agent/finish_ratio": float(col["agent_answered"].mean()),
    }


def zero_spread_fraction(scores: torch.Tensor, uid) -> float | None:
    """The fraction of prompt groups with more than one sample whose scores are all equal.

    Args:
        scores: (B,) sequence scores; uid: (B,) the group of each row.
    Returns:
        None when no group has two samples.
    """
    from lmrl.algos.advantages import group_ids

    scores = scores.float().cpu()
    groups = group_ids(uid)
    counts = torch.bincount(groups)
    n = len(counts)
    high = torch.full((n,), -math.inf).scatter_reduce(0, groups, scores, "amax")
    low = torch.full((n,), math.inf).scatter_reduce(0, groups, scores, "amin")
    several = counts > 1
    if not several.any():
        return None
    return float((high == low)[several].float().mean())


def _sources(column) -> tuple[list[str], np.ndarray]:
    """The distinct data sources of a ``data_source`` column, sorted, and each row's index
    into them (B,)."""
    names, inverse = np.unique(np.asarray([str(s) for s in column]), return_inverse=True)
    return [str(n) for n in names], inverse.reshape(-1)


def source_reward_metrics(batch: Batch, numeric: Mapping[str, np.ndarray]) -> dict[str, float]:
    """``train/<source>/acc``: the mean of the reward's per-sample ``acc`` over each data
    source's samples that have one (what ``reward/acc/mean`` is for the batch); empty unless
    the batch's ``data_source`` holds 2+ sources and the reward reports an ``acc``.

    Args:
        batch: the scored batch; numeric: the reward's numeric extras, (B,) float arrays,
            NaN where a sample has no value (`lmrl.rewards.result.split_extras`).
    """
    if "acc" not in numeric or "data_source" not in batch:
        return {}
    names, inverse = _sources(batch["data_source"])
    if len(names) < 2:
        return {}
    acc = np.asarray(numeric["acc"], dtype=np.float64)
    out = {}
    for i, name in enumerate(names):
        values = acc[(inverse == i) & np.isfinite(acc)]
        if values.size:
            out[f"train/{name}/acc"] = float(values.mean())
    return out


def source_metrics(
    metrics: Mapping[str, float], batch: Batch, max_response_length: int
) -> dict[str, float]:
    """``metrics`` with the step's metrics per data source, when its batch holds 2+ sources:
    ``train/<source>/score/mean``, ``response_length/mean``, ``response_length/clip_ratio``
    and ``score/zero_spread_frac`` from ``batch`` (the names of the batch-wide ones), beside
    the reward's ``train/<source>/acc`` and ``reward_errors`` already in ``metrics``. With
    one source, ``metrics`` without any ``train/`` key: a single-source run logs nothing
    extra.

    The per-source means are masked means over the rows of each source, on the batch's
    device, brought to the host in one transfer with the scores.

    Args:
        metrics: the step's metrics, as floats; batch: the step's finished batch, with
            ``token_level_scores`` (B, T), ``responses`` and the ``data_source`` column.
    """
    out = {k: v for k, v in metrics.items() if not k.startswith("train/")}
    if "data_source" not in batch or "token_level_scores" not in batch or len(batch) == 0:
        return out
    names, inverse = _sources(batch["data_source"])
    if len(names) < 2:
        return out
    out |= {k: v for k, v in metrics.items() if k.startswith("train/")}
    scores = batch["token_level_scores"].sum(-1).float()  # (B,)
    lengths = masked_count(response_tokens_mask(batch), dim=-1)  # (B,) observations included
    clipped = (lengths >= max_response_length).float()
    per_sample = torch.stack([scores, lengths, clipped])  # (3, B)
    rows = torch.as_tensor(inverse, device=scores.device)
    K, B = len(names), len(batch)
    of_source = rows[None, :] == torch.arange(K, device=scores.device)[:, None]  # (K, B)
    scored = _scored_rows(batch)
    in_score = of_source if scored is None else of_source & scored.to(scores.device)[None, :]
    masks = torch.stack([in_score, of_source, of_source])  # (3, K, B): scores of scored rows
    means = masked_mean(per_sample[:, None, :].expand(3, K, B), masks, dim=-1)
    has_score = in_score.any(-1).float()  # (K,)
    host = torch.cat([means.flatten(), has_score, scores]).cpu()  # one transfer: (4K + B,)
    means_host, scores_host = host[: 3 * K].view(3, K).tolist(), host[4 * K :]
    has_score_host = host[3 * K : 4 * K].tolist()
    uid = np.asarray(batch["uid"]) if "uid" in batch else None
    kept = np.ones(B, bool) if scored is None else np.asarray(batch["scored_mask"].cpu())
    for i, name in enumerate(names):
        if has_score_host[i]:
            out[f"train/{name}/score/mean"] = means_host[0][i]
        out[f"train/{name}/response_length/mean"] = means_host[1][i]
        out[f"train/{name}/response_length/clip_ratio"] = means_host[2][i]
        if uid is not None:
            mine = (inverse == i) & kept
            spread = zero_spread_fraction(scores_host[torch.as_tensor(mine)], uid[mine])
            if spread is not None:
                out[f"train/{name}/score/zero_spread_frac"] = spread
    return out


def throughput(batch: Batch, seconds: float) -> float:
    """Tokens (prompt + response) per second over the step."""
    tokens = float(batch["attention_mask"].sum()) if "attention_mask" in batch else 0.0
    return tokens / seconds if seconds > 0 else math.nan


if __name__ == "__main__":
    print(metrics_markdown(), end="")


__all__ = [
    "METRICS",
    "data_metrics",
    "mean_metrics",
    "metrics_markdown",
    "source_metrics",
    "source_reward_metrics",
    "throughput",
    "to_floats",
]


def engine_gap(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
               mask: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
    """The engine's gap from the trainer over the response tokens: ``rollout/
    actor_logprob_abs_diff`` (mean |old - rollout|) and its ``_max``, ``rollout/mismatch_k3``
    (the training-inference KL(pi_rollout || pi_old) by `lmrl.algos.kl.k3` on the engine's
    samples, as rollout correction's ``mismatch_k3``) and ``rollout/ratio_outside_frac`` (the fraction of
    tokens whose r leaves [0.9, 1.1], the measure verl users compare).

    Args:
        old_log_probs, rollout_log_probs: (B, T) the actor's and the engine's log-probs of the
            sampled tokens; mask: (B, T) bool response mask.
    """
    old, rollout = old_log_probs.float(), rollout_log_probs.float()
    log_ratio = old - rollout
    gap, ratio = log_ratio.abs(), log_ratio.exp()
    return {
        "rollout/actor_logprob_abs_diff": masked_mean(gap, mask),
        "rollout/actor_logprob_abs_diff_max": zero_outside(gap, mask).max()
        if gap.numel()
        else gap.new_zeros(()),
        "rollout/mismatch_k3": masked_mean(k3(rollout, old), mask),  # rollout_correction's
        "rollout/ratio_outside_frac": masked_mean(((ratio < 0.9) | (ratio > 1.1)).float(), mask),
    }
