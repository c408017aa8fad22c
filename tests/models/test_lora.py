"""LoRA: the reference is the adapter-disabled actor; save, load and merge adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmrl.models import (
    apply_lora,
    build_reference,
    compute_log_probs,
    export_merged,
    forward_log_probs,
    is_lora,
    load_causal_lm,
    load_lora,
    merge_lora,
    save_lora,
)


def perturb_adapter(model, seed=0):
    """A nonzero adapter update, as after a few optimizer steps (PEFT starts B at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


@pytest.fixture
def lora_actor(qwen_dir):
    return apply_lora(load_causal_lm(qwen_dir), lora_rank=4, lora_alpha=8)


def test_all_linear_layers_adapted_and_only_the_adapter_trains(lora_actor):
    adapted = {
        n.split(".lora_A")[0].rsplit(".", 1)[-1]
        for n, _ in lora_actor.named_parameters()
        if "lora_A" in n
    }
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    trainable = [n for n, p in lora_actor.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_the_adapter_init_depends_on_the_seed_alone(qwen_dir):
    """A's draw is the same whatever else drew from the RNG since seeding (on a GPU, PEFT
    draws it from the GPU's RNG; there our draw is the CPU run's)."""

    def adapters(extra_draws: int, seed: int = 0) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        torch.rand(extra_draws)
        model = apply_lora(load_causal_lm(qwen_dir), lora_rank=4, lora_alpha=8)
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}

    first, second, other = adapters(0), adapters(1000), adapters(0, seed=1)
    assert first and all(torch.equal(first[n], second[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)
    # Kaiming-uniform with a = sqrt(5): within 1 / sqrt(fan_in)
    assert all(0 < float(a.abs().max()) <= a.shape[1] ** -0.5 for a in first.values())


def test_reference_is_the_base_model_and_shares_its_weights(qwen_dir, lora_actor, batch):
    base = load_causal_lm(qwen_dir)
    base_logp, _ = compute_log_probs(base, batch, 2, temperature=0.7)
    ref = build_reference(lora_actor, path="/ignored/with/lora")
    assert ref.model is lora_actor  # no second copy
    fresh_actor, _ = compute_log_probs(lora_actor, batch, 2, temperature=0.7)
    torch.testing.assert_close(fresh_actor, base_logp, atol=1e-6, rtol=0)  # B = 0 at start
    perturb_adapter(lora_actor)
    actor_logp, _ = compute_log_probs(lora_actor, batch, 2, temperature=0.7)
    ref_logp, _ = ref.compute_log_probs(batch, 3, temperature=0.7)
    torch.testing.assert_close(ref_logp, base_logp, atol=1e-6, rtol=0)
    mask = batch["response_mask"]
    assert (actor_logp - base_logp)[mask].abs().max() > 1e-2
    # The adapter is back on after the reference pass.
    again, _ = compute_log_probs(lora_actor, batch, 5, temperature=0.7)
    torch.testing.assert_close(again, actor_logp, atol=1e-6, rtol=0)


def test_gradient_reaches_the_adapter_through_the_fused_head(lora_actor, batch):
    perturb_adapter(lora_actor)
    lora_actor.train()
    logp, _ = forward_log_probs(lora_actor, batch)
    logp[batch["response_mask"]].sum().backward()
    grads = {n: p.grad for n, p in lora_actor.named_parameters() if p.requires_grad}
    assert grads, "no trainable parameters: the adapter was not applied"
    assert all("lora_" in n for n in grads), [n for n in grads if "lora_" not in n]
    no_grad = [n for n, g in grads.items() if g is None or not g.abs().sum() > 0]
    assert not no_grad, f"no gradient reached: {no_grad}"


def test_frozen_copy_reference_without_lora(qwen_dir, batch):
    actor = load_causal_lm(qwen_dir)
    ref = build_reference(actor)
    assert ref.model is not actor and not ref.model.training
    assert not any(p.requires_grad for p in ref.model.parameters())
    with torch.no_grad():
        actor.lm_head.weight.add_(0.1)  # training the actor leaves the copy alone
    ref_logp, _ = ref.compute_log_probs(batch, 5)
    base_logp, _ = compute_log_probs(load_causal_lm(qwen_dir), batch, 5)
    torch.testing.assert_close(ref_logp, base_logp, atol=0, rtol=0)


def test_save_load_and_merge(qwen_dir, lora_actor, batch, tmp_path):
    perturb_adapter(lora_actor, seed=1)
    want, _ = compute_log_probs(lora_actor, batch, 5)
    save_lora(lora_actor, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    loaded = load_lora(load_causal_lm(qwen_dir), tmp_path / "adapter")
    assert is_lora(loaded)
    torch.testing.assert_close(compute_log_probs(loaded, batch, 5)[0], want, atol=1e-6, rtol=0)

    merged = merge_lora(lora_actor)
    assert not is_lora(merged) and is_lora(lora_actor)  # the actor itself is untouched
    torch.testing.assert_close(compute_log_probs(merged, batch, 5)[0], want, atol=1e-5, rtol=0)
    out = export_merged(lora_actor, tmp_path / "merged")
    exported = load_causal_lm(out)
    torch.testing.assert_close(compute_log_probs(exported, batch, 5)[0], want, atol=1e-5, rtol=0)


def test_lora_bad_arguments(qwen_dir, lora_actor, tmp_path):
    with pytest.raises(ValueError, match="lora_rank"):
        apply_lora(load_causal_lm(qwen_dir), lora_rank=0)
    with pytest.raises(ValueError, match="already"):
        apply_lora(lora_actor, lora_rank=2)
    with pytest.raises(FileNotFoundError, match="adapter"):
        load_lora(load_causal_lm(qwen_dir), tmp_path / "nothing")


def test_merged_state_equals_peft_merge_and_unload(lora_actor):
    perturb_adapter(lora_actor, seed=2)
    from lmrl.models.lora import merged_state

    want = merge_lora(lora_actor).state_dict()
    got = merged_state(lora_actor.state_dict(), scaling=8 / 4)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-6, msg=key)
    plain = merge_lora(lora_actor).state_dict()
    assert merged_state(plain, scaling=2.0).keys() == plain.keys()  # no adapter: unchanged


def test_target_modules_that_match_nothing_are_one_line(qwen_dir):
    """A name of ``model.target_modules`` that no module has: one line naming it and the
    layers there are, before PEFT (which trains the others, or fails with a traceback when
    none matches); the rule ``lmrl train-flow`` applies too."""
    import lmrl.flow.pipelines
    import lmrl.models.lora
    from lmrl.errors import ModelError

    for targets in (["q_proj", "qkv_proj"], "qkv_proj"):
        with pytest.raises(ModelError) as err:
            apply_lora(load_causal_lm(qwen_dir), lora_rank=2, target_modules=targets)
        message = str(err.value)
        assert message.startswith("model.target_modules: 'qkv_proj' matches no module of ")
        assert "q_proj, up_proj, v_proj" in message and "\n" not in message
    assert lmrl.flow.pipelines.check_lora_targets is lmrl.models.lora.check_lora_targets


def test_wrapping_and_loading_give_no_checkpointing_future_warning(qwen_dir, tmp_path):
    """PEFT asks the model for transformers' deprecated ``is_gradient_checkpointing``: no
    FutureWarning reaches a LoRA run, with activation checkpointing on or off."""
    import warnings

    for checkpointing in (False, True):
        model = load_causal_lm(qwen_dir, gradient_checkpointing=checkpointing)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            wrapped = apply_lora(model, lora_rank=2)
            save_lora(wrapped, tmp_path / "adapter")
            load_lora(load_causal_lm(qwen_dir), tmp_path / "adapter")


def test_the_adapter_names_a_local_base_model_by_its_absolute_path(
    qwen_dir, lora_actor, tmp_path, monkeypatch
):
    """``final/adapter`` loads from any directory: a relative ``model.path`` is recorded
    absolute; a hub id (no such local path) as it is."""
    import json

    from lmrl.models.lora import save_adapter

    monkeypatch.chdir(qwen_dir.parent)
    state, out = lora_actor.state_dict(), tmp_path / "adapter"
    save_adapter(state, out, lora_alpha=8, base_path="Qwen/Qwen2.5-0.5B")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "Qwen/Qwen2.5-0.5B"
    save_adapter(state, out, lora_alpha=8, base_path=qwen_dir.name)  # relative, as typed
    recorded = Path(
        json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    )
    assert recorded.is_absolute() and recorded.resolve() == Path(qwen_dir).resolve()
    monkeypatch.chdir(tmp_path)  # elsewhere: the base the adapter names loads
    assert is_lora(load_lora(load_causal_lm(recorded), out))
