"""data.mixture: per-step counts of weights, schedules and quotas; the seeded draw of each
source; the sampler's state round trip; bad specs in one line; the plain pool unchanged."""

from __future__ import annotations

import functools
from fractions import Fraction

import numpy as np
import pytest

from lmrl.config import ConfigError, load_config
from lmrl.config.mixture import parse_mixture, step_counts
from lmrl.data.mixture import MixtureSampler, source_rows
from lmrl.data.sampler import PromptSampler
from lmrl.errors import CheckpointError, DataError


def counts(spec, step, batch=8):
    return step_counts(parse_mixture(spec, batch), step, batch)


def test_weights_split_the_batch_by_largest_remainder():
    assert counts({"a": 1, "b": 1}, 1) == [4, 4]
    assert counts({"a": 3, "b": 1}, 7) == [6, 2]
    # 8 * (1/3) = 2.67 each: the two largest remainders tie, the earlier sources win
    assert counts({"a": 1, "b": 1, "c": 1}, 1) == [3, 3, 2]
    assert counts({"a": 0.1, "b": 0.2, "c": 0.7}, 1, batch=10) == [1, 2, 7]  # exact fractions
    assert counts({"a": 1, "b": 0}, 1) == [8, 0]


def test_a_schedule_is_linear_between_points_and_constant_past_the_ends():
    spec = {"a": [[2, 1.0], [6, 0.0]], "b": 1.0}
    rule = parse_mixture(spec, 8)[0]
    assert [rule.weight(s) for s in (1, 2, 4, 6, 9)] == [1, 1, Fraction(1, 2), 0, 0]
    assert [counts(spec, s) for s in (1, 4, 6, 9)] == [[4, 4], [3, 5], [0, 8], [0, 8]]


def test_quotas_are_exact_every_step():
    spec = {"a": {"quota": 5}, "b": {"quota": 3}}
    assert [counts(spec, s) for s in (1, 2, 100)] == [[5, 3]] * 3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.mixture.a=-1", "data.mixture.a=-1: a weight must be a number >= 0"),
        ("data.mixture.a=[[3,1],[2,0]]", "schedule must increase (3 then 2)"),
        ("data.mixture.a=[[1,1],[5,0]]", "every weight is 0 at step 5"),
        ("data.mixture.a={quota: 3}", "the quotas sum to 3, not the 4 prompts a step draws"),
        ("data.mixture.a=abc", "data.mixture.a='abc': a rule is a weight"),
    ],
)
def test_bad_specs_are_one_line_naming_the_key_and_value(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=/m", "data.train_files=/d.parquet",
                           "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", override])  # fmt: skip
    assert message in str(err.value) and "\n" not in str(err.value)


def test_quotas_with_weights_are_refused():
    with pytest.raises(ConfigError, match=r"data.mixture.b=1: with quotas, every source"):
        parse_mixture({"a": {"quota": 4}, "b": 1}, 4)


ROWS = [{"origin": ("d/one.parquet", i), "data_source": "x" if i < 6 else "y"} for i in range(10)]
ROWS += [{"origin": ("d/two.parquet", i), "data_source": "z"} for i in range(4)]
FILES = ["d/one.parquet", "d/two.parquet"]


def test_sources_are_files_or_data_sources():
    one, z = source_rows(ROWS, FILES, ["one", "z"])
    assert one.tolist() == list(range(10)) and z.tolist() == [10, 11, 12, 13]
    x, two = source_rows(ROWS, FILES, ["x", "d/two.parquet"])
    assert x.tolist() == list(range(6)) and two.tolist() == [10, 11, 12, 13]
    with pytest.raises(DataError, match=r"data.mixture.w: no training file or data_source .*"
                       r"valid sources: d/one.parquet, d/two.parquet, x, y, z"):  # fmt: skip
        source_rows(ROWS, FILES, ["w"])
    with pytest.raises(DataError, match="also in source 'one'"):
        source_rows(ROWS, FILES, ["one", "x"])


def sampler(spec=None, batch=4, seed=0):
    spec = spec or {"x": [[1, 1.0], [5, 0.0]], "z": 1.0}
    rules = parse_mixture(spec, batch)
    names = [r.source for r in rules]
    return MixtureSampler(names, source_rows(ROWS, FILES, names),
                          functools.partial(step_counts, rules, batch_size=batch), batch,
                          seed=seed)  # fmt: skip


