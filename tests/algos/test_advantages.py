"""Advantage estimators: hand-worked values, slow loop references, properties, bad input."""

from __future__ import annotations

import math
from collections import defaultdict

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from lmrl.algos.advantages import (
    _block_scan,
    _chunked_scan,
    _single_runs,
    advantage_estimators,
    reverse_discounted_scan,
)

# ----------------------------------------------------------------- slow references
# Obviously-correct loops: one sample at a time, one valid token at a time, in float64.


def ref_whiten(x, mask):
    vals = [x[i][t] for i in range(len(x)) for t in range(len(x[i])) if mask[i][t]]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1) if n > 1 else 0.0
    return [
        [(x[i][t] - mean) / math.sqrt(var + 1e-8) if mask[i][t] else 0.0 for t in range(len(x[i]))]
        for i in range(len(x))
    ]


def ref_gae(rewards, values, mask, gamma, lam):
    adv = [[0.0] * len(row) for row in rewards]
    ret = [[0.0] * len(row) for row in rewards]
    for i in range(len(rewards)):
        last_adv, next_value = 0.0, 0.0
        for t in reversed(range(len(rewards[i]))):
            if not mask[i][t]:
                continue
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            last_adv = delta + gamma * lam * last_adv
            adv[i][t], ret[i][t] = last_adv, last_adv + values[i][t]
            next_value = values[i][t]
    return ref_whiten(adv, mask), ret


def ref_reward_to_go(rewards, mask, gamma):
    ret = [[0.0] * len(row) for row in rewards]
    for i in range(len(rewards)):
        running = 0.0
        for t in reversed(range(len(rewards[i]))):
            if mask[i][t]:
                running = rewards[i][t] + gamma * running
                ret[i][t] = running
    return ret


def ref_scores(rewards, mask):
    return [
        sum(r for r, m in zip(row, mrow, strict=True) if m)
        for row, mrow in zip(rewards, mask, strict=True)
    ]


def ref_groups(index):
    groups = defaultdict(list)
    for i, g in enumerate(index):
        groups[g].append(i)
    return groups


def ref_grpo(rewards, mask, index, epsilon, norm):
    scores = ref_scores(rewards, mask)
    out = [0.0] * len(scores)
    for members in ref_groups(index).values():
        vals = [scores[i] for i in members]
        if len(vals) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(vals) / len(vals)
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i in members:
            out[i] = (scores[i] - mean) / (std + epsilon) if norm else scores[i] - mean
    return out


def ref_rloo(rewards, mask, index):
    scores = ref_scores(rewards, mask)
    out = list(scores)
    for members in ref_groups(index).values():
        if len(members) > 1:
            for i in members:
                others = [scores[j] for j in members if j != i]
                out[i] = scores[i] - sum(others) / len(others)
    return out


def ref_passk(rewards, mask, index, epsilon, norm):
    scores = ref_scores(rewards, mask)
    out = [0.0] * len(scores)
    for members in ref_groups(index).values():
        vals = [scores[i] for i in members]
        order = sorted(range(len(vals)), key=lambda k: (-vals[k], k))
        best, second = vals[order[0]], vals[order[1]]
        gap = best - second
        if norm:
            mean = sum(vals) / len(vals)
            gap /= math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) + epsilon
        out[members[order[0]]] = gap
    return out


def ref_rpp_baseline(rewards, mask, index):
    scores = ref_scores(rewards, mask)
    centered = list(scores)
    for members in ref_groups(index).values():
        if len(members) > 1:
            mean = sum(scores[i] for i in members) / len(members)
            for i in members:
                centered[i] = scores[i] - mean
    per_token = [[centered[i] if m else 0.0 for m in mask[i]] for i in range(len(scores))]
    return ref_whiten(per_token, mask)


def ref_opo(rewards, mask, index):
    scores = ref_scores(rewards, mask)
    lengths = [sum(row) for row in mask]
    out = list(scores)
    for members in ref_groups(index).values():
        if len(members) > 1:
            total = sum(lengths[i] for i in members)
            baseline = sum(lengths[i] * scores[i] for i in members) / max(total, 1)
            for i in members:
                out[i] = scores[i] - baseline
    return out


