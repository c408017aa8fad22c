"""The geneval reward on GenEval's metadata (Flow-GRPO's ``train_metadata.jsonl``): what the
detector can judge is checked, what it cannot is left out and named once."""

from __future__ import annotations

import json
import math
import random
import re

import numpy as np
import pytest
import torch

from lmrl.data.shapes import render
from lmrl.errors import DataError
from lmrl.flow.geneval import geneval_coverage, geneval_scores
from lmrl.flow.grpo import flow_advantages
from lmrl.trainer.flow import read_prompts


def _image(*boxes):
    """A black 16x16 image with filled squares ``(channel, x0, y0, side)``."""
    img = torch.zeros(3, 16, 16)
    for channel, x, y, side in boxes:
        img[channel, y : y + side, x : x + side] = 0.9
    return img


def _scores(images, metadata):
    out = geneval_scores(torch.stack(images), [""] * len(images), metadata)
    return {k: [None if math.isnan(x) else x for x in v.tolist()] for k, v in out.items()}


def test_the_checks_a_geneval_row_names_are_judged_where_the_detector_can():
    spec = {"shape": "circle", "colour": "red", "count": "two", "position": "left"}
    two_red_circles = torch.tensor(render(spec, random.Random(0))).permute(2, 0, 1)
    rows = [
        {"include": [{"class": "circle", "count": 2, "color": "red"}]},  # all judged, all hold
        {"include": [{"class": "square", "count": 3, "color": "red"}]},  # count, shape fail
        {"include": [{"class": "dog", "count": 2, "color": "red"}]},  # no class: colour, count
        {"include": [{"class": "dog", "count": 2, "color": "yellow"}]},  # nothing to judge
        {"include": [{"class": "circle", "count": 2}]},  # a shape without a colour: counted
    ]
    out = _scores([two_red_circles] * len(rows), rows)
    assert out["score"] == pytest.approx([1.0, 1 / 3, 1.0, 0.0, 1.0])
    assert out["colour"] == [1.0, 1.0, 1.0, None, None]
    assert out["count"] == [1.0, 0.0, 1.0, None, 1.0]
    assert out["shape"] == [1.0, 0.0, None, None, None]
    assert all(p is None for p in out["position"])
    strict = geneval_scores(torch.stack([two_red_circles] * 2), ["", ""], rows[:2], strict=True)
    assert strict["score"].tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    ("relation", "holds"), [("left of", 1.0), ("right of", 0.0), ("above", 0.0), ("below", 1.0)]
)
def test_a_relative_position_compares_the_two_objects(relation, holds):
    """A red square left of and below a blue one; GenEval's ``position`` names the other object
    by its index in ``include``."""
    image = _image((0, 1, 10, 4), (2, 10, 1, 4))
    row = {"include": [{"class": "square", "count": 1, "color": "blue"},
                       {"class": "square", "count": 1, "color": "red",
                        "position": [relation, 0]}]}  # fmt: skip
    out = _scores([image], [row])
    assert out["position"] == [holds] and out["colour"] == [1.0] and out["count"] == [1.0]
    missing = _scores([_image((0, 1, 10, 4))], [row])  # no blue square: the relation fails
    assert missing["position"] == [0.0] and missing["colour"] == [0.0]


def test_coverage_names_what_the_detector_cannot_judge():
    rows = [
        {"include": [{"class": "dog", "count": 1, "color": "red"}]},
        {"include": [{"class": "cup", "count": 2}]},
        {"include": [{"class": "circle", "count": 1, "color": "purple"}]},
        {"shape": "circle", "colour": "red", "count": "two", "position": "left"},
    ]
    coverage = geneval_coverage(rows)
    assert (coverage.judged, coverage.total) == (3, 4)
    assert coverage.classes == {"dog", "cup"} and coverage.colours == {"purple"}
    message = coverage.message()
    assert "dog" in message and "purple" in message and "1 of 4 prompts" in message
    assert geneval_coverage(rows[3:]).message() is None
    assert geneval_coverage([{}, {}]).judged == 0  # PickScore's text prompts


