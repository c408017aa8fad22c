"""Fixtures for the generation tests: one tiny Qwen2 model saved, loaded as a user's is."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lmrl.batch import Batch
from lmrl.models import build_tiny_model, load_causal_lm, load_tokenizer


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", size="tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture
def model(tiny_dir):
    return load_causal_lm(tiny_dir).eval()


@pytest.fixture(scope="session")
def encode(tokenizer):
    """``encode(texts, **columns)``: a prompts batch, left-padded ids, bool mask, columns."""

    def _encode(texts: list[str], **columns) -> Batch:
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        assert tokenizer.padding_side == "left"
        return Batch(
            {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"].bool()},
            columns or None,
        )

    return _encode


@pytest.fixture(scope="session")
def logit_bias():
    """``with logit_bias(model, bias):`` adds ``bias`` (V,) to every logit the model produces."""

    @contextlib.contextmanager
    def _bias(model, bias: torch.Tensor):
        handle = model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
        try:
            yield model
        finally:
            handle.remove()

    return _bias