def ref_remax(rewards, mask, baselines):
    rtg = ref_reward_to_go(rewards, mask, 1.0)
    adv = [
        [(rtg[i][t] - baselines[i]) if mask[i][t] else 0.0 for t in range(len(mask[i]))]
        for i in range(len(mask))
    ]
    return adv, rtg


def per_token(seq_values, mask):
    return [[seq_values[i] if m else 0.0 for m in mask[i]] for i in range(len(mask))]


# --------------------------------------------------------------------- fixtures


def random_case(seed, batch=None, length=None, max_group=4, single_runs=False):
    """Random rewards/values, masks with gaps and empty rows, groups incl. one-sample ones.

    ``single_runs``: each row's valid tokens are one run instead (padding before and after
    it, as in single-turn responses), which the CPU scans solve by block matrix products.
    """
    gen = torch.Generator().manual_seed(seed)
    batch = batch or int(torch.randint(2, 24, (), generator=gen))
    length = length or int(torch.randint(1, 40, (), generator=gen))
    if single_runs:
        ends = torch.randint(0, length + 1, (batch, 1), generator=gen)
        starts = (torch.rand(batch, 1, generator=gen) * ends).long()
        mask = (torch.arange(length) >= starts) & (torch.arange(length) < ends)
    else:
        mask = torch.rand(batch, length, generator=gen) < 0.75
        if batch > 2 and length > 3:  # a gap in the middle (a multi-turn observation span)
            mask[1, :4] = torch.tensor([True, False, False, True])
    mask[0] = False  # an empty response
    rewards = torch.randn(batch, length, generator=gen)
    sizes, index = [], []
    while sum(sizes) < batch:
        sizes.append(
            min(int(torch.randint(1, max_group + 1, (), generator=gen)), batch - sum(sizes))
        )
    for g, size in enumerate(sizes):
        index += [f"uid-{g}"] * size
    values = torch.randn(batch, length, generator=gen)
    baselines = torch.randn(batch, generator=gen)
    return rewards, values, mask, np.array(index, dtype=object), baselines


def close(actual, expected, tol=1e-5):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual.double(), expected, atol=tol, rtol=tol)


# --------------------------------------------------------------------- hand-worked


def test_gae_seed_example():
    """Seed 002 §2.5 (with its erratum): A = 0.56525 at t=2 and 0.5 at t=3 before whitening."""
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.3, 0.4, 0.5]])
    mask = torch.tensor([[False, False, True, True]])
    raw = reverse_discounted_scan(
        rewards + 0.99 * torch.tensor([[0.3, 0.4, 0.5, 0.0]]) - values, mask, 0.99 * 0.95
    )
    close(raw, [[0.0, 0.0, 0.56525, 0.5]])
    adv, ret = advantage_estimators.get("gae")(rewards, mask, values=values, gamma=0.99, lam=0.95)
    close(ret, [[0.0, 0.0, 0.56525 + 0.4, 0.5 + 0.5]])
    # whitened over the two response tokens: mean 0.532625, unbiased std 0.0457855...
    std = math.sqrt(((0.56525 - 0.532625) ** 2 + (0.5 - 0.532625) ** 2) / 1 + 1e-8)
    close(adv, [[0.0, 0.0, (0.56525 - 0.532625) / std, (0.5 - 0.532625) / std]])


def test_gae_skips_a_masked_span():
    """An observation token between two turns: values and advantages carried over it."""
    rewards = torch.tensor([[0.0, 5.0, 1.0]])  # the 5.0 sits on a masked token: ignored
    values = torch.tensor([[0.5, 9.0, 0.25]])
    mask = torch.tensor([[True, False, True]])
    _, ret = advantage_estimators.get("gae")(rewards, mask, values=values, gamma=0.5, lam=0.5)
    a2 = 1.0 - 0.25  # delta at t=2, last token
    a0 = (0.0 + 0.5 * 0.25 - 0.5) + 0.25 * a2  # bootstraps from V at t=2, skipping t=1
    close(ret, [[a0 + 0.5, 0.0, a2 + 0.25]])


