"""The host's layout of a batch's rows (`lmrl.models.layout`): its answers equal the tensors',
the forward with it is bitwise the forward without, and a micro-batch's forward with it reads
nothing back from the device."""

from __future__ import annotations

import pytest
import torch
from tests.host_reads import HostReads

from lmrl.models import load_causal_lm, packing
from lmrl.models.critic import forward_values, load_critic
from lmrl.models.forward import forward_log_probs, takes_own_mask
from lmrl.models.layout import (
    LAYOUT_KEY,
    MICRO_KEYS,
    MicroLayout,
    prompt_groups,
    trim_batch,
    with_row_layout,
)
from lmrl.models.packing import _segments

from .conftest import group_rows, make_batch


def _batch(hole: bool = False):
    """`group_rows(make_batch())` (16 rows, groups of 3, 2, 1, 2, 4) with its layout; with
    ``hole``, row 0's second response token is not attended (a response that is no prefix)."""
    batch = group_rows(make_batch())
    if hole:
        mask = batch["attention_mask"].clone()
        mask[0, 7 + 1] = False
        batch["attention_mask"] = mask
        batch["position_ids"] = (mask.long().cumsum(1) - 1).clamp(min=0)
    return with_row_layout(batch.select(*(k for k in MICRO_KEYS if k in batch)))


def _without_layout(micro):
    return micro.select(*(set(micro.keys()) - {LAYOUT_KEY, "prompt_group"}))


def _micros(batch, seed: int, size: int):
    order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed))
    return batch.index(order).split(size)


@pytest.mark.parametrize("hole", [False, True])
def test_the_layout_answers_what_the_tensors_do(hole):
    batch = _batch(hole)
    for seed, size in [(0, 16), (1, 5), (2, 3), (3, 1)]:
        for micro in _micros(batch, seed, size):
            with_it, without = trim_batch(micro), trim_batch(_without_layout(micro))
            assert (with_it.start, with_it.kept) == (without.start, without.kept)
            assert torch.equal(with_it.input_ids, without.input_ids)
            groups = prompt_groups(with_it)
            expected = prompt_groups(without)
            assert (groups is None) == (expected is None)
            if groups is not None:
                assert all(torch.equal(a, b) for a, b in zip(groups, expected, strict=True))
            layout = MicroLayout.of(micro)
            valid = without.response_valid[:, : without.kept]
            lengths = valid.sum(1)
            prefix = torch.arange(without.kept)[None, :] < lengths[:, None]
            assert layout.all_prefix == torch.equal(valid, prefix)
            if expected is not None:
                totals = _segments(lengths, expected[1], len(expected[0]))[1]
                assert layout.packed_tokens() == int(totals.max())
    assert not MicroLayout.of(batch).all_prefix if hole else MicroLayout.of(batch).all_prefix


@pytest.fixture(params=["packed", "two passes", "unshared"])
def path(request, monkeypatch):
    """The forward's three paths for rows that share prompts (`lmrl.models.forward`)."""
    if request.param == "two passes":
        monkeypatch.setattr(packing, "MAX_PACKED", 0)
    return request.param


def _log_probs_and_grads(model, micro, share: bool):
    model.zero_grad()
    log_probs, entropy = forward_log_probs(model, micro, with_entropy=True, share_prompts=share)
    (log_probs.sum() + entropy.sum()).backward()
    return [log_probs, entropy, *(p.grad.clone() for p in model.parameters())]


@pytest.mark.parametrize("hole", [False, True])
@pytest.mark.parametrize("size", [6, 1], ids=["padded", "one row"])
def test_the_forward_with_the_layout_is_bitwise_the_forward_without(qwen_dir, path, hole, size):
    """Micro-batches of 6 rows are padded (their mask is built here); a row alone is not (its
    forward gets no mask: sdpa's causal kernel, as transformers chooses it)."""
    model = load_causal_lm(qwen_dir)
    micros = _micros(_batch(hole), seed=4, size=size)
    assert any(trim_batch(m).dense for m in micros) == (size == 1)
    for micro in micros:
        share = path != "unshared"
        with_it = _log_probs_and_grads(model, micro, share)
        without = _log_probs_and_grads(model, _without_layout(micro), share)
        assert all(torch.equal(a, b) for a, b in zip(with_it, without, strict=True))


def test_a_micro_batch_forward_reads_nothing_back(qwen_dir, path):
    """With the layout, neither the policy's forward and backward nor the critic's reads the
    device back; without it, the same forward does (what the check sees is real)."""
    model, critic = load_causal_lm(qwen_dir), load_critic(qwen_dir)
    micro = _micros(_batch(), seed=5, size=8)[0]
    share = path != "unshared"
    with HostReads() as reads:
        _log_probs_and_grads(model, micro, share)
        forward_values(critic, micro, share_prompts=share).sum().backward()
    assert reads.reads == []
    with HostReads() as reads:
        forward_log_probs(model, _without_layout(micro), share_prompts=share)
    assert any("trim_batch" in where for _, where in reads.reads)


def test_only_a_full_attention_sdpa_model_takes_the_mask_built_here(qwen_dir):
    """A sliding-window layer's mask, and eager attention's float bias, are transformers' to
    build from the 2-D mask: the micro-batch then passes that, layout or not."""
    model = load_causal_lm(qwen_dir)
    micro = _micros(_batch(), seed=6, size=8)[0]
    trimmed = trim_batch(micro)
    assert takes_own_mask(model) and trimmed.model_inputs(True)["attention_mask"].dim() == 4
    layers = model.config.num_hidden_layers
    model.config.layer_types = ["sliding_attention"] + ["full_attention"] * (layers - 1)
    assert not takes_own_mask(model)
    model.config.layer_types = ["full_attention"] * layers
    model.config._attn_implementation = "eager"
    assert not takes_own_mask(model)
    assert trimmed.model_inputs(False)["attention_mask"].dim() == 2
