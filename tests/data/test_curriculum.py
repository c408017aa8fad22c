"""data.curriculum: the options checked in one line; skip_solved lets settled prompts sit out
and still fills every batch; target favours prompts near the target pass rate; the state
round trip (and a run killed mid-run) resumes the exact draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmrl.config import ConfigError, load_config
from lmrl.config.curriculum import Curriculum, parse_curriculum
from lmrl.data.curriculum import CurriculumSampler, passes
from lmrl.errors import CheckpointError


def sampler(mode="skip_solved", sources=((0, 1, 2, 3, 4, 5, 6, 7),), batch=4, **options):
    rows = [np.asarray(r) for r in sources]
    share = batch // len(rows)
    return CurriculumSampler(Curriculum(mode=mode, **options), [f"s{i}" for i in range(len(rows))],
                             rows, lambda step: [share] * len(rows), batch, seed=3)  # fmt: skip


def feed(s, rule, n=2):
    """Draw a batch and observe it: ``rule(index)`` -> passes of its ``n`` samples."""
    batch = s.next_batch()
    s.observe(np.array([[1] * rule(i) + [0] * (n - rule(i)) for i in batch]).reshape(-1))
    return batch


# ------------------------------------------------------------------ options
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.curriculum.history=0", "data.curriculum.history=0: must be an integer >= 1"),
        ("data.curriculum.cooldown=0", "data.curriculum.cooldown=0: must be an integer >= 1"),
        ("data.curriculum.target_pass_rate=1.5",
         "data.curriculum.target_pass_rate=1.5: must be a number from 0 to 1"),
        ("data.curriculum.pass_score=.nan", "data.curriculum.pass_score=nan: must be a finite"),
        ("async_training.enable=true", "data.curriculum.enable=true: does not combine with "
         "async_training.enable"),
    ],
)  # fmt: skip
def test_bad_options_are_one_line_naming_the_key(override, message):
    args = ["model.path=/m", "data.train_files=/t.parquet", "data.curriculum.enable=true"]
    with pytest.raises(ConfigError) as info:
        load_config(None, [*args, override])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_off_by_default_and_unknown_options_named():
    cfg = load_config(None, ["model.path=/m", "data.train_files=/t.parquet"])
    assert parse_curriculum(cfg.data.curriculum) is None
    with pytest.raises(ConfigError, match=r"data.curriculum.windows: unknown option; valid: "):
        parse_curriculum({"windows": 2})


def test_a_sample_passes_by_its_acc_else_its_score():
    scores, acc = np.array([1.0, 0.2, 0.9, 1.0]), np.array([0.0, 1.0, np.nan, np.nan])
    assert passes(scores, acc, 1.0).tolist() == [0, 1, 0, 1]
    assert passes(scores, None, 0.5, np.array([1, 1, 0, 1], bool)).tolist() == [1, 0, -1, 1]


# ------------------------------------------------------------------ skip_solved
def test_settled_prompts_sit_out_their_turns_up_to_the_cooldown():
    s = sampler(cooldown=1)
    first = feed(s, lambda i: 2 if i < 4 else 1) + feed(s, lambda i: 2 if i < 4 else 1)
    assert sorted(first) == list(range(8))  # one epoch: every prompt once
    assert all(s.settled(i) == (i < 4) for i in range(8))
    # the next pass: the four solved prompts sit out, the batch is filled by the others ...
    assert sorted(s.next_batch()) == [4, 5, 6, 7]
    assert s.skipped >= 3 and s.metrics()["curriculum/skipped"] == s.skipped  # those met
    s.observe(np.ones(8, dtype=int))  # ... which are now solved too
    # every prompt settled: those that sat out their one turn come back to be re-checked
    assert sorted(s.next_batch()) == [0, 1, 2, 3]


def test_a_batch_is_always_full_when_every_prompt_is_settled():
    s = sampler(cooldown=5)
    for _ in range(2):
        feed(s, lambda i: 0)  # every prompt failed by all its samples
    for _ in range(4):
        batch = feed(s, lambda i: 0)
        assert len(batch) == 4


def test_history_needs_that_many_settled_groups():
    s = sampler(history=2)
    feed(s, lambda i: 2)
    feed(s, lambda i: 2)
    assert not any(s.settled(i) for i in range(8))  # one group each so far
    feed(s, lambda i: 2)
    feed(s, lambda i: 2)
    assert all(s.settled(i) for i in range(8))
    s.records[0], s.records[1] = [[2, 2], [1, 2]], [[2, 2], [0, 2]]  # mixed; solved then failed
    s.records[2] = [[0, 2], [0, 2]]  # failed by every sample of both
    assert [s.settled(i) for i in range(3)] == [False, False, True]


# ------------------------------------------------------------------ target
def test_target_draws_prompts_near_the_target_pass_rate_more():
    s = sampler("target", sources=(range(40),), batch=8, target_pass_rate=0.5)
    rule = {i: (1 if i < 20 else 2) for i in range(40)}  # 0.5 for 0-19, 1.0 for 20-39
    for i in range(40):
        s.records[i] = [[rule[i], 2]]
    draws = np.concatenate([s.next_batch() for _ in range(50)])
    s._drawn.clear()
    near = (draws < 20).mean()
    assert near > 0.85  # weights 1 against 0.05
    assert s.weights(np.array([0, 20])).tolist() == pytest.approx([1.0, 0.05])
    assert s.pass_rate(99) == 0.5  # unseen: at the target


def test_with_a_mixture_each_source_gives_its_count():
    s = sampler("target", sources=(range(0, 10), range(10, 20)), batch=4)
    for _ in range(5):
        batch = s.next_batch()
        assert sum(i < 10 for i in batch) == 2 and len(set(batch)) == 4


# ------------------------------------------------------------------ state
@pytest.mark.parametrize("mode", ["skip_solved", "target"])
def test_state_round_trip_resumes_the_exact_draw(mode, tmp_path):
    def rule(i):
        return (i * 7) % 3

    whole = sampler(mode, sources=((0, 1, 2, 3, 4, 5), (6, 7, 8, 9, 10, 11)))
    expected = [feed(whole, rule) for _ in range(12)]
    cut = sampler(mode, sources=((0, 1, 2, 3, 4, 5), (6, 7, 8, 9, 10, 11)))
    head = [feed(cut, rule) for _ in range(5)]
    cut.next_batch()  # drawn, not yet observed: the state keeps it waiting
    torch.save(cut.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)  # as a checkpoint reads it
    resumed = sampler(mode, sources=((0, 1, 2, 3, 4, 5), (6, 7, 8, 9, 10, 11)))
    resumed.load_state_dict(state)
    waiting = resumed._drawn[0]
    resumed.observe(np.array([[1] * rule(i) + [0] * (2 - rule(i)) for i in waiting]).ravel())
    tail = [feed(resumed, rule) for _ in range(6)]
    assert [*head, waiting, *tail] == expected


def test_states_of_other_samplers_are_refused_in_one_line():
    from lmrl.data.sampler import PromptSampler

    s = sampler()
    with pytest.raises(CheckpointError, match=r"data\.curriculum"):
        PromptSampler(8, 4).load_state_dict(s.state_dict())
    with pytest.raises(CheckpointError, match=r"no data\.curriculum state"):
        s.load_state_dict(PromptSampler(8, 4, seed=3).state_dict())
    state = s.state_dict()
    state["curriculum"]["records"] = {99: [[1, 2]]}
    with pytest.raises(CheckpointError, match="past the data"):
        sampler().load_state_dict(state)


# ------------------------------------------------------------------ a run killed mid-run
STEPS = 4


def _run_args(root, run):
    return [
        f"model.path={root / 'model'}",
        f"data.train_files=[{root / 'digits' / 'train.parquet'},{root / 'count' / 'train.parquet'}]",
        "data.mixture.digits=1", "data.mixture.count=1", "data.curriculum.enable=true",
        "data.curriculum.mode=target", "data.curriculum.pass_score=0.5",
        "data.max_prompt_length=64", "data.max_response_length=4", "data.train_batch_size=2",
        "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.optim.lr=1e-2",
        "algorithm.adv_estimator=grpo", "model.enable_gradient_checkpointing=false",
        "trainer.device=cpu", f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1",
        "reward.num_workers=0", "trainer.logger=[]", f"trainer.default_local_dir={run}",
    ]  # fmt: skip


def _trainer(args, drawn):
    from lmrl.trainer import Trainer, build_run

    cfg = load_config(None, args)
    trainer = Trainer(build_run(cfg), cfg.trainer)
    draw = trainer.sampler.next_batch

    def recorded():
        drawn.append(draw())
        return drawn[-1]

    trainer.sampler.next_batch = recorded  # type: ignore[method-assign]
    return trainer


def test_a_run_killed_mid_run_resumes_to_the_same_draw_and_records(tiny_workspace, tmp_path):
    import os
    import signal

    from lmrl.data.tasks import write_task

    (tmp_path / "model").symlink_to(tiny_workspace / "model")
    write_task("digits", tmp_path / "digits", seed=0, num_train=3, num_test=1)
    write_task("count", tmp_path / "count", seed=0, num_train=3, num_test=1)

    whole_draws: list[list[int]] = []
    whole = _trainer(_run_args(tmp_path, tmp_path / "whole"), whole_draws)
    whole.fit()
    assert len(whole.sampler.records) >= 4  # the records steer the weighted draw

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
    assert resumed.sampler.draws == 2 and resumed.sampler.records == cut.sampler.records
    resumed.fit()
    assert cut_draws == whole_draws
    assert resumed.sampler.records == whole.sampler.records


def test_the_rule_in_words_for_the_plan():
    assert Curriculum().describe() == "prompts by pass rate: skip_solved (history 1, cooldown 2)"
    assert Curriculum(mode="target", target_pass_rate=0.4).describe() == (
        "prompts by pass rate: target 0.4 (history 1)"
    )
