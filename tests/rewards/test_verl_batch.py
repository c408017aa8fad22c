"""A scorer written for verl's ``BatchRewardManager`` (``compute_score(data_sources,
solution_strs, ground_truths, extra_infos, **kwargs)``) runs as written under
``reward.manager=batch``."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

from lmrl.batch import Batch
from lmrl.errors import RewardError
from lmrl.models.tiny import build_tokenizer
from lmrl.rewards import RewardFunction, load_reward_fn, make_reward_manager

# a batch scorer as a verl user writes it for reward_model.reward_manager=batch
VERL_SCORER = """
import numpy as np


def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    assert isinstance(data_sources, np.ndarray) and isinstance(extra_infos, np.ndarray)
    assert isinstance(solution_strs, list) and isinstance(ground_truths, list)
    bonus = kwargs.get("bonus", 0.0)
    scores = []
    for data_source, solution_str, ground_truth, extra_info in zip(
        data_sources, solution_strs, ground_truths, extra_infos
    ):
        correct = solution_str.strip() == ground_truth
        scores.append({
            "score": float(correct) + bonus,
            "acc": float(correct),
            "batch_size": len(solution_strs),
            "index": extra_info["index"],
        })
    return scores


def compute_score_floats(data_sources, solution_strs, ground_truths, extra_infos):
    return [len(s) / 10 for s in solution_strs]
"""


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture
def scorer_file(tmp_path):
    path = tmp_path / "verl_batch_reward.py"
    path.write_text(textwrap.dedent(VERL_SCORER))
    return path


def responses(tok, texts, truths) -> Batch:
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    width = max(len(x) for x in ids)
    out = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros(len(ids), width, dtype=torch.bool)
    for i, x in enumerate(ids):
        out[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), True
    return Batch(
        {"responses": out, "response_mask": mask},
        {
            "data_source": ["digits"] * len(ids),
            "ground_truth": list(truths),
            "extra_info": [{"index": i} for i in range(len(ids))],
        },
    )


@pytest.mark.parametrize("workers", [0, 1])  # in-process, and re-imported by a worker
def test_a_verl_batch_scorer_runs_as_written(tok, scorer_file, workers):
    fn = load_reward_fn(scorer_file, "compute_score", kwargs={"bonus": 0.5})
    assert fn.batched and fn.plural
    batch = responses(tok, ["12", "7", "33"], ["12", "8", "33"])
    with make_reward_manager("batch", tok, num_workers=workers, reward_fns=fn) as manager:
        result = manager(batch)
    assert result.metrics["reward/errors"] == 0.0
    np.testing.assert_allclose(result.scores.numpy(), [1.5, 0.5, 1.5])
    np.testing.assert_array_equal(result.extras["acc"], [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(result.extras["batch_size"], [3, 3, 3])  # one call
    np.testing.assert_array_equal(result.extras["index"], [0, 1, 2])


def test_a_verl_batch_scorer_of_floats_and_under_naive(tok, scorer_file):
    fn = load_reward_fn(scorer_file, "compute_score_floats")
    batch = responses(tok, ["12", "7", "333"], ["", "", ""])
    for name in ("batch", "naive"):  # naive: one-sample lists
        result = make_reward_manager(name, tok, num_workers=0, reward_fns=fn)(batch)
        np.testing.assert_allclose(result.scores.numpy(), [0.2, 0.1, 0.3], rtol=1e-6)


def test_a_verl_batch_scorer_with_batched_false_is_refused(scorer_file):
    with pytest.raises(RewardError, match=r"verl's batch arguments.*batched=False"):
        load_reward_fn(scorer_file, "compute_score", batched=False)


def test_an_unknown_signature_names_the_verl_batch_convention():
    with pytest.raises(RewardError, match="'solution_strs' means verl's batch"):
        RewardFunction(lambda text: 0.0)
