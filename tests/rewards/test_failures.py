"""A failing reward is visible and stops a hopeless run: every failure kind is counted, the
first call raises when (nearly) every sample fails, bad rows are load-time errors, timeouts run
in parallel across the pool, and a crashed worker's message gives its exit code."""

from __future__ import annotations

import json
import logging
import math
import threading

import pytest
import torch

from lmrl.batch import Batch
from lmrl.data import RLDataset
from lmrl.data.tasks import TASKS, generate_rows
from lmrl.errors import DataError, RewardError
from lmrl.models.tiny import build_tokenizer
from lmrl.rewards import load_reward_fn, make_reward_manager
from lmrl.rewards.pool import ScoringPool


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def make_batch(tok, texts, truths, data_source="digits"):
    ids = [tok(t, add_special_tokens=False)["input_ids"] or [tok.eos_token_id] for t in texts]
    T = max(len(x) for x in ids)
    responses = torch.full((len(ids), T), tok.pad_token_id)
    mask = torch.zeros(len(ids), T, dtype=torch.bool)
    for i, x in enumerate(ids):
        responses[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = True
    return Batch(
        {"responses": responses, "response_mask": mask},
        {
            "data_source": [data_source] * len(ids),
            "ground_truth": list(truths),
            "extra_info": [{} for _ in ids],
        },
    )


def raises(solution_str):
    raise KeyError("no such key")


def returns_none(solution_str):
    return None


def returns_nan(solution_str):
    return math.nan


def returns_text(solution_str):
    return "high"


def returns_dict_without_score(solution_str):
    return {"acc": 1.0}


def returns_three(prompts, completions):
    return [1.0, 1.0, 1.0]


def returns_none_batch(prompts, completions):
    return None


KINDS = [
    (raises, "naive", "raises raised KeyError: 'no such key'"),
    (returns_none, "naive", "returns_none returned None"),
    (returns_nan, "naive", "returns_nan returned a non-finite score nan"),
    (returns_text, "naive", "returns_text returned str 'high'"),
    (returns_dict_without_score, "naive", "a dict without 'score'"),
    (returns_three, "batch", "returns_three returned 3 scores for 8 samples"),
    (returns_none_batch, "batch", "returns_none_batch returned None"),
]


@pytest.mark.parametrize(("fn", "manager", "quote"), KINDS, ids=[k[0].__name__ for k in KINDS])
def test_every_failure_kind_is_counted_and_stops_the_first_call(tok, fn, manager, quote):
    batch = make_batch(tok, ["1"] * 8, ["1"] * 8)
    patient = make_reward_manager(
        manager, tok, num_workers=0, reward_fns=fn, max_error_fraction=1.5
    )
    result = patient(batch)
    assert result.metrics["reward/errors"] == 8.0 and result.metrics["reward/scored"] == 8.0
    assert result.metrics["reward/timeouts"] == 0.0 and result.scores.tolist() == [0.0] * 8
    strict = make_reward_manager(manager, tok, num_workers=0, reward_fns=fn)
    with pytest.raises(RewardError) as info:
        strict(batch)
    message = str(info.value)
    assert quote in message
    assert f"reward function '{fn.__name__}'" in message and "data_source 'digits'" in message
    assert "failed on 8 of 8 samples of the first batch" in message
    assert "reward.max_error_fraction" in message


def test_the_message_names_the_file_of_a_loaded_function(tok, tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def compute_score(solution_str):\n    raise ValueError('bad input')\n")
    manager = make_reward_manager("naive", tok, num_workers=0, reward_fns=load_reward_fn(path))
    with pytest.raises(RewardError, match=r"'compute_score' in .*my_reward\.py") as info:
        manager(make_batch(tok, ["1", "2"], ["1", "2"]))
    assert "compute_score raised ValueError: bad input" in str(info.value)


def flaky(solution_str):
    if solution_str.startswith("bad"):
        raise RuntimeError("kaput")
    return 1.0


def test_threshold_applies_to_the_first_call_only(tok, caplog):
    mostly_ok = make_batch(tok, ["bad", "1", "2", "3"], [""] * 4)
    all_bad = make_batch(tok, ["bad"] * 4, [""] * 4)
    manager = make_reward_manager("naive", tok, num_workers=0, reward_fns=flaky)
    assert manager(mostly_ok).metrics["reward/errors"] == 1.0  # 1/4 < 0.9: counted only
    with caplog.at_level(logging.WARNING, logger="lmrl.rewards"):
        later = manager(all_bad)  # a later call: counted and warned, never raised
        manager(all_bad)
    assert later.metrics["reward/errors"] == 4.0
    warned = [r.getMessage() for r in caplog.records if "failed on 4 of 4" in r.getMessage()]
    assert len(warned) == 1 and "batch 2" in warned[0] and "kaput" in warned[0]
    # the bound: at the fraction raises, just below does not; 0 = any failure
    three_of_four = make_batch(tok, ["bad", "bad", "bad", "1"], [""] * 4)
    with pytest.raises(RewardError, match="3 of 4"):
        make_reward_manager("naive", tok, num_workers=0, reward_fns=flaky, max_error_fraction=0.75)(
            three_of_four
        )
    make_reward_manager("naive", tok, num_workers=0, reward_fns=flaky, max_error_fraction=0.76)(
        three_of_four
    )
    with pytest.raises(RewardError, match="1 of 4"):
        make_reward_manager("naive", tok, num_workers=0, reward_fns=flaky, max_error_fraction=0)(
            mostly_ok
        )
    for bad in (-0.1, math.nan, "0.5"):
        with pytest.raises(ValueError, match="max_error_fraction"):
            make_reward_manager("naive", tok, num_workers=0, max_error_fraction=bad)


def test_builtin_scorer_without_ground_truth_is_an_error_not_a_zero(tok):
    batch = make_batch(tok, ["1", "2"], [None, None])
    with pytest.raises(RewardError, match=r"built-in scorer .*no ground truth for data_source"):
        make_reward_manager("naive", tok, num_workers=0)(batch)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def row(source="digits", truth="321", **extra):
    out = {"prompt": "reverse 123=", "data_source": source, **extra}
    if truth is not None:
        out["reward_model"] = {"ground_truth": truth}
    return out


def test_check_dataset_names_file_row_and_column(tok, tmp_path):
    manager = make_reward_manager("naive", tok, num_workers=0)
    good = write_jsonl(tmp_path / "good.jsonl", [row(), row("openai/gsm8k", "72")])
    manager.check_dataset(RLDataset(good, tok))
    unknown = write_jsonl(tmp_path / "unknown.jsonl", [row(), row(), row("mine")])
    with pytest.raises(DataError) as info:
        manager.check_dataset(RLDataset(unknown, tok))
    message = str(info.value)
    assert message.startswith(f"{unknown}: row 2: column 'data_source': no built-in scorer")
    assert "'mine'" in message and "known data sources:" in message and "countdown" in message
    missing = write_jsonl(tmp_path / "missing.jsonl", [row(), row(truth=None)])
    with pytest.raises(
        DataError, match=r"missing\.jsonl: row 1: column 'reward_model\.ground_truth"
    ):
        manager.check_dataset(RLDataset(missing, tok))
    malformed = write_jsonl(tmp_path / "bad.jsonl", [row("gsm8k", "seventy")])
    with pytest.raises(DataError, match=r"bad\.jsonl: row 0: .*ground_truth.*not a number"):
        manager.check_dataset(RLDataset(malformed, tok))
    # the data source column keeps its own name in the message
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"prompt": "x", "task": "mine"}])
    with pytest.raises(DataError, match="column 'task'"):
        manager.check_dataset(RLDataset(renamed, tok, reward_fn_key="task"))
    # a custom function scores anything, with or without a ground truth
    custom = make_reward_manager("naive", tok, num_workers=0, reward_fns=flaky)
    for path in (unknown, missing, malformed):
        custom.check_dataset(RLDataset(path, tok))


