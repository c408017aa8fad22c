"""compute_log_probs / forward_log_probs against the naive full-logits reference."""

from __future__ import annotations

import pytest
import torch

from lmrl.models import compute_log_probs, forward_log_probs, load_causal_lm, trim_batch
from lmrl.models.forward import can_share_prompts, fused_head, prompt_groups


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("micro_batch_size", [1, 3, 5])
def test_compute_log_probs_equals_naive(qwen_dir, batch, naive, temperature, micro_batch_size):
    model = load_causal_lm(qwen_dir)
    ref_logp, ref_ent = naive(model, batch, temperature)
    logp, ent = compute_log_probs(model, batch, micro_batch_size, temperature, with_entropy=True)
    mask = batch["response_mask"]
    assert logp.shape == ent.shape == mask.shape and logp.dtype == torch.float32
    torch.testing.assert_close(logp.double()[mask], ref_logp[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double()[mask], ref_ent[mask], atol=1e-5, rtol=0)
    assert (logp[~mask] == 0).all() and (ent[~mask] == 0).all()
    only_logp, none = compute_log_probs(model, batch, micro_batch_size, temperature)
    assert none is None and torch.equal(only_logp, logp)


def test_logits_path_equals_fused_path(llama_dir, batch):
    model = load_causal_lm(llama_dir)
    assert fused_head(model) is not None
    fused, fused_ent = compute_log_probs(model, batch, 2, 0.7, with_entropy=True)
    # A forward hook on the head forces the path through the model's own logits.
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out)
    try:
        assert fused_head(model) is None
        plain, plain_ent = compute_log_probs(model, batch, 2, 0.7, with_entropy=True)
    finally:
        handle.remove()
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=0)
    torch.testing.assert_close(fused_ent, plain_ent, atol=1e-5, rtol=0)


def test_forward_log_probs_gradient_equals_naive(qwen_dir, batch_factory):
    batch = batch_factory(seed=1)
    mask = batch["response_mask"]
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    weights = torch.where(mask, weights, 0.0)

    def grads(loss_fn):
        model = load_causal_lm(qwen_dir).double()
        logp, ent = loss_fn(model)
        ((logp * weights).sum() + 0.1 * (ent * weights).sum()).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    got = grads(lambda m: forward_log_probs(m, batch, temperature=0.7, with_entropy=True))
    want = grads(lambda m: _naive_with_grad(m, batch, 0.7))
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=1e-8, rtol=1e-6, msg=name)


def _naive_with_grad(model, batch, temperature):
    T = batch["responses"].shape[1]
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"].long(),
        position_ids=batch["position_ids"],
    ).logits[:, -T - 1 : -1]
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    return (
        logp_all.gather(-1, batch["responses"][..., None]).squeeze(-1),
        -(logp_all.exp() * logp_all).sum(-1),
    )


def test_trim_cuts_padding_columns(batch):
    trimmed = trim_batch(batch)
    # Longest prompt uses all 7 columns; longest response 5 of 6: one column cut.
    assert trimmed.input_ids.shape == (5, 12)
    assert (trimmed.start, trimmed.kept, trimmed.response_length) == (6, 5, 6)
    short = batch.index([1, 2, 4])  # prompts of 3, 5, 4 tokens; responses of 2, 0, 1
    trimmed = trim_batch(short)
    assert trimmed.input_ids.shape == (3, 7)  # 2 prompt columns and 4 response columns cut
    assert (trimmed.start, trimmed.kept) == (4, 2)
    assert torch.equal(trimmed.labels, short["responses"][:, :2])


def test_position_ids_are_derived_when_absent(qwen_dir, batch):
    model = load_causal_lm(qwen_dir)
    with_pos, _ = compute_log_probs(model, batch, 5)
    without, _ = compute_log_probs(
        model, batch.select("input_ids", "attention_mask", "responses"), 5
    )
    torch.testing.assert_close(with_pos, without, atol=0, rtol=0)


def test_bad_input(qwen_dir, batch):
    model = load_causal_lm(qwen_dir)
    with pytest.raises(ValueError, match="micro_batch_size"):
        compute_log_probs(model, batch, 0)
    with pytest.raises(ValueError, match="responses"):
        compute_log_probs(model, batch.select("input_ids", "attention_mask"), 2)


def test_gradient_checkpointing_gives_the_same_gradients(qwen_dir, batch):
    grads = []
    for checkpointing in (False, True):
        model = load_causal_lm(qwen_dir, gradient_checkpointing=checkpointing).train()
        logp, ent = forward_log_probs(model, batch, temperature=0.7, with_entropy=True)
        (logp.sum() - 0.01 * ent.sum()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-5, msg=name)


def _grouped(batch, repeats=(3, 2, 1, 2, 4), seed=5):
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


def test_prompt_groups_finds_shared_prompts(batch):
    assert prompt_groups(trim_batch(batch)) is None  # every prompt distinct
    first, inverse = prompt_groups(trim_batch(_grouped(batch)))
    assert len(first) == 5 and inverse.shape == (12,)
    assert torch.equal(inverse[first], torch.arange(5))  # first rows map to themselves
    groups = torch.arange(5).repeat_interleave(torch.tensor([3, 2, 1, 2, 4]))
    same_prompt = inverse[:, None] == inverse[None]
    assert torch.equal(same_prompt, groups[:, None] == groups[None])  # one prompt per group


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompts_equal_the_full_forward(qwen_dir, batch, temperature):
    grouped = _grouped(batch)
    mask = grouped["response_mask"]
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for share in (True, False):
        model = load_causal_lm(qwen_dir).train()
        logp, ent = forward_log_probs(
            model, grouped, temperature, with_entropy=True, share_prompts=share
        )
        ((logp * weights).sum() + 0.1 * (ent * weights).sum()).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((logp.detach(), ent.detach(), grads))
    (logp, ent, grads), (ref_logp, ref_ent, ref_grads) = results
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    assert (logp[~mask] == 0).all()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-5, msg=name)
    # and the no-grad path (old / reference log-probs), micro-batches splitting groups
    model = load_causal_lm(qwen_dir)
    no_grad, _ = compute_log_probs(model, grouped, 5, temperature)
    torch.testing.assert_close(no_grad, ref_logp, atol=1e-5, rtol=0)


def test_can_share_prompts_only_without_checkpointing_or_sliding_windows(qwen_dir):
    assert can_share_prompts(load_causal_lm(qwen_dir))
    assert not can_share_prompts(load_causal_lm(qwen_dir, gradient_checkpointing=True))
    sliding = load_causal_lm(qwen_dir)
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    assert not can_share_prompts(sliding)
