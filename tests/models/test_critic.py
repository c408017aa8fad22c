"""The critic: (B, T) values from the actor's backbone, zero head at start, save/load."""

from __future__ import annotations

import pytest
import torch

from lmrl.models import compute_values, forward_values, load_causal_lm, load_critic, packing
from lmrl.models.critic import value_head

from .conftest import REPLAYABLE, needs_replayable


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


def _random_head(critic):
    with torch.no_grad():
        critic.score.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(0))
        critic.score.bias.fill_(0.3)
    return critic


@pytest.mark.parametrize("checkpointing", [False, pytest.param(True, marks=needs_replayable)])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("arch", ["qwen", "llama"])
def test_shared_prompts_give_the_full_forwards_values_and_gradients(
    arch, packed, checkpointing, qwen_dir, llama_dir, grouped, monkeypatch
):
    """GRPO-style groups: each prompt runs once (packed with its responses in one pass, or a
    prompt pass then a response pass; with gradient checkpointing too), and the values and
    every parameter's gradient are the full forward's (not checkpointed); the no-grad path
    (micro-batches splitting groups) too."""
    if not packed:
        monkeypatch.setattr(packing, "MAX_PACKED", 0)
    path = qwen_dir if arch == "qwen" else llama_dir
    mask = grouped["response_mask"]
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for share in (True, False):
        critic = _random_head(load_critic(path, gradient_checkpointing=checkpointing and share))
        critic.train()
        calls: list[torch.Tensor] = []

        def record(module, args, kwargs, out, calls=calls):  # rows of each backbone pass
            calls.append(kwargs.get("input_ids", args[0] if args else None))

        critic.base_model.register_forward_hook(record, with_kwargs=True)
        values = forward_values(critic, grouped, share_prompts=share)
        ((values - 1.0) ** 2 * weights).sum().backward()
        results.append((values.detach(), {n: p.grad for n, p in critic.named_parameters()}))
        rows = [ids.shape[0] for ids in calls]
        # 5 distinct prompts (with their responses when packed), then 12 responses
        assert rows == ([5] if packed else [5, 12]) if share else [12]
    (values, grads), (want, want_grads) = results
    torch.testing.assert_close(values, want, atol=1e-5, rtol=0)
    assert (values[~mask] == 0).all() and (values[mask] != 0).all()
    for name, g in want_grads.items():  # float32 sums in another order: relative to the largest
        torch.testing.assert_close(grads[name], g, atol=1e-5 * g.abs().max(), rtol=1e-5, msg=name)
    critic = _random_head(load_critic(path))
    torch.testing.assert_close(compute_values(critic, grouped, 5), want, atol=1e-5, rtol=0)


def test_the_full_forward_runs_where_the_head_is_not_plain(qwen_dir):
    critic = load_critic(qwen_dir)
    assert value_head(critic) == (critic.base_model, critic.score)
    checkpointed = load_critic(qwen_dir, gradient_checkpointing=True)  # shares prompts too
    parts = (checkpointed.base_model, checkpointed.score)
    assert value_head(checkpointed) == (parts if REPLAYABLE else None)
    critic.dropout.p = 0.1  # an active dropout before the head: the model's own forward
    assert value_head(critic.train()) is None and value_head(critic.eval()) is not None
    critic.score.register_forward_hook(lambda *a: None)
    assert value_head(critic) is None


def test_critic_errors_name_the_path(tmp_path):
    from transformers import ViTConfig

    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no token-classification head") as err:
        load_critic(tmp_path)
    assert str(tmp_path) in str(err.value)
