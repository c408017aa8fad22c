"""Reward-function wrappers: convention detection, loading from a file, result checking."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch

from lmrl.errors import RewardError
from lmrl.rewards.functions import RewardFunction, load_reward_fn, normalize_value


@pytest.mark.parametrize(
    ("value", "status", "score"),
    [
        (1, "ok", 1.0),
        (0.25, "ok", 0.25),
        (True, "ok", 1.0),
        (np.float32(0.5), "ok", 0.5),
        (np.array(2.0), "ok", 2.0),
        (torch.tensor(3.0), "ok", 3.0),
        ({"score": -1.5, "acc": 0}, "ok", -1.5),
        (math.nan, "error", 0.0),
        (math.inf, "error", 0.0),
        ({"score": math.nan}, "error", 0.0),
        ("1.0", "error", 0.0),
        (None, "error", 0.0),
        ([1.0], "error", 0.0),
        (torch.tensor([1.0, 2.0]), "error", 0.0),
        ({"acc": 1.0}, "error", 0.0),
    ],
)
def test_normalize_value(value, status, score):
    out = normalize_value(value, "f")
    assert (out.status, out.score) == (status, score)
    if status == "error":
        assert out.message.startswith("f ")


def test_dict_extras_are_kept_as_numbers_or_strings():
    out = normalize_value(
        {"score": 1, "acc": True, "pred": "42", "gap": None, "n": np.int64(3)}, "f"
    )
    assert out.extras == {"acc": 1.0, "pred": "42", "gap": None, "n": 3.0}


def per_sample(data_source, solution_str, ground_truth, extra_info):
    return float(solution_str == ground_truth)


def two_args(solution_str, ground_truth):
    return float(solution_str == ground_truth)


def batched(prompts, completions, **columns):
    return [float(c == g) for c, g in zip(completions, columns["ground_truth"], strict=True)]


def test_convention_detection_by_parameter_names():
    assert RewardFunction(per_sample).batched is False
    assert RewardFunction(two_args).batched is False
    assert RewardFunction(batched).batched is True
    assert RewardFunction(lambda x: 0.0, batched=True).batched is True  # explicit wins
    with pytest.raises(ValueError, match="'completions' means batched"):
        RewardFunction(lambda x, y: 0.0)
    with pytest.raises(ValueError, match="weight"):
        RewardFunction(per_sample, weight=math.nan)


def test_undeclared_arguments_are_not_passed():
    assert RewardFunction(two_args).call_per_sample("src", "ab", "ab", {}).score == 1.0
    out = RewardFunction(batched).call_batched(["p", "q"], ["a", "b"], {"ground_truth": ["a", "x"]})
    assert [o.score for o in out] == [1.0, 0.0]


def test_call_never_raises():
    def boom(solution_str):
        raise RuntimeError("kaput")

    out = RewardFunction(boom).call_per_sample("s", "x", None, None)
    assert out.status == "error" and "RuntimeError: kaput" in out.message

    def short(prompts, completions):
        return [1.0]

    outs = RewardFunction(short).call_batched([None] * 3, ["a", "b", "c"], {})
    assert [o.status for o in outs] == ["error"] * 3 and "1 scores for 3 samples" in outs[0].message

    def nones(prompts, completions):
        return [None, 0.5, "x"]

    outs = RewardFunction(nones).call_batched([None] * 3, ["a", "b", "c"], {})
    assert [o.status for o in outs] == ["none", "ok", "error"]


REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": float(solution_str == ground_truth) + bonus, "len": len(solution_str)}

def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]

NOT_CALLABLE = 3
"""


def test_load_reward_fn_from_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    rf = load_reward_fn(path, kwargs={"bonus": 0.5})
    assert rf.name == "compute_score" and rf.batched is False
    out = rf.call_per_sample("x", "7", "7", None)
    assert out.score == 1.5 and out.extras == {"len": 1.0}
    length = load_reward_fn(str(path), "length_reward", weight=0.1)
    assert length.batched is True and length.weight == 0.1
    # picklable by (path, name): workers re-import the file
    again = pickle.loads(pickle.dumps(rf))
    assert again.call_per_sample("x", "7", "8", None).score == 0.5


def test_load_reward_fn_errors_name_the_file_and_the_function(tmp_path):
    with pytest.raises(RewardError, match=r"nope\.py does not exist .*'compute_score'"):
        load_reward_fn(tmp_path / "nope.py")
    path = tmp_path / "r.py"
    path.write_text(REWARD_FILE + "\ndef odd(x, y):\n    return 0.0\n")
    with pytest.raises(
        RewardError, match=r"'missing' not found in .*r\.py; callables there: .*length_reward"
    ):
        load_reward_fn(path, "missing")
    with pytest.raises(RewardError, match=r"'NOT_CALLABLE' in .*r\.py is not callable"):
        load_reward_fn(path, "NOT_CALLABLE")
    with pytest.raises(
        RewardError, match=r"cannot tell how to call reward function 'odd' in .*r\.py"
    ):
        load_reward_fn(path, "odd")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(RewardError, match=r"broken\.py failed: ModuleNotFoundError.*'my_score'"):
        load_reward_fn(broken, "my_score")
