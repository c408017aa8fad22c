"""Rewards in flight (issue 34 part 1): a block of rows is scored as soon as it is generated,
while the next block generates (``reward.overlap.chunks``), and the scoring may overlap the
old and reference log-probs too (``reward.overlap.log_probs``, verl's ``launch_reward_fn_async``).

What is checked: the samples and scores are those of the step that generates the batch, then
scores it; the reward really runs while the engine generates (or while stage 4 runs): the
reward of the first block waits for an event that only the overlapped work sets; ReMax and
DAPO's dynamic sampling keep their results; a reward that fails stops the run as before and
leaves no thread; the keys are checked and verl's translates.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.trainer.conftest import _tiny_overrides, linked_workspace

from lmrl.config import ConfigError, load_config
from lmrl.errors import RewardError
from lmrl.rewards.result import RewardResult, merge_results
from lmrl.trainer import Trainer, build_run


@pytest.fixture(scope="module")
def workspace(tiny_workspace, tmp_path_factory):
    return linked_workspace(
        tiny_workspace,
        tmp_path_factory.mktemp("in_flight"),
        **{
            "reward.py": "def compute_score(data_source, solution_str, ground_truth, "
            "extra_info=None):\n"
            "    return {'score': sum(c.isdigit() for c in solution_str) / "
            "max(len(solution_str), 1),\n"
            "            'digits': float(sum(c.isdigit() for c in solution_str))}\n",
            "broken.py": "def compute_score(data_source, solution_str, ground_truth, "
            "extra_info=None):\n"
            "    raise KeyError('judge unreachable')\n",
        },
    )


def args(root: Path, run: str, *extra: str) -> list[str]:
    """The tiny run of ``tests/trainer/conftest.py`` with this file's reward, 8 prompts."""
    return _tiny_overrides(
        root,
        root / run,
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
        "trainer.save_freq=-1",
        f"reward.custom_reward_function.path={root / 'reward.py'}",
        *extra,
    )


class Hooked:
    """The run's reward, calling ``before(batch)`` first."""

    def __init__(self, inner, before):
        self.inner, self.before = inner, before

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, batch):
        self.before(batch)
        return self.inner(batch)


def trainer_for(root: Path, run: str, *extra: str, reward=None, engine=None, on_stage=None):
    """A trainer whose reward calls ``reward(batch)`` first and whose engine is
    ``engine(inner)`` when given."""
    cfg = load_config(None, args(root, run, *extra))
    parts = build_run(cfg)
    if reward is not None:
        parts = dataclasses.replace(parts, reward=Hooked(parts.reward, reward))
    if engine is not None:
        parts = dataclasses.replace(parts, engine=engine(parts.engine))
    return Trainer(parts, cfg.trainer, on_stage=on_stage)


def run(root: Path, name: str, *extra: str, **wraps):
    trainer = trainer_for(root, name, *extra, **wraps)
    try:
        metrics = trainer.fit()
    finally:
        trainer.close()
    return trainer, metrics


def assert_same_run(a, a_metrics, b, b_metrics):
    """The same samples, scores and reward metrics; the updates from them agree."""
    x, y = a.last_batch, b.last_batch
    assert torch.equal(x["responses"], y["responses"])
    assert torch.equal(x["response_mask"], y["response_mask"])
    assert torch.equal(x["token_level_scores"], y["token_level_scores"])
    torch.testing.assert_close(x["rollout_log_probs"], y["rollout_log_probs"])
    assert list(x["reward_texts"]) == list(y["reward_texts"])
    for m, n in zip(a_metrics, b_metrics, strict=True):
        rewards = {k: v for k, v in m.items() if k.startswith(("reward/", "critic/score"))}
        assert rewards == {k: n[k] for k in rewards}
    wa, wb = a.parts.actor.model_state(), b.parts.actor.model_state()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


