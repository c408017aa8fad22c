"""Exact match on the <answer> (Search-R1's QA reward) and its optional credits."""

from __future__ import annotations

import numpy as np
import pytest

from lmrl.rewards.scorers import SCORERS, default_compute_score
from lmrl.rewards.scorers.qa_em import compute_score, normalize_answer, truths


def test_normalization_is_squad_and_search_r1s():
    assert normalize_answer("  The  Eiffel-Tower! ") == "eiffeltower"
    assert normalize_answer("an apple, a pear") == "apple pear"


@pytest.mark.parametrize(
    ("truth", "want"),
    [
        ({"target": ["Paris", "paris france"]}, ["Paris", "paris france"]),
        ({"target": np.array(["Lumo"], dtype=object)}, ["Lumo"]),
        (["a", "b"], ["a", "b"]),
        ("Lumo", ["Lumo"]),
    ],
)
def test_ground_truth_shapes(truth, want):
    assert truths(truth) == want


def test_exact_match_on_the_last_answer():
    t = {"target": ["Paris"]}
    assert compute_score("<answer>x</answer> then <answer>the paris.</answer>", t)["acc"] == 1
    assert compute_score("<answer>Paris</answer><|im_end|>junk", t)["score"] == 1.0
    assert compute_score("Paris", t) == {"score": 0.0, "acc": 0.0}  # no answer tag
    assert compute_score("<answer>Lyon</answer>", t) == {"score": 0.0, "acc": 0.0}
    assert compute_score("<answer>Lyon</answer>", t, format_score=0.1)["score"] == 0.1
    with pytest.raises(ValueError, match="needs 'target'"):
        compute_score("<answer>x</answer>", {"answers": ["x"]})
    for source in ("nq", "hotpotqa", "triviaqa", "popqa", "2wikimultihopqa", "musique",
                   "bamboogle", "search_qa"):  # fmt: skip
        assert SCORERS[source] is compute_score
    assert default_compute_score("nq", "<answer>Paris</answer>", t)["acc"] == 1.0


def test_dense_credits_never_reach_an_exact_match():
    t = {"target": ["Lumo"]}
    partial = compute_score("<answer>Lumi</answer>", t, partial=0.5)
    assert partial == {"score": 0.5 * 3 / 4, "acc": 0.0}
    seen = "<information>Doc 1(Title: Vo) Vo lives in Lumo.</information>"
    assert compute_score(seen + "<answer>Pab</answer>", t, retrieval_score=0.3)["score"] == 0.3
    assert compute_score(seen, t, retrieval_score=0.3)["score"] == 0.3  # searched, no answer
    # the answer must be in a retrieved passage, not merely written by the policy
    assert compute_score("Lumo <answer>Pab</answer>", t, retrieval_score=0.3)["score"] == 0.0
    assert compute_score(seen + "<answer>Lumo</answer>", t, partial=0.5, retrieval_score=0.3) == {
        "score": 1.0,
        "acc": 1.0,
    }