def test_grpo_hand_values():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
    mask = torch.ones(4, 2, dtype=torch.bool)
    index = ["a", "a", "b", "c"]  # group a = {1, 0}, b = {2}, c = {3}: singletons
    adv, ret = advantage_estimators.get("grpo")(rewards, mask, index=index, epsilon=0.0)
    std_a = math.sqrt(0.5)  # unbiased std of {1, 0}
    close(adv[:, 0], [0.5 / std_a, -0.5 / std_a, 2.0, 3.0])
    assert adv is ret or torch.equal(adv, ret)
    dr, _ = advantage_estimators.get("grpo")(
        rewards, mask, index=index, norm_adv_by_std_in_grpo=False
    )
    close(dr[:, 1], [0.5, -0.5, 2.0, 3.0])


def test_rloo_passk_opo_remax_hand_values():
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    rewards = torch.tensor([[1.0, 1.0, 7.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])  # 7.0 is masked
    index = [0, 0, 0]  # scores 2, 0, 1
    rloo, _ = advantage_estimators.get("rloo")(rewards, mask, index=index)
    close(rloo[:, 0], [2 - 0.5, 0 - 1.5, 1 - 1.0])
    passk, _ = advantage_estimators.get("grpo_passk")(
        rewards, mask, index=index, norm_adv_by_std_in_grpo=False
    )
    close(passk, [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    opo, _ = advantage_estimators.get("opo")(rewards, mask, index=index)
    baseline = (2 * 2 + 1 * 0 + 3 * 1) / 6
    close(opo[:, 0], [2 - baseline, 0 - baseline, 1 - baseline])
    adv, ret = advantage_estimators.get("remax")(
        rewards, mask, reward_baselines=torch.tensor([1.0, 1.0, 0.5])
    )
    close(ret, [[2.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    close(adv, [[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0], [0.5, 0.5, 0.5]])


def test_reinforce_plus_plus_matches_verl_loop_on_trailing_padding():
    """With padding only after the response (the usual case), skipping masked tokens equals
    verl's loop, which resets the running return at masked positions."""
    rewards = torch.tensor([[0.0, 0.5, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    verl = torch.zeros_like(rewards)
    running = torch.zeros(2)
    for t in reversed(range(4)):
        running = rewards[:, t] + 0.9 * running
        verl[:, t] = running
        running = running * mask[:, t]
    _, ret = advantage_estimators.get("reinforce_plus_plus")(rewards, mask, gamma=0.9)
    torch.testing.assert_close(ret, verl * mask)


# ------------------------------------------------------------- loop references


@pytest.mark.parametrize("single_runs", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_estimators_match_loop_references(seed, single_runs):
    rewards, values, mask, index, baselines = random_case(seed, single_runs=single_runs)
    if single_runs or min(mask.shape) > 3:  # the scans' fast path, or a real gap
        assert _single_runs(mask.float()) == single_runs
    r, v, m = rewards.double().tolist(), values.double().tolist(), mask.tolist()
    get = advantage_estimators.get
    gamma, lam = 0.97, 0.9

    for lam_ in (lam, 0.0, 0.3, 1.0):  # lam = 0 is TD(0), computed without the scan
        adv, ret = get("gae")(rewards, mask, values=values, gamma=gamma, lam=lam_)
        ref_adv, ref_ret = ref_gae(r, v, m, gamma, lam_)
        close(adv, ref_adv)
        close(ret, ref_ret)

    adv, ret = get("reinforce_plus_plus")(rewards, mask, gamma=gamma)
    rtg = ref_reward_to_go(r, m, gamma)
    close(ret, rtg)
    close(adv, ref_whiten(rtg, m))

    for norm in (True, False):
        adv, ret = get("grpo")(
            rewards, mask, index=index, epsilon=1e-6, norm_adv_by_std_in_grpo=norm
        )
        close(adv, per_token(ref_grpo(r, m, index, 1e-6, norm), m))
        close(ret, per_token(ref_grpo(r, m, index, 1e-6, norm), m))

    adv, _ = get("rloo")(rewards, mask, index=index)
    close(adv, per_token(ref_rloo(r, m, index), m))
    adv, _ = get("reinforce_plus_plus_baseline")(rewards, mask, index=index)
    close(adv, ref_rpp_baseline(r, m, index))
    adv, _ = get("opo")(rewards, mask, index=index)
    close(adv, per_token(ref_opo(r, m, index), m))
    adv, ret = get("remax")(rewards, mask, reward_baselines=baselines)
    ref_adv, ref_ret = ref_remax(r, m, baselines.double().tolist())
    close(adv, ref_adv)
    close(ret, ref_ret)


@pytest.mark.parametrize("seed", range(6))
def test_passk_matches_loop_reference(seed):
    rewards, _, mask, _, _ = random_case(seed)
    batch = rewards.shape[0] - rewards.shape[0] % 2 or 2
    rewards, mask = rewards[:batch], mask[:batch]
    index = np.repeat(np.arange(batch // 2), 2)
    if seed % 2:  # ties: only the first best sample learns
        rewards = rewards.round()
    r, m = rewards.double().tolist(), mask.tolist()
    for norm in (True, False):
        adv, _ = advantage_estimators.get("grpo_passk")(
            rewards, mask, index=index, norm_adv_by_std_in_grpo=norm
        )
        close(adv, per_token(ref_passk(r, m, list(index), 1e-6, norm), m))


@pytest.mark.parametrize("rate", [0.0, 1e-3, 0.5, 0.95, 0.999, 1.0])
def test_scan_long_sequences_many_chunks(rate):
    """Long T forces several chunks for small rates; the result equals the token loop: to
    float64's precision for float64 inputs; for float32 ones, which the CPU scans in float32,
    within 1e-6 of the largest value (3000 N(0, 1) rewards at rate 0.999 reach ~47, where one
    float32 rounding is ~4e-6: a float32 token loop drifts by ~1e-4 here)."""
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(3, 3000, generator=gen, dtype=torch.float64)
    mask = torch.rand(3, 3000, generator=gen) < 0.9
    expected = torch.tensor(
        ref_reward_to_go(rewards.tolist(), mask.tolist(), rate), dtype=torch.float64
    )
    close(reverse_discounted_scan(rewards, mask, rate), expected, tol=1e-10)
    scale = float(expected.abs().max())
    got = reverse_discounted_scan(rewards.float(), mask, rate).double()
    torch.testing.assert_close(got, expected, atol=1e-6 * scale, rtol=0)


@pytest.mark.parametrize("length", [1, 16, 17, 3000])
@pytest.mark.parametrize("rate", [0.0, 1e-3, 0.5, 0.95, 0.999, 1.0])
def test_block_scan_on_single_runs(rate, length):
    """One run of valid tokens per row (padding before and after, an empty row): the block
    scan (several levels of blocks at T=3000, a partial last block at 17 and 3000) equals the
    token loop, to float64's precision for float64 inputs and within 1e-6 of the largest
    value for float32 ones (measured: 2.5e-7), and agrees with the chunked scan."""
    rewards, _, mask, _, _ = random_case(length, batch=5, length=length, single_runs=True)
    rewards = rewards.double()
    assert _single_runs(mask.float()) and _single_runs(mask.double())
    expected = torch.tensor(
        ref_reward_to_go(rewards.tolist(), mask.tolist(), rate), dtype=torch.float64
    )
    junk = rewards.masked_fill(~mask, math.nan)
    close(reverse_discounted_scan(junk, mask, rate), expected, tol=1e-10)
    scale = max(float(expected.abs().max()), 1e-30)
    got = reverse_discounted_scan(junk.float(), mask, rate).double()
    torch.testing.assert_close(got, expected, atol=1e-6 * scale, rtol=0)
    keep = mask.double()
    chunked = _chunked_scan(rewards * keep, keep, rate) * keep
    torch.testing.assert_close(_block_scan(rewards * keep, rate) * keep, chunked)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_single_runs_detects_gaps(rows, dtype):
    """True iff no row has a masked position between two valid ones; a run that ends one row
    and one that starts the next are still two rows' single runs."""
    mask = torch.tensor(rows)
    patterns = ["".join("1" if v else "0" for v in row) for row in rows]
    expected = all("0" not in p.strip("0") for p in patterns)  # e.g. "0110" yes, "101" no
    assert _single_runs(mask.to(dtype)) == expected
    assert _single_runs(torch.tensor([[False, True], [True, False]]).to(dtype))
    assert not _single_runs(torch.tensor([[True, False, True]]).to(dtype))


def test_all_equal_rewards_give_zero_group_advantages():
    rewards = torch.ones(6, 3)
    mask = torch.ones(6, 3, dtype=torch.bool)
    index = [0, 0, 0, 1, 1, 1]
    for name in ("grpo", "rloo", "grpo_passk", "reinforce_plus_plus_baseline", "opo"):
        adv, _ = advantage_estimators.get(name)(rewards, mask, index=index)
        assert torch.all(adv == 0), name


# -------------------------------------------------------------------- properties


def _call_all(rewards, values, mask, index, baselines):
    out = {}
    for name in advantage_estimators.names():
        if name == "grpo_passk":
            continue
        out[name] = advantage_estimators.get(name)(
            rewards,
            mask,
            index=index,
            values=values,
            reward_baselines=baselines,
            gamma=0.9,
            lam=0.8,
        )
    return out


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    junk=st.sampled_from([math.nan, math.inf, 1e6, -3.0]),
    single_runs=st.booleans(),
)
def test_masked_positions_change_nothing(seed, junk, single_runs):
    rewards, values, mask, index, baselines = random_case(seed, single_runs=single_runs)
    before = _call_all(rewards, values, mask, index, baselines)
    after = _call_all(
        rewards.masked_fill(~mask, junk), values.masked_fill(~mask, junk), mask, index, baselines
    )
    for name, (adv, ret) in before.items():
        assert torch.equal(adv, after[name][0]), name
        assert torch.equal(ret, after[name][1]), name
        assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0), name


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), norm=st.booleans())
def test_grpo_zero_mean_per_group(seed, norm):
    rewards, _, _, index, _ = random_case(seed)
    mask = torch.ones_like(rewards, dtype=torch.bool)  # every row carries its scalar
    adv, _ = advantage_estimators.get("grpo")(
        rewards, mask, index=index, norm_adv_by_std_in_grpo=norm
    )
    assert torch.equal(adv, adv[:, :1].expand_as(adv))
    for members in ref_groups(index).values():
        if len(members) > 1:
            assert abs(float(adv[members, 0].double().sum())) < 1e-5


# ------------------------------------------------------------------- contract


@pytest.mark.parametrize("name", advantage_estimators.names())
def test_contract_every_estimator(name):
    rewards, values, mask, _, baselines = random_case(3, batch=8, length=5)
    index = np.repeat(np.arange(4), 2)
    adv, ret = advantage_estimators.get(name)(
        rewards,
        mask,
        index=index,
        values=values,
        reward_baselines=baselines,
        gamma=0.99,
        lam=0.95,
        epsilon=1e-6,
        norm_adv_by_std_in_grpo=True,
        unused_hyperparameter=1,
    )
    assert adv.shape == ret.shape == rewards.shape
    assert adv.dtype == rewards.dtype
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.all(adv[~mask] == 0)


def test_declared_needs():
    needs = advantage_estimators.needs
    assert needs("gae") == {"values"} and needs("remax") == {"reward_baselines"}
    assert needs("grpo_vectorized") == {"index"} and needs("reinforce_plus_plus") == set()


def test_aliases_resolve():
    assert advantage_estimators.get("grpo_vectorized") is advantage_estimators.get("grpo")
    assert advantage_estimators.get("rloo_vectorized") is advantage_estimators.get("rloo")


# ------------------------------------------------------------------ bad input


def test_bad_input_names_the_argument():
    rewards, mask = torch.zeros(4, 3), torch.ones(4, 3, dtype=torch.bool)
    get = advantage_estimators.get
    with pytest.raises(ValueError, match="values"):
        get("gae")(rewards, mask)
    with pytest.raises(ValueError, match="values"):
        get("gae")(rewards, mask, values=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="response_mask"):
        get("grpo")(rewards, mask[:, :2], index=[0, 0, 1, 1])
    with pytest.raises(ValueError, match="index"):
        get("grpo")(rewards, mask)
    with pytest.raises(ValueError, match="index"):
        get("grpo")(rewards, mask, index=[0, 0, 1])
    with pytest.raises(ValueError, match="index"):
        get("grpo_passk")(rewards, mask, index=[0, 0, 1, 2])
    with pytest.raises(ValueError, match="reward_baselines"):
        get("remax")(rewards, mask)
    with pytest.raises(ValueError, match="reward_baselines"):
        get("remax")(rewards, mask, reward_baselines=torch.zeros(3))
    with pytest.raises(ValueError, match=r"valid names: .*gae.*grpo"):
        get("grpo_typo")
    with pytest.raises(ValueError, match="token_level_rewards"):
        get("grpo")(torch.zeros(4), mask, index=[0, 0, 1, 1])
