"""Tests of the engine interface: SamplingParams, prompt checks, the engine table."""

from __future__ import annotations

import pytest
import torch

from lmrl.batch import Batch
from lmrl.errors import LmrlError
from lmrl.rollout import ENGINES, HFEngine, SamplingParams, build_engine, check_prompts


def test_sampling_params_defaults_and_validation():
    p = SamplingParams(max_new_tokens=8)
    assert (p.temperature, p.top_p, p.top_k, p.do_sample, p.stop, p.seed) == (
        1.0,
        1.0,
        -1,
        True,
        [],
        None,
    )
    assert SamplingParams(do_sample=False, temperature=0).logprob_temperature == 1.0
    assert SamplingParams(temperature=0.7).logprob_temperature == 0.7
    assert SamplingParams(stop=("\n",)).stop == ["\n"]
    bad = [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0, "do_sample": False}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": "###"}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"seed": 1.5}, "seed"),
    ]
    for kwargs, name in bad:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def _prompts(ids, mask) -> Batch:
    return Batch({"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)})


def test_check_prompts_accepts_left_padding():
    ids, mask = check_prompts(_prompts([[0, 5, 6], [7, 8, 9]], [[0, 1, 1], [1, 1, 1]]), n=2)
    assert ids.dtype == torch.long and mask.dtype == torch.bool
    assert mask.tolist() == [[False, True, True], [True, True, True]]


def test_check_prompts_errors():
    with pytest.raises(ValueError, match="left-padded; rows \\[0\\]"):
        check_prompts(_prompts([[5, 6, 0]], [[1, 1, 0]]), n=1)
    with pytest.raises(ValueError, match="rows \\[1\\] have no token"):
        check_prompts(_prompts([[5, 6], [0, 0]], [[1, 1], [0, 0]]), n=1)
    with pytest.raises(ValueError, match="'attention_mask'"):
        check_prompts(Batch({"input_ids": torch.ones(2, 3, dtype=torch.long)}), n=1)
    with pytest.raises(ValueError, match="'attention_mask' must have the shape"):
        check_prompts(_prompts([[5, 6]], [[1, 1, 1]]), n=1)
    with pytest.raises(ValueError, match="integer ids"):
        check_prompts(_prompts([[5.0, 6.0]], [[1, 1]]), n=1)
    with pytest.raises(ValueError, match="n \\(samples per prompt\\)"):
        check_prompts(_prompts([[5, 6]], [[1, 1]]), n=0)


def test_engine_table(model, tokenizer):
    assert ENGINES.names() == ["hf", "vllm"]
    engine = build_engine("hf", model, tokenizer, micro_batch_size=4)
    assert isinstance(engine, HFEngine) and engine.micro_batch_size == 4
    assert engine.eos_ids == [258, 256]  # tokenizer eos, then generation_config's others
    assert engine.pad_id == 256
    with pytest.raises(ValueError, match="unknown rollout engine 'sglang'; valid names: hf, vllm"):
        build_engine("sglang", model, tokenizer)


def test_a_copy_engine_of_a_model_without_parameters_needs_a_dtype():
    """An engine that must not follow the actor copies its weights in the actor's dtype: a
    model with no parameter has none to copy, which is said in one line."""
    with pytest.raises(ValueError, match="needs a dtype: the model has no parameters"):
        build_engine("hf", torch.nn.Module(), follow=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only machine")
def test_vllm_without_vllm_says_how_to_get_it(model, tokenizer, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(LmrlError, match=r"the vllm engine needs vLLM, which is not installed"):
        build_engine("vllm", model, tokenizer)
