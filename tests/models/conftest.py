"""Fixtures for the model tests: tiny models saved once per session, and a small batch."""

from __future__ import annotations

import pytest
import torch

from lmrl.batch import Batch
from lmrl.models.tiny import build_tiny_model

# transformers 5 lets a checkpointed layer keep a cache it only reads; older releases drop the
# cache, and lmrl then shares no prompts under gradient checkpointing (`lmrl.models.prefix`).
try:
    from transformers.modeling_layers import GradientCheckpointingLayer

    REPLAYABLE = hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")
except ImportError:
    REPLAYABLE = False
needs_replayable = pytest.mark.skipif(
    not REPLAYABLE, reason="this transformers drops the cache of a checkpointed layer"
)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", size="tiny")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", size="tiny")


def make_batch(seed: int = 0, vocab: int = 259, pad: int = 256) -> Batch:
    """5 sequences, prompts left-padded to P=7, responses right-padded to T=6.

    Lengths vary, one response is empty, and no column is padding in every row except the
    last response column (so trimming has something to cut).
    """
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.tensor([7, 3, 5, 1, 4])
    response_len = torch.tensor([4, 2, 0, 5, 1])
    B, P, T = 5, 7, 6
    prompts = torch.randint(0, vocab, (B, P), generator=g)
    responses = torch.randint(0, vocab, (B, T), generator=g)
    prompt_mask = torch.arange(P)[None] >= (P - prompt_len)[:, None]
    response_mask = torch.arange(T)[None] < response_len[:, None]
    prompts[~prompt_mask] = pad
    responses[~response_mask] = pad
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.long().cumsum(1) - 1).clamp(min=0),
            "response_mask": response_mask,
        }
    )


def group_rows(batch: Batch, repeats=(3, 2, 1, 2, 4), seed: int = 5) -> Batch:
    """Rows of ``batch`` repeated as GRPO groups, each row with its own random response."""
    index = torch.arange(len(repeats)).repeat_interleave(torch.tensor(repeats))
    out = batch.index(index)
    responses = torch.randint(
        0, 256, out["responses"].shape, generator=torch.Generator().manual_seed(seed)
    )
    responses[~out["response_mask"]] = 256
    out["responses"] = responses
    out["input_ids"] = torch.cat([out["prompts"], responses], 1)
    return out


def naive_log_probs(model, batch, temperature: float = 1.0):
    """The obviously-correct reference: full logits, float64 log_softmax, gather."""
    T = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"].long(),
            position_ids=batch["position_ids"],
        ).logits[:, -T - 1 : -1]
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, batch["responses"][..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.fixture
def batch():
    return make_batch()


@pytest.fixture
def grouped():
    """``make_batch()``'s rows repeated as GRPO groups of 3, 2, 1, 2 and 4 (``group_rows``)."""
    return group_rows(make_batch())


@pytest.fixture(scope="session")
def batch_factory():
    """``batch_factory(seed)``: another batch of the same layout (see ``make_batch``)."""
    return make_batch


@pytest.fixture(scope="session")
def naive():
    """``naive(model, batch, temperature)``: the full-logits float64 reference (no grad)."""
    return naive_log_probs
