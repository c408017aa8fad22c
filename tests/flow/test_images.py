"""The image side of Flow-GRPO: the shapes task, the detector and rewards, the image model."""

from __future__ import annotations

import itertools
import random
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from lmrl.data.shapes import (
    ATTRIBUTES,
    attribute_vector,
    noisy_captions,
    prompt_text,
    random_spec,
    read_images,
    render,
)
from lmrl.data.tasks import write_task
from lmrl.errors import ModelError, RewardError
from lmrl.flow.rewards import (
    brightness,
    colourfulness,
    compressibility,
    find_objects,
    geneval,
    geneval_checks,
    load_image_reward,
)

ALL_SPECS = [
    dict(zip(ATTRIBUTES, values, strict=True)) for values in itertools.product(*ATTRIBUTES.values())
]


def _images(specs, seed=0):
    rng = random.Random(seed)
    return torch.tensor(np.stack([render(s, rng) for s in specs])).permute(0, 3, 1, 2)


def test_prompts_read_as_english_and_condition_as_multi_hot():
    spec = {"shape": "circle", "colour": "red", "count": "two", "position": "left"}
    assert prompt_text(spec) == "two red circles on the left"
    assert prompt_text({**spec, "count": "one", "position": "top"}) == "one red circle at the top"
    vec = attribute_vector(spec)
    assert vec.shape == (12,) and vec.sum() == 4
    assert len({attribute_vector(s).tobytes() for s in ALL_SPECS}) == 72


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_detector_passes_every_rendered_prompt(seed):
    images = _images(ALL_SPECS, seed)
    assert geneval(images, None, ALL_SPECS, strict=True).tolist() == [1.0] * 72


def test_each_check_fails_for_the_attribute_it_reads():
    spec = {"shape": "square", "colour": "green", "count": "two", "position": "bottom"}
    (objects,) = find_objects(_images([spec]))
    assert [(o.colour, o.shape) for o in objects] == [("green", "square")] * 2
    assert all(o.centroid[1] > 8 for o in objects)
    for key, other, failed in [
        ("colour", "red", {"colour", "count", "shape", "position"}),
        ("count", "one", {"count"}),
        ("shape", "triangle", {"shape"}),
        ("position", "top", {"position"}),
    ]:
        checks = geneval_checks(objects, {**spec, key: other}, 16)
        assert {k for k, v in checks.items() if v == 0} == failed, key


def test_objects_are_four_connected_regions_of_one_colour():
    img = torch.zeros(1, 3, 16, 16)
    img[0, 0, 2:5, 2:5] = 0.9  # a red 3x3 square
    img[0, 0, 5:8, 5:8] = 0.9  # another, touching the first at one corner only
    img[0, 2, 2:5, 5:8] = 0.9  # a blue one beside the first red one
    img[0, 1, 12, 12] = 0.9  # one green pixel: below min_area
    (objects,) = find_objects(img)
    assert sorted(o.colour for o in objects) == ["blue", "red", "red"]
    assert all(o.area == 9 and o.shape == "square" for o in objects)


def test_image_statistics_rewards():
    black, noise = torch.zeros(2, 3, 16, 16), torch.rand(2, 3, 16, 16)
    assert brightness(torch.ones(2, 3, 4, 4)).tolist() == [1.0, 1.0]
    assert (compressibility(black) > compressibility(noise)).all()
    assert geneval(black, None, ALL_SPECS[:2]).tolist() == [0.0, 0.0]
    # colourfulness by hand: grey 0; all red: 0.3 |(1, 0.5)|; half red, half green: rg = +-1
    # (std 1, mean 0), yb = 0.5 everywhere: 1 + 0.3 * 0.5
    red, half = torch.zeros(1, 3, 4, 4), torch.zeros(1, 3, 4, 4)
    red[:, 0] = 1
    half[:, 0, :2], half[:, 1, 2:] = 1, 1
    grey = torch.full((1, 3, 4, 4), 0.4)
    got = colourfulness(torch.cat([grey, red, half])).tolist()
    assert got == pytest.approx([0.0, 0.3 * 1.25**0.5, 1.15], abs=1e-6)


def test_user_image_rewards_from_a_file_are_checked(tmp_path):
    user = tmp_path / "reward.py"
    user.write_text(
        "def reward_fn(images, prompts, metadata):\n"
        "    return [float(len(p)) for p in prompts]\n"
        "def wrong_length(images, prompts, metadata):\n"
        "    return [1.0]\n"
        "def nan(images, prompts, metadata):\n"
        "    return [float('nan')] * len(prompts)\n"
    )
    images = torch.zeros(2, 3, 16, 16)
    assert load_image_reward(path=user)(images, ["ab", "abc"], [{}, {}]).tolist() == [2.0, 3.0]
    for name, what in (("wrong_length", "scores of shape (1,)"), ("nan", "non-finite score nan")):
        with pytest.raises(RewardError, match=re.escape(what)):
            load_image_reward(name, user)(images, ["a", "b"], [{}, {}])
    with pytest.raises(RewardError, match="no function 'missing'; its functions: reward_fn, "
                       "wrong_length, nan"):  # fmt: skip
        load_image_reward("missing", user)
    with pytest.raises(RewardError, match=r"no function 'geneval' \(the built-in default; set "
                       r"reward.name\); its functions: reward_fn"):  # fmt: skip
        load_image_reward("geneval", user)
    with pytest.raises(RewardError, match="built in: geneval"):
        load_image_reward("pickscore")
    assert (
        load_image_reward("geneval_strict")(_images(ALL_SPECS[:3]), None, ALL_SPECS[:3]).tolist()
        == [1.0] * 3
    )


