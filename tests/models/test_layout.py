"""The host's layout of a batch's rows (`lmrl.models.layout`): its answers equal the tensors',
the forward with it is bitwise the forward without, and a micro-batch's forward with it reads
nothing back from the device."""

from __future__ import annotations

import pytest
import torch
from tests.host_reads import HostReads

from lmrl.models import forward as forward_mod
from lmrl.models import load_causal_lm, packing
from lmrl.models.critic import forward_values, load_critic
from lmrl.models.forward import forward_log_probs, own_mask
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


@pytest.fixture(params=["packed", "two passes", "unshared", "logits"])
def path(request, monkeypatch):
    """The forward's paths (`lmrl.models.forward`): for rows that share prompts, packed or a
    prompt pass then a response pass; every row in full; the model's own logits (a head that
    is not plain)."""
    if request.param == "two passes":
        monkeypatch.setattr(packing, "MAX_PACKED", 0)
    if request.param == "logits":
        monkeypatch.setattr(forward_mod, "fused_head", lambda model: None)
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
        share = path not in ("unshared", "logits")
        with_it = _log_probs_and_grads(model, micro, share)
        without = _log_probs_and_grads(model, _without_layout(micro), share)
        assert all(torch.equal(a, b) for a, b in zip(with_it, without, strict=True))


@pytest.mark.parametrize("arch", ["qwen", "llama"])
def test_a_micro_batch_forward_reads_nothing_back(qwen_dir, llama_dir, path, arch):
    """With the layout, neither the policy's forward and backward nor the critic's reads the
    device back, padded or not (a row alone: no padding mask, and no position ids for
    transformers to check for packed sequences); without it, the same forward does."""
    model_dir = qwen_dir if arch == "qwen" else llama_dir
    model, critic = load_causal_lm(model_dir), load_critic(model_dir)
    share = path not in ("unshared", "logits")
    for micro in (_micros(_batch(), seed=5, size=8)[0], _batch().index([0])):  # padded, not
        with HostReads() as reads:
            _log_probs_and_grads(model, micro, share)
            forward_values(critic, micro, share_prompts=share).sum().backward()
        assert reads.reads == []
    with HostReads() as reads:
        forward_log_probs(model, _without_layout(micro), share_prompts=share)
    assert any("trim_batch" in where for _, where in reads.reads)


def test_which_mask_each_model_is_given(qwen_dir, llama_dir):
    """Padded, an sdpa model of full attention gets the 4-D mask built here; not padded, Qwen2
    (whose decoder takes the mapping of made masks) gets none, Llama the causal mask. A
    sliding-window layer's mask, and eager attention's float bias, are transformers' to build
    from the 2-D mask: those models get that, layout or not."""
    model = load_causal_lm(qwen_dir)
    padded = trim_batch(_micros(_batch(), seed=6, size=8)[0])
    alone = trim_batch(_batch().index([0]))
    assert own_mask(model) == "mapping" and own_mask(load_causal_lm(llama_dir)) == "4d"
    assert padded.model_inputs("mapping")["attention_mask"].shape == (8, 1, 12, 12)
    assert alone.model_inputs("mapping")["attention_mask"] == {"full_attention": None}
    causal = alone.model_inputs("4d")["attention_mask"]
    assert torch.equal(causal[0, 0], torch.ones(11, 11, dtype=torch.bool).tril())
    layers = model.config.num_hidden_layers
    model.config.layer_types = ["sliding_attention"] + ["full_attention"] * (layers - 1)
    assert own_mask(model) is None
    model.config.layer_types = ["full_attention"] * layers
    model.config._attn_implementation = "eager"
    assert own_mask(model) is None
    assert padded.model_inputs(None)["attention_mask"].dim() == 2


def test_llama_given_the_causal_mask_equals_its_forward_without(llama_dir, path):
    """Llama's decoder takes no mapping of made masks: a micro-batch without padding gets the
    causal 4-D mask (another sdpa kernel than transformers' choice, so equal to rounding)."""
    model = load_causal_lm(llama_dir)
    for micro in [*_micros(_batch(), seed=4, size=6), _batch().index([0])]:
        share = path not in ("unshared", "logits")
        with_it = _log_probs_and_grads(model, micro, share)
        without = _log_probs_and_grads(model, _without_layout(micro), share)
        for a, b in zip(with_it, without, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