def test_check_dataset_accepts_every_built_in_task(tok, tmp_path):
    manager = make_reward_manager("naive", tok, num_workers=0)
    for name, spec in TASKS.items():
        if spec.ability == "image":  # prompts of the image model, scored by lmrl.flow.rewards
            continue
        rows = generate_rows(name, num_train=20, num_test=5, prompt_format="{}")["train"]
        manager.check_dataset(RLDataset(write_jsonl(tmp_path / f"{name}.jsonl", rows), tok))


WORKER_FAULTS = """
import os, signal, time

def compute_score(solution_str):
    if solution_str == "hang":
        time.sleep(10_000)
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if solution_str == "slow":
        time.sleep(0.6)
    return 1.0
"""


TIMING = """
import os, time

def compute_score(solution_str, ground_truth):
    if solution_str == "slow":
        time.sleep(0.3)
    if solution_str == "late":
        time.sleep(1.5)
    if solution_str == "once":
        try:
            os.close(os.open(ground_truth, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return 1.0
        time.sleep(1.5)
    return 1.0
"""


def sample(text):
    return (0, "sample", ("digits", text, "1", {}))


@pytest.fixture
def faults(tmp_path):
    path = tmp_path / "faults.py"
    path.write_text(WORKER_FAULTS)
    return load_reward_fn(path)


