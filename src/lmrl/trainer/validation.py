"""Validation metrics: mean@k and the unbiased pass@k estimator, per data source.

Pure functions over plain lists, so the trainer (and ``lmrl eval``) call them on whatever the
validation rollout produced. The choice made here is Chen et al.'s: with ``n >= k`` samples
per prompt of which ``c`` pass, pass@k is the probability that ``k`` of them drawn without
replacement contain at least one pass, 1 - C(n-c, k) / C(n, k), computed as a product so it
neither overflows nor loses precision for large ``n``. mean@k is the same idea for scores: the
expected mean of ``k`` samples drawn from the ``n``, which is the mean of all ``n``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt (Chen et al. 2021, "Evaluating Large Language Models
    Trained on Code").

    pass@k = 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k / i)

    Args:
        n: samples generated for the prompt.
        c: samples that passed, ``0 <= c <= n``.
        k: samples the metric draws, ``1 <= k <= n``.

    Returns:
        The probability that ``k`` samples drawn without replacement hold at least one pass:
        exactly 0.0 when ``c = 0`` and exactly 1.0 when ``n - c < k``.
    """
    if n < 1:
        raise ValueError(f"pass_at_k: n must be >= 1, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c must be in [0, n={n}], got c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k must be in [1, n={n}], got k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_at_k(scores: Sequence[float], k: int) -> float:
    """Expected mean score of ``k`` of a prompt's samples drawn without replacement.

    Every sample is in a random k-subset with probability k/n, so the expectation is the mean
    of all ``n`` scores, an unbiased estimate of mean@k that uses every sample.

    Args:
        scores: the ``n`` scores of one prompt's samples, shape ``(n,)``.
        k: samples the metric draws, ``1 <= k <= n``.

    Returns:
        The mean of ``scores``.
    """
    n = len(scores)
    if not 1 <= k <= n:
        raise ValueError(f"mean_at_k: k must be in [1, n={n}], got k={k}")
    return math.fsum(scores) / n


def validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence[Hashable],
    scores: Sequence[float],
    accs: Sequence[float] | None,
    k: int,
) -> dict[str, float]:
    """Per-data-source validation metrics from one validation rollout.

    Samples of a prompt share its ``uid``; a sample passes when its acc is 1, or, without
    accs, when its score is at least 1.

    Args:
        data_sources: ``(N,)`` data source of each sample (``digits``, ``openai/gsm8k``).
        uids: ``(N,)`` prompt id of each sample; a prompt has ``n >= k`` samples.
        scores: ``(N,)`` reward-function score of each sample.
        accs: ``(N,)`` exact-match accuracy of each sample (0 or 1), or None.
        k: samples per prompt the @k metrics draw.

    Returns:
        For each source ``s``: ``val/s/mean@k`` (mean@k averaged over prompts),
        ``val/s/pass@k`` (unbiased pass@k averaged over prompts), ``val/s/reward/mean``
        (mean score over samples) and, when accs are given, ``val/s/acc`` (mean acc over
        samples).
    """
    n_samples = len(scores)
    for name, seq in (("data_sources", data_sources), ("uids", uids), ("accs", accs)):
        if seq is not None and len(seq) != n_samples:
            raise ValueError(
                f"validation_metrics: {name} has {len(seq)} entries, scores has {n_samples}"
            )
    if n_samples == 0:
        raise ValueError("validation_metrics: no samples (scores is empty)")
    if k < 1:
        raise ValueError(f"validation_metrics: k must be >= 1, got k={k}")

    # source -> uid -> sample indices, in first-seen order
    groups: dict[str, dict[Hashable, list[int]]] = {}
    source_of: dict[Hashable, str] = {}
    for i, (source, uid) in enumerate(zip(data_sources, uids, strict=True)):
        if source_of.setdefault(uid, source) != source:
            raise ValueError(
                f"validation_metrics: uid {uid!r} has samples from two data sources "
                f"({source_of[uid]!r} and {source!r})"
            )
        groups.setdefault(source, {}).setdefault(uid, []).append(i)

    metrics: dict[str, float] = {}
    for source, prompts in groups.items():
        mean_k, pass_k = [], []
        for uid, idx in prompts.items():
            if len(idx) < k:
                raise ValueError(
                    f"validation_metrics: prompt uid {uid!r} ({source}) has {len(idx)} samples, "
                    f"fewer than k={k}"
                )
            mean_k.append(mean_at_k([scores[i] for i in idx], k))
            passed = [accs[i] >= 1.0 if accs is not None else scores[i] >= 1.0 for i in idx]
            pass_k.append(pass_at_k(len(idx), sum(passed), k))
        every = [i for idx in prompts.values() for i in idx]
        metrics[f"val/{source}/mean@{k}"] = math.fsum(mean_k) / len(mean_k)
        metrics[f"val/{source}/pass@{k}"] = math.fsum(pass_k) / len(pass_k)
        if accs is not None:
            metrics[f"val/{source}/acc"] = math.fsum(accs[i] for i in every) / len(every)
        metrics[f"val/{source}/reward/mean"] = math.fsum(scores[i] for i in every) / len(every)
    return metrics


__all__ = ["mean_at_k", "pass_at_k", "validation_metrics"]
