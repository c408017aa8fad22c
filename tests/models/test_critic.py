"""The critic: (B, T) values from the actor's backbone, zero head at start, save/load."""

from __future__ import annotations

import pytest
import torch

from lmrl.models import compute_values, forward_values, load_causal_lm, load_critic


def test_initialized_from_the_actor_with_a_zero_head(qwen_dir, batch):
    critic = load_critic(qwen_dir)
    actor = load_causal_lm(qwen_dir)
    assert critic.config.num_labels == 1
    for name, p in actor.model.state_dict().items():
        assert torch.equal(critic.model.state_dict()[name], p), name
    assert critic.score.weight.abs().sum() == 0
    values = compute_values(critic, batch, micro_batch_size=2)
    assert values.shape == batch["responses"].shape and values.dtype == torch.float32
    assert (values == 0).all()


def test_values_align_with_the_state_before_each_response_token(qwen_dir, batch):
    critic = load_critic(qwen_dir)
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(0))
        critic.score.bias.fill_(0.3)
    T = batch["responses"].shape[1]
    with torch.no_grad():
        full = critic(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"].long(),
            position_ids=batch["position_ids"],
        ).logits[:, -T - 1 : -1, 0]
    mask = batch["response_mask"]
    for micro_batch_size in (1, 3, 5):
        values = compute_values(critic, batch, micro_batch_size)
        torch.testing.assert_close(values[mask], full[mask], atol=1e-5, rtol=0)
        assert (values[~mask] == 0).all()


def test_gradient_flows_and_save_load_round_trip(qwen_dir, batch, tmp_path):
    critic = load_critic(qwen_dir)
    values = forward_values(critic, batch)
    ((values - 1.0)[batch["response_mask"]] ** 2).mean().backward()
    assert critic.score.weight.grad.abs().sum() > 0
    with torch.no_grad():
        critic.score.weight.add_(-0.1 * critic.score.weight.grad)
    want = compute_values(critic, batch, 5)
    assert want[batch["response_mask"]].abs().min() > 0
    critic.save_pretrained(tmp_path / "critic")
    loaded = load_critic(tmp_path / "critic")  # its own trained head, not a fresh zero one
    torch.testing.assert_close(compute_values(loaded, batch, 2), want, atol=1e-6, rtol=0)


def test_critic_errors_name_the_path(tmp_path):
    from transformers import ViTConfig

    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no token-classification head") as err:
        load_critic(tmp_path)
    assert str(tmp_path) in str(err.value)