def test_each_step_draws_its_counts_from_each_sources_seeded_epochs():
    s = sampler()
    batches = [s.next_batch() for _ in range(8)]
    x, z = set(range(6)), {10, 11, 12, 13}
    for step, batch in enumerate(batches, start=1):
        nx, _ = counts({"x": [[1, 1.0], [5, 0.0]], "z": 1.0}, step, batch=4)
        assert set(batch[:nx]) <= x and set(batch[nx:]) <= z and len(batch) == 4
    # each source walks through its epochs: every prompt once per epoch
    drawn_z = [i for b in batches for i in b if i in z]
    assert sorted(drawn_z[:4]) == sorted(z) and sorted(drawn_z[4:8]) == sorted(z)
    assert [s.next_batch() for _ in range(3)] != [sampler(seed=1).next_batch() for _ in range(3)]
    again = sampler()
    assert [again.next_batch() for _ in range(8)] == batches  # seeded


def test_state_round_trip_resumes_the_exact_draw():
    whole = sampler()
    expected = [whole.next_batch() for _ in range(9)]
    cut = sampler()
    head = [cut.next_batch() for _ in range(4)]
    state = cut.state_dict()
    resumed = sampler()
    resumed.load_state_dict(state)
    assert head + [resumed.next_batch() for _ in range(5)] == expected
    assert state["mixture"]["draws"] == 4
    with pytest.raises(CheckpointError, match=r"same data\.mixture"):
        sampler({"z": 1.0, "x": 1.0}).load_state_dict(state)
    with pytest.raises(CheckpointError, match=r"data\.mixture it was saved with"):
        PromptSampler(10, 4).load_state_dict(state)


def test_a_state_without_a_mixture_starts_it_from_its_first_step():
    old = PromptSampler(10, 4, seed=0)
    old.next_batch()
    s = sampler()
    s.load_state_dict(old.state_dict())
    assert s.draws == 0 and s.next_batch() == sampler().next_batch()


def test_the_plain_pool_draws_as_before():
    s = PromptSampler(10, 4, seed=3)
    assert [s.next_batch() for _ in range(4)] == [
        [9, 6, 0, 2], [1, 4, 7, 5], [4, 1, 2, 8], [5, 0, 7, 9]
    ]  # fmt: skip
    assert np.array_equal(PromptSampler(10, 4, seed=3).order(1), [4, 1, 2, 8, 5, 0, 7, 9, 6, 3])


# ------------------------------------------------------------------ a run killed mid-schedule
STEPS = 3


def _run_args(root, run, *extra):
    return [
        f"model.path={root / 'model'}",
        f"data.train_files=[{root / 'digits' / 'train.parquet'},{root / 'count' / 'train.parquet'}]",
        "data.mixture.digits=[[1,1.0],[3,0.0]]", "data.mixture.count=1.0",
        "data.max_prompt_length=64", "data.max_response_length=6", "data.train_batch_size=4",
        "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.optim.lr=1e-2",
        "algorithm.adv_estimator=grpo", "model.enable_gradient_checkpointing=false",
        "trainer.device=cpu", f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1",
        "reward.num_workers=0", "trainer.logger=[]", f"trainer.default_local_dir={run}", *extra,
    ]  # fmt: skip


def _trainer(args, drawn):
    from lmrl.trainer import Trainer, build_run

    cfg = load_config(None, args)
    trainer = Trainer(build_run(cfg), cfg.trainer)
    sampler, draw = trainer.sampler, trainer.sampler.next_batch

    def recorded():
        drawn.append(draw())
        return drawn[-1]

    sampler.next_batch = recorded  # type: ignore[method-assign]
    return trainer


def test_a_run_killed_mid_schedule_resumes_to_the_same_draw_and_weights(tiny_workspace, tmp_path):
    import os
    import signal

    import torch
    from safetensors.torch import load_file

    from lmrl.data.tasks import write_task

    (tmp_path / "model").symlink_to(tiny_workspace / "model")
    write_task("digits", tmp_path / "digits", seed=0, num_train=8, num_test=2)
    write_task("count", tmp_path / "count", seed=0, num_train=8, num_test=2)

    whole_draws: list[list[int]] = []
    _trainer(_run_args(tmp_path, tmp_path / "whole"), whole_draws).fit()
    assert [sum(i < 8 for i in b) for b in whole_draws] == [2, 1, 0]  # digits' share falls

    cut_draws: list[list[int]] = []
    cut = _trainer(_run_args(tmp_path, tmp_path / "cut"), cut_draws)
    step = cut.step

    def step_then_signal():
        out = step()
        if cut.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's time limit does
        return out

    cut.step = step_then_signal  # type: ignore[method-assign]
    cut.fit()
    assert cut.exit_code == 143 and cut.global_step == 2
    resumed = _trainer(_run_args(tmp_path, tmp_path / "cut"), cut_draws)
    assert resumed.global_step == 2 and resumed.sampler.draws == 2
    resumed.fit()
    assert cut_draws == whole_draws
    expected = load_file(tmp_path / "whole" / f"global_step_{STEPS}" / "actor.safetensors")
    actual = load_file(tmp_path / "cut" / f"global_step_{STEPS}" / "actor.safetensors")
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