# "hang": a call that hangs holding a lock on a file of its own (released when its process is
# killed), in the folder ``ground_truth``, and records the most such calls it sees alive at once as an empty file ``<pid>.most<count>``
HANG_AND_COUNT = """
import fcntl, glob, os, time

def compute_score(solution_str, ground_truth):
    if solution_str != "hang":
        return 1.0
    mine = open(os.path.join(ground_truth, f"{os.getpid()}.lock"), "w")
    fcntl.flock(mine, fcntl.LOCK_EX)
    most = 0
    while True:
        live = 0
        for path in glob.glob(os.path.join(ground_truth, "*.lock")):
            with open(path) as other:
                try:
                    fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    live += 1
        if live > most:
            most = live
            open(os.path.join(ground_truth, f"{os.getpid()}.most{most}"), "w").close()
        time.sleep(0.05)
"""


def test_timeouts_run_in_parallel_across_the_pool(tmp_path):
    # one after another, 2 workers hang 2 calls at a time; in parallel, stand-ins take the
    # waiting calls and more than 2 hang at once
    (tmp_path / "hang.py").write_text(HANG_AND_COUNT)
    seen = tmp_path / "seen"
    seen.mkdir()
    pool = ScoringPool([load_reward_fn(tmp_path / "hang.py")], num_workers=2, timeout_s=2.0)
    try:
        pool.start()
        out = pool.run([(0, "sample", ("digits", "hang", str(seen), {}))] * 8)
        assert [o.status for o in out] == ["timeout"] * 8
        assert "compute_score: call exceeded timeout_s=2 s" in out[0].message
        assert len(list(seen.glob("*.lock"))) == 8  # each call in a process of its own
        most = max(int(p.name.rpartition(".most")[2]) for p in seen.glob("*.most*"))
        assert most > 2, f"at most {most} hanging calls at once on 2 workers"
        assert pool.restarts == 8 and len(pool._workers) <= 2  # stand-ins stopped
        assert [o.score for o in pool.run([sample("1"), sample("1")])] == [1.0, 1.0]
    finally:
        pool.close()


def test_workers_killed_while_idle_are_replaced_at_the_next_call(faults):
    # e.g. the OOM killer, or Linux's parent-death signal after the thread that started them
    # ended: every send fails, and the call must start fresh workers, not wait on none
    pool = ScoringPool([faults], num_workers=2, timeout_s=5.0)
    try:
        assert len(pool.run([sample("1")] * 4)) == 4  # both workers ready, then idle
        for worker in pool._workers:
            worker.process.kill()
            worker.process.wait()
        done = threading.Event()
        out: list = []
        threading.Thread(target=lambda: (out.extend(pool.run([sample("1")] * 4)), done.set()),
                         daemon=True).start()  # fmt: skip
        assert done.wait(timeout=30), "the call waited on dead workers"
        assert [o.score for o in out] == [1.0] * 4
        assert pool.restarts == 2
    finally:
        pool.close()


def test_a_hung_looking_worker_hands_its_queue_on_and_each_answer_counts_once(tmp_path):
    # one worker, 8 tasks in chunks of 2. Task 0 ("slow") makes the worker look hung, so its
    # chunk-mate, task 1, goes to a stand-in too; whoever runs "once" first sleeps, so the
    # stand-in answers task 1 first and the worker answers it again later, while "late" is
    # still running: the second answer must not count.
    path = tmp_path / "timing.py"
    path.write_text(TIMING)
    pool = ScoringPool([load_reward_fn(path)], 1, timeout_s=5.0, stand_in_after_s=0.2)
    marker = str(tmp_path / "marker")
    texts = ["slow", "once", "late", "1", "1", "1", "1", "1"]
    try:
        out = pool.run([(0, "sample", ("digits", t, marker, {})) for t in texts])
        assert [(o.status, o.score) for o in out] == [("ok", 1.0)] * 8
        assert pool.restarts == 0 and len(pool._workers) <= 1  # busy and extra ones stopped
    finally:
        pool.close()


def test_a_crashed_worker_gives_its_exit_code_or_signal(tok, faults):
    manager = make_reward_manager(
        "naive", tok, num_workers=1, timeout_s=5.0, reward_fns=faults, max_error_fraction=2.0
    )
    with manager:
        result = manager(make_batch(tok, ["exit", "1", "kill", "1"], ["1"] * 4))
        assert result.scores.tolist() == [0.0, 1.0, 0.0, 1.0]
        assert result.metrics["reward/errors"] == 2.0
        assert result.metrics["reward/worker_restarts"] == 2.0
    strict = make_reward_manager("naive", tok, num_workers=1, timeout_s=5.0, reward_fns=faults)
    with (
        strict,
        pytest.raises(RewardError, match=r"exited with code 3.*reward\.max_error_fraction"),
    ):
        strict(make_batch(tok, ["exit", "exit"], ["1"] * 2))
    pool = ScoringPool([faults], num_workers=1, timeout_s=5.0)
    try:
        died, killed = pool.run([sample("exit"), sample("kill")])
    finally:
        pool.close()
    assert died.message == "compute_score: the reward worker process exited with code 3"
    assert killed.message == "compute_score: the reward worker process was killed by SIGKILL"
