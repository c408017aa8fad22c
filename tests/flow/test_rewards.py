"""Image rewards from a user's file fail as text rewards do (issue 31 §4): a function that
raises, returns strings or NaN scores costs those images a 0 and a count in
``reward/errors``, and stops the run in one line when it fails on (nearly) all of the first
batch; a function that cannot take ``(images, prompts, metadata)`` is refused when loaded."""

from __future__ import annotations

import logging

import pytest
import torch

from lmrl.errors import RewardError
from lmrl.flow.rewards import load_image_reward

USER_REWARDS = """
calls = []

def raises(images, prompts, metadata):
    calls.append(1)
    if len(calls) > 1:
        raise ValueError("no detector\\nsecond line")
    return [1.0] * len(prompts)

def always_raises(images, prompts, metadata):
    raise ValueError("no detector")

def strings(images, prompts, metadata):
    return ["0.5"] * len(prompts)

def none(images, prompts, metadata):
    return None

def one_nan(images, prompts, metadata):
    return [float("nan")] + [1.0] * (len(prompts) - 1)

def with_checks(images, prompts, metadata):
    return {"score": [1.0] * len(prompts), "colour": [1, 0, 1, 0], "label": ["a"] * 4}

def one_argument(images):
    return [1.0] * len(images)

def keywords_only(*, images, prompts, metadata):
    return [1.0] * len(images)

def with_defaults(images, prompts=None, metadata=None, scale=1.0):
    return [scale] * len(images)
"""

IMAGES = torch.zeros(4, 3, 8, 8)
PROMPTS = ["a", "b", "c", "d"]
META = [{}] * 4


@pytest.fixture
def user(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(USER_REWARDS)
    return path


@pytest.mark.parametrize(
    "name, what",
    [
        ("always_raises", "failed on 4 of 4 images of the first batch; first error: it raised "
                          "ValueError: no detector"),
        ("strings", "returned scores as strings ('0.5'), expected numbers"),
        ("none", "returned scores as NoneType (None), expected numbers"),
    ],
)  # fmt: skip
def test_a_reward_failing_on_the_first_batch_stops_in_one_line(user, name, what):
    with pytest.raises(RewardError) as err:
        load_image_reward(name, user).score(IMAGES, PROMPTS, META)
    message = str(err.value)
    assert what in message and f"image reward {name} in {user}" in message
    assert "reward.max_error_fraction above 0.9" in message and "\n" not in message


def test_failures_after_the_first_batch_score_zero_and_are_counted(user, caplog):
    reward = load_image_reward("raises", user)
    scores, _, counts = reward.score(IMAGES, PROMPTS, META)
    assert scores.tolist() == [1.0] * 4 and counts == {"reward/scored": 4.0, "reward/errors": 0.0}
    with caplog.at_level(logging.WARNING, logger="lmrl.rewards"):
        for _ in range(2):
            scores, _, counts = reward.score(IMAGES, PROMPTS, META)
            assert scores.tolist() == [0.0] * 4 and counts["reward/errors"] == 4.0
    warnings = [r.getMessage() for r in caplog.records if r.name == "lmrl.rewards"]
    assert len(warnings) == 1 and "raised ValueError: no detector (scored 0" in warnings[0]


def test_a_nan_score_is_named_and_costs_only_its_image(user):
    with pytest.raises(RewardError, match=r"non-finite score nan for image 0 of 4"):
        load_image_reward("one_nan", user, max_error_fraction=0.25).score(IMAGES, PROMPTS, META)
    scores, _, counts = load_image_reward("one_nan", user).score(IMAGES, PROMPTS, META)
    assert scores.tolist() == [0.0, 1.0, 1.0, 1.0] and counts["reward/errors"] == 1.0


def test_max_error_fraction_above_one_never_stops(user):
    scores, _, counts = load_image_reward("always_raises", user, 1.5).score(IMAGES, PROMPTS, META)
    assert scores.tolist() == [0.0] * 4 and counts["reward/errors"] == 4.0


def test_numeric_values_beside_the_score_are_kept_and_text_ones_dropped(user, caplog):
    with caplog.at_level(logging.WARNING, logger="lmrl.rewards"):
        scores, extras, counts = load_image_reward("with_checks", user).score(IMAGES, PROMPTS, META)
    assert scores.tolist() == [1.0] * 4 and counts["reward/errors"] == 0.0
    assert list(extras) == ["colour"] and extras["colour"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert any("'label' values as strings" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name", ["one_argument", "keywords_only"])
def test_a_function_with_the_wrong_signature_is_refused_when_loaded(user, name):
    with pytest.raises(RewardError) as err:
        load_image_reward(name, user)
    message = str(err.value)
    assert f"image reward file {user}: {name}(" in message
    assert f"cannot be called as {name}(images, prompts, metadata)" in message
    assert "\n" not in message


def test_a_function_with_defaults_beyond_the_three_arguments_loads(user):
    assert load_image_reward("with_defaults", user)(IMAGES, PROMPTS, META).tolist() == [1.0] * 4


def test_train_flow_with_a_raising_reward_exits_2_in_one_line(tmp_path, user, capsys):
    from lmrl.cli import main
    from lmrl.data.tasks import write_task
    from lmrl.flow.matching import pretrain_image_flow

    paths = write_task("shapes", tmp_path / "data", seed=0, num_images=16)
    pretrain_image_flow(paths["images"], tmp_path / "model", steps=1, block_out_channels=(8, 16))
    args = [
        "train-flow",
        f"model.path={tmp_path / 'model'}",
        f"data.train_files={paths['train']}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.logger=[]", "trainer.total_training_steps=1", "trainer.save_freq=0",
        "data.train_batch_size=2", "sampler.n=2", "sampler.num_steps=2",
        "actor.micro_batch_size=2", "trainer.device=cpu",
        f"reward.path={user}", "reward.name=always_raises",
    ]  # fmt: skip
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "image reward" in line]
    assert len(lines) == 1 and "raised ValueError: no detector" in lines[0], err
