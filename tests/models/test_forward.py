"""compute_log_probs / forward_log_probs against the naive full-logits reference."""

from __future__ import annotations

import warnings

import pytest
import torch

from lmrl.batch import Batch
from lmrl.models import (
    Reference,
    apply_lora,
    build_reference,
    compute_log_probs,
    forward_log_probs,
    freeze,
    load_causal_lm,
    load_tokenizer,
    trim_batch,
)
from lmrl.models.forward import (
    cache_keyword,
    can_share_prompts,
    forward_log_probs_and_kl,
    fused_head,
)
from lmrl.models.layout import prompt_groups
from lmrl.models.prefix import prefix_cache

from .conftest import needs_replayable


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


def test_prompt_groups_finds_shared_prompts(batch, grouped):
    assert prompt_groups(trim_batch(batch)) is None  # every prompt distinct
    first, inverse = prompt_groups(trim_batch(grouped))
    assert len(first) == 5 and inverse.shape == (12,)
    assert torch.equal(inverse[first], torch.arange(5))  # first rows map to themselves
    groups = torch.arange(5).repeat_interleave(torch.tensor([3, 2, 1, 2, 4]))
    same_prompt = inverse[:, None] == inverse[None]
    assert torch.equal(same_prompt, groups[:, None] == groups[None])  # one prompt per group


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompts_equal_the_full_forward(qwen_dir, grouped, temperature):
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


def test_the_cache_goes_by_the_name_the_installed_transformers_takes(
    qwen_dir, grouped, monkeypatch
):
    """No deprecated ``past_key_values`` on a transformers that renamed it to ``cache`` (it
    warns there, and goes in 5.40), the old name on one that did not; a LoRA wrapper or a
    forward that names only ``past_key_values`` is asked by its own signature."""
    import inspect

    import transformers.utils.generic as generic
    from transformers import Qwen2ForCausalLM

    from lmrl.rollout import HFEngine, SamplingParams

    renamed = "cache" in inspect.signature(Qwen2ForCausalLM.forward).parameters
    model = load_causal_lm(qwen_dir)
    assert cache_keyword(model) == ("cache" if renamed else "past_key_values")
    assert cache_keyword(apply_lora(load_causal_lm(qwen_dir), 4)) == cache_keyword(model)

    class OldModel(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            return input_ids

    assert cache_keyword(OldModel()) == "past_key_values"

    said = []
    if hasattr(generic, "logger"):  # the rename's warning, once per process: catch every call
        monkeypatch.setattr(generic.logger, "warning_once", lambda msg, *a, **k: said.append(msg))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forward_log_probs(model, grouped, 1.0, share_prompts=True)  # the shared prefill
        tokenizer = load_tokenizer(qwen_dir)
        enc = tokenizer(["abc", "de"], return_tensors="pt", padding=True)
        prompts = Batch(
            {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"].bool()}
        )
        HFEngine(model.eval(), tokenizer).generate(
            prompts, n=2, sampling=SamplingParams(max_new_tokens=4, seed=0)
        )
    said += [str(w.message) for w in caught]
    assert not [m for m in said if "past_key_values" in m], said


@needs_replayable
def test_can_share_prompts_without_sliding_windows_and_checkpointed_where_tested(
    qwen_dir, monkeypatch
):
    from transformers.modeling_layers import GradientCheckpointingLayer

    import lmrl.models.forward as forward_mod

    assert can_share_prompts(load_causal_lm(qwen_dir))
    checkpointed = load_causal_lm(qwen_dir, gradient_checkpointing=True)
    assert can_share_prompts(checkpointed)
    monkeypatch.setattr(forward_mod, "CHECKPOINTED_SHARING_DEVICES", ())  # not measured there
    assert not can_share_prompts(checkpointed)
    assert can_share_prompts(load_causal_lm(qwen_dir))  # not checkpointed: shared anywhere
    monkeypatch.setattr(forward_mod, "CHECKPOINTED_SHARING_DEVICES", ("cpu",))
    with monkeypatch.context() as m:  # a transformers (4.x) whose checkpointed layers drop it
        m.delattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache")
        assert not can_share_prompts(checkpointed)
    assert can_share_prompts(checkpointed)
    checkpointed.config.model_type = "gemma"  # checkpointed layers not tested to keep a cache
    assert not can_share_prompts(checkpointed)
    sliding = load_causal_lm(qwen_dir)
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    assert not can_share_prompts(sliding)


def _checkpointed_shared_and_full(path, batch, lora, monkeypatch, device="cpu"):
    """Log-probs, entropy and gradients of a checkpointed model sharing its prompts (the prompt
    pass and the response pass) and of the same model's full forward, not checkpointed, with
    the checkpointed model; asserts that the prompts were shared."""
    import lmrl.models.forward as forward_mod
    from lmrl.models import packing

    monkeypatch.setattr(packing, "MAX_PACKED", 0)  # the two passes, not one packed pass
    passes = []
    monkeypatch.setattr(
        forward_mod, "prefix_cache", lambda *a: passes.append(1) or prefix_cache(*a)
    )
    batch = batch.to(device)
    weights = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(2))
    results = []
    for checkpointing in (True, False):
        model = load_causal_lm(path, gradient_checkpointing=checkpointing)
        if lora:  # in float64: the perturbed adapter's gradients reach ~70
            model = _perturbed(apply_lora(model.double(), 4, 8))
        model.to(device).train()
        logp, ent = forward_log_probs(
            model, batch, 0.7, with_entropy=True, share_prompts=checkpointing
        )
        ((logp * weights.to(device)).sum() + 0.1 * (ent * weights.to(device)).sum()).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((logp.detach(), ent.detach(), grads))
    assert passes == [1]  # the checkpointed run shared its prompts
    return (*results[0], model), results[1]


@needs_replayable
@pytest.mark.parametrize(("arch", "lora"), [("qwen", False), ("llama", False), ("qwen", True)])
def test_shared_prompts_under_gradient_checkpointing_equal_the_full_forward(
    arch, lora, qwen_dir, llama_dir, grouped, monkeypatch
):
    """The prompt pass and the response pass with checkpointed layers (the backward replays
    each layer with its cache): the full forward's log-probs, entropy and every gradient, the
    rows shuffled; the layers' own rule on caches is back afterwards."""
    path = qwen_dir if arch == "qwen" else llama_dir
    batch = grouped.index(torch.randperm(12, generator=torch.Generator().manual_seed(3)))
    (logp, ent, grads, model), (ref_logp, ref_ent, ref_grads) = _checkpointed_shared_and_full(
        path, batch, lora, monkeypatch
    )
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-5, msg=name)
    layers = [m for m in model.modules() if hasattr(m, "_can_checkpoint_with_cache")]
    assert layers and not any("_can_checkpoint_with_cache" in vars(m) for m in layers)