def test_global_std_divides_by_the_whole_steps_spread():
    scores = torch.tensor([0.0, 1.0, 0.0, 3.0])
    groups = [0, 0, 1, 1]
    centered = torch.tensor([-0.5, 0.5, -1.5, 1.5])
    per_prompt = flow_advantages(scores, groups)
    assert np.allclose(per_prompt, [-0.7071, 0.7071, -0.7071, 0.7071], atol=1e-3)
    batch = flow_advantages(scores, groups, global_std=True)
    assert torch.allclose(batch, centered / (scores.std() + 1e-6))
    assert torch.allclose(flow_advantages(scores, groups, norm_adv_by_std=False), centered)


CAT = {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a cat"}


def _metadata_file(tmp_path, *rows):
    path = tmp_path / "geneval" / "train_metadata.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("include", "message"),
    [
        ([{"class": "cat", "count": "two"}],
         "include[0].count='two' must be a whole number >= 1 (2, not \"two\")"),
        ([{"class": "cat", "count": 1.5}], "include[0].count=1.5 must be a whole number"),
        ([{"class": "cat"}], "include[0].count=None must be a whole number"),
        ([{"count": 1}], "include[0].class=None must be an object class"),
        ([{"class": "cat", "count": 1, "color": 3}], "include[0].color=3 must be a colour name"),
        ([{"class": "cat", "count": 1, "colour": "red"}],
         "include[0] has 'colour': its keys are class, count, color, position"),
        ([{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["near", 0]}],
         "include[1].position=['near', 0] must be [relation, index]"),
        ([{"class": "cat", "count": 1, "position": ["left of", 0]}],
         "include[0].position=['left of', 0] must be [relation, index]"),
        ("a cat", "include='a cat' must be a non-empty list of objects"),
        ([], "include=[] must be a non-empty list of objects"),
    ],
    ids=["count-a-word", "count-a-float", "no-count", "no-class", "colour-a-number",
         "unknown-key", "unknown-relation", "position-of-itself", "not-a-list", "empty"],
)  # fmt: skip
def test_a_bad_geneval_row_is_refused_as_it_is_read(tmp_path, include, message):
    """A GenEval metadata file is checked row by row when it is read: a bad field is one line
    naming the file, the line and the field (not a reward failing at the first step)."""
    path = _metadata_file(tmp_path, CAT, {**CAT, "include": include})
    with pytest.raises(DataError) as err:
        read_prompts(str(path))
    assert str(err.value).startswith(f"{path} line 2: {message}")
    assert "\n" not in str(err.value)


def test_an_exclude_list_is_checked_like_include(tmp_path):
    path = _metadata_file(tmp_path, {**CAT, "exclude": [{"class": "cat", "count": "2"}]})
    with pytest.raises(DataError, match=r"line 1: exclude\[0\].count='2' must be a whole"):
        read_prompts(str(path))
    ok = {**CAT, "exclude": [{"class": "cat", "count": 2}]}
    assert read_prompts(str(_metadata_file(tmp_path, ok)))[0]["metadata"] == ok


def test_a_geneval_row_without_include_is_a_data_error(tmp_path):
    """In a GenEval file (one of its rows has ``include``), a row without it is the data's
    fault: named by file and line when read. A prompt with no metadata at all (a text
    prompt's) scores 0 under geneval instead of failing the reward."""
    path = _metadata_file(tmp_path, CAT, {"tag": "single_object", "prompt": "a dog"})
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))} line 2: no include"):
        read_prompts(str(path))
    text = _metadata_file(tmp_path, {"prompt": "a cat"}, {"prompt": "a dog"})
    assert [r["metadata"] for r in read_prompts(str(text))] == [
        {"prompt": "a cat"},
        {"prompt": "a dog"},
    ]  # no row names include: prompts for another reward
    red_square = {"include": [{"class": "square", "count": 1, "color": "red"}]}
    out = _scores([_image((0, 1, 1, 4))] * 2, [red_square, {"prompt": "a dog"}])
    assert out["score"] == [1.0, 0.0] and out["count"] == [1.0, None]