class Blocks:
    """Wraps the engine: counts its calls; ``started[i]`` is set when call i starts."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.started = [threading.Event() for _ in range(64)]

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompts, n=1, sampling=None, *, prompt_offset=0):
        self.started[self.calls].set()
        self.calls += 1
        return self.inner.generate(prompts, n, sampling, prompt_offset=prompt_offset)


# ------------------------------------------------------------------ overlap.chunks


def test_blocks_scored_as_they_finish_give_the_batch_scored_at_once(workspace):
    whole, whole_m = run(workspace, "whole")
    sizes: list[int] = []
    parts, parts_m = run(workspace, "blocks", "reward.overlap.chunks=3",
                         reward=lambda batch: sizes.append(len(batch)))  # fmt: skip
    assert sizes == [6, 6, 4] * 2  # 8 prompts x 2 samples in 3 calls of whole groups, 2 steps
    assert_same_run(whole, whole_m, parts, parts_m)
    assert parts_m[0]["reward/digits/mean"] == whole_m[0]["reward/digits/mean"]


def test_a_block_is_scored_while_the_next_one_generates(workspace):
    engines: list[Blocks] = []
    overlapped: list[bool] = []

    def wrap_engine(inner):
        engines.append(Blocks(inner))
        return engines[0]

    def waiting(batch):
        if not overlapped:  # the first block: waits until the second starts generating
            overlapped.append(engines[0].started[1].wait(timeout=20))

    run(workspace, "overlap", "reward.overlap.chunks=2", "trainer.total_training_steps=1",
        reward=waiting, engine=wrap_engine)  # fmt: skip
    assert overlapped == [True]
    assert engines[0].calls == 2


def test_remax_and_dynamic_sampling_keep_their_results_with_blocks(workspace):
    remax = ("algorithm.adv_estimator=remax",)
    a = run(workspace, "remax1", *remax)
    b = run(workspace, "remax3", *remax, "reward.overlap.chunks=3")
    assert_same_run(*a, *b)
    assert torch.equal(a[0].last_batch["reward_baselines"], b[0].last_batch["reward_baselines"])
    dapo = ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2")
    a = run(workspace, "dapo1", *dapo)
    b = run(workspace, "dapo4", *dapo, "reward.overlap.chunks=4")
    assert_same_run(*a, *b)
    assert a[1][0]["filter_groups/gen_batches"] == b[1][0]["filter_groups/gen_batches"]


def test_a_failing_reward_stops_the_run_as_before_and_leaves_no_thread(workspace):
    broken = f"reward.custom_reward_function.path={workspace / 'broken.py'}"
    for extra in ([], ["reward.overlap.chunks=2"], ["reward.overlap.log_probs=true"]):
        trainer = trainer_for(workspace, "broken", broken, *extra)
        try:
            with pytest.raises(RewardError, match="judge unreachable"):
                trainer.fit()
        finally:
            trainer.close()
    deadline = time.monotonic() + 5
    while any(t.name.startswith("lmrl-reward") for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.05)


# ------------------------------------------------------------------ overlap.rows

STOPS = ('rollout.stop=["a","e","1"]', "data.max_response_length=12")  # rows stop at 4, 11, 12


def test_the_engine_reports_each_row_once_with_its_final_tokens(workspace):
    cfg = load_config(None, args(workspace, "engine", *STOPS))
    parts = build_run(cfg)
    try:
        reports = []
        parts.engine.set_row_done(lambda rows, block: reports.append((rows.tolist(), block)))
        prompts = parts.train_data.get_batch(list(range(8)))
        prompts["uid"] = np.array([f"p{i}" for i in range(8)], dtype=object)  # as the step's
        out = parts.engine.generate(prompts, 2, parts.plan.sampling)
    finally:
        parts.engine.set_row_done(None)
        parts.close()
    assert_reported_once(reports, out)


def assert_reported_once(reports, out):
    """Each row of ``out`` reported once, as ``out`` holds it (up to the block's width)."""
    assert sorted(r for rows, _ in reports for r in rows) == list(range(len(out)))
    assert len(reports) > 1  # some rows stopped before the others
    for rows, block in reports:
        t = block["responses"].shape[1]
        for key in ("responses", "response_mask", "rollout_log_probs"):
            assert torch.equal(block[key], out[key][rows, :t]), key
        assert not out["response_mask"][rows, t:].any()  # nothing after the report
        assert torch.equal(block["prompts"], out["prompts"][rows])
        assert list(block["uid"]) == [out["uid"][r] for r in rows]


def test_the_static_decode_reports_its_rows_per_micro_batch_with_the_same_scores(workspace):
    static = (*STOPS, "rollout.hf.decode=static")
    whole = run(workspace, "static-whole", *static)
    sizes: list[int] = []
    rows = run(workspace, "static-rows", *static, "reward.overlap.rows=true",
               reward=lambda batch: sizes.append(len(batch)))  # fmt: skip
    assert sizes == [16, 16]  # one micro-batch a call: reported when it ends
    assert_same_run(*whole, *rows)


def test_rows_scored_as_they_stop_give_the_batch_scored_at_once(workspace):
    whole = run(workspace, "rows-whole", *STOPS)
    sizes: list[int] = []
    rows = run(workspace, "rows", *STOPS, "reward.overlap.rows=true",
               reward=lambda batch: sizes.append(len(batch)))  # fmt: skip
    assert sum(sizes) == 32 and len(sizes) > 2  # 2 steps of 16 rows, in several calls
    assert_same_run(*whole, *rows)
    both = run(workspace, "rows-chunks", *STOPS, "reward.overlap.rows=true",
               "reward.overlap.chunks=2", "reward.overlap.log_probs=true")  # fmt: skip
    assert_same_run(*whole, *both)


@pytest.mark.parametrize(
    "engine", ["rollout.dtype=bfloat16", "model.mixed_precision.param_dtype=bfloat16"]
)
def test_rows_stream_through_a_bf16_copy_and_under_autocast(workspace, engine):
    sizes: list[int] = []
    run_name = "rows-" + engine.split(".")[0]
    trainer = trainer_for(workspace, run_name, *STOPS, engine, "reward.overlap.rows=true",
                          "trainer.total_training_steps=1",
                          reward=lambda batch: sizes.append(len(batch)))  # fmt: skip
    try:
        assert type(trainer.parts.engine).__name__ in ("CopyEngine", "PrecisionEngine")
        trainer.fit()
    finally:
        trainer.close()
    assert sum(sizes) == 16 and len(sizes) > 1


def test_an_agent_row_is_reported_when_its_last_turn_ends_and_scores_the_same(
    search_workspace, tmp_path
):
    from tests.trainer.test_agent_run import agent_args

    def agent_run(name, *extra, reward=None):
        cfg = load_config(None, agent_args(search_workspace, name, "trainer.total_training_steps=1",
                                           "trainer.save_freq=-1", "data.val_files=null",
                                           *extra))  # fmt: skip
        cfg.trainer.default_local_dir = str(tmp_path / name)
        parts = build_run(cfg)
        if reward is not None:
            parts = dataclasses.replace(parts, reward=Hooked(parts.reward, reward))
        trainer = Trainer(parts, cfg.trainer)
        try:
            return trainer, trainer.fit()
        finally:
            trainer.close()

    cfg = load_config(None, agent_args(search_workspace, "agent-engine"))
    parts = build_run(cfg)
    try:
        reports = []
        parts.engine.set_row_done(lambda rows, block: reports.append((rows.tolist(), block)))
        prompts = parts.train_data.get_batch(list(range(4)))
        prompts["uid"] = np.array([f"p{i}" for i in range(4)], dtype=object)
        out = parts.engine.generate(prompts, 2, parts.plan.sampling)
    finally:
        parts.engine.set_row_done(None)
        parts.close()
    assert_reported_once(reports, out)
    for rows, block in reports:  # what the reward decodes: the observations read, too
        t, p = block["responses"].shape[1], out["prompts"].shape[1]
        read = out["attention_mask"][rows, p : p + t]
        assert torch.equal(block["attention_mask"][:, -t:], read)

    sizes: list[int] = []
    plain = agent_run("agent-plain")
    rows = agent_run("agent-rows", "reward.overlap.rows=true",
                     reward=lambda batch: sizes.append(len(batch)))  # fmt: skip
    assert sum(sizes) == 8 and len(sizes) > 1
    assert_same_run(*plain, *rows)


def test_a_row_is_scored_while_the_others_decode(workspace):
    forwards = [0]
    overlapped: list[bool] = []

    def counting(inner):
        real = inner._forward

        def forward(*a, **k):
            forwards[0] += 1
            return real(*a, **k)

        inner._forward = forward
        return inner

    def waiting(batch):
        if not overlapped:  # the first row that stopped: the decode goes on meanwhile
            seen, deadline = forwards[0], time.monotonic() + 20
            while forwards[0] == seen and time.monotonic() < deadline:
                time.sleep(0.001)
            overlapped.append(forwards[0] > seen)

    run(workspace, "rows-overlap", *STOPS, "reward.overlap.rows=true",
        "trainer.total_training_steps=1", reward=waiting, engine=counting)  # fmt: skip
    assert overlapped == [True]


# ------------------------------------------------------------------ launch_async


def test_launch_async_scores_while_the_reference_log_probs_run(workspace):
    kl = ("actor.use_kl_loss=true", "actor.kl_loss_coef=0.1")
    ref_started = threading.Event()
    seen: list[bool] = []

    def waiting(batch):
        seen.append(ref_started.wait(timeout=20))  # stage 4 starts before the scores
        ref_started.clear()

    def on_stage(name):
        if name == "ref":
            ref_started.set()

    later, later_m = run(workspace, "late", *kl, "reward.overlap.log_probs=true",
                         reward=waiting, on_stage=on_stage)  # fmt: skip
    assert seen == [True, True]
    now, now_m = run(workspace, "now", *kl)
    assert_same_run(now, now_m, later, later_m)
    # the wait for the scores is timed where it happens: after stages 3-5
    assert all(m["timing_s/reward"] >= 0.0 for m in later_m)


# ------------------------------------------------------------------ keys and merging


def test_bad_keys_are_one_line_and_verls_key_translates(workspace):
    with pytest.raises(ConfigError, match=r"reward\.overlap\.chunks=0 must be >= 1"):
        load_config(None, args(workspace, "bad", "reward.overlap.chunks=0"))
    with pytest.raises(ConfigError, match=r"reward\.overlap\.rows=True needs reward\.manager"):
        load_config(None, args(workspace, "bad", "reward.overlap.rows=true",
                               "reward.manager=batch"))  # fmt: skip
    cfg = load_config(None, args(workspace, "verl", "reward_model.launch_reward_fn_async=true"))
    assert cfg.reward.overlap["log_probs"] is True


def test_merged_results_pad_the_narrower_blocks_and_fill_missing_extras():
    a = RewardResult(torch.tensor([[0.0, 1.0]]), {"score": np.array([1.0])},
                     {"reward/scored": 1.0})  # fmt: skip
    b = RewardResult(torch.tensor([[0.0, 0.0, 0.5], [2.0, 0.0, 0.0]]),
                     {"score": np.array([0.5, 2.0]), "pred": np.array(["x", None], dtype=object)},
                     {"reward/scored": 2.0, "reward/errors": 1.0})  # fmt: skip
    merged = merge_results([a, b], width=4)
    assert merged.token_level_scores.shape == (3, 4)
    assert merged.scores.tolist() == [1.0, 0.5, 2.0]
    assert merged.extras["score"].tolist() == [1.0, 0.5, 2.0]
    assert list(merged.extras["pred"]) == [None, "x", None]
    assert merged.metrics == {"reward/scored": 3.0, "reward/errors": 1.0}