@needs_replayable
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_prompts_under_gradient_checkpointing_on_cuda(qwen_dir, grouped, monkeypatch):
    """The same on CUDA (where it is not the default yet: the benchmark's ``lmrl-shared`` side
    turns it on), in fp32, with the transformers release installed there."""
    import lmrl.models.forward as forward_mod

    monkeypatch.setattr(forward_mod, "CHECKPOINTED_SHARING_DEVICES", ("cpu", "cuda"))
    batch = grouped.index(torch.randperm(12, generator=torch.Generator().manual_seed(3)))
    (logp, ent, grads, _), (ref_logp, ref_ent, ref_grads) = _checkpointed_shared_and_full(
        qwen_dir, batch, False, monkeypatch, device="cuda"
    )
    torch.testing.assert_close(logp, ref_logp, atol=1e-4, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-4 * g.abs().max(), rtol=1e-4, msg=name)


# ----------------------------------------------------------------- full KL to a reference


def _perturbed(model, seed=0, scale=0.05):
    """``model`` with seeded noise on every trainable weight; a LoRA adapter is set to it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
                if "lora_" in name:  # PEFT draws A from the global RNG and starts B at 0
                    p.copy_(0.5 * noise)
                else:
                    p.add_(scale * noise)
    return model


def _policy_and_reference(qwen_dir, kind):
    """(policy, reference) in float64 that differ: a frozen model, or the LoRA base."""
    if kind == "frozen":
        reference = Reference(freeze(load_causal_lm(qwen_dir).double()))
        return _perturbed(load_causal_lm(qwen_dir).double()), reference
    policy = _perturbed(apply_lora(load_causal_lm(qwen_dir).double(), 4, 8))
    return policy, build_reference(policy)


def _naive_full_kl(policy, reference, batch, temperature):
    """Unchunked ``sum_v p (log p - log q)`` from both models' full logits (policy with grad)."""
    T = batch["responses"].shape[1]
    inputs = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"].long(),
        "position_ids": batch["position_ids"],
    }
    with torch.no_grad(), reference.context() as ref_model:
        ref_logits = ref_model(**inputs).logits[:, -T - 1 : -1]
    logits = policy(**inputs).logits[:, -T - 1 : -1]
    log_p = torch.log_softmax(logits.double() / temperature, -1)
    log_q = torch.log_softmax(ref_logits.double() / temperature, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    logp = log_p.gather(-1, batch["responses"][..., None]).squeeze(-1)
    mask = batch["response_mask"]
    return torch.where(mask, logp, 0.0), torch.where(mask, kl, 0.0)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("kind", ["frozen", "lora"])
def test_full_kl_and_its_gradient_equal_the_unchunked_kl(qwen_dir, grouped, kind, share):
    # ``grouped``: GRPO groups; with ``share``, each prompt runs once per side
    mask = grouped["response_mask"]
    weights = torch.rand(
        mask.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )

    def grads(fn):
        policy, reference = _policy_and_reference(qwen_dir, kind)
        logp, kl = fn(policy, reference)
        ((logp * weights).sum() + (kl * weights).sum()).backward()
        return (
            logp.detach(),
            kl.detach(),
            {n: p.grad for n, p in policy.named_parameters() if p.requires_grad},
        )

    def ours(policy, reference):
        logp, _, kl = forward_log_probs_and_kl(
            policy, reference, grouped, 0.7, chunk_size=7, share_prompts=share
        )
        return logp, kl

    logp, kl, got = grads(ours)
    ref_logp, ref_kl, want = grads(lambda p, r: _naive_full_kl(p, r, grouped, 0.7))
    assert kl.shape == mask.shape and (kl[~mask] == 0).all()
    assert kl[mask].min() > 1e-4  # the two policies differ
    torch.testing.assert_close(kl, ref_kl, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(logp, ref_logp, atol=1e-10, rtol=1e-8)
    assert want and set(got) == set(want)
    # in float64 the chunked KL's gradient is the unchunked one's to ~1e-16 of the largest
    # entry; the shared-prompt forward's gradients are the full forward's to ~1e-6 of it
    # (plain log-probs alike)
    tol = 1e-5 if share else 1e-12
    for name, g in want.items():
        assert (got[name] - g).abs().max() <= tol * g.abs().max(), name


@pytest.mark.parametrize("kind", ["frozen", "lora"])
def test_full_kl_is_zero_when_the_policy_is_the_reference(qwen_dir, batch, kind):
    policy = load_causal_lm(qwen_dir)
    if kind == "lora":
        policy = apply_lora(policy, 4, 8)  # B = 0: the adapter changes nothing yet
    reference = build_reference(policy)
    logp, ent, kl = forward_log_probs_and_kl(policy, reference, batch, 0.7, with_entropy=True)
    assert kl.abs().max() < 1e-6
    kl.sum().backward()
    for name, p in policy.named_parameters():
        if p.grad is not None:
            assert p.grad.abs().max() < 1e-5, name
    plain, plain_ent = forward_log_probs(policy, batch, 0.7, with_entropy=True)
    torch.testing.assert_close(logp, plain, atol=0, rtol=0)
    torch.testing.assert_close(ent, plain_ent, atol=0, rtol=0)


def test_full_kl_through_the_logits_path_equals_the_fused_path(qwen_dir, batch):
    results = []
    for hooked in (False, True):
        policy, reference = _policy_and_reference(qwen_dir, "frozen")
        if hooked:  # the policy's head has a hook: its side goes through the model's logits
            policy.lm_head.register_forward_hook(lambda module, args, out: out)
            assert fused_head(policy) is None and fused_head(reference.model) is not None
        _, _, kl = forward_log_probs_and_kl(policy, reference, batch, 0.7)
        kl.sum().backward()
        results.append((kl.detach(), {n: p.grad for n, p in policy.named_parameters()}))
    (fused, fused_grads), (plain, plain_grads) = results
    torch.testing.assert_close(plain, fused, atol=1e-10, rtol=1e-8)
    for name, g in fused_grads.items():
        torch.testing.assert_close(plain_grads[name], g, atol=1e-10, rtol=1e-7, msg=name)


def test_full_kl_needs_the_same_vocabulary(qwen_dir, tmp_path, batch):
    from lmrl.models.tiny import save_model, tiny_config

    other = load_causal_lm(save_model(tiny_config("qwen2", "tiny", vocab_size=300), tmp_path))
    with pytest.raises(ValueError, match="vocabulary"):
        forward_log_probs_and_kl(load_causal_lm(qwen_dir), Reference(freeze(other)), batch)