def test_the_shapes_task_writes_prompts_and_its_pretraining_images(tmp_path):
    paths = write_task("shapes", tmp_path, seed=0, num_images=64)
    assert set(paths) == {"train", "test", "images"}
    train = pq.read_table(paths["train"]).to_pylist()
    test = pq.read_table(paths["test"]).to_pylist()
    assert len(train) == 60 and len(test) == 12
    row = train[0]
    spec = row["reward_model"]["ground_truth"]
    assert row["data_source"] == "shapes" and set(spec) == set(ATTRIBUTES)
    assert prompt_text(spec) in str(row["prompt"])
    images, specs = read_images(paths["images"])
    assert images.shape == (64, 16, 16, 3) and images.max() <= 1.0
    decoded = torch.tensor(images).permute(0, 3, 1, 2)
    assert geneval(decoded, None, specs, strict=True).mean() == 1.0  # PNG keeps what it checks


def test_noisy_captions_redraw_each_attribute_with_the_given_probability():
    rng = random.Random(0)
    specs = [random_spec(rng) for _ in range(4000)]
    before = [dict(spec) for spec in specs]
    assert noisy_captions(specs, 0.0) == specs
    loose = noisy_captions(specs, 0.25, seed=3)
    assert specs == before  # the true attributes are not touched
    assert loose == noisy_captions(specs, 0.25, seed=3) != noisy_captions(specs, 0.25, seed=4)
    for noise in (0.25, 1.0):
        loose = noisy_captions(specs, noise, seed=1)
        for key, values in ATTRIBUTES.items():
            right = np.mean([a[key] == b[key] for a, b in zip(specs, loose, strict=True)])
            expected = 1 - noise + noise / len(values)
            assert abs(right - expected) < 4 * np.sqrt(expected * (1 - expected) / len(specs))
    with pytest.raises(ValueError, match=r"caption noise must be in \[0, 1\], got 1.5"):
        noisy_captions(specs, 1.5)


def test_pretraining_conditions_on_the_loose_captions(tmp_path, monkeypatch):
    import lmrl.flow.matching as matching

    paths = write_task("shapes", tmp_path / "data", seed=0, num_images=64)
    images, specs = read_images(paths["images"])
    pixels = torch.tensor(images).permute(0, 3, 1, 2).flatten(1) * 2 - 1
    truth = torch.tensor(np.stack([attribute_vector(s) for s in specs]))
    seen = {}

    def capture(model, data, *args, **kwargs):
        seen["batch"] = data(2048, torch.Generator().manual_seed(0))
        return [0.0]

    monkeypatch.setattr(matching, "pretrain", capture)
    for noise, out in ((0.0, "exact"), (1.0, "loose")):
        matching.pretrain_image_flow(paths["images"], tmp_path / out, steps=1, seed=2,
                                     caption_noise=noise, block_out_channels=(8, 16))  # fmt: skip
        x0, cond = seen["batch"]
        which = torch.cdist(x0.flatten(1), pixels).argmin(1)  # each row's image
        right = (cond == truth[which]).all(1).float().mean()
        # all four attributes redrawn: right when each lands on its value, 1/72 of the rows
        assert right == 1.0 if noise == 0 else right < 0.1


def test_the_image_model_saves_and_loads(tmp_path):
    from lmrl.flow.image_model import ImageFlow

    torch.manual_seed(0)
    model = ImageFlow(12, image_size=16, block_out_channels=(16, 32))
    x, t = torch.randn(3, 3, 16, 16), torch.tensor([0.1, 0.5, 1.0])
    cond = torch.tensor(np.stack([attribute_vector(s) for s in ALL_SPECS[:3]]))
    out = model(x, t, cond)
    assert out.shape == x.shape
    model.save(tmp_path / "m")
    again = ImageFlow.load(tmp_path / "m")
    assert torch.equal(again(x, t, cond), out)
    with pytest.raises(ModelError, match=r"not an image flow model.*`lmrl pretrain-flow`"):
        ImageFlow.load(tmp_path)
    (tmp_path / "run" / "global_step_3").mkdir(parents=True)
    with pytest.raises(ModelError, match="it is a checkpoint of a run: give that run's final/"):
        ImageFlow.load(tmp_path / "run" / "global_step_3")


def test_the_image_model_sees_where_each_pixel_is(tmp_path):
    """The U-Net's input holds each pixel's (y, x) in [-1, 1] after the image's channels, so
    the same object drawn left and right is told apart; a model saved before the channels
    existed (no ``coords`` in its config) loads without them."""
    import json

    from lmrl.flow.image_model import ImageFlow

    torch.manual_seed(0)
    model = ImageFlow(12, image_size=8, block_out_channels=(8, 16))
    seen = []
    model.unet.conv_in.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    x, cond = torch.randn(2, 3, 8, 8), torch.zeros(2, 12)
    model(x, torch.tensor([0.5, 0.5]), cond)
    (inputs,) = seen
    assert inputs.shape == (2, 5, 8, 8) and torch.equal(inputs[:, :3], x)
    ramp = torch.linspace(-1, 1, 8)
    assert torch.equal(inputs[1, 3], ramp[:, None].expand(8, 8))  # y: down the rows
    assert torch.equal(inputs[1, 4], ramp[None, :].expand(8, 8))  # x: along a row

    old = ImageFlow(12, image_size=8, block_out_channels=(8, 16), coords=False)
    assert old.unet.conv_in.in_channels == 3
    old.save(tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    del config["coords"]  # as written before the channels existed
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    again = ImageFlow.load(tmp_path / "old")
    assert again.config["coords"] is False
    assert torch.equal(
        again(x, torch.tensor([0.5, 0.5]), cond), old(x, torch.tensor([0.5, 0.5]), cond)
    )
