"""PromptSampler: per-epoch shuffles, and resuming to the exact next prompt."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmrl.data import PromptSampler


def take(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def flat(batches):
    return list(itertools.chain.from_iterable(batches))


def test_each_epoch_is_a_new_permutation():
    sampler = PromptSampler(10, 5, seed=3)
    assert len(sampler) == 2
    epochs = [flat(take(sampler, 2)) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(10))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] == np.random.default_rng([3, 0]).permutation(10).tolist()
    assert flat(take(PromptSampler(10, 5, seed=3), 2)) == epochs[0]  # reproducible
    assert flat(take(PromptSampler(10, 5, seed=4), 2)) != epochs[0]


def test_drop_last_and_no_shuffle():
    kept = PromptSampler(7, 3, shuffle=False)
    assert len(kept) == 2
    assert take(kept, 3) == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]  # 6 is dropped every epoch
    partial = PromptSampler(7, 3, shuffle=False, drop_last=False)
    assert len(partial) == 3
    assert take(partial, 4) == [[0, 1, 2], [3, 4, 5], [6], [0, 1, 2]]
    with pytest.raises(ValueError, match="larger than the dataset"):
        PromptSampler(3, 4)
    assert take(PromptSampler(3, 4, drop_last=False, shuffle=False), 2) == [[0, 1, 2], [0, 1, 2]]


def test_resume_across_an_epoch_boundary_matches_an_uninterrupted_run():
    steps = 12
    reference = take(PromptSampler(10, 4, seed=7), steps)  # 2 batches per epoch (2 dropped)
    for stop in range(steps + 1):  # stops mid-epoch, at the boundary, at the start
        first = PromptSampler(10, 4, seed=7)
        before = take(first, stop)
        state = first.state_dict()
        resumed = PromptSampler(10, 4, seed=7)
        resumed.load_state_dict(state)
        assert before + take(resumed, steps - stop) == reference, stop


@settings(max_examples=40, deadline=None)
@given(
    num_items=st.integers(1, 30),
    batch_size=st.integers(1, 8),
    stop=st.integers(0, 20),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_resume_property(num_items, batch_size, stop, drop_last, seed):
    if drop_last and batch_size > num_items:
        return
    args = dict(num_items=num_items, batch_size=batch_size, seed=seed, drop_last=drop_last)
    reference = list(itertools.islice(iter(PromptSampler(**args)), 25))
    first = PromptSampler(**args)
    before = take(first, stop)
    resumed = PromptSampler(**args)
    resumed.load_state_dict(first.state_dict())
    assert before + take(resumed, 25 - stop) == reference


def test_resume_with_another_batch_size_continues_with_the_next_prompt():
    stream = flat(take(PromptSampler(12, 3, seed=1), 4))  # one epoch, 12 prompts
    first = PromptSampler(12, 3, seed=1)
    take(first, 1)
    bigger = PromptSampler(12, 6, seed=1)
    bigger.load_state_dict(first.state_dict())
    assert bigger.next_batch() == stream[3:9]


def test_state_mismatch_is_refused():
    state = PromptSampler(10, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_items=10"):
        PromptSampler(11, 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1"):
        PromptSampler(10, 2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="invalid position"):
        PromptSampler(10, 2, seed=1).load_state_dict({**state, "offset": 11})
